"""harness.fixtures: every fixture builds, its manifest matches what is on disk, builds are
byte-identical, the identity is stable, and the cache is safe under concurrency and failure."""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import harness.fixtures as F
from harness import cpu
from harness.fixtures import cache as C
from harness.fixtures import models as M
from harness.fixtures.identity import load_bin, read_safetensors_header
from harness.fixtures.recipes import INT4_GROUP_SIZE
from harness.quant import LABELS

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def built(cache_dir):
    """Every fixture, built once into a fresh cache for this session."""
    return {name: F.build(name) for name in F.names()}


def _linear_names(model: str) -> set[str]:
    import torch

    cfg = M.make_config(model)
    cls = M.model_class(model)
    with torch.device("meta"):
        m = cls(cfg)
    return {n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}


LINEARS = {}


def linear_names(model):
    if model not in LINEARS:
        LINEARS[model] = _linear_names(model)
    return LINEARS[model]


def disk_labels(path: Path, spec, modules) -> dict[str, str]:
    """Label each linear from the files alone (not from the manifest)."""
    if spec.weights_file.endswith(".bin"):
        sd = load_bin(path / spec.weights_file)
        out = {}
        for m in modules:
            w = sd.get(f"{m}.weight")
            out[m] = {"Int8Tensor": "torchao-int8", "Float8Tensor": "torchao-float8"}.get(
                type(w).__name__, "unquantized"
            )
        return out
    h, _ = read_safetensors_header(path / "model.safetensors")
    meta = h.get("__metadata__", {})
    out = {}
    for m in modules:
        d = M.checkpoint_name(spec.model, m)  # tensors are written in the checkpoint spelling
        if f"{d}.weight.quant_state.bitsandbytes__nf4" in h:
            out[m] = "bnb-nf4"
        elif f"{d}.weight.quant_state.bitsandbytes__fp4" in h:
            out[m] = "bnb-fp4"
        elif f"{d}._weight_qdata" in h:
            # transformers 5.19 writes torchao's __metadata__ keys in the in-memory spelling
            entry = json.loads(meta[f"{m}.weight"])
            if entry["_type"] == "IntxUnpackedToInt8Tensor":  # the label names its target dtype: int4
                out[m] = "torchao-" + entry["_data"]["target_dtype"]["_data"]
            else:
                out[m] = {"Int8Tensor": "torchao-int8", "Float8Tensor": "torchao-float8"}[entry["_type"]]
        elif f"{d}.weight" in h and h[f"{d}.weight"]["dtype"] == "F8_E4M3":
            shape = h[f"{d}.weight_scale"]["shape"]
            out[m] = "fp8-tensor" if shape in ([1], []) else "fp8-channel"
        elif f"{d}.weight" in h:
            assert h[f"{d}.weight"]["dtype"] == "F32", (m, h[f"{d}.weight"])
            out[m] = "unquantized"
        else:
            # only the tied output projections are absent: Whisper's proj_out (model.decoder.embed_tokens),
            # Bart's lm_head (model.shared)
            tied = {"whisper": ("proj_out", "model.decoder.embed_tokens.weight"), "bart": ("lm_head", "model.shared.weight")}
            assert spec.model in tied and m == tied[spec.model][0] and tied[spec.model][1] in h, m
            out[m] = "unquantized"
    return out


# ---------------------------------------------------------------- API


def test_names_and_specs():
    names = F.names()
    assert len(names) == len(set(names)) >= 26
    for n in names:
        s = F.spec(n)
        assert s.name == n and s.model in M.MODELS
        assert n == "-".join(x for x in (s.model, s.scheme, s.variant) if x)
        assert s.description and "\n" not in s.description
        assert s.label in LABELS
    for model in M.MODELS:
        for scheme in ("unquantized", "bnb-nf4", "bnb-nf4-dq", "bnb-fp4", "fp8-static-kv", "fp8-dynamic",
                       "torchao-int8wo", "torchao-float8wo"):
            assert f"{model}-{scheme}" in names


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="llama-bnb-nf4"):
        F.spec("llama-nope")
    with pytest.raises(ValueError, match="known fixtures"):
        F.build("llama-nope")


