"""Teacher-forced scoring and greedy decoding on any model that is called like transformers'.

Both engines that run in-process (reference, transformers) go through these functions, so a
difference between them is a difference in loading, never in how they were driven.

``teacher_forced_text`` and ``greedy_text`` take many plain token sequences (the accuracy tasks')
and run as many of them in one forward pass as fit ``batch_tokens`` positions, right-padded: a
causal model's real positions never attend to the padding after them, so each row is what it
would be alone, up to how the matmul kernels sum a taller matrix. That holds for a computation
that treats each token on its own (activation scales static or per token); one that takes an
activation scale over the whole input would see the padding and the other rows, so its callers
pass ``batch_tokens=0`` (``Engine.rows_alone``): one sequence a pass.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class Prompt:
    """One prompt: the token ids that scoring extends (the decoder ids of an encoder-decoder
    model), and every other model input: input_features for audio, pixel_values and friends for
    images, the encoder's input_ids for Bart."""

    id: str
    kind: str  # text, audio, image
    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    encoder_decoder: bool = False

    @classmethod
    def from_model_inputs(cls, id: str, kwargs: dict[str, torch.Tensor]) -> "Prompt":
        kwargs = dict(kwargs)
        kind = "image" if "pixel_values" in kwargs else "audio" if "input_features" in kwargs else "text"
        if "decoder_input_ids" in kwargs:
            return cls(id, kind, kwargs.pop("decoder_input_ids")[0].tolist(), kwargs, encoder_decoder=True)
        return cls(id, kind, kwargs.pop("input_ids")[0].tolist(), kwargs)

    def model_inputs(self, tokens: list[int]) -> dict[str, torch.Tensor]:
        """Fresh tensors on every call: models may modify their inputs in place (transformers'
        Mllama rewrites cross_attention_mask), which would leak from one forward into the next."""
        ids = torch.tensor([tokens])
        if self.encoder_decoder:
            return {**{k: v.clone() for k, v in self.inputs.items()}, "decoder_input_ids": ids}
        return {**{k: _extend(k, v, len(tokens)).clone() for k, v in self.inputs.items()}, "input_ids": ids}


# Per-token inputs of decoder-only prompts, and how a continuation extends them: a new token is
# attended, is text (not an image token), and sees the images the last prompt token saw.
_PER_TOKEN = {"attention_mask": 1, "mm_token_type_ids": 0, "token_type_ids": 0, "cross_attention_mask": None}


def _extend(key: str, value: torch.Tensor, length: int) -> torch.Tensor:
    if key not in _PER_TOKEN or value.shape[1] >= length:
        return value
    extra = length - value.shape[1]
    if _PER_TOKEN[key] is None:
        tail = value[:, -1:].expand(-1, extra, *value.shape[2:])
    else:
        tail = torch.full((value.shape[0], extra, *value.shape[2:]), _PER_TOKEN[key], dtype=value.dtype)
    return torch.cat([value, tail], dim=1)


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
    out = model(**prompt.model_inputs(tokens))
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def _logprob(row: torch.Tensor, token: int) -> float:
    """A token the model cannot output (an image placeholder beyond the output vocabulary) has
    probability zero."""
    return float(row[token]) if token < row.shape[0] else float("-inf")


def _topk(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    values, indices = row.topk(k)
    return [(int(i), float(v)) for i, v in zip(indices, values)]


def _scored(lp: torch.Tensor, tokens: list[int], k: int) -> Scored:
    positions = range(len(tokens) - 1)
    return Scored(
        tokens=list(tokens),
        logprobs=[_logprob(lp[i], tokens[i + 1]) for i in positions],
        topk=[_topk(lp[i], k) for i in positions],
    )


def teacher_forced(model, prompt: Prompt, tokens: list[int], k: int) -> Scored:
    """Score a given token sequence in one forward pass."""
    return _scored(_log_softmax(model, prompt, tokens), tokens, k)


@torch.inference_mode()
def _log_softmax_rows(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each text sequence's log-softmax rows, from one forward pass over all of them right-padded
    (with each one's own last token: any id the model takes)."""
    width = max(map(len, sequences))
    ids = torch.tensor([s + s[-1:] * (width - len(s)) for s in sequences])
    logits = model(input_ids=ids).logits.float()
    return [torch.log_softmax(logits[row, :len(s)], dim=-1) for row, s in enumerate(sequences)]


def _batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices of sequences of these lengths, shortest first (the least padding), in groups whose
    padded size (rows times the longest) is at most ``batch_tokens``, at least one sequence each."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def teacher_forced_text(model, sequences: list[list[int]], k: int, batch_tokens: int) -> list[Scored]:
    """``teacher_forced`` of many plain token sequences, batched (module docstring)."""
    out: list[Scored | None] = [None] * len(sequences)
    for group in _batches([len(s) for s in sequences], batch_tokens):
        for i, lp in zip(group, _log_softmax_rows(model, [sequences[i] for i in group])):
            out[i] = _scored(lp, sequences[i], k)
    return out


def greedy(model, prompt: Prompt, max_tokens: int, k: int, stop=None) -> Greedy:
    """Free-running greedy decoding. Each step re-runs the whole sequence: the models are tiny,
    and no cache means no cache code path can make two engines differ. ``stop``, called with the
    tokens generated so far after each step, ends decoding when it returns True (the engines'
    ``Stop``)."""
    tokens = list(prompt.tokens)
    out = Greedy([], [])
    for _ in range(max_tokens):
        row = _log_softmax(model, prompt, tokens)[-1]
        top = _topk(row, k)
        out.tokens.append(top[0][0])
        out.topk.append(top)
        tokens.append(top[0][0])
        if stop is not None and stop(out.tokens):
            break
    return out


def greedy_text(model, prompts: list[list[int]], max_tokens: int, k: int, batch_tokens: int,
                stop=None) -> list[Greedy]:
    """``greedy`` from many plain token prompts, batched (module docstring; a batch's size counts
    its prompts at their longest, ``max_tokens`` added): each step runs the prompts still
    decoding, and a prompt leaves its batch when ``stop`` says so."""
    out = [Greedy([], []) for _ in prompts]
    for group in _batches([len(p) + max_tokens for p in prompts], batch_tokens):
        live = list(group)
        for _ in range(max_tokens):
            rows = _log_softmax_rows(model, [prompts[i] + out[i].tokens for i in live])
            for i, lp in zip(live, rows):
                top = _topk(lp[-1], k)
                out[i].tokens.append(top[0][0])
                out[i].topk.append(top)
            live = [i for i in live if stop is None or not stop(out[i].tokens)]
            if not live:
                break
    return out


def fixture_prompts(path) -> list[Prompt]:
    """The fixed prompts of a fixture directory, from its manifest."""
    # lazy: regex, +60 ms (scripts/import-graph --costs)
    from harness import fixtures

    inputs = fixtures.prompt_inputs(fixtures.manifest(path))
    return [Prompt.from_model_inputs(f"p{index}", kwargs) for index, kwargs in enumerate(inputs)]
