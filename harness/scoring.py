"""Teacher-forced scoring and greedy decoding on any model that is called like transformers'.

Both engines that run in-process (reference, transformers) go through these two functions, so
a difference between them is a difference in loading, never in how they were driven.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class Prompt:
    """One prompt: its token ids (decoder ids for encoder-decoder models) and, where the model
    takes them, the encoder inputs (input_features for audio, pixel_values for images)."""

    id: str
    kind: str  # text, audio, image
    tokens: list[int]
    encoder_inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Scored:
    tokens: list[int]
    logprobs: list[float]  # logprobs[i] is log p(tokens[i + 1] | tokens[: i + 1])
    topk: list[list[tuple[int, float]]]  # per scored position


@dataclass
class Greedy:
    tokens: list[int]  # generated tokens only
    topk: list[list[tuple[int, float]]]  # per generated step


@torch.inference_mode()
def _log_softmax(model, prompt: Prompt, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    if prompt.encoder_inputs:
        out = model(**prompt.encoder_inputs, decoder_input_ids=ids)
    else:
        out = model(input_ids=ids)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def _topk(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    values, indices = row.topk(k)
    return [(int(i), float(v)) for i, v in zip(indices, values)]


def teacher_forced(model, prompt: Prompt, tokens: list[int], k: int) -> Scored:
    """Score a given token sequence in one forward pass."""
    lp = _log_softmax(model, prompt, tokens)
    positions = range(len(tokens) - 1)
    return Scored(
        tokens=list(tokens),
        logprobs=[float(lp[i, tokens[i + 1]]) for i in positions],
        topk=[_topk(lp[i], k) for i in positions],
    )


def greedy(model, prompt: Prompt, max_tokens: int, k: int) -> Greedy:
    """Free-running greedy decoding. Each step re-runs the whole sequence: the models are tiny,
    and no cache means no cache code path can make two engines differ."""
    tokens = list(prompt.tokens)
    out = Greedy([], [])
    for _ in range(max_tokens):
        row = _log_softmax(model, prompt, tokens)[-1]
        top = _topk(row, k)
        out.tokens.append(top[0][0])
        out.topk.append(top)
        tokens.append(top[0][0])
    return out


def fixture_prompts(path) -> list[Prompt]:
    """The fixed prompts of a fixture directory, from its manifest."""
    from harness import fixtures

    manifest = fixtures.manifest(path)
    prompts = []
    for index, kwargs in enumerate(fixtures.prompt_inputs(manifest)):
        if "decoder_input_ids" in kwargs:
            tokens = kwargs.pop("decoder_input_ids")[0].tolist()
            prompts.append(Prompt(f"audio-{index}", "audio", tokens, kwargs))
        else:
            prompts.append(Prompt(f"text-{index}", "text", kwargs["input_ids"][0].tolist()))
    return prompts
