"""Configuration cells (docs/design.md, "Configurations"): a scheme's cell run in another engine
configuration, tensor-parallel ranks or compiled execution (models.yaml ``configurations``), and
judged against its plain cell (one rank, eager) of the same run, as a candidate build is judged
against the pinned one (judging.judge_against_base): the plain cell's record stands in for a
baseline (the loaded state exactly, the logprobs within the family bounds where the computation
carries; a configuration cell runs no accuracy tasks), so a configuration needs no baseline of its
own, and writes none.

A configuration cell needs its plain cell in the same run: :func:`with_bases` adds the plain cells
a selection lacks, :class:`ConfigurationRuns` finds the configuration cells of a judged plain cell
(the runner runs them then: ``Runner.judge_configuration``), and :func:`judge` judges one.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from harness import judging

if TYPE_CHECKING:
    from harness import records as R
    from harness.matrix import Cell


def with_bases(cells: Iterable[Cell], universe: Iterable[Cell]) -> list[Cell]:
    """``cells`` and the plain cells their configuration cells are judged against, taken from
    ``universe`` (every cell of the matrix) where ``cells`` lacks them."""
    cells = list(cells)
    have = {c.id for c in cells}
    wanted = {c.base for c in cells if c.base is not None and c.base not in have}
    return cells + [c for c in universe if c.id in wanted]


class ConfigurationRuns:
    """The configuration cells of a run, by the plain cell each is judged against."""

    def __init__(self, cells: Iterable[Cell]):
        self.by_base: dict[str, list[Cell]] = {}
        for c in cells:
            if c.base is not None:
                self.by_base.setdefault(c.base, []).append(c)

    def of(self, plain: Cell) -> list[Cell]:
        return self.by_base.get(plain.id, [])


def judge(cell: Cell, record: R.Record, base: R.Record, raws: dict[str, R.Record], group: Iterable[Cell],
          unfused: R.Record | None) -> R.Record:
    """The configuration cell's record judged against ``base``, its plain cell's judged record of
    this run, and the other engines of its group (``raws``, ``unfused``: the reference executed
    unfused)."""
    j = judging.judge_against_base(cell, record, base, [r for e, r in raws.items() if e != cell.engine],
                                   known_failures=[k for c in group for k in c.known_failures], unfused=unfused,
                                   subject="the configuration",
                                   base_name=f"the plain cell {base.cell} (one rank, eager)")
    return j.apply(record)
