"""Image and audio prompts as model inputs, for every engine (docs/design.md, "Synthetic inputs").

A :class:`Builder` turns a prompt's text and input (a uint8 RGB image or a float32 waveform) into
the prompt's token ids and the kwargs of a transformers-style forward, with the checkpoint's own
tokenizer and processor configuration, the way the model's processor lays them out: Mllama
``<|image|>`` + text through MllamaProcessor; Qwen2.5-VL ``<|vision_start|><|image_pad|>
<|vision_end|>`` + text, the pad expanded to the image's grid; Whisper's decoder prefix
(``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``) + text, with log-mel features.
``rebuild`` gives the kwargs of the same token ids with another input of the same shape, which
the input-sensitivity check scores (harness.engines.execute). Image processors are always the PIL
ones (harness.fixtures.inputs.image_processor): this environment has no torchvision.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np

from harness import synthetic
from harness.fixtures import inputs as fixture_inputs

IMAGE_TOKENS = {"mllama": "<|image|>", "qwen2_5_vl": "<|image_pad|>"}


def load(value: str, where: str) -> tuple[np.ndarray, int | None]:
    """The input a prompt names: (uint8 image or float32 waveform, sampling rate or None).
    ``where`` names the prompt in the one-line error."""
    if not synthetic.is_synthetic(value):
        raise NotImplementedError(f"{where}: input {value!r}: only synthetic: inputs are implemented for prompt sets")
    try:
        spec = synthetic.parse(value)
    except synthetic.SyntheticError as e:
        raise ValueError(f"{where}: {e}") from None
    return synthetic.generate(spec), (spec.rate or None)


class Builder:
    """The inputs of one checkpoint's prompts; ``family`` is the architecture's short name."""

    def __init__(self, family: str, path: Path):
        self.family = family
        self.path = Path(path)

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path)

    @cached_property
    def image_processor(self):
        return fixture_inputs.image_processor(self.family, self.path)

    @cached_property
    def feature_extractor(self):
        from transformers import WhisperFeatureExtractor

        return WhisperFeatureExtractor.from_pretrained(self.path)

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(IMAGE_TOKENS[self.family])

    def input_end(self, kind: str, ids: list[int]) -> int:
        """The index of the prompt's last input token (0 for audio: the encoder feeds every position)."""
        if kind != "image":
            return 0
        return max(i for i, t in enumerate(ids) if t == self.image_token_id)

    # ---- token ids -------------------------------------------------------------------------
    def text_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def prompt_ids(self, kind: str, text: str | None, data: np.ndarray) -> list[int]:
        text = text or ""
        if kind == "audio":
            tail = self.tokenizer(" " + text, add_special_tokens=False)["input_ids"] if text else []
            return list(fixture_inputs.whisper_prefix(self.tokenizer)) + list(tail)
        if self.family == "mllama":
            from transformers import MllamaProcessor

            proc = MllamaProcessor(image_processor=self.image_processor, tokenizer=self.tokenizer)
            return list(proc(images=[[_pil(data)]], text=[IMAGE_TOKENS["mllama"] + text])["input_ids"][0])
        grid = self.image_processor(images=[_pil(data)], return_tensors="np")["image_grid_thw"]
        expanded = fixture_inputs.qwen_expand_text("<|vision_start|><|image_pad|><|vision_end|>" + text, grid,
                                                   self.image_processor.merge_size)
        return self.text_ids(expanded)

    # ---- model kwargs ----------------------------------------------------------------------
    def rebuild(self, kind: str, ids: list[int], data: np.ndarray, rate: int | None = None) -> dict:
        """The forward kwargs of ``ids`` with the input ``data``."""
        import torch

        if kind == "audio":
            feats = self.feature_extractor(data, sampling_rate=rate, return_tensors="np")["input_features"]
            return {"input_features": torch.from_numpy(np.ascontiguousarray(feats, dtype=np.float32)),
                    "decoder_input_ids": torch.tensor([ids])}
        base = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.int64)}
        if self.family == "mllama":
            return {**base, **self._mllama_images(ids, data)}
        feats = self.image_processor(images=[_pil(data)], return_tensors="np")
        image = [1 if t == self.image_token_id else 0 for t in ids]
        return {**base, "mm_token_type_ids": torch.tensor([image], dtype=torch.int64),
                "pixel_values": torch.from_numpy(np.ascontiguousarray(feats["pixel_values"], dtype=np.float32)),
                "image_grid_thw": torch.from_numpy(np.asarray(feats["image_grid_thw"], dtype=np.int64))}

    def _mllama_images(self, ids: list[int], data: np.ndarray) -> dict:
        import torch
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        ip = self.image_processor
        feats = ip(images=[[_pil(data)]], return_tensors="np")
        mask = convert_sparse_cross_attention_mask_to_dense(
            [get_cross_attention_token_mask(list(ids), self.image_token_id)], num_tiles=feats["num_tiles"],
            max_num_tiles=ip.max_image_tiles, length=len(ids))
        return {
            "pixel_values": torch.from_numpy(np.ascontiguousarray(feats["pixel_values"], dtype=np.float32)),
            "aspect_ratio_ids": torch.from_numpy(np.asarray(feats["aspect_ratio_ids"], dtype=np.int64)),
            "aspect_ratio_mask": torch.from_numpy(np.asarray(feats["aspect_ratio_mask"], dtype=np.int64)),
            "cross_attention_mask": torch.from_numpy(np.asarray(mask, dtype=np.int64)),
        }


def _pil(data: np.ndarray):
    from PIL import Image

    return Image.fromarray(np.asarray(data, dtype=np.uint8))
