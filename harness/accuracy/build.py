"""The offline tiny accuracy tasks, and the command that rebuilds them on purpose (docs/design.md,
"Accuracy", "Tiny tasks").

A random tiny model is at chance on any real task, so the cpu-tiny tasks measure fidelity: their
gold answers are what the *unquantized* fixture of the same model chooses, run through the same
lm-eval pipeline as every cell (harness.accuracy.lmeval on the reference engine). A quantized
cell's score is then its agreement with its own unquantized model. Each recipe below makes many
small items from the fixture's own tokenizer (contexts of a few tokens drawn from every clean token
of the vocabulary), so a task reads far more embedding rows and LM-head rows than the fixed logprob
prompts do:

- ``choice`` (``multiple_choice``, metric ``acc``): a context and two one-word continuations;
  gold = the continuation the unquantized model scores highest;
- ``generate`` (``generate_until``, metric ``exact_match``): gold = the unquantized model's greedy
  continuation, cut at the task's stop string. The stop string is picked from the unquantized
  model's own outputs so that about half of the items stop on it before ``max_gen_toks``;
- ``rolling`` (``loglikelihood_rolling``, metric ``bits_per_byte``): fixed texts, no gold.

**Margins.** The items are scored twice, in this interpreter and in a fresh one with
``ATEN_CPU_CAPABILITY=default`` (other kernels, as harness.measure_noise does for module traces). The noise is
the largest difference of any choice's loglikelihood (or step gap) between the two; an item is
kept only when its margin (the gold's lead over the runner-up; for generation, the smallest
top-1/top-2 gap over the generated steps) is at least max(``MIN_MARGIN``, ``NOISE_FACTOR`` x the
noise). The YAML header records the fixture identity, the noise, the threshold and what was kept.

The files are committed under ``harness/accuracy/data/`` and rebuilt only by
``harness accuracy build NAME...`` (or ``all``). A rebuilt task has a new hash, so its baselines
become ``stale-baseline`` until they are updated on purpose.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from harness.errors import UsageError

DATA_DIR = Path(__file__).resolve().parent / "data"
MIN_MARGIN = 0.05  # nats: the smallest lead kept, whatever the measured noise
NOISE_FACTOR = 100.0  # and at least this many times the measured noise
STOP_CANDIDATES = tuple("etaoinsrlhdcum,.") + (" t", " a", " the", " s")


@dataclass(frozen=True)
class Recipe:
    name: str  # the task's file stem and models.yaml name
    model: str  # the models.yaml model whose unquantized fixture decides the gold answers
    kind: Literal["choice", "generate", "rolling"]
    items: int  # at most this many items kept
    candidates: int  # items generated before the margin filter
    context_tokens: tuple[int, int]  # tokens per context (or text), min and max
    choices: int = 4
    max_gen_toks: int = 6
    seed: int = 0

    @property
    def yaml_path(self) -> Path:
        return DATA_DIR / f"{self.name}.yaml"

    @property
    def data_path(self) -> Path:
        return DATA_DIR / f"{self.name}.jsonl"

    @property
    def lm_eval_name(self) -> str:
        return "harness_" + self.name.replace("-", "_")

    @property
    def metric(self) -> str:
        return {"choice": "acc", "generate": "exact_match", "rolling": "bits_per_byte"}[self.kind]


RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("llama-choice", "llama", "choice", items=160, candidates=320, context_tokens=(3, 8), choices=2, seed=1),
    Recipe("llama-continue", "llama", "generate", items=40, candidates=80, context_tokens=(3, 8), seed=2),
    Recipe("llama-rolling", "llama", "rolling", items=16, candidates=16, context_tokens=(48, 96), seed=3),
)}


# ------------------------------------------------------------------------------------ items


def clean_tokens(tokenizer) -> list[int]:
    """Token ids that decode to printable text which encodes back to that one token."""
    special = set(tokenizer.all_special_ids)
    out = []
    for t in range(len(tokenizer)):
        if t in special:
            continue
        text = tokenizer.decode([t])
        if text and text.isprintable() and tokenizer(text, add_special_tokens=False)["input_ids"] == [t]:
            out.append(t)
    return out


def candidates(recipe: Recipe, tokenizer) -> list[dict]:
    """The recipe's candidate items, deterministic (numpy PCG64 seeded by the recipe)."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(recipe.seed))
    vocab = clean_tokens(tokenizer)
    words = [t for t in vocab if tokenizer.decode([t]).startswith(" ") and tokenizer.decode([t]).strip()]
    lo, hi = recipe.context_tokens

    def text(n: int) -> str:
        return "".join(tokenizer.decode([int(t)]) for t in rng.choice(vocab, size=n)).rstrip() or "a"

    items = []
    for _ in range(recipe.candidates):
        context = text(int(rng.integers(lo, hi + 1)))
        if recipe.kind == "choice":
            picks = rng.choice(words, size=recipe.choices, replace=False)
            items.append({"context": context, "choices": [tokenizer.decode([int(t)]) for t in picks], "gold": 0})
        elif recipe.kind == "generate":
            items.append({"context": context, "gold": ""})
        else:
            items.append({"text": context})
    return items


