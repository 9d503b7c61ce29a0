"""models.yaml: validation with key paths, expansion, -k selection, the committed matrix's coverage."""
import re
from pathlib import Path

import pytest
import yaml

from harness import matrix as M
from harness import selection

ROOT = Path(__file__).resolve().parent.parent
MODELS_YAML = ROOT / "models.yaml"

LLAMA_SCHEMES = [
    "unquantized", "bnb-nf4", "bnb-nf4-dq", "bnb-fp4", "fp8-static-kv", "fp8-dynamic", "torchao-int8wo",
    "torchao-float8wo", "bnb-nf4-skip-ambiguous", "bnb-nf4-skip-kproj", "bnb-nf4-skip-short",
    "torchao-int8wo-skip-fqn", "torchao-int8wo-skip-modules", "torchao-int8wo-bin", "torchao-int4wo",
    "torchao-int4wo-fqn-none", "torchao-int4wo-skip-prefix", "fp8-dynamic-ignore", "fp8-static-kv-skip-kproj",
]
WHISPER_SCHEMES = [
    "unquantized", "bnb-nf4", "bnb-nf4-dq", "bnb-fp4", "fp8-static-kv", "fp8-dynamic", "torchao-int8wo",
    "torchao-float8wo", "torchao-int4wo", "bnb-nf4-skip-encoder", "torchao-int8wo-skip-encoder",
    "fp8-dynamic-ignore-encoder",
]
FIXTURES = {f"llama-{s}" for s in LLAMA_SCHEMES} | {f"whisper-{s}" for s in WHISPER_SCHEMES}
GPU_FULL_HUB_IDS = {
    "unsloth/Llama-3.2-11B-Vision-Instruct-unsloth-bnb-4bit",
    "amd/Llama-3.2-11B-Vision-Instruct-FP8-KV",
    "neuralmagic/Llama-3.2-11B-Vision-Instruct-FP8-dynamic",
    "mobiuslabsgmbh/Qwen2.5-VL-7B-Instruct_gemlite-ao_a16w4_gs_128_pack_32bit",
    "mobicham/Qwen2.5-VL-3B-Instruct_int8wo_ao",
}

MINIMAL = """
version: 1
environments:
  core:
    engines: {reference: "0.1.0", transformers: "5.19.0"}
  vllm-cpu-0.32:
    engines: {vllm: "0.32.0"}
defaults:
  max_tokens: 8
  top_k: 5
  timeout_s: 60
  bounds:
    unquantized: {logprob: 1.0e-4, topk: 1.0e-4, load_time: 1.5}
    bnb: {logprob: 2.0e-3, topk: 2.0e-3, load_time: 1.5}
    torchao: {logprob: 2.0e-3, topk: 2.0e-3, load_time: 1.5}
prompt_sets:
  chat:
    - {id: hello, text: "Hello"}
models:
  llama:
    arch: LlamaForCausalLM
    fixture: llama
    prompts: fixture
    tier: cpu-tiny
    engines: {reference: core, transformers: core}
    schemes:
      unquantized:
      bnb-nf4:
        top_k: 3
        bounds: {logprob: 0.5}
        known_failures:
          - {engine: transformers, versions: ">=5.19,<5.20", pattern: "boom", reason: "known"}
  big:
    arch: MllamaForConditionalGeneration
    hub: {id: org/model, revision: unpinned}
    prompts: chat
    tier: gpu-full
    engines: {vllm: vllm-cpu-0.32}
    schemes:
      torchao-int8wo:
"""


def _edit(path_to_value: str, value, base: str = MINIMAL) -> str:
    """MINIMAL with one key set (dotted path; created when absent)."""
    data = yaml.safe_load(base)
    keys = path_to_value.split(".")
    node = data
    for k in keys[:-1]:
        if node.get(k) is None:
            node[k] = {}
        node = node[k]
    node[keys[-1]] = value
    return yaml.safe_dump(data, sort_keys=False)


