"""harness.dialects against the owners of each skip-list dialect.

Every dialect is compared with its owner's own function where the owner exposes one
(transformers ``should_convert_module`` and friends, torchao ``quantize_`` itself,
compressed-tensors ``utils.match``, vLLM's ``is_layer_skipped`` / ``should_skip`` /
``should_ignore_layer`` / ``get_scheme_dict`` / ``get_quant_method``, vllm-bnb-plugin's
``is_layer_skipped_bnb``, transformers' checkpoint conversion mapping). The owners are imported
lazily in session fixtures so that collecting this file stays cheap.
"""
from __future__ import annotations

import ast
import copy
import json
import re
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.architectures import BY_NAME as ARCH
from harness.dialects import SkipPolicy, intent_disagreements
from harness.dialects.compressed_tensors import NAME as COMPRESSED_TENSORS
from harness.dialects.compressed_tensors import ct_is_match, ct_match_class, ct_match_name, ct_match_targets, ct_resolve
from harness.dialects.intent import literal_dots
from harness.dialects.names import normalise_entry, to_checkpoint, to_memory, to_vllm, vllm_rename_entry
from harness.dialects.torchao import NAME as TORCHAO
from harness.dialects.torchao import torchao_fqn_matches, torchao_quant_type, torchao_resolve
from harness.dialects.transformers import NAME as TRANSFORMERS
from harness.dialects.transformers import transformers_default_skip_keys, transformers_should_convert, transformers_skip_keys
from harness.dialects.transformers_fp8 import NAME as TRANSFORMERS_FP8
from harness.dialects.transformers_torchao import NAME as TRANSFORMERS_TORCHAO
from harness.dialects.transformers_torchao import transformers_torchao_resolve
from harness.dialects.vllm_bnb import NAME as VLLM_BNB
from harness.dialects.vllm_bnb import vllm_bnb_is_layer_skipped
from harness.dialects.vllm_compressed_tensors import NAME as VLLM_COMPRESSED_TENSORS
from harness.dialects.vllm_compressed_tensors import (vllm_ct_find_matched_target, vllm_ct_resolve, vllm_ct_should_ignore_layer,
                                                      vllm_find_matching_patterns)
from harness.dialects.vllm_fp8 import NAME as VLLM_FP8
from harness.dialects.vllm_fp8 import vllm_fp8_ignored_layers, vllm_is_layer_skipped
from harness.dialects.vllm_torchao import NAME as VLLM_TORCHAO
from harness.dialects.vllm_torchao import vllm_torchao_resolve, vllm_torchao_should_skip, vllm_torchao_skip_modules

pytestmark = pytest.mark.filterwarnings("ignore")

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SLOW = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# ---------------------------------------------------------------------------------------------
# name universes and entry strategies
# ---------------------------------------------------------------------------------------------

IDX = (0, 1, 2, 10, 11)
HF_TEMPLATES = (
    "model.layers.{i}.self_attn.q_proj",
    "model.layers.{i}.self_attn.k_proj",
    "model.layers.{i}.self_attn.v_proj",
    "model.layers.{i}.self_attn.o_proj",
    "model.layers.{i}.mlp.gate_proj",
    "model.layers.{i}.mlp.up_proj",
    "model.layers.{i}.mlp.down_proj",
    "model.encoder.layers.{i}.fc1",
    "model.encoder.layers.{i}.fc2",
    "model.encoder.layers.{i}.self_attn.q_proj",
    "model.decoder.layers.{i}.encoder_attn.q_proj",
    "model.decoder.layers.{i}.encoder_attn.k_proj",
    "model.decoder.layers.{i}.encoder_attn.v_proj",
    "model.visual.blocks.{i}.attn.qkv",
)
HF_NAMES = sorted({t.format(i=i) for t in HF_TEMPLATES for i in IDX} | {"lm_head"})
VLLM_TEMPLATES = {
    "model.layers.{i}.self_attn.qkv_proj": "QKVParallelLinear",
    "model.layers.{i}.self_attn.o_proj": "RowParallelLinear",
    "model.layers.{i}.mlp.gate_up_proj": "MergedColumnParallelLinear",
    "model.layers.{i}.mlp.down_proj": "RowParallelLinear",
    "model.decoder.layers.{i}.encoder_attn.q_proj": "ColumnParallelLinear",
    "model.decoder.layers.{i}.encoder_attn.kv_proj": "MergedColumnParallelLinear",
    "model.encoder.layers.{i}.mlp.fc1": "ColumnParallelLinear",
    "visual.blocks.{i}.attn.qkv": "QKVParallelLinear",
}
VLLM_CLASSES = {t.format(i=i): c for t, c in VLLM_TEMPLATES.items() for i in IDX}
VLLM_CLASSES["lm_head"] = "ParallelLMHead"
VLLM_NAMES = sorted(VLLM_CLASSES)
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"], "kv_proj": ["k_proj", "v_proj"]}


def _pieces(names):
    out = set()
    for n in names:
        parts = n.split(".")
        for i in range(len(parts)):
            for j in range(i + 1, len(parts) + 1):
                out.add(".".join(parts[i:j]))
    return sorted(out)


EXTRA = ["proj", "_proj", "fc", "layers.1", "model.layers.1", "nothing.here", "model.layer"]
HF_PIECES = _pieces(HF_NAMES) + EXTRA
VLLM_PIECES = _pieces(VLLM_NAMES + HF_NAMES) + EXTRA
CLASS_NAMES = ["Linear", "Embedding", "Module", "LinearBase", "ParallelLMHead"]


@st.composite
def regex_bodies(draw, pieces):
    p = draw(st.sampled_from(pieces))
    style = draw(st.sampled_from(["escaped", "raw", "lead"]))
    tail = draw(st.sampled_from(["", r"\..*", ".*", "$", r"\.\d+", r"\d*"]))
    if style == "escaped":
        return re.escape(p) + tail
    if style == "raw":
        return p + tail
    return ".*" + re.escape(p) + tail


def plain_or_regex(pieces, with_classes=False):
    options = [st.sampled_from(pieces), regex_bodies(pieces).map(lambda b: "re:" + b)]
    if with_classes:
        options.append(st.sampled_from(CLASS_NAMES))
    return st.one_of(*options)


transformers_keys = st.one_of(
    st.sampled_from(HF_PIECES),
    regex_bodies(HF_PIECES),  # transformers keys are raw regexes
    regex_bodies(HF_PIECES).map(lambda b: "re:" + b),  # a "re:" prefix is a literal to transformers
)


class _Root(torch.nn.Module):
    def get_input_embeddings(self):  # what transformers' TorchAoQuantize asks of a model
        return None


def build(names, bias=False, device=None):
    """A plain module tree with an nn.Linear at every given name."""
    root = _Root()
    for n in names:
        parts = n.split(".")
        mod = root
        for p in parts[:-1]:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        mod.add_module(parts[-1], torch.nn.Linear(16, 16, bias=bias, device=device))
    return root


