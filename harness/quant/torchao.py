"""torchao weight-only Int8 / Float8 / group-wise int4 checkpoints, decoded in plain torch.

On-disk layout (transformers 5.19 + torchao 0.18, `torchao.prototype.safetensors`
`flatten_tensor_state_dict`): for a parameter `M.weight` that is a tensor subclass,

    M._weight_qdata        I8 [out, in] (Int8Tensor, IntxUnpackedToInt8Tensor)  or  F8_E4M3 [out, in] (Float8Tensor)
    M._weight_scale        F32, one value per block: [out, 1] per row, [1, 1] per tensor, [out, in/g] per group
    M._weight_zero_point   I8, as the scale   integer subclasses only (zeros for the symmetric default)

and the file's `__metadata__` holds, under the key `M.weight`, the JSON
    {"_type": "Int8Tensor" | "Float8Tensor",
     "_data": {"block_size": [1, in], "dtype": {"_type": "torch.dtype", "_data": "float32"},
               "act_quant_kwargs": null, ...},
     "_tensor_data_names": ["zero_point", "qdata", "scale"]}
plus `tensor_names` (a JSON list of every parameter) and `format: pt`. Plain tensors keep their
names and get `{"_type": "Tensor"}`. IntxWeightOnlyConfig's `IntxUnpackedToInt8Tensor` holds int4
values one per int8 byte (unpacked, nibbles not packed), its `_data` naming `target_dtype` (int4)
and `block_size` [1, group]; its `activation_quantization` must be null.

Legacy `torch.save`d `.bin` checkpoints hold the subclass objects themselves; `TensorSource`
splits them into this same layout when it opens the file.

Decoding, as the subclasses' `dequantize()`:
- Int8Tensor, IntxUnpackedToInt8Tensor: `(float(q) - float(zero_point)) * scale`, scale broadcast
  over its block (torchao's `dequantize_affine`); an int4 code outside [-8, 7] is refused;
- Float8Tensor: `float32(q) * scale`;
then cast to the metadata's `dtype` (the original weight dtype) and widened back to float32.
Activation quantization (`act_quant_kwargs` not null, `act_pre_scale`...) is refused: the labels
here are weight-only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from harness.errors import CheckpointError
from harness.quant import Decoded, StoredWeight, native, schema
from harness.quant.source import TensorSource

SUBCLASSES = {"Int8Tensor": "torchao-int8", "Float8Tensor": "torchao-float8", "IntxUnpackedToInt8Tensor": "torchao-int4"}
_QDTYPE = {"Int8Tensor": torch.int8, "Float8Tensor": torch.float8_e4m3fn, "IntxUnpackedToInt8Tensor": torch.int8}
# IntxUnpackedToInt8Tensor: the code range of each target dtype read here (torchao's _DTYPE_TO_QVALUE_BOUNDS)
_INTX_RANGE = {"int4": (-8, 7)}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ACT_PARTS = ("act_quant_scale", "act_quant_zero_point", "act_pre_scale")


def _split(weight: str) -> tuple[str, str]:
    return weight.rsplit(".", 1) if "." in weight else ("", weight)


def part_name(weight: str, part: str) -> str:
    """`M.weight`, `qdata` -> `M._weight_qdata` (the flattened safetensors name)."""
    module, param = _split(weight)
    return f"{module}._{param}_{part}" if module else f"_{param}_{part}"


def owns(src: TensorSource, weight: str) -> bool:
    return part_name(weight, "qdata") in src.keys


def read_metadata(src: TensorSource, weight: str) -> dict:
    qname = part_name(weight, "qdata")
    key = src.metadata_aliases.get(weight, weight)
    raw = src.file_metadata(src.file_of(qname)).get(key) if qname in src.keys else None
    if raw is None:
        raw = src.metadata.get(key)
    if raw is None:
        raise CheckpointError(weight, "missing torchao metadata: no entry for it in the safetensors __metadata__")
    try:
        meta = json.loads(raw)
    except Exception as e:
        raise CheckpointError(weight, f"torchao metadata JSON unreadable: {e}") from None
    return schema.torchao_tensor(meta, weight)


def _attr_dtype(weight: str, data: dict) -> torch.dtype:
    d = data.get("dtype")
    name = d.get("_data") if isinstance(d, dict) else d
    if name is None:
        return torch.float32
    if isinstance(name, str):
        name = name.removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointError(weight, f"torchao metadata dtype {d!r} is not float32/float16/bfloat16")
    return _DTYPES[name]


def dequantize(qdata: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, block: tuple[int, int],
               dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """(float(q) - float(zero_point)) * scale, scale and zero point per [block] tile, rounded through
    `dtype`, as the subclasses' `dequantize()`; written into `out` when given. The per-block
    tensors [out/bo, in/bi] broadcast over a [out/bo, bo, in/bi, bi] view: never expanded."""
    rows, cols = qdata.shape
    if out is None:
        out = torch.empty((rows, cols), dtype=torch.float32, device=qdata.device)
    if not (zero_point is None and block[0] == 1 and _decoded_in_c(qdata, scale, block[1], out)):
        tiles = out.copy_(qdata).view(rows // block[0], block[0], cols // block[1], block[1])
        if zero_point is not None:
            tiles.sub_(zero_point.float()[:, None, :, None])
        tiles.mul_(scale[:, None, :, None])
    if dtype != torch.float32:
        out.copy_(out.to(dtype))
    return out


def _decoded_in_c(qdata: torch.Tensor, scale: torch.Tensor, group: int, out: torch.Tensor) -> bool:
    """Tiles one row high without a zero point, in C on the CPU (harness.quant.native)."""
    scales, flat = scale.float().reshape(-1).contiguous(), out.view(-1)
    if qdata.dtype == torch.int8:
        return native.decode_int8(qdata.contiguous().reshape(-1), scales, group, flat)
    if qdata.dtype == torch.float8_e4m3fn:
        return native.decode_e4m3(qdata.contiguous().view(torch.uint8).reshape(-1), None, scales, group, flat)
    return False


@dataclass
class StoredTorchao(StoredWeight):
    """A torchao Int8Tensor / Float8Tensor weight as stored: qdata (memory-mapped), one scale (and
    zero point) per block."""

    qdata: torch.Tensor  # int8 or float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [out/bo, in/bi]
    zero_point: torch.Tensor | None  # integer [out/bo, in/bi]; None when all zero (x - 0 is x)
    block: tuple[int, int]
    dtype: torch.dtype  # the original weight dtype, which the values are rounded through

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qdata.shape)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        return dequantize(self.qdata, self.scale, self.zero_point, self.block, self.dtype, out)

    @property
    def row_alignment(self) -> int:
        return self.block[0]

    def rows(self, start: int, stop: int) -> StoredTorchao:
        b0 = self.block[0]
        return StoredTorchao(self.qdata[start:stop], *(None if t is None else t[start // b0:-(-stop // b0)]
                                                       for t in (self.scale, self.zero_point)), self.block, self.dtype)

    @classmethod
    def per_row(cls, qdata, scale, zero_point, block, dtype) -> StoredTorchao:
        """Tiles taller than one row (per tensor, block-wise) held as their rows' scales (and zero
        points), a small tensor: so any range of rows can be taken."""
        if block[0] > 1:
            scale, zero_point = (None if t is None else t.repeat_interleave(block[0], 0) for t in (scale, zero_point))
        return cls(qdata, scale, zero_point, (1, block[1]), dtype)


def granularity(block: tuple[int, int], shape: tuple[int, int]) -> str:
    if tuple(block) == tuple(shape):
        return "per-tensor"
    if block[0] == 1 and block[1] == shape[1]:
        return "per-row"
    return f"block-{block[0]}x{block[1]}"


def decode(src: TensorSource, weight: str) -> Decoded:
    kind, data = _weight_only_subclass(src, weight)
    dtype = _attr_dtype(weight, data)
    qname, sname, zname = (part_name(weight, p) for p in ("qdata", "scale", "zero_point"))
    q = _read_qdata(src, kind, qname, sname)
    if kind == "IntxUnpackedToInt8Tensor":
        _check_codes(qname, q, _intx_target(weight, data))
    shape = tuple(q.shape)
    block = _block_size(weight, data.get("block_size"), shape)
    nblocks = (shape[0] // block[0], shape[1] // block[1])
    scale = _read_scale(src, sname, shape, block, nblocks)
    zero_point = _read_zero_point(src, zname, kind, scale, nblocks)
    asymmetric = zero_point is not None and bool((zero_point != 0).any())
    return Decoded(
        label=SUBCLASSES[kind],
        weight=StoredTorchao.per_row(q, scale, zero_point if asymmetric else None, block, dtype),
        settings={"subclass": kind, "granularity": granularity(block, shape), "asymmetric": asymmetric},
    )


def _weight_only_subclass(src: TensorSource, weight: str) -> tuple[str, dict]:
    """The weight's subclass and its metadata `_data`, refused unless a supported weight-only one."""
    meta = read_metadata(src, weight)
    kind = meta["_type"]
    if kind not in SUBCLASSES:
        raise CheckpointError(weight, f"torchao subclass {kind!r} is not supported (only {sorted(SUBCLASSES)})")
    data = meta.get("_data") or {}
    if data.get("act_quant_kwargs") is not None or data.get("activation_quantization") is not None:
        raise CheckpointError(weight, "torchao activation quantization (act_quant_kwargs, activation_quantization) "
                                      "is not supported; only weight-only Int8/Float8/int4")
    for part in _ACT_PARTS:
        if part_name(weight, part) in src.keys:
            raise CheckpointError(part_name(weight, part), "torchao activation quantization tensors are not supported")
    return kind, data


