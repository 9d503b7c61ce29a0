"""The ``transformers-fp8`` dialect: transformers 5.19 ``FineGrainedFP8HfQuantizer``: entries
renamed through the checkpoint conversion mapping, then ``should_convert_module``."""
from __future__ import annotations

from harness.dialects import names
from harness.dialects.base import Reading, SkipEntry, register
from harness.dialects.transformers import TransformersKeys, keys_with_defaults

NAME = "transformers-fp8"


class TransformersFp8(TransformersKeys):
    name = NAME
    quant_method = "fp8"

    def read(self, reading: Reading) -> None:
        # FineGrainedFP8Config: ignored_layers is an alias only when modules_to_not_convert is absent;
        # _normalize_modules_to_not_convert renames entries through the checkpoint conversion mapping.
        ignored = reading.config.get("ignored_layers")
        mtnc = reading.config.get("modules_to_not_convert")
        user = mtnc if mtnc is not None else ignored
        source = "modules_to_not_convert" if mtnc is not None else "ignored_layers"
        if user is None:
            keys_with_defaults(reading, None, source)
        else:
            reading.entries.extend(SkipEntry(k, source, (names.to_memory(k, reading.arch),)) for k in user)
            reading.entries.extend(SkipEntry(k, "keep_in_fp32", (k,)) for k in reading.keep_in_fp32)
        if mtnc is not None and ignored:
            reading.entries.extend(SkipEntry(k, "ignored_layers", (k,), honoured=False) for k in ignored)


register(TransformersFp8())