# ---------------------------------------------------------------------------------------------
# owners, imported lazily
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def hf():
    from transformers.quantizers.base import HfQuantizer, get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    return {"should_convert_module": should_convert_module, "get_keys_to_not_convert": get_keys_to_not_convert,
            "get_modules_to_not_convert": HfQuantizer.get_modules_to_not_convert}


@pytest.fixture(scope="session")
def ao():
    warnings.filterwarnings("ignore")
    import torchao.quantization as q
    from torchao.utils import TorchAOBaseTensor

    return q, TorchAOBaseTensor


@pytest.fixture(scope="session")
def ctm():
    import compressed_tensors.utils.match as m

    return m


@pytest.fixture(scope="session")
def vq():
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.quantization import torchao as vtorchao
    from vllm.model_executor.layers.quantization.compressed_tensors import utils as ctutils
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils import config_utils, quant_utils
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm_bnb_plugin.quantization.utils import is_layer_skipped_bnb

    classes = {c.__name__: c for c in (linear.QKVParallelLinear, linear.RowParallelLinear, linear.MergedColumnParallelLinear,
                                       linear.ColumnParallelLinear, linear.ReplicatedLinear, ParallelLMHead)}
    return {
        "is_layer_skipped": quant_utils.is_layer_skipped,
        "should_skip": vtorchao.should_skip,
        "TorchAOConfig": vtorchao.TorchAOConfig,
        "should_ignore_layer": ctutils.should_ignore_layer,
        "find_matched_target": ctutils.find_matched_target,
        "find_matching_patterns": config_utils.find_matching_patterns,
        "CompressedTensorsConfig": CompressedTensorsConfig,
        "Fp8Config": Fp8Config,
        "UnquantizedLinearMethod": linear.UnquantizedLinearMethod,
        "is_layer_skipped_bnb": is_layer_skipped_bnb,
        "fake": lambda cls_name: object.__new__(classes[cls_name]),  # only the class is ever looked at
    }


def _outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError:
        return "ValueError"


# ---------------------------------------------------------------------------------------------
# transformers 5.19
# ---------------------------------------------------------------------------------------------


@FAST
@given(names=st.lists(st.sampled_from(HF_NAMES), min_size=1, max_size=12, unique=True),
       keys=st.one_of(st.none(), st.lists(transformers_keys, max_size=4)), param=st.booleans())
def test_transformers_should_convert_matches_owner(hf, names, keys, param):
    for n in names:
        name = f"{n}.weight" if param else n
        assert transformers_should_convert(name, keys) == hf["should_convert_module"](name, keys)


def test_transformers_documented_cases():
    keys = ["model.layers.1"]
    assert not transformers_should_convert("model.layers.11.mlp.up_proj", keys)  # layers.1 hits layers.11
    assert not transformers_should_convert("model.layers.10.self_attn.q_proj", keys)
    assert transformers_should_convert("model.layers.2.mlp.up_proj", keys)
    # dots are wildcards, and the key is anchored at the start only
    assert not transformers_should_convert("model_layers_1.x", ["model.layers.1"])
    assert transformers_should_convert("model.model.layers.1.x", ["model.layers.1"])
    # plain suffix, no dot boundary; on a parameter name (torchao path) the suffix no longer matches
    assert not transformers_should_convert("model.encoder.layers.23.fc1", ["fc1"])
    assert not transformers_should_convert("model.layers.0.self_attn.q_proj", ["proj"])
    assert transformers_should_convert("model.encoder.layers.23.fc1.weight", ["fc1"])
    # a "re:" prefix is just text to transformers
    assert transformers_should_convert("model.layers.1.mlp", ["re:model.layers.1"])
    # in-memory paths only: the checkpoint spelling of Mllama's vision tower does not match
    assert transformers_should_convert("model.vision_model.transformer.layers.0.mlp.fc1", ["vision_model"])


