"""harness.fixtures for Mllama, Qwen2.5-VL and Bart: the recipes (head_dim, cross-attention layers and
their gates, vision towers), the committed tokenizers and image processors (no torchvision), image
prompts rebuilt exactly as the processors produce them, the checkpoint spelling transformers writes,
and what each skip fixture's producer really did.

The generic checks (every fixture builds, its manifest covers every linear, the disk agrees, the
quantized layouts) run for these fixtures too, in tests/test_fixtures.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import harness.fixtures as F
from harness.fixtures import inputs as I
from harness.fixtures import models as M
from harness.fixtures.identity import read_safetensors_header

REPO = Path(__file__).resolve().parent.parent
NEW_MODELS = ("mllama", "qwen2_5_vl", "bart")
SCHEMES = ("unquantized", "bnb-nf4", "bnb-nf4-dq", "bnb-fp4", "fp8-static-kv", "fp8-dynamic",
           "torchao-int8wo", "torchao-float8wo", "torchao-int4wo")
VARIANTS = (
    "mllama-bnb-nf4-skip-vision",
    "mllama-torchao-int8wo-skip-vision",
    "mllama-fp8-dynamic-ignore-vision",
    "mllama-bnb-nf4-skip-unsloth",
    "mllama-bnb-nf4-skip-kproj-cross",
    "mllama-fp8-static-kv-mixed-cross",
    "qwen2_5_vl-bnb-nf4-skip-vision",
    "qwen2_5_vl-torchao-int8wo-skip-vision",
    "qwen2_5_vl-torchao-int4wo-skip-vision",
    "qwen2_5_vl-fp8-dynamic-ignore-vision",
)
NEW = [n for n in F.names() if F.spec(n).model in NEW_MODELS]


@pytest.fixture(scope="session")
def built(cache_dir):
    return {name: F.build(name) for name in NEW}


def _mods(built, name):
    return F.manifest(built[name])["modules"]


def _under(mods, prefix):
    return {m: lab for m, lab in mods.items() if m == prefix or m.startswith(prefix + ".")}


def _header(built, name):
    return read_safetensors_header(built[name] / "model.safetensors")[0]


# ---------------------------------------------------------------- table and recipes


def test_names():
    names = F.names()
    for model in NEW_MODELS:
        for scheme in SCHEMES:
            assert f"{model}-{scheme}" in names
    assert set(VARIANTS) <= set(names)
    assert len(NEW) == 3 * len(SCHEMES) + len(VARIANTS)
    for n in NEW:
        assert "." not in n  # cell ids are dot-separated


def test_configs_head_dim_and_layers():
    mc = M.make_config("mllama")
    tc, vc = mc.text_config, mc.vision_config
    assert tc.hidden_size // tc.num_attention_heads in (32, 64)
    assert vc.hidden_size // vc.attention_heads in (32, 64)
    assert tc.num_hidden_layers >= 4 and len(tc.cross_attention_layers) >= 2
    assert mc.image_token_index == tc.vocab_size == M.load_tokenizer("mllama").convert_tokens_to_ids("<|image|>")
    qc = M.make_config("qwen2_5_vl")
    assert qc.text_config.hidden_size // qc.text_config.num_attention_heads in (32, 64)
    assert qc.vision_config.hidden_size // qc.vision_config.num_heads in (32, 64)
    assert sum(qc.text_config.rope_parameters["mrope_section"]) * 2 == qc.text_config.hidden_size // 4
    bc = M.make_config("bart")
    assert bc.d_model // bc.decoder_attention_heads in (32, 64) and bc.tie_word_embeddings


def test_assets_without_torchvision():
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    mt = AutoTokenizer.from_pretrained(M.tokenizer_dir("mllama"))
    assert len(mt) == 513 and mt.convert_tokens_to_ids("<|image|>") == 512
    qt = AutoTokenizer.from_pretrained(M.tokenizer_dir("qwen2_5_vl"))
    assert len(qt) == 512
    assert qt.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [504, 505, 506]
    bt = AutoTokenizer.from_pretrained(M.tokenizer_dir("bart"))
    assert bt.convert_tokens_to_ids(["<s>", "<pad>", "</s>", "<unk>", "<mask>"]) == [0, 1, 2, 3, 511]
    for model in ("mllama", "qwen2_5_vl"):
        ip = I.image_processor(model)
        assert type(ip).__name__.endswith("Pil")
        cfg = json.loads((M.processor_dir(model) / "preprocessor_config.json").read_text())
        assert cfg["processor_class"] == {"mllama": "MllamaProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}[model]
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():  # what loads in this venv, where torchvision breaks transformers
        assert type(AutoImageProcessor.from_pretrained(M.processor_dir("qwen2_5_vl"))).__name__ == \
            "Qwen2VLImageProcessorPil"


def test_images_platform_independent():
    # golden values: PCG64 integer draws, integer arithmetic only
    digests = {
        m: hashlib.sha256(b"".join(a.tobytes() for a in I.synth_images(I.IMAGES[m]))).hexdigest()
        for m in ("mllama", "qwen2_5_vl")
    }
    assert digests == {
        "mllama": GOLDEN_IMAGES["mllama"],
        "qwen2_5_vl": GOLDEN_IMAGES["qwen2_5_vl"],
    }
    a = I.synth_images(I.IMAGES["mllama"])
    assert [x.shape for x in a] == [(56, 56, 3), (56, 112, 3), (112, 56, 3)] and a[0].dtype == np.uint8


GOLDEN_IMAGES = {
    "mllama": "07f439f64a4e745759c1913cf4e0dd8c86cbaef32aa6e1097ad661450aebef82",
    "qwen2_5_vl": "85a3f67af8a271f70d80dc79ac82929769aea3db2ea8d9e1a35a6df781c9076f",
}


# ---------------------------------------------------------------- image prompts


def _eq(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(torch.as_tensor(a).to(b.dtype), b)


def test_mllama_inputs_are_what_the_processor_returns():
    """prompt_batches (ids + images -> image processor + the processor's own cross-attention-mask
    helpers) equals MllamaProcessor(images, text) on the original texts, every key and value."""
    proc = I.mllama_processor()
    ours = I.prompt_batches("mllama")
    for text, img, mine in zip(I.VLM_TEXTS, I.synth_images(I.IMAGES["mllama"]), ours, strict=True):
        theirs = proc(images=[[I._pil(img)]], text=["<|image|>" + text], return_tensors="pt")
        assert set(theirs) == set(mine)
        for k in theirs:
            assert _eq(theirs[k], mine[k]), k
    # one tile, two tiles side by side, two tiles stacked: aspect ratio ids 1, 2, 3
    assert [b["aspect_ratio_ids"].item() for b in ours] == [1, 2, 3]
    assert [b["aspect_ratio_mask"][0, 0].tolist() for b in ours] == [[1, 0], [1, 1], [1, 1]]
    ids = ours[0]["input_ids"][0].tolist()
    tok = M.load_tokenizer("mllama")
    assert ids[:3] == [tok.bos_token_id, 512, tok.bos_token_id]  # as MllamaProcessor + a Llama-3 tokenizer do
    cam = ours[0]["cross_attention_mask"][0]
    assert cam[0].sum() == 0 and cam[1:, 0, 0].all()  # text attends to the image from the image token on


def test_qwen_inputs_are_what_the_processor_returns():
    """Qwen2_5_VLProcessor cannot be constructed without torchvision (its video processor); its
    __call__ run on an instance built without __init__ gives exactly our ids, pixels, grid and
    mm_token_type_ids."""
    from transformers import Qwen2_5_VLProcessor

    ip, tok = I.image_processor("qwen2_5_vl"), M.load_tokenizer("qwen2_5_vl")
    proc = Qwen2_5_VLProcessor.__new__(Qwen2_5_VLProcessor)
    proc.image_processor, proc.tokenizer, proc.video_processor, proc.chat_template = ip, tok, None, None
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")
    proc.video_token_id = tok.convert_tokens_to_ids("<|video_pad|>")
    ours = I.prompt_batches("qwen2_5_vl")
    for text, img, mine in zip(I.VLM_TEXTS, I.synth_images(I.IMAGES["qwen2_5_vl"]), ours, strict=True):
        try:
            theirs = proc(images=[I._pil(img)], text=["<|vision_start|><|image_pad|><|vision_end|>" + text],
                          return_tensors="pt")
        except (AttributeError, TypeError) as e:  # pragma: no cover - a transformers change
            pytest.skip(f"Qwen2_5_VLProcessor.__call__ without __init__ no longer works: {e}")
        assert set(theirs) == set(mine)
        for k in theirs:
            assert _eq(theirs[k], mine[k]), k
    assert [int(b["mm_token_type_ids"].sum()) for b in ours] == [4, 8, 12]
    assert [b["image_grid_thw"].tolist() for b in ours] == [[[1, 4, 4]], [[1, 4, 8]], [[1, 6, 8]]]


def test_prompt_inputs_from_manifest(built):
    import torch

    for model in NEW_MODELS:
        man = F.manifest(built[f"{model}-unquantized"])
        again, direct = F.prompt_inputs(man), I.prompt_batches(model)
        assert len(again) == len(direct) == len(man["prompts"]) == 3
        for a, b in zip(again, direct):
            assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    bart = F.manifest(built["bart-unquantized"])
    ins = F.prompt_inputs(bart)
    assert ins[0]["decoder_input_ids"][0, :2].tolist() == [2, 0]  # </s> (decoder start), <s>
    assert ins[0]["input_ids"][0, 0].item() == 0 and ins[0]["input_ids"][0, -1].item() == 2
    assert bart["encoder_prompts"] == [b["input_ids"][0].tolist() for b in ins]


# ---------------------------------------------------------------- the cross-attention really works


def _reload(path, model):
    import torch

    return M.model_class(model).from_pretrained(path, device_map="cpu", dtype=torch.float32).eval()


def _other_images(images: dict) -> dict:
    return {**images, "items": [{**it, "seed": it["seed"] + 500} for it in images["items"]]}


def test_mllama_gates_nonzero_and_image_changes_logits(built):
    import torch

    path = built["mllama-unquantized"]
    h = _header(built, "mllama-unquantized")
    for layer in M.MLLAMA_CROSS_LAYERS:
        for g in ("cross_attn_attn_gate", "cross_attn_mlp_gate"):
            assert f"language_model.model.layers.{layer}.{g}" in h
    model = _reload(path, "mllama")
    for layer in M.MLLAMA_CROSS_LAYERS:
        dec = model.model.language_model.layers[layer]
        for g in (dec.cross_attn_attn_gate, dec.cross_attn_mlp_gate):
            assert 0.4 < g.tanh().item() < 0.8
    man = F.manifest(path)
    ins = F.prompt_inputs(man)
    other = I.prompt_batches("mllama", {"prompts": man["prompts"], "images": _other_images(man["images"])})
    with torch.no_grad():
        for a, b in zip(ins, other):
            la, lb = model(**a).logits[0], model(**b).logits[0]
            assert a["cross_attention_mask"][0, 0].sum() == 0 and a["cross_attention_mask"][0, 1:, 0, 0].all()
            assert (la[1:] - lb[1:]).abs().amax(-1).min() > 0.05  # from the image token on, every position moves
            # transformers 5.19 quirk: position 0 (<|begin_of_text|>, before the image token, cross-attention
            # mask all 0) moves too. _prepare_cross_attention_mask turns a fully masked row into an all-zero
            # bias (the row attends to every vision token) and only the cross-attention MLP output is
            # multiplied by full_text_row_masked_out_mask, not the attention output (Meta's reference and
            # vLLM mask both). Engines that mask the row disagree with transformers at such positions.
            assert (la[0] - lb[0]).abs().max() > 0.05
        # with the gates at their init value (0), cross-attention is a no-op: the image changes nothing
        for layer in M.MLLAMA_CROSS_LAYERS:
            dec = model.model.language_model.layers[layer]
            dec.cross_attn_attn_gate.zero_()
            dec.cross_attn_mlp_gate.zero_()
        assert torch.equal(model(**ins[0]).logits, model(**other[0]).logits)


def test_qwen_image_changes_logits(built):
    import torch

    man = F.manifest(built["qwen2_5_vl-unquantized"])
    model = _reload(built["qwen2_5_vl-unquantized"], "qwen2_5_vl")
    ins = F.prompt_inputs(man)
    other = I.prompt_batches("qwen2_5_vl", {"prompts": man["prompts"], "images": _other_images(man["images"])})
    with torch.no_grad():
        la, lb = model(**ins[1]).logits[0], model(**other[1]).logits[0]
    first_image = man["prompts"][1].index(I.make_config_ids("qwen2_5_vl")["image_token_id"])
    assert torch.equal(la[:first_image], lb[:first_image])
    assert (la[first_image:] - lb[first_image:]).abs().amax(-1).min() > 0.05


# ---------------------------------------------------------------- checkpoint spelling


@pytest.mark.parametrize("model", ["mllama", "qwen2_5_vl"])
def test_checkpoint_spelling(built, model):
    """transformers 5.19's save_pretrained writes the legacy (checkpoint) spelling, and
    models.CHECKPOINT_PREFIXES says exactly which."""
    import torch

    h = _header(built, f"{model}-unquantized")
    on_disk = {k for k in h if k != "__metadata__"}
    with torch.device("meta"):
        m = M.model_class(model)(M.make_config(model))
    in_memory = set(m.state_dict())
    assert {M.checkpoint_name(model, k) for k in in_memory} == on_disk
    assert not any(k.startswith(("model.language_model.", "model.visual.", "model.vision_model.")) for k in on_disk)
    if model == "mllama":
        assert "language_model.model.layers.3.cross_attn.k_proj.weight" in on_disk
        assert "language_model.lm_head.weight" in on_disk and "vision_model.patch_embedding.weight" in on_disk
    else:
        assert "model.layers.0.self_attn.q_proj.bias" in on_disk and "visual.blocks.0.attn.qkv.weight" in on_disk


def test_torchao_metadata_keeps_in_memory_spelling(built):
    """transformers 5.19 renames the torchao tensors to the checkpoint spelling but writes the
    safetensors __metadata__ (each weight's _type) under the in-memory names."""
    h = _header(built, "mllama-torchao-int8wo")
    meta = h["__metadata__"]
    assert "language_model.model.layers.3.cross_attn.k_proj._weight_qdata" in h
    assert json.loads(meta["model.language_model.layers.3.cross_attn.k_proj.weight"])["_type"] == "Int8Tensor"
    assert "language_model.model.layers.3.cross_attn.k_proj.weight" not in meta


# ---------------------------------------------------------------- what each skip fixture's producer did

VISION = {"mllama": ("model.vision_model", "model.multi_modal_projector"), "qwen2_5_vl": ("model.visual",)}
TEXT = {"mllama": "model.language_model", "qwen2_5_vl": "model.language_model"}


@pytest.mark.parametrize("name", [v for v in VARIANTS if "vision" in v])
def test_vision_tower_left_unquantized(built, name):
    s = F.spec(name)
    mods = _mods(built, name)
    vision = {m: lab for p in VISION[s.model] for m, lab in _under(mods, p).items()}
    assert vision and set(vision.values()) == {"unquantized"}
    assert set(_under(mods, TEXT[s.model]).values()) == {s.label}
    assert mods["lm_head"] == "unquantized"
    assert len(vision) + len(_under(mods, TEXT[s.model])) + 1 == len(mods)
    # the disk agrees, in the checkpoint spelling
    h = _header(built, name)
    for m in vision:
        d = M.checkpoint_name(s.model, m)
        assert h[f"{d}.weight"]["dtype"] == "F32" and f"{d}.weight_scale" not in h and f"{d}._weight_qdata" not in h
    cfg = json.loads((built[name] / "config.json").read_text())["quantization_config"]
    if s.producer == "compressed-tensors":
        assert cfg["ignore"] == s.skip_policy["ignore"]  # in-memory spelling, as the producer matched them
    if "modules_to_not_convert" in s.skip_policy:
        assert cfg["modules_to_not_convert"] == s.skip_policy["modules_to_not_convert"]
    if "FqnToConfig" in s.skip_policy:
        table = cfg["quant_type"]["default"]["_data"]["fqn_to_config"]
        assert {k for k, v in table.items() if v is None} == {k for k, v in s.skip_policy["FqnToConfig"].items() if v is None}


def test_unsloth_style_skip_list(built):
    """An unsloth-style list in the checkpoint spelling, given to transformers 5.19, whose modules are
    named model.language_model.* / model.vision_model.*: its matcher (re.match anchored at the start,
    or endswith) misses every 'language_model.model.' entry and the bare 'vision_model', but catches
    full vision paths through endswith, and 'multi_modal_projector' the same way."""
    name = "mllama-bnb-nf4-skip-unsloth"
    mods = _mods(built, name)
    man = F.manifest(built[name])
    matched = man["producer"]["skip_entries_matched"]
    assert matched == {
        "language_model.model.layers.3.cross_attn": [],
        "vision_model": [],
        "vision_model.transformer.layers.1.mlp.fc2": ["model.vision_model.transformer.layers.1.mlp.fc2"],
        "multi_modal_projector": ["model.multi_modal_projector"],
        "lm_head": ["lm_head"],
    }
    # intent: cross-attention layer 3 and the whole vision tower unquantized; what happened:
    assert set(_under(mods, "model.language_model.layers.3.cross_attn").values()) == {"bnb-nf4"}
    vision = _under(mods, "model.vision_model")
    assert {m for m, lab in vision.items() if lab == "unquantized"} == {"model.vision_model.transformer.layers.1.mlp.fc2"}
    assert mods["model.multi_modal_projector"] == mods["lm_head"] == "unquantized"
    assert sum(lab == "unquantized" for lab in mods.values()) == 3
    # on disk the cross_attn weights sit exactly under the spelling the skip entry used, packed nf4
    h = _header(built, name)
    for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"language_model.model.layers.3.cross_attn.{p}.weight.quant_state.bitsandbytes__nf4" in h
    cfg = json.loads((built[name] / "config.json").read_text())["quantization_config"]
    assert cfg["llm_int8_skip_modules"] == F.spec(name).skip_policy["llm_int8_skip_modules"]


def test_skip_kproj_cross(built):
    name = "mllama-bnb-nf4-skip-kproj-cross"
    mods = _mods(built, name)
    cross = "model.language_model.layers.3.cross_attn"
    assert mods[f"{cross}.k_proj"] == "unquantized"
    assert {mods[f"{cross}.{p}"] for p in ("q_proj", "v_proj", "o_proj")} == {"bnb-nf4"}
    assert mods["model.language_model.layers.1.cross_attn.k_proj"] == "bnb-nf4"
    assert mods["lm_head"] == "bnb-nf4"  # a custom list replaces transformers' default skips
    assert sum(lab == "unquantized" for lab in mods.values()) == 1
    h = _header(built, name)
    assert h["language_model.model.layers.3.cross_attn.k_proj.weight"]["dtype"] == "F32"
    assert h["language_model.model.layers.3.cross_attn.v_proj.weight"]["dtype"] == "U8"


def test_mixed_cross_three_settings(built):
    name = "mllama-fp8-static-kv-mixed-cross"
    mods = _mods(built, name)
    cross = "model.language_model.layers.3.cross_attn"
    assert (mods[f"{cross}.q_proj"], mods[f"{cross}.k_proj"], mods[f"{cross}.v_proj"]) == \
        ("fp8-tensor", "fp8-channel", "unquantized")
    assert mods[f"{cross}.o_proj"] == "fp8-tensor"
    assert {mods[f"model.language_model.layers.1.cross_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")} == {"fp8-tensor"}
    assert sum(lab == "fp8-channel" for lab in mods.values()) == 1
    h = _header(built, name)
    d = "language_model.model.layers.3.cross_attn"
    assert h[f"{d}.q_proj.weight_scale"]["shape"] == [1] and f"{d}.q_proj.input_scale" in h
    assert h[f"{d}.k_proj.weight_scale"]["shape"] == [64, 1] and h[f"{d}.k_proj.input_scale"]["shape"] == [1]
    assert h[f"{d}.v_proj.weight"]["dtype"] == "F32" and f"{d}.v_proj.weight_scale" not in h
    assert h[f"{d}.k_scale"]["shape"] == h[f"{d}.v_scale"]["shape"] == [1]
    qc = json.loads((built[name] / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_1"]["targets"] == [f"{cross}.k_proj"]
    assert qc["config_groups"]["group_1"]["weights"]["strategy"] == "channel"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "tensor"
    assert f"{cross}.v_proj" in qc["ignore"]


@pytest.mark.parametrize("name", ["mllama-fp8-static-kv", "mllama-fp8-static-kv-mixed-cross", "qwen2_5_vl-fp8-static-kv",
                                  "bart-fp8-static-kv"])
def test_kv_scales_calibrated(built, name):
    """k_scale/v_scale on every text attention (Mllama: self- and cross-attention; Bart: encoder,
    decoder and cross-attention), calibrated (not the initial value), none on vision attention."""
    from safetensors import safe_open

    s = F.spec(name)
    man = F.manifest(built[name])
    kv = man["kv_cache_modules"]
    if s.model == "mllama":
        assert {f"model.language_model.layers.{i}.{'cross_attn' if i in M.MLLAMA_CROSS_LAYERS else 'self_attn'}"
                for i in range(5)} == set(kv)
        assert "model.language_model" in man["producer"]["kv_cache_scheme_applied_to"]
    if s.model == "bart":
        assert any(".encoder_attn" in a for a in kv) and any("model.encoder." in a for a in kv)
        assert "num_key_value_heads" in man["producer"]["kv_cache_scheme_applied_to"]
    with safe_open(built[name] / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        scales = {a: [f.get_tensor(f"{M.checkpoint_name(s.model, a)}.{k}").item() for k in ("k_scale", "v_scale")]
                  for a in kv}
    assert all(0 < x < 1 and x != pytest.approx(1.0) for v in scales.values() for x in v), scales
    assert len({x for v in scales.values() for x in v}) > len(kv)  # calibrated per module
    assert not any(k.endswith(("k_scale", "v_scale")) and ("vision" in k or "visual" in k) for k in keys)


def test_bart_lm_head_tied(built):
    h = _header(built, "bart-unquantized")
    assert "model.shared.weight" in h and "lm_head.weight" not in h
    assert _mods(built, "bart-bnb-nf4")["lm_head"] == "unquantized"
    assert "lm_head" in F.manifest(built["bart-bnb-nf4"])["producer"]["modules_to_not_convert_resolved"]


def test_sizes(built):
    for name, path in built.items():
        size = sum(p.stat().st_size for p in path.iterdir())
        assert size < 5_000_000, (name, size)


# ---------------------------------------------------------------- rebuild

REBUILD = ("mllama-bnb-nf4-dq", "mllama-fp8-static-kv-mixed-cross", "qwen2_5_vl-torchao-int8wo-skip-vision",
           "bart-fp8-static-kv")


@pytest.mark.slow("rebuilds four VLM and Bart fixtures in a fresh process and cache to compare their bytes")
def test_rebuild_is_byte_identical(built, tmp_path):
    env = dict(os.environ, HARNESS_FIXTURE_CACHE=str(tmp_path), PYTHONHASHSEED="4242")
    code = "import sys, harness.fixtures as F\nfor n in sys.argv[1:]: print(F.build(n))"
    out = subprocess.run([sys.executable, "-c", code, *REBUILD], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    paths = [Path(line) for line in out.stdout.split()]
    assert len(paths) == len(REBUILD)
    for name, again in zip(REBUILD, paths):
        first = built[name]
        assert again.name == first.name
        assert (again / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes(), name
        a, b = F.manifest(again), F.manifest(first)
        assert a["identity"] == b["identity"] and a["margins"] == b["margins"] and a["modules"] == b["modules"]
        assert a["prompts"] == b["prompts"] and a.get("images") == b.get("images")