def test_weights_are_platform_independent():
    # golden values: PCG64 + sha256 seeds + exact float64 arithmetic, the same on every platform
    v = M.param_value("llama", "model.layers.0.self_attn.q_proj.weight", (128, 128))
    assert v.dtype.name == "float32"
    assert hashlib.sha256(v.tobytes()).hexdigest() == "f5a79f0776a03c3048b15227cb330f2b4b6bd4b2c7b9ef80b1e7034eb2cca11f"
    v = M.param_value("whisper", "model.decoder.embed_tokens.weight", (512, 128))
    assert hashlib.sha256(v.tobytes()).hexdigest() == "deba65eace8061fafe572f1900bdffce9ea6ca26a963ad59b1f18c6a3ee9a83a"


def test_assets_load():
    from transformers import AutoFeatureExtractor, AutoTokenizer

    lt = AutoTokenizer.from_pretrained(M.tokenizer_dir("llama"))
    wt = AutoTokenizer.from_pretrained(M.tokenizer_dir("whisper"))
    assert len(lt) == 512 and len(wt) == 512
    specials = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
    ids = wt.convert_tokens_to_ids(specials)
    assert len(set(ids)) == len(ids) and min(ids) == wt.convert_tokens_to_ids("<|endoftext|>") == 501
    fe = AutoFeatureExtractor.from_pretrained(M.ASSETS / "whisper-preprocessor")
    assert fe.feature_size == 80 and fe.nb_max_frames == 2 * M.WHISPER["max_source_positions"]
    size = sum(p.stat().st_size for p in M.ASSETS.rglob("*") if p.is_file())
    assert size < 200_000


# ---------------------------------------------------------------- every fixture