@pytest.fixture(scope="session")
def tiny_models():
    """Tiny transformers models on the meta device: llama (tied, untied), whisper, mllama, qwen2.5-vl."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MllamaConfig, MllamaForConditionalGeneration, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration, WhisperConfig, WhisperForConditionalGeneration)

    tc = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfgs = {
        "llama-untied": (LlamaForCausalLM, LlamaConfig(**tc, tie_word_embeddings=False)),
        "llama-tied": (LlamaForCausalLM, LlamaConfig(**tc, tie_word_embeddings=True)),
        "whisper": (WhisperForConditionalGeneration, WhisperConfig(
            d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128, num_mel_bins=8, max_source_positions=16,
            max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
        "mllama": (MllamaForConditionalGeneration, MllamaConfig(
            text_config=dict(tc, cross_attention_layers=[1]),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_global_layers=1, attention_heads=2,
                               image_size=32, patch_size=16, vision_output_dim=64, intermediate_layers_indices=[0]))),
        "qwen2_5_vl": (Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig(
            text_config=dict(tc, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32,
                               fullatt_block_indexes=[0]))),
    }
    out = {}
    for key, (cls, cfg) in cfgs.items():
        with torch.device("meta"):
            out[key] = cls(cfg)
    return out


@pytest.mark.parametrize("user", [None, [], ["model.layers.1"], ["lm_head", "model.visual"]])
@pytest.mark.parametrize("add_default", [False, True])
def test_transformers_skip_keys_match_owner(hf, tiny_models, user, add_default):
    for key, model in tiny_models.items():
        defaults = transformers_default_skip_keys(model)
        assert defaults == sorted(hf["get_keys_to_not_convert"](model)), key
        keep = sorted(model._keep_in_fp32_modules or []) or None
        ours = transformers_skip_keys(user, defaults, keep, add_default)
        theirs = hf["get_modules_to_not_convert"](model, list(user) if user is not None else None, keep, add_default)
        assert ours == sorted(theirs), key


def test_transformers_bnb_end_to_end(tiny_models):
    """The real quantizer on a meta Llama: a custom llm_int8_skip_modules replaces the defaults (so lm_head
    is quantized) and layers.1 also skips layers.10/11; the policy says the same."""
    from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM
    from transformers.quantizers.auto import AutoHfQuantizer

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=12, num_attention_heads=2, num_key_value_heads=1,
                      vocab_size=128, tie_word_embeddings=False)
    for skip in (["model.layers.1", "mlp.down_proj"], None):
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        bnb = BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=skip)
        quantizer = AutoHfQuantizer.from_config(bnb, pre_quantized=False)
        policy = SkipPolicy.from_quantization_config(bnb.to_dict(), default_keys=transformers_default_skip_keys(model))
        quantizer._process_model_before_weight_loading(model, device_map={"": "cpu"})
        kept = {n for n, m in model.named_modules() if type(m) is torch.nn.Linear}
        assert {n for n in linears if policy.skips(n)} == kept
        assert ("lm_head" in kept) == (skip is None)
        if skip:
            assert "model.layers.11.self_attn.q_proj" in kept


# ---------------------------------------------------------------------------------------------
# torchao 0.18 FqnToConfig, and transformers' reading of it
# ---------------------------------------------------------------------------------------------

LEAVES = sorted({n.rsplit(".", 1)[-1] for n in HF_NAMES})


@st.composite
def fqn_configs(draw, names, containers):
    """FqnToConfig dicts that torchao can apply to a plain module tree: non-None keys only ever reach
    nn.Linear leaves (exact leaf / leaf.weight keys, regexes ending in a leaf name); None keys go anywhere."""
    items = []
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["exact", "param", "container", "regex-none", "regex-leaf"]))
        none = draw(st.booleans())
        if kind == "exact":
            items.append((draw(st.sampled_from(names)), None if none else "int8"))
        elif kind == "param":
            items.append((draw(st.sampled_from(names)) + ".weight", None if none else "int8"))
        elif kind == "container" and containers:
            items.append((draw(st.sampled_from(containers)), None))
        elif kind == "regex-none":
            items.append(("re:" + draw(regex_bodies(_pieces(names)))
                          , None))
        else:
            lead = draw(st.sampled_from([".*", r"model\.layers\.1.*", r"model\..*", r"model\.layers\.\d\..*"]))
            leaf = draw(st.sampled_from(LEAVES))
            items.append(("re:" + lead + re.escape("." + leaf), None if none else "int8"))
    if draw(st.booleans()):
        items.append(("_default", "int8"))
    return OrderedDict((k, v) for k, v in items)


def _containers(names):
    out = set()
    for n in names:
        parts = n.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return sorted(out)


def _ao_cfg(ao_mod, symbolic):
    return OrderedDict((k, None if v is None else ao_mod.Int8WeightOnlyConfig()) for k, v in symbolic.items())


@SLOW
@given(data=st.data())
def test_torchao_resolve_matches_quantize(ao, data):
    q, base = ao
    names = data.draw(st.lists(st.sampled_from(HF_NAMES), min_size=1, max_size=8, unique=True))
    cfg = _ao_cfg(q, data.draw(fqn_configs(names, _containers(names))))
    model = build(names)
    q.quantize_(model, q.FqnToConfig(cfg), filter_fn=None)
    for n in names:
        quantized = isinstance(model.get_submodule(n).weight, base)
        assert torchao_resolve(cfg, n).skipped == (not quantized), (n, list(cfg))


@SLOW
@given(data=st.data())
def test_transformers_torchao_resolve_matches_convert(ao, data):
    from transformers import TorchAoConfig
    from transformers.integrations.torchao import TorchAoQuantize

    q, base = ao
    names = data.draw(st.lists(st.sampled_from(HF_NAMES), min_size=1, max_size=8, unique=True))
    cfg = _ao_cfg(q, data.draw(fqn_configs(names, _containers(names))))

    model = build(names)

    class Quantizer:
        quantization_config = TorchAoConfig(q.FqnToConfig(cfg))
        offload_to_cpu = False

    op = TorchAoQuantize(Quantizer())
    for n in names:
        full = f"{n}.weight"
        op.convert({full: model.get_submodule(n).weight.data}, model=model, full_layer_name=full, missing_keys=set())
        quantized = isinstance(model.get_submodule(n).weight, base)
        assert transformers_torchao_resolve(cfg, full).skipped == (not quantized), (n, list(cfg))


@FAST
@given(names=st.lists(st.sampled_from(HF_NAMES), min_size=1, max_size=6, unique=True),
       keys=st.lists(plain_or_regex(HF_PIECES), max_size=4))
def test_torchao_fqn_matches_owner(ao, names, keys):
    q, _ = ao
    cfg = OrderedDict((k, None) for k in keys)
    conf = q.FqnToConfig(cfg)
    for n in names:
        for fqn in (n, f"{n}.weight"):
            assert torchao_fqn_matches(fqn, cfg) == q.fqn_matches_fqn_config(fqn, conf)


def test_torchao_and_transformers_disagree_on_regex_precedence(ao):
    """torchao tries every parameter regex before any module regex; transformers tries each key against
    parameter then module, first key wins. A None key matching the parameter beats an earlier module key
    in torchao only."""
    q, _ = ao
    cfg = OrderedDict([(r"re:.*\.up_proj", "int8"), (r"re:model\.layers\.1\..*", None)])
    ao_res = torchao_resolve(cfg, "model.layers.1.mlp.up_proj")
    hf_res = transformers_torchao_resolve(cfg, "model.layers.1.mlp.up_proj.weight")
    assert ao_res.skipped and ao_res.how == "param-regex"
    assert not hf_res.skipped and hf_res.how == "module-regex"
    # None exact module key: unquantized; a None key on a container does not reach its children
    cfg = OrderedDict([("model.visual", None), ("_default", "int8")])
    assert not torchao_resolve(cfg, "model.visual.blocks.0.attn.qkv").skipped
    assert torchao_resolve(OrderedDict([("_default", None)]), "x").how == "unmatched"
    # no _default, nothing matched: torchao never touches it
    assert torchao_resolve(OrderedDict([("a", "int8")]), "b").how == "unmatched"


def _serialized_torchao(q, symbolic, mtnc=None):
    from transformers import TorchAoConfig

    fqn = q.FqnToConfig(_ao_cfg(q, symbolic))
    return json.loads(TorchAoConfig(fqn, modules_to_not_convert=mtnc).to_json_string())


def test_torchao_config_json_shape(ao):
    """What transformers writes for TorchAoConfig(FqnToConfig(...)): both fqn_to_config and
    module_fqn_to_config, sorted keys (so regex order after a save is alphabetical)."""
    q, _ = ao
    symbolic = OrderedDict([(r"re:z\..*", None), (r"re:a\..*", "int8"), ("model.visual", None), ("_default", "int8")])
    qc = _serialized_torchao(q, symbolic, ["lm_head"])
    assert qc["quant_method"] == "torchao"
    data = qc["quant_type"]["default"]["_data"]
    assert qc["quant_type"]["default"]["_type"] == "FqnToConfig"
    assert list(data["fqn_to_config"]) == sorted(symbolic) == list(data["module_fqn_to_config"])
    type_name, fqn = torchao_quant_type(qc)
    assert type_name == "FqnToConfig" and list(fqn) == sorted(symbolic)
    assert fqn["model.visual"] is None and fqn["_default"]["_type"] == "Int8WeightOnlyConfig"
    policy = SkipPolicy.from_quantization_config(qc)
    assert [e.raw for e in policy.from_source("modules_to_not_convert")] == ["lm_head"]
    assert {e.raw for e in policy.from_source("fqn_to_config") if e.value is None} == {r"re:z\..*", "model.visual"}
    assert policy.skips("lm_head") and policy.skips("z.q") and not policy.skips("a.q") and not policy.skips("model.x")


@SLOW
@given(data=st.data())
def test_vllm_torchao_matches_owner(ao, vq, data):
    q, _ = ao
    prefixes = data.draw(st.lists(st.sampled_from(VLLM_NAMES), min_size=1, max_size=8, unique=True))
    symbolic = OrderedDict()
    for k in data.draw(st.lists(plain_or_regex(VLLM_PIECES), max_size=4)):
        symbolic[k] = data.draw(st.sampled_from([None, "int8"]))
    if data.draw(st.booleans()):
        symbolic["_default"] = "int8"
    mtnc = data.draw(st.one_of(st.none(), st.lists(st.sampled_from(VLLM_PIECES), max_size=3)))
    qc = _serialized_torchao(q, symbolic, mtnc)
    owner = vq["TorchAOConfig"].from_config(copy.deepcopy(qc))
    assert owner.skip_modules == vllm_torchao_skip_modules(qc)
    policy = SkipPolicy.from_quantization_config(qc, dialect=VLLM_TORCHAO)
    for p in prefixes:
        cls = VLLM_CLASSES[p]
        method = owner.get_quant_method(vq["fake"](cls), p)
        theirs = method is None or isinstance(method, vq["UnquantizedLinearMethod"])
        ours = vllm_torchao_resolve(p, qc, is_linear=cls != "ParallelLMHead").skipped
        assert ours == theirs == policy.skips(p, cls), (p, qc["quant_type"]["default"]["_data"]["fqn_to_config"].keys(), mtnc)


@FAST
@given(prefix=st.sampled_from(VLLM_NAMES + HF_NAMES), skip=st.lists(st.sampled_from(VLLM_PIECES), max_size=4))
def test_vllm_torchao_should_skip_matches_owner(vq, prefix, skip):
    assert vllm_torchao_should_skip(prefix, skip) == vq["should_skip"](prefix, skip)


def test_vllm_torchao_documented_cases():
    assert vllm_torchao_should_skip("model.model.layers.1.q_proj", ["layers.1"])
    assert not vllm_torchao_should_skip("model.model.layers.11.q_proj", ["layers.1"])
    assert vllm_torchao_should_skip("visual.blocks.0.attn.qkv", ["visual"])
    assert not vllm_torchao_should_skip("visual.blocks.0.attn.qkv", [r"re:visual\..*"])
    # no shard expansion: a q_proj None entry does not reach vLLM's fused qkv_proj
    qc = {"quant_method": "torchao", "quant_type": {"default": {"_type": "FqnToConfig", "_data": {
        "module_fqn_to_config": {"model.layers.0.self_attn.q_proj": None, "_default": {"_type": "Int8WeightOnlyConfig"}}}}}}
    assert not vllm_torchao_resolve("model.layers.0.self_attn.qkv_proj", qc).skipped
    # a config with only fqn_to_config: vLLM's skip list misses the None entries, get_quant_method still honours exact ones
    qc2 = {"quant_method": "torchao", "quant_type": {"default": {"_type": "FqnToConfig", "_data": {
        "fqn_to_config": {"model.visual": None, "_default": {"_type": "Int8WeightOnlyConfig"}}}}}}
    assert vllm_torchao_skip_modules(qc2) == []
    assert not vllm_torchao_resolve("model.visual.blocks.0.attn.qkv", qc2).skipped


# ---------------------------------------------------------------------------------------------
# compressed-tensors 0.17
# ---------------------------------------------------------------------------------------------

MODULE_TYPES = {"Linear": torch.nn.Linear, "Embedding": torch.nn.Embedding, "Module": torch.nn.Module}


def _module(kind):
    with torch.device("meta"):
        if kind == "Linear":
            return torch.nn.Linear(1, 1)
        if kind == "Embedding":
            return torch.nn.Embedding(1, 1)
        return torch.nn.Module()


@FAST
@given(name=st.sampled_from(HF_NAMES + VLLM_NAMES), kind=st.sampled_from(sorted(MODULE_TYPES)),
       targets=st.lists(plain_or_regex(HF_PIECES, with_classes=True), max_size=4),
       ignore=st.lists(plain_or_regex(HF_PIECES, with_classes=True), max_size=3), use_fused=st.booleans())
def test_ct_matching_matches_owner(ctm, name, kind, targets, ignore, use_fused):
    mod = _module(kind)
    fused = FUSED if use_fused else None
    for t in targets:
        assert ct_match_name(name, t, fused) == ctm.match_name(name, t, fused)
        assert ct_match_class(MODULE_TYPES[kind], t) == ctm._match_class(mod, t)
        assert ct_match_class(kind, t) == ctm._match_class(mod, t)
    assert ct_is_match(name, MODULE_TYPES[kind], targets, ignore, fused) == ctm.is_match(name, mod, targets, ignore, fused)
    assert ct_match_targets(name, kind, targets) == ctm.match_targets(name, mod, targets)


@FAST
@given(names=st.lists(st.sampled_from(HF_NAMES), min_size=1, max_size=10, unique=True),
       groups=st.lists(st.lists(plain_or_regex(HF_PIECES, with_classes=True), min_size=1, max_size=3), min_size=1, max_size=3),
       ignore=st.lists(plain_or_regex(HF_PIECES, with_classes=True), max_size=3))
def test_ct_resolve_matches_apply_quantization_config_selection(ctm, names, groups, ignore):
    """The selection loop of apply_quantization_config, run with compressed-tensors' own functions."""
    config_groups = {f"group_{i}": {"targets": t, "weights": {"num_bits": 8}} for i, t in enumerate(groups)}
    target_to_scheme = OrderedDict()
    for g, grp in config_groups.items():
        for t in grp["targets"]:
            target_to_scheme[t] = g
    model = build(names, device="meta")
    theirs = {}
    for name, sub in ctm.match_named_modules(model, target_to_scheme, ignore):
        theirs[name] = target_to_scheme[ctm.match_targets(name, sub, target_to_scheme)[0]]
    for name, sub in model.named_modules():
        res = ct_resolve(name, type(sub), config_groups, ignore)
        assert (None if res is None else res.group) == theirs.get(name), name