def _read_qdata(src: TensorSource, kind: str, qname: str, sname: str) -> torch.Tensor:
    if qname not in src.keys:
        raise CheckpointError(qname, "missing tensor (torchao qdata)")
    if sname not in src.keys:
        raise CheckpointError(sname, "missing tensor (torchao scale)")
    q = src.get(qname)
    if q.dtype != _QDTYPE[kind]:
        raise CheckpointError(qname, f"{kind} qdata must be {_QDTYPE[kind]}, got {q.dtype}")
    if q.dim() != 2:
        raise CheckpointError(qname, f"expected a 2-D [out, in] weight, got shape {tuple(q.shape)}")
    return q


def _intx_target(weight: str, data: dict) -> str:
    """An IntxUnpackedToInt8Tensor's target dtype (``int4``), refused unless one read here."""
    d = data.get("target_dtype")
    name = (d.get("_data") if isinstance(d, dict) else d) or None
    if name not in _INTX_RANGE:
        raise CheckpointError(weight, f"IntxUnpackedToInt8Tensor target_dtype {name!r} is not supported (only "
                                      f"{', '.join(_INTX_RANGE)})")
    return name


def _check_codes(qname: str, q: torch.Tensor, target: str) -> None:
    """Every code within the target dtype's range: an int4 checkpoint holds -8..7 in each byte."""
    low, high = _INTX_RANGE[target]
    qmin, qmax = int(q.min()), int(q.max())
    if qmin < low or qmax > high:
        raise CheckpointError(qname, f"{target} codes must lie in [{low}, {high}], found [{qmin}, {qmax}]")