def task_yaml(recipe: Recipe, data_file: str, until: list[str] | None = None) -> dict:
    """The lm-eval task config of a recipe (data read from ``data_file``, relative to the YAML)."""
    config: dict = {"task": recipe.lm_eval_name, "dataset_path": "json",
                    "dataset_kwargs": {"data_files": {"test": data_file}}, "test_split": "test"}
    if recipe.kind == "choice":
        config.update(output_type="multiple_choice", doc_to_text="context", doc_to_choice="choices",
                      doc_to_target="gold", target_delimiter="",
                      metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}])
    elif recipe.kind == "generate":
        config.update(output_type="generate_until", doc_to_text="context", doc_to_target="gold",
                      generation_kwargs={"until": list(until or []), "max_gen_toks": recipe.max_gen_toks,
                                         "do_sample": False, "temperature": 0.0},
                      metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}])
    else:
        config.update(output_type="loglikelihood_rolling", doc_to_text="", doc_to_target="text",
                      metric_list=[{"metric": "bits_per_byte"}, {"metric": "word_perplexity"}])
    config["metadata"] = {"version": 1.0}
    return config


def _write(directory: Path, recipe: Recipe, items: list[dict], until: list[str] | None = None,
           header: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{recipe.name}.jsonl"
    data.write_text("".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items))
    path = directory / f"{recipe.name}.yaml"
    path.write_text(header + yaml.safe_dump(task_yaml(recipe, data.name, until), sort_keys=False, allow_unicode=True))
    return path


# -------------------------------------------------------------------------------- scoring


def _unquantized_engine(recipe: Recipe):
    # lazy: pydantic, +300 ms (scripts/import-graph --costs)
    from harness import matrix
    # lazy: pydantic, +230 ms (scripts/import-graph --costs)
    from harness.engines import base

    cell = {c.id: c for c in matrix.load().cells()}[f"{recipe.model}.unquantized.reference"]
    engine = base.engine_class("reference")(cell)
    ckpt = base.resolve_checkpoint(cell)
    engine.load(ckpt)
    return engine, ckpt


def score(recipe: Recipe, yaml_path: Path) -> dict:
    """What the unquantized fixture does on the items of ``yaml_path``, through lm-eval on the
    reference engine: per item the choices' loglikelihoods, or the generated text and its smallest
    step gap, or the text's loglikelihood."""
    # lazy: pydantic, +230 ms (scripts/import-graph --costs)
    from harness.accuracy.lmeval import make_lm, run_task
    # lazy: pydantic, +180 ms (scripts/import-graph --costs)
    from harness.accuracy.spec import CellAccuracyTask, Gate

    engine, ckpt = _unquantized_engine(recipe)
    lm = make_lm(engine, ckpt, margins=True)
    task = CellAccuracyTask(name=recipe.name, task=str(yaml_path), path=str(yaml_path), metric=recipe.metric,
                            gate=Gate(abs=1.0))
    _, res = run_task(lm, task)
    samples = sorted(res["samples"][recipe.lm_eval_name], key=lambda s: s["doc_id"])
    if recipe.kind == "choice":
        out = {"lls": [[float(r[0]) for r in s["filtered_resps"]] for s in samples]}
    elif recipe.kind == "generate":
        out = {"texts": [s["filtered_resps"][0] for s in samples],
               "gaps": [lm.generation_margins[s["doc"]["context"]] for s in samples]}
    else:
        out = {"lls": [float(s["resps"][0][0]) for s in samples]}
    out["identity"] = ckpt.identity
    engine.close()
    return out