def _error(text: str) -> str:
    with pytest.raises(M.MatrixError) as e:
        M.loads(text, filename="models.yaml")
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_minimal_loads_and_resolves_settings():
    m = M.loads(MINIMAL)
    cells = {c.id: c for c in M.expand(m)}
    assert sorted(cells) == [
        "big.torchao-int8wo.vllm", "llama.bnb-nf4.reference", "llama.bnb-nf4.transformers",
        "llama.unquantized.reference", "llama.unquantized.transformers",
    ]
    c = cells["llama.bnb-nf4.transformers"]
    assert c.top_k == 3 and c.max_tokens == 8
    assert c.bounds.logprob == 0.5 and c.bounds.topk == 2.0e-3  # field-wise override of the family's bounds
    assert c.family == "bnb" and c.engine_version == "5.19.0" and c.environment == "core"
    assert c.fixture_name == "llama-bnb-nf4" and c.pinned
    assert [k.reason for k in c.known_failures] == ["known"]
    assert cells["llama.bnb-nf4.reference"].known_failures == ()  # filtered per engine
    big = cells["big.torchao-int8wo.vllm"]
    assert big.fixture_name is None and not big.pinned and big.hardware.gpus == 1
    assert [p.id for p in big.prompts] == ["hello"]
    assert M.warnings(M.expand(m)) == [
        "warning: big.torchao-int8wo.vllm: hub revision of org/model is unpinned; pin a 40-hex commit in models.yaml"
    ]


@pytest.mark.parametrize(
    "edit, expected",
    [
        (("models.llama.schemes.bnb-nf4.colour", "red"),
         "models.yaml: models.llama.schemes.bnb-nf4.colour: unknown key (allowed: "),
        (("models.llama.schemes.bnb-nf4.bounds.logprob", 0),
         "models.yaml: models.llama.schemes.bnb-nf4.bounds.logprob: must be > 0"),
        (("models.llama.schemes.bnb-nf4.bounds.load_time", 0.9),
         "models.yaml: models.llama.schemes.bnb-nf4.bounds.load_time: must be > 1"),
        (("models.llama.tier", "cpu-small"),
         "models.yaml: models.llama.tier: 'cpu-small' is not one of 'cpu-tiny', 'cpu-load', 'cpu-config', 'gpu-tiny' or 'gpu-full'"),
        (("models.llama.engines", {"reference": "cor"}),
         "models.yaml: models.llama.engines.reference: environment 'cor' is not defined under environments (defined: core, vllm-cpu-0.32)"),
        (("models.llama.schemes.unquantized", {"engines": {"vllm": "core"}}),
         "models.yaml: models.llama.schemes.unquantized.engines.vllm: environment 'core' does not provide engine 'vllm'"),
        (("models.big.hub.revision", "main"),
         "models.yaml: models.big.hub.revision: 'main' must be a 40-hex commit id (or the literal 'unpinned')"),
        (("models.big.hub.revision", "ABCDEF" * 6 + "abcd"),
         "models.yaml: models.big.hub.revision: "),
        (("models.big.prompts", "nope"),
         "models.yaml: models.big.prompts: prompt set 'nope' is not defined under prompt_sets (defined: chat)"),
        (("models.big.prompts", "fixture"),
         "models.yaml: models.big.prompts: 'fixture' prompts need a fixture source"),
        (("models.big.fixture", "llama"),
         "models.yaml: models.big: exactly one of fixture, path, hub is required (found: fixture, hub)"),
        (("models.llama.schemes.bnb-nf4.known_failures", [{"engine": "vllm", "versions": "<1", "pattern": "x", "reason": "r"}]),
         "models.yaml: models.llama.schemes.bnb-nf4.known_failures[0].engine: 'vllm' is not one of this cell's engines"),
        (("models.llama.schemes.bnb-nf4.known_failures", [{"engine": "transformers", "versions": "about 5", "pattern": "x", "reason": "r"}]),
         "models.yaml: models.llama.schemes.bnb-nf4.known_failures[0].versions: 'about 5' is not a PEP 440 version specifier"),
        (("models.llama.schemes.bnb-nf4.known_failures", [{"engine": "transformers", "versions": "<6", "pattern": "(", "reason": "r"}]),
         "models.yaml: models.llama.schemes.bnb-nf4.known_failures[0].pattern: '(' is not a valid regex"),
        (("models.llama.schemes.fp8-dynamic", {}),
         "models.yaml: models.llama.schemes.fp8-dynamic: bounds family 'fp8' is not defined under defaults.bounds"),
        (("models.llama.schemes.bnb-nf4.hardware", {"gpus": 1}),
         "models.yaml: models.llama.schemes.bnb-nf4.hardware.gpus: cpu-tiny cells cannot need a GPU"),
        (("models.big.hardware", {"compute_capability": "sm90"}),
         "models.yaml: models.big.hardware.compute_capability: 'sm90' is not a compute capability like '8.9'"),
        (("models.llama.arch", "GPT2"),
         "models.yaml: models.llama.arch: 'GPT2' is not one of "),
        (("models.llama.max_tokens", "many"),
         "models.yaml: models.llama.max_tokens: must be a valid integer"),
        (("version", 2), "models.yaml: version: 2 is not one of 1"),
        (("prompt_sets.chat", [{"id": "a"}]), "models.yaml: prompt_sets.chat[0]: a prompt needs text, image or audio"),
    ],
)
def test_rejections_name_the_key_path(edit, expected):
    msg = _error(_edit(*edit))
    assert msg.startswith(expected), msg