def _block_size(weight: str, block: list | None, shape: tuple[int, int]) -> tuple[int, int]:
    if block is None or len(block) == 0:
        block = list(shape)  # Float8Tensor: an empty block_size means per tensor
    if (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)
            or shape[0] % block[0] or shape[1] % block[1]):
        raise CheckpointError(weight, f"block_size {block!r} does not tile the weight shape {list(shape)}")
    return (block[0], block[1])


def _read_scale(src: TensorSource, sname: str, shape: tuple[int, int], block: tuple[int, int],
                nblocks: tuple[int, int]) -> torch.Tensor:
    """One positive float32 scale per block, shaped [out/bo, in/bi]."""
    scale = src.get(sname)
    if not scale.dtype.is_floating_point:
        raise CheckpointError(sname, f"scale must be floating point, got {scale.dtype}")
    if scale.numel() != nblocks[0] * nblocks[1]:
        raise CheckpointError(sname, f"scale shape {tuple(scale.shape)} does not match weight {list(shape)} "
                                     f"in blocks of {list(block)}")
    scale = scale.float().reshape(nblocks)
    if not torch.isfinite(scale).all():
        raise CheckpointError(sname, "NaN or infinite scale")
    if (scale <= 0).any():
        raise CheckpointError(sname, "zero or negative scale")
    return scale


def _read_zero_point(src: TensorSource, zname: str, kind: str, scale: torch.Tensor,
                     nblocks: tuple[int, int]) -> torch.Tensor | None:
    """The integer zero point per block, shaped as the scale; None when the file holds none."""
    if zname not in src.keys:
        return None
    if _QDTYPE[kind] != torch.int8:
        raise CheckpointError(zname, f"{kind} has no zero point")
    zero_point = src.get(zname)
    if zero_point.dtype.is_floating_point or zero_point.dtype.is_complex:
        raise CheckpointError(zname, f"zero point must be an integer tensor, got {zero_point.dtype}")
    if zero_point.numel() != scale.numel():
        raise CheckpointError(zname, f"zero point shape {tuple(zero_point.shape)} does not match scale shape {tuple(scale.shape)}")
    return zero_point.reshape(nblocks)