def _score_elsewhere(recipe: Recipe, yaml_path: Path) -> dict:
    """score() in a fresh interpreter under other kernels (ATEN_CPU_CAPABILITY=default)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scores.json"
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}
        p = subprocess.run([sys.executable, "-m", "harness.accuracy.build", "--score", recipe.name, str(yaml_path), str(out)],
                           env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"scoring {recipe.name} under ATEN_CPU_CAPABILITY=default failed:\n{p.stderr[-3000:]}")
        return json.loads(out.read_text())


def _noise(a: dict, b: dict, key: str) -> float:
    flat = lambda x: [v for row in x for v in (row if isinstance(row, list) else [row])]  # noqa: E731
    return max((abs(x - y) for x, y in zip(flat(a[key]), flat(b[key]))), default=0.0)


def _pick_stop(texts: list[str]) -> str:
    """The stop string that ends about half of the generations, not at their first character."""
    def rate(s):
        return sum(1 for t in texts if s in t[1:]) / max(1, len(texts))

    return min(STOP_CANDIDATES, key=lambda s: (abs(rate(s) - 0.5), s))


# -------------------------------------------------------------------------------- building


def build(recipe: Recipe, out_dir: Path = DATA_DIR, say=print) -> Path:
    """Build one tiny task into ``out_dir`` (see the module docstring). Returns the YAML's path."""
    import torch
    from transformers import AutoTokenizer

    # lazy: numpy, regex, +180 ms (scripts/import-graph --costs)
    from harness import fixtures

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(fixtures.build(f"{recipe.model}-unquantized"))
    items = candidates(recipe, tokenizer)
    say(f"{recipe.name}: {len(items)} candidate {recipe.kind} items from {recipe.model}-unquantized")
    with tempfile.TemporaryDirectory() as tmp:
        until, ends = None, 0
        if recipe.kind == "generate":  # a first pass without a stop string picks one
            first = score(recipe, _write(Path(tmp) / "first", recipe, items, until=[]))
            until = [_pick_stop(first["texts"])]
            ends = sum(1 for t in first["texts"] if until[0] in t[1:])
            say(f"{recipe.name}: stop string {until[0]!r} (it ends {ends} of {len(items)} generations)")
        path = _write(Path(tmp), recipe, items, until=until)
        say(f"{recipe.name}: scoring with the unquantized fixture, here and under ATEN_CPU_CAPABILITY=default")
        here, there = score(recipe, path), _score_elsewhere(recipe, path)
    if recipe.kind == "choice":
        noise = _noise(here, there, "lls")
        threshold = max(MIN_MARGIN, NOISE_FACTOR * noise)
        kept = []
        for item, lls in zip(items, here["lls"]):
            order = sorted(range(len(lls)), key=lambda i: -lls[i])
            margin = lls[order[0]] - lls[order[1]]
            if margin >= threshold:
                kept.append(({**item, "gold": order[0]}, margin))
    elif recipe.kind == "generate":
        noise = _noise(here, there, "gaps")
        threshold = max(MIN_MARGIN, NOISE_FACTOR * noise)
        kept = [({**item, "gold": text}, gap) for item, text, gap, other in
                zip(items, here["texts"], here["gaps"], there["texts"]) if gap >= threshold and text == other]
    else:
        noise = _noise(here, there, "lls")
        threshold = 0.0
        kept = [(item, None) for item in items]
    clear = len(kept)
    kept = kept[: recipe.items]
    margins = sorted(m for _, m in kept if m is not None)
    header = (f"# Built by `harness accuracy build {recipe.name}` (harness/accuracy/build.py); rebuild on purpose only.\n"
              f"# {recipe.kind} items from the tokenizer of {recipe.model}-unquantized (identity {here['identity']});\n"
              + (f"# gold: what that unquantized fixture chooses through lm-eval on the reference engine.\n"
                 if recipe.kind != "rolling" else "# no gold: the metric is the text's bits per byte.\n")
              + (f"# stop string {until[0]!r}: it ends {ends} of the {len(items)} candidates' generations before "
                 f"max_gen_toks\n" if until else "")
              + f"# measured noise (here vs ATEN_CPU_CAPABILITY=default): {noise:.3g}; margin kept >= {threshold:.3g}\n"
              + f"# {clear} of {len(items)} candidates clear it; the first {len(kept)} kept"
              + (f"; margins min {margins[0]:.3g}, median {margins[len(margins) // 2]:.3g}" if margins else "") + "\n")
    if recipe.kind == "choice" and len(kept) < recipe.items:
        say(f"{recipe.name}: warning: only {len(kept)} items have a clear margin (wanted {recipe.items})")
    path = _write(out_dir, recipe, [i for i, _ in kept], until=until, header=header)
    say(f"{recipe.name}: {header.splitlines()[-2].lstrip('# ')}; {header.splitlines()[-1].lstrip('# ')} -> {path}")
    return path


# ------------------------------------------------------------------------------------ CLI


def add_arguments(p) -> None:
    p.add_argument("action", choices=["list", "build"], help="list the tiny tasks, or rebuild them")
    p.add_argument("names", nargs="*", metavar="NAME", help="tasks to build ('all' for every one)")


def run(args) -> int:
    if args.action == "list":
        for r in RECIPES.values():
            print(f"{r.name}\t{r.kind}\t{r.model}\t{r.yaml_path.relative_to(DATA_DIR.parents[2])}")
        return 0
    names = list(RECIPES) if args.names == ["all"] else args.names
    if not names:
        raise UsageError("harness accuracy build: name the tasks to build, or 'all'")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        raise UsageError(f"harness accuracy build: unknown task {', '.join(unknown)} (known: {', '.join(RECIPES)})")
    for n in names:
        build(RECIPES[n])
    return 0


def _main(argv: list[str]) -> int:
    """``python -m harness.accuracy.build --score NAME YAML OUT``: score() for the builder's other run."""
    if len(argv) != 4 or argv[0] != "--score":
        print("usage: python -m harness.accuracy.build --score NAME YAML OUT", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    Path(argv[3]).write_text(json.dumps(score(RECIPES[argv[1]], Path(argv[2]))))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