def test_rejects_dotted_model_name_and_missing_tier():
    text = MINIMAL.replace("  llama:\n", "  llama.v2:\n")
    assert _error(text).startswith("models.yaml: models.llama.v2: 'llama.v2' is not a valid name")
    text = MINIMAL.replace("    tier: cpu-tiny\n", "")
    assert _error(text) == (
        "models.yaml: models.llama.schemes.unquantized.tier: required key is missing (set it on the scheme or on the model)"
    )


def test_yaml_syntax_error_and_duplicate_key_give_file_and_line():
    msg = _error("version: 1\nmodels: [\n")
    assert re.match(r"models\.yaml:\d+: YAML syntax error: ", msg), msg
    dup = MINIMAL.replace("  big:\n", "  llama:\n")
    msg = _error(dup)
    assert re.match(r"models\.yaml:\d+: YAML syntax error: duplicate key 'llama'", msg), msg
    assert _error("- a\n- b\n") == "models.yaml: the top level must be a mapping (found list)"


def test_load_names_the_file(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text(_edit("models.llama.schemes.bnb-nf4.bounds.logprob", -1))
    with pytest.raises(M.MatrixError, match=r"m\.yaml: models\.llama\.schemes\.bnb-nf4\.bounds\.logprob: must be > 0$"):
        M.load(p)
    with pytest.raises(M.MatrixError, match="cannot read"):
        M.load(tmp_path / "absent.yaml")


def test_expansion_is_sorted_deterministic_and_filters():
    m = M.load(MODELS_YAML)
    a = M.expand(m)
    b = M.expand(M.load(MODELS_YAML))
    assert [c.id for c in a] == [c.id for c in b] == sorted(c.id for c in a)
    assert a == b
    assert len({c.id for c in a}) == len(a)
    tiny = M.expand(m, tier="cpu-tiny", engines=["reference"])
    assert tiny and all(c.tier == "cpu-tiny" and c.engine == "reference" for c in tiny)
    assert M.expand(m, engines="reference,transformers") == [c for c in a if c.engine != "vllm"]
    with pytest.raises(M.MatrixError, match="unknown engine 'tensorrt'"):
        M.expand(m, engines=["tensorrt"])
    with pytest.raises(M.MatrixError, match="unknown tier"):
        M.expand(m, tier="cpu")


def test_select_with_pytest_k_expressions():
    cells = M.expand(M.load(MODELS_YAML))
    ids = [c.id for c in cells]
    got = [c.id for c in selection.select(cells, "whisper and torchao")]
    assert got == [i for i in ids if "whisper" in i and "torchao" in i]
    assert got == sorted([f"whisper.{s}.{e}" for s in WHISPER_SCHEMES if "torchao" in s
                          for e in ("reference", "transformers", "vllm", "vllm-tp2")]
                         + ["whisper.online-torchao-int8wo.reference", "whisper.online-torchao-int8wo.transformers"])
    got = [c.id for c in selection.select(cells, "llama and not fp8")]
    assert got and got == [i for i in ids if "llama" in i and "fp8" not in i]
    # case-insensitive like pytest; an exact id part; markers match too (pytest matches marker names)
    assert selection.select(cells, "WHISPER and TORCHAO") == selection.select(cells, "whisper and torchao")
    # pytest -k matches substrings: llama.bnb-nf4.reference is also part of mllama.bnb-nf4.reference
    assert [c.id for c in selection.select(cells, "llama.bnb-nf4.reference and not mllama")] == ["llama.bnb-nf4.reference"]
    assert {c.tier for c in selection.select(cells, "gpu_full")} == {"gpu-full"}
    assert selection.select(cells, "") == cells and selection.select(cells, None) == cells
    with pytest.raises(M.MatrixError, match="wrong expression"):
        selection.select(cells, "whisper and (")


def test_committed_matrix_covers_every_fixture_on_cpu_tiny():
    m = M.load(MODELS_YAML)
    cpu = M.expand(m, tier="cpu-tiny")
    assert FIXTURES <= {c.fixture_name for c in cpu}
    for fixture in {c.fixture_name for c in cpu}:
        engines = {c.engine for c in cpu if c.fixture_name == fixture}
        assert {"reference", "transformers"} <= engines, fixture
        if fixture in FIXTURES:
            assert "vllm" in engines, fixture
    assert all(c.prompt_set == "fixture" and c.hardware.gpus == 0 and not c.gate_load_time for c in cpu)


def test_cpu_tiny_matches_the_fixture_table():
    """Every fixture harness.fixtures can build has cpu-tiny cells, and every fixture cell names one."""
    try:
        from harness import fixtures
        names = set(fixtures.names())
    except (ImportError, AttributeError) as e:  # the fixture package is optional for this unit test
        pytest.skip(f"harness.fixtures not importable: {e}")
    cells = M.expand(M.load(MODELS_YAML))
    assert {c.fixture_name for c in cells if c.tier == "cpu-tiny"} == names
    assert {c.fixture_name for c in cells if c.source_kind == "fixture"} <= names


def test_committed_matrix_gpu_tiers():
    m = M.load(MODELS_YAML)
    gpu_tiny = M.expand(m, tier="gpu-tiny")
    assert gpu_tiny and all(c.source_kind == "fixture" and c.fixture_name in FIXTURES for c in gpu_tiny)
    # vLLM's CUDA build, or the reference and transformers on CUDA in an environment of their own (scripts/gpu-check)
    assert all(c.engine == "vllm" or (c.environment == "cuda-check" and c.model.endswith("-cuda")) for c in gpu_tiny)
    assert {c.engine for c in gpu_tiny if c.environment == "cuda-check"} == {"reference", "transformers"}
    assert not [c for c in M.expand(m) if c.environment == "cuda-check" and c.tier != "gpu-tiny"]
    assert any("fp8-static-kv" in c.scheme for c in gpu_tiny)
    full = M.expand(m, tier="gpu-full")
    hub_ids = {c.hub.id for c in full}
    assert GPU_FULL_HUB_IDS <= hub_ids
    assert any("whisper" in h.lower() for h in hub_ids) and any("bart" in h.lower() for h in hub_ids)
    for c in full:  # a configuration cell is judged against its plain cell, its load time too
        assert c.gate_load_time != bool(c.configuration) and c.hardware.gpus >= c.tensor_parallel and c.prompts
        if c.arch in ("MllamaForConditionalGeneration", "BartForConditionalGeneration"):
            # Mllama (and Bart) need vLLM 0.10.x or older
            assert c.engine_version.startswith("0.10."), c.id
    # every unpinned gpu-full revision is warned about
    unpinned = [c for c in full if not c.pinned]
    assert len(M.warnings(full)) == len(unpinned)