def test_ct_apply_quantization_config_end_to_end():
    """apply_quantization_config itself, with leaf-only targets: class targets, re.match prefix semantics
    (re:model.layers.1 hits layers.11), ignore by name and regex, untargeted modules."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    names = [f"model.layers.{i}.{s}" for i in (0, 1, 11) for s in ("self_attn.q_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]
    w = lambda b: {"num_bits": b, "type": "int", "symmetric": True, "strategy": "channel"}  # noqa: E731
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g8": {"targets": ["Linear"], "weights": w(8)},
                            "g4": {"targets": ["re:model.layers.1.*proj"], "weights": w(4)},
                            "g6": {"targets": ["model.layers.0.mlp.down_proj"], "weights": w(6)}},
          "ignore": ["lm_head", "re:.*q_proj"]}
    model = build(names)
    apply_quantization_config(model, QuantizationConfig.model_validate(copy.deepcopy(qc)))
    bits = {"g8": 8, "g4": 4, "g6": 6}
    policy = SkipPolicy.from_quantization_config(qc)
    for n in names:
        scheme = getattr(model.get_submodule(n), "quantization_scheme", None)
        res = ct_resolve(n, torch.nn.Linear, qc["config_groups"], qc["ignore"])
        assert (None if scheme is None else scheme.weights.num_bits) == (None if res is None else bits[res.group]), n
        assert policy.skips(n) == (scheme is None)
    assert ct_resolve("model.layers.11.mlp.up_proj", "Linear", qc["config_groups"], qc["ignore"]).group == "g4"
    assert ct_resolve("model.layers.0.mlp.down_proj", "Linear", qc["config_groups"], qc["ignore"]).group == "g6"
    # untargeted: no group names it and it is not in ignore
    only_mlp = {"g": {"targets": ["re:.*mlp.*"], "weights": w(8)}}
    assert ct_resolve("model.layers.0.self_attn.o_proj", "Linear", only_mlp, []) is None
    assert ct_resolve("model.layers.0.self_attn.o_proj", "Linear", {"g": {"targets": ["Embedding"], "weights": w(8)}}, []) is None
    # exact names only for plain entries; "Module" is a class every module has
    assert not ct_match_name("model.layers.0.mlp", "mlp")
    assert ct_match_class("Linear", "Module")


# ---------------------------------------------------------------------------------------------
# vLLM 0.32
# ---------------------------------------------------------------------------------------------


@FAST
@given(prefix=st.sampled_from(VLLM_NAMES + HF_NAMES + ["model.layers.0.mlp.experts.3.w1"]),
       ignored=st.lists(st.sampled_from(HF_NAMES + VLLM_NAMES + VLLM_PIECES + ["model.layers.0.mlp.experts"]), max_size=6),
       mode=st.sampled_from(["exact", "substring", "suffix"]), fused=st.sampled_from([{}, FUSED]))
def test_vllm_is_layer_skipped_matches_owner(vq, prefix, ignored, mode, fused):
    ours = _outcome(vllm_is_layer_skipped, prefix, ignored, fused, match_mode=mode)
    theirs = _outcome(vq["is_layer_skipped"], prefix, ignored, fused, match_mode=mode)
    assert ours == theirs


def test_vllm_fp8_documented_cases(vq):
    fused = ARCH["llama"].vllm_packed_modules
    ignored = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
               "model.layers.1.self_attn.q_proj"]
    assert vllm_is_layer_skipped("model.layers.0.self_attn.qkv_proj", ignored, fused)
    with pytest.raises(ValueError):
        vllm_is_layer_skipped("model.layers.1.self_attn.qkv_proj", ignored, fused)
    assert not vllm_is_layer_skipped("model.layers.10.self_attn.qkv_proj", ["model.layers.1.self_attn.q_proj"], fused)
    assert not vllm_is_layer_skipped("model.layers.0.mlp.down_proj", ["model.layers.0.mlp"], fused)  # exact only
    for qc in ({"ignored_layers": ["a"], "modules_to_not_convert": ["b"]}, {"ignored_layers": [], "modules_to_not_convert": ["b"]},
               {"modules_to_not_convert": ["b"]}, {}):
        full = {"quant_method": "fp8", "activation_scheme": "dynamic", **qc}
        assert vq["Fp8Config"].from_config(copy.deepcopy(full)).ignored_layers == vllm_fp8_ignored_layers(full)


@FAST
@given(prefix=st.sampled_from(VLLM_NAMES + HF_NAMES), skip=st.lists(st.sampled_from(VLLM_PIECES), max_size=4))
def test_vllm_bnb_matches_owner(vq, prefix, skip):
    assert vllm_bnb_is_layer_skipped(prefix, skip) == vq["is_layer_skipped_bnb"](prefix, skip)


@FAST
@given(prefix=st.sampled_from(VLLM_NAMES), ignore=st.lists(plain_or_regex(VLLM_PIECES), max_size=4),
       targets=st.lists(plain_or_regex(VLLM_PIECES, with_classes=True), max_size=4), fused=st.sampled_from([{}, FUSED]))
def test_vllm_ct_helpers_match_owner(vq, prefix, ignore, targets, fused):
    cls = VLLM_CLASSES[prefix]
    assert _outcome(vllm_ct_should_ignore_layer, prefix, ignore, fused) == _outcome(vq["should_ignore_layer"], prefix, ignore, fused)
    assert vllm_find_matching_patterns(prefix, ignore, fused) == vq["find_matching_patterns"](prefix, ignore, fused)
    assert vllm_ct_find_matched_target(prefix, cls, targets, fused) == vq["find_matched_target"](prefix, vq["fake"](cls), targets, fused)


@FAST
@given(prefixes=st.lists(st.sampled_from(VLLM_NAMES), min_size=1, max_size=6, unique=True),
       groups=st.lists(st.lists(plain_or_regex(VLLM_PIECES, with_classes=True), min_size=1, max_size=3), min_size=1, max_size=3),
       ignore=st.lists(plain_or_regex(VLLM_PIECES), max_size=3), attention_group=st.booleans())
def test_vllm_ct_resolve_matches_get_scheme_dict(vq, prefixes, groups, ignore, attention_group):
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}
    config_groups = {f"group_{i}": {"targets": t, "weights": w} for i, t in enumerate(groups)}
    if attention_group:
        config_groups["attn"] = {"targets": ["LlamaAttention"], "weights": w}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": config_groups, "ignore": ignore}
    owner = vq["CompressedTensorsConfig"].from_config(copy.deepcopy(qc))
    owner.packed_modules_mapping = FUSED
    policy = SkipPolicy.from_quantization_config(qc, dialect=VLLM_COMPRESSED_TENSORS, fused_mapping=FUSED)
    for p in prefixes:
        cls = VLLM_CLASSES[p]
        theirs = _outcome(owner.get_scheme_dict, vq["fake"](cls), p)
        if isinstance(theirs, dict):
            theirs = next(t for t, d in owner.target_scheme_map.items() if d is theirs)
        ours = _outcome(vllm_ct_resolve, p, cls, qc, FUSED)
        ours = ours[1] if isinstance(ours, tuple) else ours
        assert ours == theirs, p
        if theirs != "ValueError":
            assert policy.skips(p, cls) == (theirs is None)


def _qwen_vllm_source():
    """The packed_modules_mapping and hf_to_vllm_mapper prefixes of vLLM's Qwen2_5_VLForConditionalGeneration,
    read from its source (importing it needs torchvision, which this venv does not have)."""
    import vllm

    src = Path(vllm.__file__).parent / "model_executor" / "models" / "qwen2_5_vl.py"
    tree = ast.parse(src.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2_5_VLForConditionalGeneration")
    out = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "packed_modules_mapping":
                out["packed"] = ast.literal_eval(node.value)
            if node.targets[0].id == "hf_to_vllm_mapper":
                kw = {k.arg: ast.literal_eval(k.value) for k in node.value.keywords}
                out["prefix"] = kw["orig_to_new_prefix"]
    return out


def test_vllm_names_match_owner(vq):
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.utils import WeightsMapper
    from vllm.model_executor.models.whisper import WhisperForConditionalGeneration

    qwen = _qwen_vllm_source()
    assert ARCH["llama"].vllm_packed_modules == LlamaForCausalLM.packed_modules_mapping
    assert ARCH["whisper"].vllm_packed_modules == WhisperForConditionalGeneration.packed_modules_mapping
    assert ARCH["qwen2_5_vl"].vllm_packed_modules == qwen["packed"]
    qwen_mapper = WeightsMapper(orig_to_new_prefix=qwen["prefix"])
    cases = {
        "llama": (LlamaForCausalLM.hf_to_vllm_mapper, [t.format(i=i) for t in HF_TEMPLATES[:7] for i in IDX] + ["lm_head"]),
        "whisper": (WhisperForConditionalGeneration.hf_to_vllm_mapper, [t.format(i=i) for t in HF_TEMPLATES[7:13] for i in IDX]
                    + [f"model.decoder.layers.{i}.self_attn.{p}" for i in IDX for p in ("q_proj", "k_proj", "v_proj", "out_proj")]
                    + [f"model.decoder.layers.{i}.{p}" for i in IDX for p in ("fc1", "fc2")]),
        "qwen2_5_vl": (qwen_mapper, [t.format(i=i) for t in HF_TEMPLATES[:7] for i in IDX] + ["lm_head", "model.layers.0.mlp.up_proj"]
                       + [f"model.language_model.layers.{i}.mlp.gate_proj" for i in IDX] + [f"visual.blocks.{i}.attn.qkv" for i in IDX]
                       + [f"model.visual.merger.mlp.{j}" for j in (0, 2)] + ["language_model.model.layers.1.mlp.down_proj"]),
    }
    for arch, (mapper, names) in cases.items():
        rename = mapper.get_rename_mapper()
        for n in names:
            assert vllm_rename_entry(n, arch) == rename.map_name(n), (arch, n)
            if arch == "qwen2_5_vl" and n.startswith("language_model."):
                continue  # vLLM spelling already; to_vllm takes HF spellings
            mapped = mapper.map_name(f"{n}.weight").removesuffix(".weight")
            # qwen's text stacking happens in Qwen2Model.load_weights, not in the mapper
            if arch == "qwen2_5_vl":
                mapped = re.sub(r"self_attn\.[qkv]_proj$", "self_attn.qkv_proj", mapped)
                mapped = re.sub(r"mlp\.(gate|up)_proj$", "mlp.gate_up_proj", mapped)
            assert to_vllm(n, arch) == mapped, (arch, n)
    # documented surprises: module entries carry no trailing dot, so some renames never fire
    assert vllm_rename_entry("model.encoder.layers.0.fc1", "whisper") == "model.encoder.layers.0.fc1"
    assert to_vllm("model.encoder.layers.0.fc1", "whisper") == "model.encoder.layers.0.mlp.fc1"
    assert vllm_rename_entry("lm_head", "qwen2_5_vl") == "lm_head"
    assert to_vllm("lm_head", "qwen2_5_vl") == "language_model.lm_head"
    assert to_vllm("model.decoder.layers.0.encoder_attn.v_proj", "whisper") == "model.decoder.layers.0.encoder_attn.kv_proj"


# ---------------------------------------------------------------------------------------------
# Names: checkpoint <-> memory, unsloth spelling
# ---------------------------------------------------------------------------------------------


def _checkpoint_pairs(model):
    from transformers.core_model_loading import revert_weight_conversion

    sd = {k: torch.empty(0) for k in model.state_dict()}
    ids = {id(v): k for k, v in sd.items()}
    return [(ids[id(v)], k) for k, v in revert_weight_conversion(model, dict(sd)).items()]


@pytest.mark.parametrize("arch", ["mllama", "qwen2_5_vl", "whisper", "llama-tied"])
def test_names_match_transformers_conversion_mapping(tiny_models, arch):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    model = tiny_models[arch]
    arch = arch.split("-")[0]
    convs = get_model_conversion_mapping(model)
    ren = [c for c in convs if isinstance(c, WeightRenaming)]
    cv = [c for c in convs if isinstance(c, WeightConverter)]
    pairs = _checkpoint_pairs(model)
    assert pairs
    for mem, ckpt in pairs:
        assert to_checkpoint(mem, arch) == ckpt
        assert to_memory(ckpt, arch) == mem == rename_source_key(ckpt, ren, cv)[0]
        assert to_memory(mem, arch) == mem
        mod_mem, mod_ckpt = mem.rsplit(".", 1)[0], ckpt.rsplit(".", 1)[0]
        assert to_checkpoint(mod_mem, arch) == mod_ckpt and to_memory(mod_ckpt, arch) == mod_mem
    if arch == "mllama":
        assert ("model.language_model.layers.0.self_attn.q_proj.weight", "language_model.model.layers.0.self_attn.q_proj.weight") in pairs
        assert ("lm_head.weight", "language_model.lm_head.weight") in pairs
    if arch == "qwen2_5_vl":
        assert ("model.language_model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight") in pairs


MLLAMA_MEM = ["model.language_model.layers.{i}.self_attn.q_proj", "model.language_model.layers.{i}.cross_attn.k_proj",
              "model.vision_model.transformer.layers.{i}.mlp.fc1", "model.multi_modal_projector", "lm_head",
              "model.vision_model.global_transformer.layers.{i}.self_attn.o_proj"]
QWEN_MEM = ["model.language_model.layers.{i}.mlp.up_proj", "model.visual.blocks.{i}.attn.qkv", "model.visual.merger.mlp.0", "lm_head",
            "model.language_model.embed_tokens"]


@FAST
@given(arch=st.sampled_from(["mllama", "qwen2_5_vl"]), template=st.integers(0, 5), i=st.sampled_from(IDX), depth=st.integers(1, 8))
def test_name_round_trips(arch, template, i, depth):
    names = MLLAMA_MEM if arch == "mllama" else QWEN_MEM
    full = names[template % len(names)].format(i=i)
    name = ".".join(full.split(".")[:depth])
    if name in ("model",):
        return  # the bare base model: transformers itself maps Qwen's "model" to "model.language_model"
    ckpt = to_checkpoint(name, arch)
    assert to_memory(ckpt, arch) == name
    assert to_checkpoint(to_memory(ckpt, arch), arch) == ckpt
    # any entry spelling (memory, checkpoint, unsloth) normalises to memory spelling
    assert name in normalise_entry(name, arch)
    assert name in normalise_entry(ckpt, arch) or (arch == "qwen2_5_vl" and ckpt == "model")
    if name.startswith("model.language_model"):
        unsloth = "language_model.model" + name[len("model.language_model"):]
        assert normalise_entry(unsloth, arch) == (name,)
    rx = "re:" + re.escape(ckpt) + r"\..*"
    if ckpt != "model":
        assert normalise_entry(rx, arch) == ("re:" + re.escape(name) + r"\..*",)


def test_normalise_entry_documented_cases():
    assert normalise_entry("language_model.model.layers.1.mlp", "mllama") == ("model.language_model.layers.1.mlp",)
    assert normalise_entry("language_model", "mllama") == ("model.language_model", "lm_head")
    assert normalise_entry("vision_model", "mllama") == ("model.vision_model",)
    assert normalise_entry("language_model.lm_head", "mllama") == ("lm_head",)
    assert normalise_entry("model.layers.2.mlp", "qwen2_5_vl") == ("model.language_model.layers.2.mlp",)
    assert normalise_entry("language_model.model.layers.2", "qwen2_5_vl") == ("model.language_model.layers.2",)
    assert normalise_entry("visual.blocks.31.mlp.down_proj", "qwen2_5_vl") == ("model.visual.blocks.31.mlp.down_proj",)
    assert normalise_entry(r"re:language_model.model.layers.*", "mllama") == (r"re:model\.language_model.layers.*",)
    assert normalise_entry(r"re:.*vision_model.*", "mllama") == (r"re:.*vision_model.*",)  # no literal lead: unchanged
    assert normalise_entry("mlp.down_proj", "mllama") == ("mlp.down_proj",)
    assert normalise_entry("model.layers.1", "llama") == ("model.layers.1",)
    assert to_memory("model.encoder.layers.0.fc1", "whisper") == "model.encoder.layers.0.fc1"


# ---------------------------------------------------------------------------------------------
# SkipPolicy and intent_disagreements
# ---------------------------------------------------------------------------------------------

LLAMA12 = [f"model.layers.{i}.{s}" for i in range(12) for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]


def _kinds(ds):
    return {(d.kind, d.entry) for d in ds}


def test_policy_bitsandbytes_sources_and_defaults():
    from transformers import BitsAndBytesConfig

    qc = BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["model.layers.1"]).to_dict()
    qc["modules_to_not_convert"] = ["lm_head"]  # some producers write it; nobody reads it for bnb
    p = SkipPolicy.from_quantization_config(qc)
    assert p.dialect == TRANSFORMERS and p.quant_method == "bitsandbytes"
    assert [(e.raw, e.source, e.honoured) for e in p.entries] == [("model.layers.1", "llm_int8_skip_modules", True),
                                                                   ("lm_head", "modules_to_not_convert", False)]
    assert not p.skips("lm_head") and p.skips("model.layers.11.mlp.up_proj") and not p.skips("model.layers.2.mlp.up_proj")
    assert any("lm_head" in n for n in p.notes)
    ds = intent_ds = intent_disagreements(p, LLAMA12)
    assert ("overreach", "model.layers.1") in _kinds(ds)
    assert ("unread-source", "lm_head") in _kinds(ds)
    assert {d.module for d in intent_ds if d.kind == "overreach"} == {n for n in LLAMA12 if n.startswith(("model.layers.10.", "model.layers.11."))}
    assert all(d.dialect == TRANSFORMERS and d.explanation for d in ds)
    # null list: transformers' defaults
    p0 = SkipPolicy.from_quantization_config(BitsAndBytesConfig(load_in_4bit=True).to_dict())
    assert p0.skips("lm_head") and [e.source for e in p0.entries] == ["default"]
    # vLLM's bnb plugin: dot-component semantics, lm_head is a ParallelLMHead there
    pv = SkipPolicy.from_quantization_config(qc, dialect=VLLM_BNB)
    assert pv.skips("model.layers.1.self_attn.qkv_proj") and not pv.skips("model.layers.11.self_attn.qkv_proj")
    assert pv.skips("lm_head", "ParallelLMHead")


def test_policy_unsloth_spelling_for_mllama():
    qc = {"quant_method": "bitsandbytes", "load_in_4bit": True,
          "llm_int8_skip_modules": ["lm_head", "multi_modal_projector", "language_model.model.layers.1.cross_attn", "vision_model"]}
    mem = ["model.language_model.layers.1.cross_attn.q_proj", "model.language_model.layers.1.cross_attn.k_proj",
           "model.language_model.layers.1.cross_attn.v_proj", "model.language_model.layers.2.self_attn.q_proj",
           "model.vision_model.transformer.layers.0.mlp.fc1", "model.multi_modal_projector", "lm_head"]
    raw = SkipPolicy.from_quantization_config(qc, arch="mllama")
    meant = SkipPolicy.from_quantization_config(qc, arch="mllama", normalise=True)
    # transformers 5.19 itself: only lm_head, and the projector through its endswith clause
    assert [n for n in mem if raw.skips(n)] == ["model.multi_modal_projector", "lm_head"]
    assert [n for n in mem if meant.skips(n)] == [n for n in mem if "layers.2" not in n]
    kinds = _kinds(intent_disagreements(raw, mem))
    assert ("spelling", "language_model.model.layers.1.cross_attn") in kinds
    assert ("underreach", "vision_model") in kinds
    assert not [d for d in intent_disagreements(meant, mem) if d.kind in ("spelling", "unmatched", "overreach")]


def test_policy_torchao_vision_tower(ao):
    """The TorchAO VLM case: the vision tower left unquantized through a None entry. transformers and torchao
    apply an exact key to that exact module only; vLLM reads None entries as dot-bounded skips."""
    q, _ = ao
    symbolic = OrderedDict([("model.visual", None), (r"re:model\.language_model\.layers\.1\..*", None), ("_default", "int8")])
    qc = _serialized_torchao(q, symbolic, ["lm_head"])
    names = ["model.visual.blocks.0.attn.qkv", "model.language_model.layers.1.mlp.up_proj",
             "model.language_model.layers.11.mlp.up_proj", "lm_head"]
    producer = SkipPolicy.from_quantization_config(qc)
    assert [producer.skips(n) for n in names] == [False, True, False, True]
    kinds = _kinds(intent_disagreements(producer, names))
    assert ("underreach", "model.visual") in kinds and ("unmatched", "model.visual") in kinds
    vllm = SkipPolicy.from_quantization_config(qc, dialect=VLLM_TORCHAO, arch="qwen2_5_vl")
    vnames = [to_vllm(n, "qwen2_5_vl") for n in names]
    assert vnames[0] == "visual.blocks.0.attn.qkv"
    # in vLLM's spelling the HF keys reach nothing (TorchAOConfig never remaps names) ...
    assert [vllm.skips(n) for n in vnames[:3]] == [False, False, False]
    assert vllm.skips("language_model.lm_head", "ParallelLMHead")
    # ... and with vLLM spelling in the keys, the container entry is a dot-bounded skip
    assert vllm.skips("model.visual.blocks.0.attn.qkv", "QKVParallelLinear")


def test_policy_torchao_order_dependence(ao):
    q, _ = ao
    symbolic = OrderedDict([(r"re:.*\.up_proj", "int8"), (r"re:model\.layers\.1\..*", None)])
    qc = _serialized_torchao(q, symbolic)
    for dialect in (TRANSFORMERS_TORCHAO, TORCHAO):
        p = SkipPolicy.from_quantization_config(qc, dialect=dialect)
        ds = intent_disagreements(p, ["model.layers.1.mlp.up_proj", "model.layers.2.mlp.up_proj"])
        assert any(d.kind == "order-dependent" and d.module == "model.layers.1.mlp.up_proj" for d in ds)


def test_policy_compressed_tensors():
    w = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": w},
                            "group_1": {"targets": ["re:.*layers.1.*"], "weights": dict(w, strategy="tensor")}},
          "ignore": ["lm_head", "re:.*visual.*", "model.layers.0.mlp.down_proj"]}
    p = SkipPolicy.from_quantization_config(qc)
    assert p.dialect == COMPRESSED_TENSORS
    assert {e.source for e in p.entries} == {"ignore", "config_groups.group_0.targets", "config_groups.group_1.targets"}
    assert p.skips("lm_head") and p.skips("model.visual.blocks.0.attn.qkv") and p.skips("model.layers.0.mlp.down_proj")
    assert not p.skips("model.layers.0.mlp.up_proj")
    assert p.skips("model.embed_tokens", torch.nn.Embedding)  # untargeted
    d = p.decide("model.layers.11.mlp.up_proj")
    assert d.reason.startswith("group group_1")
    names = ["model.layers.1.mlp.up_proj", "model.layers.11.mlp.up_proj", "model.layers.0.mlp.up_proj", "lm_head"]
    kinds = _kinds(intent_disagreements(p, names))
    assert ("overreach", "re:.*layers.1.*") in kinds  # ".*layers.1.*" reaches layers.11: the trailing .* eats the "1"
    pv = SkipPolicy.from_quantization_config(qc, dialect=VLLM_COMPRESSED_TENSORS, arch="llama")
    assert pv.skips("lm_head", "ParallelLMHead")
    assert not pv.skips("model.layers.0.mlp.gate_up_proj", "MergedColumnParallelLinear")


def test_policy_compressed_tensors_group_precedence():
    w = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    qc = {"quant_method": "compressed-tensors", "config_groups": {
        "late": {"targets": [r"re:model\.layers\.1\..*"], "weights": w},
        "early": {"targets": [r"re:.*mlp.*"], "weights": dict(w, num_bits=4)}}, "ignore": []}
    p = SkipPolicy.from_quantization_config(qc)
    assert ct_resolve("model.layers.1.mlp.up_proj", "Linear", qc["config_groups"], []).group == "early"  # alphabetical regex
    assert vllm_ct_resolve("model.layers.1.mlp.up_proj", "Linear", qc)[0] == "late"  # config order
    ds = intent_disagreements(p, ["model.layers.1.mlp.up_proj"])
    assert any(d.kind == "group-precedence" for d in ds)


def test_policy_fp8_and_partial_fused_groups():
    qc = {"quant_method": "fp8", "activation_scheme": "static",
          "ignored_layers": ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.3.mlp", "model.encoder.layers.0.fc1"]}
    p = SkipPolicy.from_quantization_config(qc)
    assert p.dialect == VLLM_FP8
    assert p.skips("model.layers.0.self_attn.q_proj") and not p.skips("model.layers.3.mlp.down_proj")
    ds = intent_disagreements(p, LLAMA12)
    kinds = _kinds(ds)
    assert ("partial-fused-group", "q_proj") in kinds
    assert ("underreach", "model.layers.3.mlp") in kinds
    # vLLM: fused names, entries renamed by the model's mapper
    pv = SkipPolicy.from_quantization_config(qc, dialect=VLLM_FP8, arch="llama")
    with pytest.raises(ValueError):
        pv.skips("model.layers.0.self_attn.qkv_proj", "QKVParallelLinear")
    pw = SkipPolicy.from_quantization_config(qc, dialect=VLLM_FP8, arch="whisper")
    assert not pw.skips(to_vllm("model.encoder.layers.0.fc1", "whisper"), "ColumnParallelLinear")
    # transformers' FineGrainedFP8: ignored_layers is an alias, renamed through the conversion mapping
    pt = SkipPolicy.from_quantization_config({"quant_method": "fp8", "ignored_layers": ["language_model.model.layers.1"]},
                                               dialect=TRANSFORMERS_FP8, arch="mllama")
    assert pt.skips("model.language_model.layers.1.self_attn.q_proj") and pt.skips("model.language_model.layers.10.mlp.up_proj")


def test_intent_kinds_on_documented_cases():
    p = SkipPolicy.from_quantization_config({"quant_method": "bitsandbytes", "llm_int8_skip_modules": ["nothing.here", "proj", "mlp"]})
    kinds = _kinds(intent_disagreements(p, LLAMA12))
    assert ("unmatched", "nothing.here") in kinds
    assert ("overreach", "proj") in kinds  # endswith("proj") hits q_proj
    assert ("underreach", "mlp") in kinds  # neither a start-anchored regex nor a suffix of mlp.up_proj
    # a trailing dot meant as a boundary is a wildcard: "model.layers.1." still skips layers.11
    dot = SkipPolicy.from_quantization_config({"quant_method": "bitsandbytes", "llm_int8_skip_modules": ["model.layers.1."]})
    assert dot.skips("model.layers.11.mlp.up_proj")
    ds = intent_disagreements(dot, LLAMA12)
    assert {d.kind for d in ds} == {"wildcard-dot"}
    assert {d.module for d in ds} == {n for n in LLAMA12 if n.startswith(("model.layers.10.", "model.layers.11."))}
    ct = SkipPolicy.from_quantization_config({"quant_method": "compressed-tensors", "ignore": ["re:.*layers.1."],
                                                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8}}}})
    assert ("wildcard-dot", "re:.*layers.1.") in _kinds(intent_disagreements(ct, LLAMA12))
    bad = SkipPolicy.from_quantization_config({"quant_method": "bitsandbytes", "llm_int8_skip_modules": ["model.layers.(1"]})
    assert ("invalid-regex", "model.layers.(1") in _kinds(intent_disagreements(bad, LLAMA12))
    assert literal_dots(r"a.b\.c.*[.]d.+") == r"a\.b\.c.*[.]d.+"
    with pytest.raises(Exception):
        SkipPolicy.from_quantization_config({"quant_method": "gguf"})
