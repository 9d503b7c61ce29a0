"""Read the tensors of a checkpoint directory without loading whole files.

`TensorSource.open(directory)` opens every `*.safetensors` file in the directory through
`safetensors.safe_open`, which validates it, and maps it copy-on-write: a tensor is a view of the
mapping, read from disk when it is touched and never copied, and `dtype`/`shape` read only the
header. A directory without safetensors files may instead hold legacy
`pytorch_model*.bin` files; those are read with `torch.load(weights_only=True, mmap=True)`, with
torchao's tensor subclasses allow-listed and nothing else. A pickle that asks for anything else is
refused with a `CheckpointError`; it never runs.

Legacy torchao tensor subclasses are split, at open time, into the same flattened plain tensors
and the same per-tensor JSON metadata that transformers' safetensors writer produces
(`<module>._weight_qdata`, `<module>._weight_scale`, `<module>._weight_zero_point`, metadata
`<module>.weight = {"_type": "Int8Tensor", "_data": {...}, "_tensor_data_names": [...]}`), so the
torchao decoder reads one layout only.

`TensorSource.from_tensors(...)` builds an in-memory source, for tests and for callers that
already hold a state dict.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import pickle
import re
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from harness import files
from harness.errors import CheckpointError
from harness.quant import schema

# safetensors header dtype strings -> torch dtypes
_ST_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    _ST_DTYPES["F8_E8M0"] = torch.float8_e8m0fnu

_SAFETENSORS_INDEX = "model.safetensors.index.json"


HEADER_LIMIT = 100 << 20  # safetensors' own limit on the JSON header


def _check_header(path: Path) -> tuple[dict, int]:
    """What safetensors itself does not refuse: a shard that is not a regular file (a FIFO would
    block its open), and a header that names a tensor twice (safetensors keeps the last one
    without a word). The header's length and JSON are checked here, its types by
    schema.safetensors_header; the values of its dtypes, shapes and offsets by safetensors. Returns the header and where the tensor data starts in the file."""
    try:
        size = files.check_regular(path)
        head = files.read_range(path, 0, 8)
    except files.Unreadable as e:
        raise CheckpointError(str(path), e.reason) from None
    if len(head) < 8:
        raise CheckpointError(str(path), f"not a readable safetensors file: {size} bytes, shorter than its 8-byte header length")
    n = int.from_bytes(head, "little")
    if n > min(HEADER_LIMIT, size - 8):
        raise CheckpointError(str(path), f"not a readable safetensors file: header length {n} exceeds the file "
                                         f"({size} bytes) or safetensors' limit of {HEADER_LIMIT}")
    try:
        header = schema.unique_object(files.decode_utf8(path, files.read_range(path, 8, n)))
    except schema.DuplicateKey as e:
        raise CheckpointError(str(path), f"the header names the tensor {e.key!r} twice (safetensors would "
                                         "silently keep the last one)") from None
    except files.Unreadable as e:
        raise CheckpointError(str(path), f"not a readable safetensors file: its header {e.reason}") from None
    except ValueError as e:  # json.JSONDecodeError
        raise CheckpointError(str(path), f"not a readable safetensors file: header is not JSON: {e}") from None
    return schema.safetensors_header(header, str(path)), 8 + n


class _MappedFile:
    """One safetensors file mapped copy-on-write (MAP_PRIVATE): its tensors are views of the
    mapping, never copies. Writable, so torch takes the views without a warning; a write changes
    this process's pages only, never the file. The header was validated by safetensors first."""

    def __init__(self, path: Path, header: dict, data_start: int):
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self.header, self.data_start = header, data_start
        self.start = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()

    def tensor(self, name: str) -> torch.Tensor | None:
        """The tensor as a view of the file, or None for a dtype torch cannot view."""
        entry = self.header[name]
        dtype = _ST_DTYPES.get(entry["dtype"])
        if dtype is None:
            return None
        begin, end = entry["data_offsets"]
        offset, nbytes = self.data_start + begin, end - begin
        if nbytes == 0:
            return torch.empty(entry["shape"], dtype=dtype)
        raw = torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=offset)
        if offset % dtype.itemsize:  # a writer that did not align the tensor: a view cannot be typed
            raw = raw.clone()
        return raw.view(dtype).reshape(entry["shape"])

    def holds(self, t: torch.Tensor) -> bool:
        return self.start <= t.data_ptr() < self.start + len(self.map)