@pytest.mark.slow("its first parameter builds every fixture (the session fixture `built`) into a fresh cache")
@pytest.mark.parametrize("name", F.names())
def test_fixture_manifest_and_layout(built, name):
    path, s = built[name], F.spec(name)
    man = F.manifest(path)
    assert man["fixture"] == name and man["model"] == s.model and man["scheme"] == s.scheme
    assert man["skip_policy"] == s.skip_policy
    assert man["identity"] == F.identity(path)
    for f in ("config.json", s.weights_file, "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (path / f).is_file(), f
    if s.model == "whisper":
        assert (path / "preprocessor_config.json").is_file()
        assert man["audio"]["kind"] == "sines" and man["decoder_prompts"] == man["prompts"]
    if s.model in M.VLMS:
        assert (path / "preprocessor_config.json").is_file()
        assert man["images"]["kind"] == "pcg64-blocks" and len(man["images"]["items"]) == len(man["prompts"])
        assert man["checkpoint_prefixes"] == M.CHECKPOINT_PREFIXES[s.model]
    if s.model == "bart":
        assert man["decoder_prompts"] == man["prompts"] and len(man["encoder_prompts"]) == len(man["prompts"])

    # every linear of the architecture is labelled, with a known label, and the disk agrees
    modules = man["modules"]
    assert set(modules) == linear_names(s.model)
    assert set(modules.values()) <= set(LABELS)
    assert disk_labels(path, s, modules) == modules
    if s.label != "unquantized":
        assert s.label in modules.values()
    if not s.variant or s.variant == "bin":  # default skip policy: only the output projection stays
        out = "proj_out" if s.model == "whisper" else "lm_head"
        expect = {m: ("unquantized" if m == out else s.label) for m in modules}
        assert modules == expect

    # margins from the producer's forward: clearly non-flat logits
    mg = man["margins"]
    assert 0 <= mg["min"] <= mg["p10"] <= mg["median"] and mg["median"] > 0.3
    assert mg["positions"] == sum(len(p) for p in man["prompts"])

    cfg = json.loads((path / "config.json").read_text())
    qc = cfg.get("quantization_config")
    if s.producer == "none":
        assert qc is None
    elif s.producer == "bitsandbytes":
        assert qc["quant_method"] == "bitsandbytes" and qc["load_in_4bit"]
        assert qc["bnb_4bit_quant_type"] == s.label.split("-")[1]
        assert qc["bnb_4bit_use_double_quant"] == (s.scheme == "bnb-nf4-dq")
        if "llm_int8_skip_modules" in s.skip_policy:
            assert qc["llm_int8_skip_modules"] == s.skip_policy["llm_int8_skip_modules"]
    elif s.producer == "torchao":
        assert qc["quant_method"] == "torchao"
    elif s.producer == "compressed-tensors":
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
        assert qc["ignore"] == s.skip_policy["ignore"]
        assert qc["config_groups"]["group_0"]["targets"] == s.skip_policy["targets"]
        assert (qc["kv_cache_scheme"] is not None) == (s.scheme == "fp8-static-kv")

    if s.weights_file != "model.safetensors":
        return
    h, _ = read_safetensors_header(path / "model.safetensors")
    quantized = [m for m, lab in modules.items() if lab != "unquantized"]
    # from here on, keys are tensor names on disk: the checkpoint spelling of each in-memory name
    h = {**h, **{k: v for k, v in _in_memory_view(s.model, h).items()}}
    if s.scheme.startswith("bnb"):
        for m in quantized:
            assert h[f"{m}.weight"]["dtype"] == "U8" and h[f"{m}.weight"]["shape"][1] == 1
            assert h[f"{m}.weight.quant_map"]["dtype"] == "F32"
            if s.scheme == "bnb-nf4-dq":
                assert h[f"{m}.weight.absmax"]["dtype"] == "U8"
                assert f"{m}.weight.nested_absmax" in h and f"{m}.weight.nested_quant_map" in h
            else:
                assert h[f"{m}.weight.absmax"]["dtype"] == "F32"
                assert f"{m}.weight.nested_absmax" not in h
    if s.scheme.startswith("fp8"):
        static = s.scheme == "fp8-static-kv"
        for m in quantized:
            n_out = h[f"{m}.weight"]["shape"][0]
            assert h[f"{m}.weight_scale"]["shape"] == ([1] if modules[m] == "fp8-tensor" else [n_out, 1])
            assert (f"{m}.input_scale" in h) == static
        attn = sorted({m.rsplit(".", 1)[0] for m in modules if m.endswith(".k_proj")})
        if s.model == "mllama":  # k/v scales on the text model's attention only (see ct_producer.produce_ct)
            attn = [a for a in attn if a.startswith("model.language_model.")]
        for a in attn:
            for k in ("k_scale", "v_scale"):
                assert (f"{a}.{k}" in h) == static, (a, k)
                if static:
                    assert h[f"{a}.{k}"]["dtype"] == "F32" and h[f"{a}.{k}"]["shape"] == [1]
        if static:
            assert man["kv_cache_modules"] == attn
            if s.model == "whisper":  # self- and cross-attention, encoder too
                assert any(".encoder_attn" in a for a in attn) and any("model.encoder." in a for a in attn)
    if s.scheme.startswith("torchao"):
        qdtype = {"torchao-int8": "I8", "torchao-float8": "F8_E4M3", "torchao-int4": "I8"}  # int4: one per byte
        for m in quantized:
            assert h[f"{m}._weight_qdata"]["dtype"] == qdtype[modules[m]]
            assert h[f"{m}._weight_scale"]["dtype"] == "F32"
            assert (f"{m}._weight_zero_point" in h) == (modules[m] in ("torchao-int8", "torchao-int4"))
            if modules[m] == "torchao-int4":  # one scale per group of INT4_GROUP_SIZE input columns
                rows, cols = h[f"{m}._weight_qdata"]["shape"]
                assert h[f"{m}._weight_scale"]["shape"] == [rows, cols // INT4_GROUP_SIZE], m
            assert f"{m}.weight" not in h
        # no bias (or anything else) became a tensor subclass
        for k, v in h["__metadata__"].items():
            if k.endswith(".bias"):
                assert json.loads(v)["_type"] == "Tensor", k


def _in_memory_view(model: str, header: dict) -> dict:
    """The header's tensor entries keyed by their in-memory names (tensors whose checkpoint spelling
    differs are renamed; metadata and unaffected keys are left out)."""
    if model not in M.CHECKPOINT_PREFIXES:
        return {}
    out = {}
    for k, v in header.items():
        for mem, disk in M.CHECKPOINT_PREFIXES[model]:
            if k.startswith(disk) and mem != disk:
                out[mem + k[len(disk):]] = v
                break
    return out


# ---------------------------------------------------------------- skip fixtures


def _labels(built, name):
    return F.manifest(built[name])["modules"]


def _unq(mods, prefix):
    return {m: lab for m, lab in mods.items() if m == prefix or m.startswith(prefix + ".")}


def test_skip_ambiguous_prefix_catches_layers_10_and_11(built):
    mods = _labels(built, "llama-bnb-nf4-skip-ambiguous")
    for layer in (1, 10, 11):
        assert set(_unq(mods, f"model.layers.{layer}").values()) == {"unquantized"}
    for layer in (0, 2, 9):
        assert set(_unq(mods, f"model.layers.{layer}").values()) == {"bnb-nf4"}
    assert mods["lm_head"] == "unquantized"


def test_skip_kproj_single_projection(built):
    for name, lab in (("llama-bnb-nf4-skip-kproj", "bnb-nf4"), ("llama-fp8-static-kv-skip-kproj", "fp8-tensor")):
        mods = _labels(built, name)
        assert mods["model.layers.0.self_attn.k_proj"] == "unquantized"
        assert mods["model.layers.0.self_attn.q_proj"] == lab
        assert mods["model.layers.0.self_attn.v_proj"] == lab
        assert mods["model.layers.1.self_attn.k_proj"] == lab
    # a custom bnb skip list replaces transformers' default, so lm_head is quantized there
    assert _labels(built, "llama-bnb-nf4-skip-kproj")["lm_head"] == "bnb-nf4"
    assert _labels(built, "llama-fp8-static-kv-skip-kproj")["lm_head"] == "unquantized"
    h, _ = read_safetensors_header(built["llama-fp8-static-kv-skip-kproj"] / "model.safetensors")
    assert "model.layers.0.self_attn.k_scale" in h and "model.layers.0.self_attn.v_scale" in h


def test_skip_short_spelling_is_what_transformers_did(built):
    mods = _labels(built, "llama-bnb-nf4-skip-short")
    # transformers' matcher (re.match / endswith on module names) never matches "layers.2.mlp"
    # against "model.layers.2.mlp.gate_proj": the short spelling skipped nothing
    assert set(_unq(mods, "model.layers.2.mlp").values()) == {"bnb-nf4"}
    assert mods["lm_head"] == "unquantized"


def test_torchao_fqn_and_modules_to_not_convert(built):
    mods = _labels(built, "llama-torchao-int8wo-skip-fqn")
    assert mods["model.layers.1.self_attn.q_proj"] == "unquantized"
    assert mods["model.layers.1.self_attn.k_proj"] == "torchao-int8"
    assert set(_unq(mods, "model.layers.3.mlp").values()) == {"unquantized"}
    assert set(_unq(mods, "model.layers.3.self_attn").values()) == {"torchao-int8"}
    assert mods["lm_head"] == "unquantized"
    assert sum(v == "unquantized" for v in mods.values()) == 5

    mods = _labels(built, "llama-torchao-int8wo-skip-modules")
    assert set(_unq(mods, "model.layers.2").values()) == {"unquantized"}
    assert mods["lm_head"] == "unquantized"
    assert sum(v == "unquantized" for v in mods.values()) == 8


def test_ct_ignore_regex(built):
    mods = _labels(built, "llama-fp8-dynamic-ignore")
    assert set(_unq(mods, "model.layers.1.mlp").values()) == {"unquantized"}
    assert set(_unq(mods, "model.layers.10.mlp").values()) == {"fp8-channel"}
    assert set(_unq(mods, "model.layers.1.self_attn").values()) == {"fp8-channel"}
    assert mods["lm_head"] == "unquantized"


@pytest.mark.parametrize(
    "name,label",
    [
        ("whisper-bnb-nf4-skip-encoder", "bnb-nf4"),
        ("whisper-torchao-int8wo-skip-encoder", "torchao-int8"),
        ("whisper-fp8-dynamic-ignore-encoder", "fp8-channel"),
    ],
)
def test_whisper_encoder_left_unquantized(built, name, label):
    mods = _labels(built, name)
    assert set(_unq(mods, "model.encoder").values()) == {"unquantized"}
    assert set(_unq(mods, "model.decoder").values()) == {label}
    assert any(".encoder_attn." in m for m in _unq(mods, "model.decoder"))
    assert mods["proj_out"] == "unquantized"


def test_prompt_inputs(built):
    ins = F.prompt_inputs(built["whisper-unquantized"])
    assert len(ins) == 3
    assert tuple(ins[0]["input_features"].shape) == (1, 80, 100)
    assert ins[0]["decoder_input_ids"][0, 0].item() == M.make_config("whisper").decoder_start_token_id
    ins = F.prompt_inputs(built["llama-unquantized"])
    assert ins[0]["input_ids"][0, 0].item() == M.make_config("llama").bos_token_id


def test_bin_is_safe_to_load(built):
    import torch

    f = built["llama-torchao-int8wo-bin"] / "pytorch_model.bin"
    # Without torchao's classes allowed, weights_only refuses the pickle. A fresh interpreter: in
    # this one, importing torchao may already have allowed them process-wide.
    plain = subprocess.run([sys.executable, "-c", f"import torch; torch.load({str(f)!r}, weights_only=True)"],
                           capture_output=True, text=True)
    assert plain.returncode != 0 and "Weights only load failed" in plain.stderr
    sd = load_bin(f)
    assert type(sd["model.layers.0.self_attn.q_proj.weight"]).__name__ == "Int8Tensor"


# ---------------------------------------------------------------- identity


def test_identity_stable_and_sensitive(built, tmp_path):
    src = built["llama-bnb-nf4"]
    ident = F.identity(src)
    assert ident == F.identity(src) == F.manifest(src)["identity"]
    assert len(ident) == 64

    d = tmp_path / "copy"
    shutil.copytree(src, d)
    # library-version / provenance fields do not count
    cfg = json.loads((d / "config.json").read_text())
    cfg["transformers_version"] = "0.0.0"
    cfg["quantization_config"]["_transformers_version"] = "9.9"
    (d / "config.json").write_text(json.dumps(cfg))
    assert F.identity(d) == ident
    # a semantic config change counts
    cfg["quantization_config"]["bnb_4bit_quant_type"] = "fp4"
    (d / "config.json").write_text(json.dumps(cfg))
    assert F.identity(d) != ident
    cfg["quantization_config"]["bnb_4bit_quant_type"] = "nf4"
    (d / "config.json").write_text(json.dumps(cfg))
    assert F.identity(d) == ident
    # one byte of one tensor counts
    h, start = read_safetensors_header(d / "model.safetensors")
    b, _ = h["model.layers.5.mlp.up_proj.weight"]["data_offsets"]
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[start + b] ^= 1
    (d / "model.safetensors").write_bytes(bytes(raw))
    assert F.identity(d) != ident


def test_identity_of_bin(built):
    p = built["llama-torchao-int8wo-bin"]
    assert F.identity(p) == F.manifest(p)["identity"]
    assert F.identity(p) != F.identity(built["llama-torchao-int8wo"])


# ---------------------------------------------------------------- identity under other kernels

# The fixtures whose production runs float32 torch arithmetic that torch's kernels round differently:
# bitsandbytes' double quant (its dynamic map, from torch.linspace: bnb_double_quant.bnb_double_quant_map)
# and static FP8 (scales calibrated from forward passes: ct_producer.calibrate_min_max). The other
# producers store what exactly rounded elementwise ops, min and max give: measured stable under
# every condition.
KERNEL_SENSITIVE = [n for n in F.names() if F.spec(n).scheme in ("bnb-nf4-dq", "fp8-static-kv")]


@pytest.fixture(scope="module")
def native_identities(cache_dir) -> dict[str, str]:
    return {name: F.identity(F.build(name)) for name in KERNEL_SENSITIVE}


def test_kernel_sensitive_fixtures_build_as_the_committed_baselines_recorded_them(native_identities):
    """The committed baselines' ``fixture.identity`` of each kernel-sensitive fixture is what this
    machine builds (each fixture's cells would be ``stale-baseline`` otherwise)."""
    committed: dict[str, set[str]] = {}
    for path in (REPO / "baselines").rglob("*.json"):
        data = json.loads(path.read_text())
        if path.name.endswith(".obtained.json") or not isinstance(data, dict):
            continue  # a run's obtained result beside its baseline, or not a baseline
        fixture = data.get("fixture") or {}
        if fixture.get("name") in native_identities:
            committed.setdefault(fixture["name"], set()).add(fixture["identity"])
    assert committed == {name: {ident} for name, ident in native_identities.items()}


@pytest.mark.slow("a child per kernel condition building every bnb-nf4-dq and fp8-static-kv fixture")
@pytest.mark.parametrize("condition", sorted(cpu.KERNEL_CONDITIONS))
def test_kernel_sensitive_fixtures_build_with_one_identity_under_every_kernel_condition(
        tmp_path, native_identities, condition):
    """Built in a child under each kernel condition this machine can set (a lowered torch capability,
    the libraries' AVX2 paths, both at AVX2), every kernel-sensitive fixture has its native identity."""
    env = {**cpu.condition_env(cpu.KERNEL_CONDITIONS[condition]), "HARNESS_FIXTURE_CACHE": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "harness.fixtures", "build", *KERNEL_SENSITIVE], env=env, cwd=REPO,
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    paths = [Path(line) for line in p.stdout.split()]
    assert len(paths) == len(KERNEL_SENSITIVE), p.stdout
    built_here = {name: F.identity(path) for name, path in zip(KERNEL_SENSITIVE, paths)}
    assert {n: i for n, i in built_here.items() if i != native_identities[n]} == {}


def test_the_double_quant_map_is_bitsandbytes_own_on_avx2_and_avx512():
    """bnb_double_quant.bnb_dynamic_map is what bitsandbytes' create_dynamic_map gives on torch's AVX2
    and AVX-512 kernels, and bnb_double_quant.linspace_fused is their torch.linspace."""
    import torch
    from bitsandbytes.functional import create_dynamic_map

    from harness.fixtures import bnb_double_quant as B

    if torch.backends.cpu.get_cpu_capability().lower() == "default":
        pytest.skip("torch runs its default kernels here: compared under the kernel conditions above")
    assert torch.equal(B.bnb_dynamic_map(), create_dynamic_map())
    for start, end in ((0.1, 1.0), (-2.5, 3.0), (1.0, -0.3)):
        for steps in range(1, 300):
            assert torch.equal(B.linspace_fused(start, end, steps), torch.linspace(start, end, steps)), (start, end, steps)


REBUILD = ("llama-bnb-nf4-dq", "whisper-fp8-static-kv", "llama-torchao-int8wo")


@pytest.mark.slow("rebuilds three fixtures in a fresh process and cache to compare their bytes")
def test_rebuild_is_byte_identical(built, tmp_path):
    """A second build in another process (other hash seed, fresh cache) writes the same bytes."""
    env = dict(os.environ, HARNESS_FIXTURE_CACHE=str(tmp_path), PYTHONHASHSEED="12345")
    code = "import sys, harness.fixtures as F\nfor n in sys.argv[1:]: print(F.build(n))"
    out = subprocess.run(
        [sys.executable, "-c", code, *REBUILD], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    paths = [Path(line) for line in out.stdout.split()]
    assert len(paths) == len(REBUILD)
    for name, again in zip(REBUILD, paths):
        first = built[name]
        assert again.name == first.name  # same cache key
        assert (again / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes(), name
        assert F.manifest(again)["identity"] == F.manifest(first)["identity"]
        assert F.manifest(again)["margins"] == F.manifest(first)["margins"]


# ---------------------------------------------------------------- cache


def test_cache_hit_and_key(built, cache_dir):
    path, was_built = F._ensure("llama-unquantized")
    assert path == built["llama-unquantized"] and not was_built
    assert path.parent == cache_dir
    assert C.cache_key("llama-bnb-nf4") != C.cache_key("llama-bnb-fp4")
    assert not list(cache_dir.glob(".build-*"))


def _concurrent_worker(cache, name, barrier, queue):
    os.environ["HARNESS_FIXTURE_CACHE"] = cache
    import harness.fixtures as fx

    barrier.wait()
    path, built_here = fx._ensure(name)
    queue.put((str(path), built_here, sorted(p.name for p in path.iterdir())))


@pytest.mark.slow("two spawned processes racing to build the llama-unquantized fixture")
def test_concurrent_build_one_builder(tmp_path):
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_concurrent_worker, args=(str(tmp_path), "llama-unquantized", barrier, queue))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0][0] == results[1][0]
    assert sorted(r[1] for r in results) == [False, True]  # exactly one build
    assert results[0][2] == results[1][2] and "manifest.json" in results[0][2]
    path = Path(results[0][0])
    assert F.manifest(path)["identity"] == F.identity(path)
    assert not list(tmp_path.glob(".build-*"))


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    import harness.fixtures.producers as P

    monkeypatch.setenv("HARNESS_FIXTURE_CACHE", str(tmp_path))

    def boom(spec, out, scratch):
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("producer exploded")

    monkeypatch.setattr(P, "produce", boom)
    with pytest.raises(RuntimeError, match="exploded"):
        F.build("whisper-unquantized")
    assert not C.fixture_dir("whisper-unquantized", tmp_path).exists()
    assert not list(tmp_path.glob(".build-*"))
