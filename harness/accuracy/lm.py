"""The harness as an lm-eval model: one class that drives any engine of the matrix (docs/design.md,
"Accuracy").

``HarnessLM`` is registered with lm-eval as ``harness`` and holds an engine that is already
loaded (harness.engines.base): the reference, transformers or vLLM, in the engine child that ran
the cell's logprob steps. It answers lm-eval's three request types through the two methods every
engine has, so accuracy is measured the same way on every engine and a difference between engines
is a difference between the engines, not between two lm-eval integrations:

- ``loglikelihood``: ``teacher_forced`` on prefix + context + continuation (top-1 kept): the sum of
  the continuation's logprobs, and whether each continuation token is the top-1 at its position;
- ``loglikelihood_rolling``: lm-eval's disjoint rolling windows over the text, each scored by
  ``teacher_forced``;
- ``generate_until``: ``greedy`` with a :class:`~harness.engines.base.Stop` (the request's stop
  strings, decoded with the checkpoint's tokenizer, and the EOS token), then the text cut at the
  first stop string, as lm-eval's own models do.

Every sequence starts with the tokenizer's BOS token (EOS when it has none), lm-eval's
``prefix_token_id``; sequences longer than the model's context are cut on the left (the engines
feed every token of a scored sequence, so a sequence is at most the context length). Identical
sequences are scored once.
"""
from __future__ import annotations

from collections.abc import Callable

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from harness.engines.base import Checkpoint, Engine, EnginePrompt, Stop

CHUNK = 256  # sequences per engine call (progress lines between chunks)
DEFAULT_MAX_GEN_TOKS = 256
# Token positions per forward pass of an in-process engine (harness.scoring): the tiny tasks' few
# dozen sequences of up to ~100 tokens go in a handful of passes, a GPU model's long few-shot
# prompts a couple at a time, their logits in memory.
BATCH_TOKENS = 2048


def context_length(config: dict) -> int:
    """The model's context length from its config (the text model's, for a composite model)."""
    for c in (config.get("text_config") or {}, config.get("decoder") or {}, config):
        for key in ("max_position_embeddings", "max_target_positions", "n_positions"):
            if isinstance(c.get(key), int):
                return int(c[key])
    return 2048


@register_model("harness")
class HarnessLM(TemplateLM):
    """lm-eval's model interface over a loaded harness engine (see the module docstring)."""

    def __init__(self, engine: Engine, checkpoint: Checkpoint, log: Callable[[str], None] | None = None,
                 margins: bool = False, **_ignored):
        super().__init__()
        from transformers import AutoTokenizer

        self.engine = engine
        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint.path)
        self._max_length = context_length(checkpoint.config)
        self.log = log or (lambda s: None)
        # With ``margins``, generate_until also records, per context, the smallest gap between the
        # top-1 and top-2 logprob over the generated steps (the tiny-task builder keeps only items
        # whose gold is clear).
        self.margins = margins
        # A batched row is what it computes alone unless an activation scale is taken over more
        # than one token, the other rows and the padding with it: such a cell goes one at a time.
        self.batch_tokens = BATCH_TOKENS if engine.rows_alone(checkpoint) else 0
        self.generation_margins: dict[str, float] = {}
        self._cache: dict[tuple[int, ...], tuple[list[float], list[int]]] = {}

    # ---- tokenization ----------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # The prefix token is added by this class, once, to every sequence.
        return list(self.tokenizer(string, add_special_tokens=False)["input_ids"])

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _prefixed(self, tokens: list[int]) -> list[int]:
        return tokens if tokens[:1] == [self.prefix_token_id] else [self.prefix_token_id, *tokens]

    # ---- scoring through the engine -------------------------------------------------------
    def _score(self, sequences: list[list[int]], what: str) -> list[tuple[list[float], list[int]]]:
        """(logprobs, top-1 ids) of every sequence, teacher-forced by the engine, each sequence once."""
        todo = list(dict.fromkeys(tuple(s) for s in sequences if tuple(s) not in self._cache))
        for start in range(0, len(todo), CHUNK):
            chunk = todo[start:start + CHUNK]
            if len(todo) > CHUNK:
                self.log(f"accuracy: {what}: scoring sequences {start + 1}-{start + len(chunk)} of {len(todo)}")
            prompts = [EnginePrompt(id=f"acc{start + i}", kind="text", tokens=list(s[:1])) for i, s in enumerate(chunk)]
            scored = self.engine.teacher_forced(prompts, [list(s) for s in chunk], 1, batch_tokens=self.batch_tokens)
            for s, r in zip(chunk, scored):
                self._cache[s] = (list(r.logprobs), [top[0][0] if top else -1 for top in r.topk])
        return [self._cache[tuple(s)] for s in sequences]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        seqs, conts = [], []
        for _, context_enc, continuation_enc in requests:
            seq = self._prefixed(list(context_enc)) + list(continuation_enc)
            seqs.append(seq[-self.max_length:])  # every token is fed, the last one too
            conts.append(list(continuation_enc))
        out = []
        for seq, cont, (logprobs, top1) in zip(seqs, conts, self._score(seqs, f"{len(seqs)} loglikelihood requests")):
            n = len(cont)
            lp = logprobs[-n:] if n else []
            out.append((float(sum(lp)), all(t == c for t, c in zip(top1[-n:], cont)) if n else True))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            for context, pred in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 1, context_len=1)):  # a window plus its last token fits
                windows.append((list(context) + list(pred), len(pred)))
                owner.append(i)
        totals = [0.0] * len(requests)
        scored = self._score([w for w, _ in windows], f"{len(windows)} rolling windows")
        for (seq, n), i, (logprobs, _) in zip(windows, owner, scored):
            totals[i] += float(sum(logprobs[-n:]))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[tuple[tuple[str, ...], int], list[int]] = {}
        parsed = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            kwargs = dict(gen_kwargs or {})
            until = kwargs.get("until") or []
            until = (until,) if isinstance(until, str) else tuple(until)
            max_gen = int(kwargs.get("max_gen_toks") or DEFAULT_MAX_GEN_TOKS)
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
                raise ValueError("generate_until: the harness decodes greedily only (do_sample false, temperature 0)")
            parsed.append((context, until, max_gen))
            groups.setdefault((until, max_gen), []).append(i)
        out: list[str | None] = [None] * len(requests)
        for (until, max_gen), indices in groups.items():
            stop = Stop(strings=until, token_ids=(self.eot_token_id,), decode=self.tok_decode)
            keep = max(1, self.max_length - max_gen)
            prompts = []
            for i in indices:
                tokens = self._prefixed(self.tok_encode(parsed[i][0]))[-keep:]
                prompts.append(EnginePrompt(id=f"gen{i}", kind="text", tokens=tokens))
            self.log(f"accuracy: generate_until: {len(prompts)} requests, at most {max_gen} tokens, stop {list(until)}")
            results = []
            for start in range(0, len(prompts), CHUNK):
                results += self.engine.greedy(prompts[start:start + CHUNK], max_gen, 2 if self.margins else 1, stop=stop,
                                             batch_tokens=self.batch_tokens)
            for i, g in zip(indices, results):
                tokens = [t for t in g.tokens if t != self.eot_token_id]
                text = self.tok_decode(tokens)
                for s in until:
                    if s:
                        text = text.split(s)[0]
                out[i] = text
                if self.margins:
                    gaps = [top[0][1] - top[1][1] for top in g.topk if len(top) > 1]
                    self.generation_margins[parsed[i][0]] = min(gaps) if gaps else 0.0
        return out