def torchao_safe_globals() -> list:
    """The classes a legacy torchao .bin may name: torchao's own safetensors allow-list.

    Imported only when a .bin is read. Without torchao, the list is empty and a torchao pickle
    is refused like any other.
    """
    try:
        from torchao.prototype.safetensors.safetensors_utils import ALLOWED_CLASSES
    except Exception:  # torchao missing or broken: allow nothing extra
        return []
    return list(ALLOWED_CLASSES.values())


@contextmanager
def torchao_globals_allowed() -> Iterator[None]:
    """torchao's classes allowed for a ``weights_only`` load within the block, and the process's
    allow-list as it was after it. torchao registers most of them itself, for the whole process, on
    import, and vLLM's .bin loader relies on that; torch's ``safe_globals`` removes on exit every
    class it was given, registered before or not, so only the missing ones are given to it.
    (Giving it all of them made every later vLLM .bin load in the same process refuse
    ``torchao.quantization.Int8Tensor``: docs/findings.md.)"""
    allowed = torchao_safe_globals()  # first: importing torchao registers its own
    registered = torch.serialization.get_safe_globals()
    with torch.serialization.safe_globals([c for c in allowed if c not in registered]):
        yield


_BOILERPLATE = ("Weights only load failed", "Check the documentation", "Re-running `torch.load`")


def _refusal(e: Exception) -> str:
    """torch's own reason for refusing a pickle, without its boilerplate: the text after
    ``WeightsUnpickler error:`` (which torch may put on the next line), else the paragraphs that
    are not advice, whitespace collapsed."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    _, marker, rest = text.partition("WeightsUnpickler error:")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", rest if marker else text)]
    detail = " ".join(p for p in paragraphs if p and not p.startswith(_BOILERPLATE)) or type(e).__name__
    detail = detail.split(" Please use `torch.serialization", 1)[0].split(". Please use", 1)[0]
    if "torchao" in detail:
        detail += " (only torchao's current tensor subclasses are allowed; older AffineQuantizedTensor checkpoints cannot be read)"
    return detail


def _is_torchao_subclass(t) -> bool:
    return isinstance(t, torch.Tensor) and type(t) is not torch.Tensor and hasattr(type(t), "tensor_data_names")


def _json_attr(value):
    """A torchao subclass attribute, as transformers' writer spells it in the metadata JSON."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"_type": "torch.dtype", "_data": str(value).removeprefix("torch.")}
    if isinstance(value, (list, tuple, torch.Size)):
        return [_json_attr(v) for v in value]
    # enums, configs, kwargs: the decoder only needs to know they are there
    return {"_type": type(value).__name__, "_data": str(value)}


def _flatten_torchao(name: str, t) -> tuple[dict[str, torch.Tensor], str]:
    """Split one torchao subclass into the plain tensors and metadata JSON of the safetensors layout."""
    module, param = name.rsplit(".", 1) if "." in name else ("", name)
    prefix = f"{module}._{param}_" if module else f"_{param}_"
    cls = type(t)
    parts: dict[str, torch.Tensor] = {}
    data_names = list(cls.tensor_data_names) + list(getattr(cls, "optional_tensor_data_names", []))
    for dn in data_names:
        v = getattr(t, dn, None)
        if v is not None:
            parts[prefix + dn] = v.detach()
    attrs = {}
    for an in list(getattr(cls, "tensor_attribute_names", [])) + list(getattr(cls, "optional_tensor_attribute_names", [])):
        attrs[an] = _json_attr(getattr(t, an, None))
    if "dtype" not in attrs or attrs["dtype"] is None:
        attrs["dtype"] = _json_attr(t.dtype)
    present = [dn for dn in data_names if prefix + dn in parts]
    meta = json.dumps({"_type": cls.__name__, "_data": attrs, "_tensor_data_names": present})
    return parts, meta


