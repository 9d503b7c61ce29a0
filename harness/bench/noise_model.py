"""The normal model of a load-time gate's noise (harness.bench.detection): a level the children of
one cell-run share and each child's own part, what a rule's threshold flags under it, and the
threshold that balances a clean run's false alarm against a missed slowdown.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MAD_TO_SD = 1.4826


def robust_sd(values: Sequence[float]) -> float:
    med = statistics.median(values)
    return MAD_TO_SD * statistics.median(abs(v - med) for v in values)


@dataclass(frozen=True)
class Noise:
    """The normal model of log(obtained / baseline) for one cell-run: a level its children share
    (sd ``level``: what moves between runs, and the baseline's own error) and each child's own
    part (sd ``within``: what differs between two children timed back to back)."""

    level: float
    within: float

    @classmethod
    def of(cls, child_sd: float, within_sd: float | None, baseline_children: int) -> Noise:
        """From the spread of single children around their cell's median (``child_sd``), of two
        children timed back to back (``within_sd``; None: independent children), with the baseline
        the median of ``baseline_children`` children (about pi/(2B) of a child's variance)."""
        within = child_sd if within_sd is None else min(within_sd, child_sd)
        shared = max(child_sd ** 2 - within ** 2, 0.0)
        return cls(math.sqrt(shared + child_sd ** 2 * math.pi / (2 * baseline_children)), max(within, 1e-6))

    def cell_flags(self, threshold: float, confirmations: int, slowdown: float, mean: float = 0.0) -> float:
        """The chance that 1 + ``confirmations`` children of one cell-run, ``slowdown`` slower,
        are all over ``threshold``: each child's chance, to that power, averaged over the level."""
        child = statistics.NormalDist(0.0, self.within)
        centre, t = mean + math.log(1 + slowdown), math.log(threshold)
        levels = statistics.NormalDist(0.0, 1.0)
        steps = 200
        total = weight = 0.0
        for i in range(steps + 1):  # the level's normal, on a grid of +-8 sd
            z = -8 + 16 * i / steps
            w = levels.pdf(z)
            total += w * (1 - child.cdf(t - centre - z * self.level)) ** (1 + confirmations)
            weight += w
        return total / weight


def modelled_flag(threshold: float, noise: Noise, confirmations: int, cells: int, slowdown: float,
                   mean: float = 0.0) -> float:
    """The model's chance that a run flags when ``cells`` of its cells are ``slowdown`` slower
    (0: a clean run of ``cells`` cells)."""
    return 1 - (1 - noise.cell_flags(threshold, confirmations, slowdown, mean)) ** cells


def balanced_threshold(noise: Noise, confirmations: int, cells: int, slowed_cells: int, slowdown: float) -> float:
    """The threshold at which the normal model misses a run slowed by ``slowdown`` as often
    as it flags a clean one: the two errors the issue bounds weigh the same, since the model's
    tails are thinner than this host's on both sides."""
    lo, hi = 0.0, math.log(1 + slowdown)
    for _ in range(50):
        mid = (lo + hi) / 2
        false_alarm = modelled_flag(math.exp(mid), noise, confirmations, cells, 0.0)
        miss = 1 - modelled_flag(math.exp(mid), noise, confirmations, slowed_cells, slowdown)
        lo, hi = (mid, hi) if false_alarm > miss else (lo, mid)
    return math.exp((lo + hi) / 2)
