"""KV-cache fake quantization, as an attention implementation registered with transformers.

vLLM stores K and V in an fp8 cache with the checkpoint's k_scale/v_scale and reads them back
dequantized; compressed-tensors does the same through a hooked cache. The reference models that
by quantizing K and V to fp8 and back just before attention, for self- and cross-attention alike.
Values already on the fp8 grid come back unchanged, so cached positions are not rounded twice.
Queries are left alone: vLLM's q_scale only applies with fp8 attention kernels.
"""
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from harness.quant import fp8

NAME = "harness_fp8_kv"


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    k_scale = getattr(module, "k_scale", None)
    if k_scale is not None:
        key = fp8.fake_quant(key, k_scale)
        value = fp8.fake_quant(value, module.v_scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def enable(model) -> None:
    AttentionInterface.register(NAME, _fp8_kv_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(NAME)
