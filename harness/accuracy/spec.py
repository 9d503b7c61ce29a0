"""The models.yaml schema of accuracy tasks and their gates (docs/design.md, "Accuracy").

A task is declared once under ``accuracy_tasks`` and named by models and schemes in their
``accuracy`` list. ``task`` is an lm-eval task name (``gsm8k``) or a task YAML in the repo (a path
ending in ``.yaml``, relative to models.yaml). The gate decides whether two values of the task's
metric (a run and its baseline, or two engines of one run) are the same:

- ``abs: X``: |a - b| <= X;
- ``rel: X``: |a - b| <= X * |b|;
- ``test: two-proportion, alpha: A``: for a proportion metric, the two-sided pooled z-test of the
  two proportions at their sample sizes is not significant at level A;
- ``test: wilson, alpha: A``: for a proportion metric, a lies inside the Wilson score interval of b
  at b's sample size, at confidence 1 - A;
- ``test: mcnemar, alpha: A``: for a proportion metric evaluated on the same samples, the exact
  McNemar test on the samples that changed (lost and gained) is not significant at level A: the
  paired rule, which sees that 8 of 40 samples were lost where a two-proportion test at n=40 sees
  nothing. Without per-sample values on both sides it falls back to the two-proportion test.

Every gate is two-sided: a quantized cell that suddenly agrees more with its unquantized model
(a skip list now covering everything, say) has changed as much as one that agrees less.

Nothing here imports torch or lm-eval.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

# Metrics whose values are proportions of samples, the only ones a statistical rule applies to.
PROPORTION_METRICS = frozenset({"acc", "acc_norm", "exact_match", "mcc_acc"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Gate(_Strict):
    """Exactly one rule: ``abs``, ``rel``, or ``test`` (with ``alpha``)."""

    abs: float | None = Field(default=None, gt=0)
    rel: float | None = Field(default=None, gt=0)
    test: Literal["two-proportion", "wilson", "mcnemar"] | None = None
    alpha: float | None = Field(default=None, gt=0, lt=0.5)

    @model_validator(mode="after")
    def _one_rule(self) -> Gate:
        rules = [k for k in ("abs", "rel", "test") if getattr(self, k) is not None]
        if len(rules) != 1:
            raise ValueError(f"a gate needs exactly one of abs, rel, test (found: {', '.join(rules) or 'none'})")
        if (self.test is None) != (self.alpha is None):
            raise ValueError("alpha goes with test, and a test needs alpha (e.g. {test: two-proportion, alpha: 0.01})")
        return self

    def describe(self) -> str:
        if self.abs is not None:
            return f"|Δ| <= {self.abs:g}"
        if self.rel is not None:
            return f"|Δ| <= {self.rel:g} x baseline"
        return f"{self.test} test, alpha {self.alpha:g}"


class AccuracyTask(_Strict):
    """One accuracy task as models.yaml declares it under ``accuracy_tasks``."""

    description: str | None = None
    task: Annotated[str, StringConstraints(min_length=1)]  # an lm-eval task name, or a task YAML (relative to models.yaml)
    metric: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_]+$")]  # lm-eval's metric name: acc, exact_match, ...
    filter: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]+$")] = "none"  # lm-eval's filter name
    num_fewshot: int | None = Field(default=None, ge=0)  # None: the task's own
    limit: int | None = Field(default=None, gt=0)  # None: every sample
    gate: Gate

    @model_validator(mode="after")
    def _gate_fits_metric(self) -> AccuracyTask:
        if self.gate.test is not None and self.metric not in PROPORTION_METRICS:
            raise ValueError(f"a statistical gate ({self.gate.test}) needs a proportion metric "
                             f"({', '.join(sorted(PROPORTION_METRICS))}); {self.metric!r} is not one")
        return self

    @property
    def local(self) -> bool:
        """Whether ``task`` is a task YAML in the repo (not an lm-eval task name)."""
        return self.task.endswith((".yaml", ".yml"))


class CellAccuracyTask(AccuracyTask):
    """A task as a cell carries it: its name in models.yaml, and for a local task its YAML's
    absolute path."""

    name: str
    path: str | None = None