class TensorSource:
    """All the tensors of one checkpoint directory, by name, read lazily.

    Attributes:
        directory: the checkpoint directory (None for an in-memory source)
        keys: every tensor name (frozenset)
        metadata: the safetensors `__metadata__` of all files merged (str -> str); for torchao
            files the per-tensor JSON entries are merged as they are (the harness reads no
            other entry).
    """

    def __init__(self, directory: str | None = None):
        self.directory = directory
        self._handles: dict[str, object] = {}  # safetensors path -> safe_open handle
        self._maps: dict[str, _MappedFile] = {}  # safetensors path -> its mapping
        self._where: dict[str, str] = {}  # tensor name -> file path
        self._tensors: dict[str, torch.Tensor] = {}  # tensors held in memory (.bin, from_tensors)
        self._file_meta: dict[str, dict[str, str]] = {}
        self.metadata: dict[str, str] = {}
        self.keys: frozenset[str] = frozenset()
        # Producers may key per-tensor metadata by in-memory names while the tensors carry the
        # checkpoint spelling (transformers' torchao saves of Qwen2.5-VL). The loader fills this
        # with {checkpoint spelling: metadata key} once it knows the architecture.
        self.metadata_aliases: dict[str, str] = {}
        self._weight_map: tuple[str, dict[str, str]] | None = None  # (index file, tensor -> shard)

    # construction ---------------------------------------------------------------------------

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "TensorSource":
        directory = Path(directory)
        if not directory.is_dir():
            raise CheckpointError(str(directory), "not a checkpoint directory")
        src = cls(str(directory))
        st_files = sorted(directory.glob("*.safetensors"))
        if st_files:
            src._check_index(directory, st_files)
            for path in st_files:
                src._open_safetensors(path)
            src._check_weight_map()
        else:
            bins = sorted(directory.glob("pytorch_model*.bin"))
            if not bins:
                raise CheckpointError(str(directory), "no *.safetensors or pytorch_model*.bin file")
            for path in bins:
                src._open_bin(path)
        src._finish()
        return src

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                     file: str = "<memory>") -> "TensorSource":
        """An in-memory source. torchao subclasses are flattened as for a .bin file."""
        src = cls(None)
        src._add_state_dict(file, dict(tensors))
        if metadata:
            src._file_meta.setdefault(file, {}).update(metadata)
        src._finish()
        return src

    def _check_index(self, directory: Path, st_files: list[Path]) -> None:
        """The index, validated (harness.quant.schema.index): every shard it names is present;
        after the files are open, ``_check_weight_map`` checks that each holds its tensors."""
        index = directory / _SAFETENSORS_INDEX
        if not os.path.lexists(index):
            return
        try:
            data = json.loads(files.read_text(index))
        except files.Unreadable as e:
            raise CheckpointError(str(index), e.reason) from None
        except json.JSONDecodeError as e:
            raise CheckpointError(str(index), f"invalid JSON: {e}") from None
        self._weight_map = (str(index), schema.index(data, str(index)))
        present = {p.name for p in st_files}
        for shard in sorted(set(self._weight_map[1].values())):
            if shard not in present:
                raise CheckpointError(str(directory / shard), "shard named in the index is missing")

    def _check_weight_map(self) -> None:
        if self._weight_map is None:
            return
        index, weight_map = self._weight_map
        for name, shard in weight_map.items():
            where = self._where.get(name)
            if where is None or Path(where).name != shard:
                held = f"it is in {Path(where).name}" if where else "no file holds it"
                raise CheckpointError(index, f"weight_map names {name!r} in {shard}, but {held}")

    def _open_safetensors(self, path: Path) -> None:
        from safetensors import safe_open

        header, data_start = _check_header(path)
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
            names = list(handle.keys())
            meta = handle.metadata() or {}
        except Exception as e:
            raise CheckpointError(str(path), f"not a readable safetensors file: {e}") from None
        self._handles[str(path)] = handle
        self._maps[str(path)] = _MappedFile(path, header, data_start)
        self._file_meta[str(path)] = dict(meta)
        for n in names:
            self._claim(n, str(path))

    def _open_bin(self, path: Path) -> None:
        try:
            files.check_regular(path)
        except files.Unreadable as e:
            raise CheckpointError(str(path), e.reason) from None
        kwargs = {"weights_only": True, "map_location": "cpu"}
        if zipfile.is_zipfile(path):
            kwargs["mmap"] = True  # the legacy (non-zip) format cannot be mmapped
        try:
            with torchao_globals_allowed():
                state = torch.load(str(path), **kwargs)
        except pickle.UnpicklingError as e:
            raise CheckpointError(str(path), f"refused to unpickle: {_refusal(e)}") from None
        except Exception as e:
            raise CheckpointError(str(path), f"could not read: {type(e).__name__}: {e}") from None
        if not isinstance(state, dict):
            raise CheckpointError(str(path), f"holds a {type(state).__name__}, not a state dict")
        self._add_state_dict(str(path), state)

    def _add_state_dict(self, file: str, state: dict) -> None:
        meta = self._file_meta.setdefault(file, {})
        for name, value in state.items():
            if not isinstance(name, str) or not isinstance(value, torch.Tensor):
                raise CheckpointError(file, f"entry {name!r} is a {type(value).__name__}, not a tensor")
            if _is_torchao_subclass(value):
                parts, m = _flatten_torchao(name, value)
                meta[name] = m
                for pn, pt in parts.items():
                    self._claim(pn, file)
                    self._tensors[pn] = pt
            else:
                if isinstance(value, torch.nn.Parameter) or type(value) is not torch.Tensor:
                    value = value.detach().as_subclass(torch.Tensor)
                self._claim(name, file)
                self._tensors[name] = value

    def _claim(self, name: str, file: str) -> None:
        if name in self._where and self._where[name] != file:
            raise CheckpointError(name, f"tensor is in two files: {self._where[name]} and {file}")
        self._where[name] = file

    def _finish(self) -> None:
        self.keys = frozenset(self._where)
        merged: dict[str, str] = {}
        for meta in self._file_meta.values():
            merged.update(meta)
        self.metadata = merged

    # access ---------------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> str:
        try:
            return self._where[name]
        except KeyError:
            raise CheckpointError(name, "missing tensor") from None

    def file_metadata(self, file: str) -> dict[str, str]:
        """The `__metadata__` of one file (or the synthesised metadata of a .bin)."""
        return self._file_meta.get(file, {})

    def get(self, name: str) -> torch.Tensor:
        """The tensor: a view of the memory-mapped file where torch can view its dtype (writing to
        it changes this process's copy only), else read by safetensors."""
        file = self.file_of(name)
        if name in self._tensors:
            return self._tensors[name]
        try:
            view = self._maps[file].tensor(name)
            return view if view is not None else self._handles[file].get_tensor(name)
        except Exception as e:
            raise CheckpointError(name, f"unreadable in {file}: {e}") from None

    def is_mapped(self, t: torch.Tensor) -> bool:
        """Whether `t` is a view of one of the mapped files (its data never copied)."""
        return any(m.holds(t) for m in self._maps.values())

    def dtype(self, name: str) -> torch.dtype:
        file = self.file_of(name)
        if name in self._tensors:
            return self._tensors[name].dtype
        st = self._handles[file].get_slice(name).get_dtype()
        if st in _ST_DTYPES:
            return _ST_DTYPES[st]
        return self.get(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        file = self.file_of(name)
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        return tuple(self._handles[file].get_slice(name).get_shape())

    def numel(self, name: str) -> int:
        return math.prod(self.shape(name))

    def close(self) -> None:
        self._handles.clear()
        self._maps.clear()
        self._tensors.clear()

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TensorSource({self.directory or '<memory>'}, {len(self.keys)} tensors)"
