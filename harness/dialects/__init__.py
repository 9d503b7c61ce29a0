"""Skip-list dialects: how each library reads a checkpoint's "leave these unquantized" rules.

The libraries do not agree on what a skip entry means. Each dialect is a module of this package,
written the way its owner writes it (the owner's function is named in each docstring, with the
version it was read from), and ``tests/test_skip_dialects.py`` checks every one against the
owner's own code. None of those libraries is imported here: they are the oracles, not the
implementation.

=========================  ======================================================================
``transformers``           transformers 5.19 ``should_convert_module`` on module names
                           (``llm_int8_skip_modules`` for bitsandbytes), with the default list of
                           ``HfQuantizer.get_modules_to_not_convert``.
``transformers-torchao``   transformers 5.19 ``TorchAoHfQuantizer``: ``should_convert_module`` on
                           the *parameter* name, then ``FqnToConfig`` as ``TorchAoQuantize.convert``
                           resolves it.
``transformers-fp8``       transformers 5.19 ``FineGrainedFP8HfQuantizer``: entries renamed through
                           the checkpoint conversion mapping, then ``should_convert_module``.
``torchao``                torchao 0.18 ``quantize_(model, FqnToConfig)``.
``compressed-tensors``     compressed-tensors 0.17 ``apply_quantization_config``.
``vllm-fp8``               vLLM 0.32 ``Fp8Config`` / ``is_layer_skipped`` (exact names, fused shards).
``vllm-torchao``           vLLM 0.32 ``TorchAOConfig`` (dot-bounded substring, ``should_skip``).
``vllm-compressed-tensors``  vLLM 0.32 ``CompressedTensorsConfig.get_scheme_dict``.
``vllm-bnb``               vllm-bnb-plugin 0.0.3 ``is_layer_skipped_bnb``.
=========================  ======================================================================

Layout (docs/design.md): ``base`` (the ``Dialect`` interface and the registry), one module per
dialect (each registers one ``Dialect``; adding a dialect means adding a module here), ``names``
(checkpoint / memory / vLLM spelling), ``policy`` (``SkipPolicy``), ``intent`` (where a dialect
and an entry's evident intent disagree). Importing this package imports every module in it.
"""
from __future__ import annotations

import importlib
import pkgutil

from harness.dialects.base import REGISTRY, Dialect, producer_dialects, vllm_dialects

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

from harness.dialects.base import EntryDisagreement  # noqa: E402
from harness.dialects.intent import intent_disagreements  # noqa: E402
from harness.dialects.policy import SkipPolicy  # noqa: E402

DIALECTS: tuple[str, ...] = tuple(REGISTRY)
VLLM_DIALECTS: tuple[str, ...] = tuple(name for name, d in REGISTRY.items() if d.vllm)
# The dialect in which each quant_method's producer wrote its skip list.
PRODUCER_DIALECT: dict[str, str] = producer_dialects()
# The dialect in which vLLM 0.32 (plus vllm-bnb-plugin) reads each quant_method.
VLLM_DIALECT: dict[str, str] = vllm_dialects()


def get(name: str) -> Dialect:
    """The registered dialect of that name (KeyError if none)."""
    return REGISTRY[name]


__all__ = ["DIALECTS", "PRODUCER_DIALECT", "VLLM_DIALECT", "VLLM_DIALECTS", "Dialect", "EntryDisagreement",
           "SkipPolicy", "get", "intent_disagreements"]
