"""The producing libraries, used as oracles: transformers' own loading of a checkpoint, and each
library's own dequantization of a loaded module. Nothing in harness/ calls these."""
import json
from functools import cache
from pathlib import Path

import torch
import transformers

from harness.engines.transformers import bnb_float_compute
from harness.quant.source import torchao_globals_allowed


@cache
def transformers_model(path: str):
    """The checkpoint as transformers loads it on CPU, in float32, through the producer's library."""
    config = json.loads((Path(path) / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    kwargs = {}
    if (config.get("quantization_config") or {}).get("quant_method") == "compressed-tensors":
        # The compressed kernels need a GPU; decompressed, compressed-tensors still fake-quantizes
        # activations and the KV cache exactly as the scheme says.
        kwargs["quantization_config"] = transformers.CompressedTensorsConfig(run_compressed=False)
    # transformers reads a legacy .bin with weights_only=True; torchao's classes must be allowed,
    # exactly as the reference allows them (harness.quant.source).
    with torchao_globals_allowed():
        model = cls.from_pretrained(path, dtype=torch.float32, device_map="cpu", **kwargs)
    # The bf16 CPU kernel of bitsandbytes would make the oracle about bnb's kernel, not loading.
    bnb_float_compute(model)
    return model.eval()


def library_weight(module: torch.nn.Module) -> torch.Tensor:
    """A loaded module's weight, dequantized by the library that owns its format."""
    weight = module.weight
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is not None:
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, quant_state).float()
    if type(weight.data) not in (torch.Tensor, torch.nn.Parameter) and hasattr(weight, "dequantize"):
        return weight.dequantize().float()  # a torchao tensor subclass
    if hasattr(module, "weight_scale") and weight.dtype == torch.float8_e4m3fn:
        return weight.float() * module.weight_scale.float()  # compressed-tensors, still compressed
    return weight.detach().float()
