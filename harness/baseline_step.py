"""The step after a cell's verdict (harness.runner): which baselines a run writes for the cell and
where, and writing them, or the obtained file of a mismatch beside the baseline it was judged
against (docs/design.md, "Verdicts": a run that writes a cell's baseline judges it against what
it writes).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harness import baselines as B
from harness import records as R
from harness import resolver, store
from harness.accuracy import store as accuracy_store

if TYPE_CHECKING:
    from harness.matrix import Cell


@dataclass(frozen=True)
class BaselineStep:
    root: Path  # the baselines root
    update_baselines: bool  # --update-baselines: every cell's, where it was read
    update_kernel_baselines: bool  # --update-kernel-baselines: this machine's kernels', where they do not carry

    def handle(self, result, root: Path, writes: bool, stored: R.Record) -> None:
        """The step after the verdict: the cell's baselines written into ``root`` where this run
        writes them (refused for a verdict that may not become one), else the obtained files.
        ``stored``: the record gathered against the stored baselines, which says what moved."""
        cell = result.cell
        moved = [f"{c.name}: {c.detail}" for c in stored.checks if not c.ok and c.against_baseline]
        moved += stored.evidence.stale if stored.evidence is not None else []
        # a load time over its bound (or under 1/bound) rewrites the file even where nothing else moved
        rewrite = bool(moved) or any(c.kind == "load-time" and (c.data or {}).get("improved") for c in stored.checks)
        result.outcome = outcome = self._handle_baseline(cell, result, root, writes, rewrite)
        if outcome.refused:
            result.messages.append(f"baseline refused: {outcome.refused}")
        acc = accuracy_store.handle(root if writes else self.root, result.record, update_baselines=writes)
        if outcome.change is not None:
            result.messages.append(str(outcome.change))
        result.messages += acc.messages
        if (outcome.change is not None and outcome.change.written) or acc.written:
            flag = "--update-baselines" if self.update_baselines else "--update-kernel-baselines"
            kind = outcome.change.kind if outcome.change is not None and outcome.change.written else "accuracy new or updated"
            was = f" (against the stored one: {'; '.join(moved)})" if moved else ""
            result.record = result.record.model_copy(update={
                "verdict_reason": f"{result.record.verdict_reason}; baseline {kind} by {flag}{was}"})
        if outcome.obtained is not None:
            result.messages.append(f"obtained result written beside the baseline: {outcome.obtained}")

    def _handle_baseline(self, cell: Cell, result, root: Path, writes: bool, rewrite: bool) -> B.Outcome:
        """baselines.handle in ``root``: the baselines the cell is judged against, or those this run
        writes. Where those are not in the cell's own place and that holds no baseline of it, the
        obtained file left there while the cell had no baseline at all is answered by them, and goes."""
        try:
            if root != self.root and not B.path_for(self.root, cell.tier, cell.id).exists():
                store.clear_obtained(B.Baseline, self.root, cell.tier, cell.id)
            return B.handle(root, result.record, update_baselines=writes, rewrite=rewrite)
        except OSError as e:  # the cell keeps its verdict and record; the baseline files were not written
            result.messages.append(f"baseline files not written: {e.filename or self.root}: {e.strerror or e}")
            return B.Outcome()

    def writes_into(self, result, found: resolver.Resolution, load_here: bool) -> Path | None:
        """Where this run writes the cell's baselines, None where it writes none: with
        --update-baselines, where they were read; with --update-kernel-baselines, into this
        machine's kernels' baselines for a cell whose logprobs against a baseline from other kernels
        are not judged (its computation does not carry), or a gated cell whose load-time baseline is
        from other kernels or missing (``load_here``; docs/design.md, "Load-time baselines per kind
        of CPU"), where nothing against the stored baseline fails but the load time. Says why where
        such a cell's is not recorded."""
        if self.update_baselines:
            return found.root
        gathered = result.record
        not_judged = gathered.evidence is not None and gathered.evidence.not_judged is not None
        if not (not_judged or load_here):
            return None
        if not self.update_kernel_baselines or found.kernels_root is None:
            result.messages.append("judged by what carries against a baseline from other kernels; harness run "
                                   "--update-kernel-baselines records these kernels' once")
            return None
        failing = [c.name for c in gathered.checks if not c.ok and c.against_baseline and c.kind != "load-time"]
        failing += gathered.evidence.stale if gathered.evidence is not None else []
        if failing:
            result.messages.append(f"these kernels' baseline not recorded: {', '.join(failing)}, not only its load time")
            return None
        return found.kernels_root
