"""Which stored baselines judge a record: the one place that chooses them.

Given the baselines root and a record (its cell, and the CPU and kernels it ran on), :func:`resolve`
returns a :class:`Resolution`: the logprob baseline and the root it was read from, the load time's
baseline where that is another, the accuracy baseline, the root this record's own kernels record
into, whether the logprob baseline is from these kernels (so that everything is judged), and what
to tell the user where a choice is not the cell's own file. The stores stay files only
(harness.baselines, harness.accuracy.store).

The rules (docs/design.md, "Portability across CPUs" and "Load-time baselines per kind of CPU"):
- **logprobs, loaded state**: the cell's own baseline where it was recorded on the record's kernels;
  else the one recorded on those kernels (``<root>/kernels/<kernel set>``, written by
  ``--update-kernel-baselines``); else the cell's own; and where the cell has none, one recorded on
  the record's kind of CPU under another kernel condition.
- **load time**: that baseline where it is from the record's kind of CPU (or there is none); else
  the cell's baseline recorded on this kind of CPU under any kernel condition, its own kernels
  first; else that baseline. A load's calibration carries a CPU's speed across its kernel
  conditions, not across CPUs.
- **accuracy**: beside the logprob baseline (a kernel set's where one was recorded), else the cell's own.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from harness import cpu
from harness.accuracy import store as accuracy_store
from harness.baselines import KERNELS_FOLDER, Baseline, cpu_of, cpu_of_record, other_kernels, path_for, read


@dataclass(frozen=True)
class Resolution:
    baseline: Baseline | None  # the logprobs' and the loaded state's
    root: Path  # where ``baseline`` was read (and a baseline of it would be written)
    load_baseline: Baseline | None  # the load time's
    load_root: Path | None  # where ``load_baseline`` was read when it is not ``baseline``
    accuracy: object  # harness.accuracy.store's baseline, or None
    kernels_root: Path | None  # where this record's own kernels' baselines live (None: its CPU unknown)
    # whether ``baseline`` was recorded on the record's kernels (or there is none): then everything
    # against it is judged; elsewhere only what carries (harness.judging)
    on_these_kernels: bool

    def notes(self, root: str | Path, record, gated: bool) -> list[str]:
        """One line for each baseline that is not the cell's own file under ``root`` (the load
        time's where it is ``gated``): which it is."""
        said = []
        if self.root != Path(root):
            whose = "these kernels" if self.on_these_kernels else "this CPU under another kernel condition"
            said.append(f"judged against the baseline of {whose}: {path_for(self.root, record.tier, record.cell)}")
        if self.load_root is not None and gated:
            said.append(f"load time judged against this CPU's under another kernel condition: "
                        f"{path_for(self.load_root, record.tier, record.cell)}")
        return said


def resolve(root: str | Path, record) -> Resolution:
    """The baselines ``record`` is judged against (module docstring). BaselineError where a file
    that would be read cannot be (the runner makes that cell an ``error``)."""
    mine = cpu_of_record(record)
    baseline, read_root = _logprobs(root, record.tier, record.cell, mine)
    load, load_root = _load(root, record.tier, record.cell, mine, baseline)
    accuracy = accuracy_store.read(read_root, record.tier, record.cell) if read_root != Path(root) else None
    return Resolution(baseline, read_root, load, load_root,
                      accuracy or accuracy_store.read(root, record.tier, record.cell), _kernels_root(root, mine),
                      baseline is None or not other_kernels(record, baseline))


def kernels_root(root: str | Path, record) -> Path | None:
    """The root of the baselines recorded on the kernels ``record`` ran on (``<root>/kernels/<kernel
    set>``, harness.cpu.kernel_set), None for a record that does not say its CPU."""
    return _kernels_root(root, cpu_of_record(record))


def load_baseline_here(root: str | Path, tier: str, cell_id: str, description: dict) -> Baseline | None:
    """The baseline whose load time a run of the cell on ``description``'s CPU and kernels
    (harness.cpu.describe) is judged against, as :func:`resolve` chooses it (harness bench)."""
    baseline, _ = _logprobs(root, tier, cell_id, description)
    return _load(root, tier, cell_id, description, baseline)[0]


def loads_of_another_cpu(root: str | Path, cells: Sequence, mine: dict) -> str | None:
    """One line naming the gated ``cells`` whose load time has a baseline only from another kind of
    CPU than ``mine`` (harness.cpu.describe), which vLLM's loads do not carry (docs/design.md,
    "Load-time baselines per kind of CPU"), and how to record this kind's; None where there are none."""
    judged_by = {c.id: load_baseline_here(root, c.tier, c.id, mine) for c in cells}
    foreign = [c for c in cells if judged_by[c.id] is not None and not cpu.same_cpu(mine, cpu_of(judged_by[c.id]))]
    if not foreign:
        return None
    tiers = ",".join(sorted({c.tier for c in foreign}))
    return (f"{len(foreign)} gated cell(s) have no load-time baseline recorded on this kind of CPU ({mine.get('model')}): "
            f"{', '.join(c.id for c in foreign)}; they are judged against another kind's, which vLLM's loads do not "
            f"carry (docs/design.md, \"Load-time baselines per kind of CPU\"): harness run --tier {tiers} "
            "--update-kernel-baselines records this kind's once, and --candidate times a build against the pinned one here")


def _kernels_root(root: str | Path, mine: dict | None) -> Path | None:
    return Path(root, KERNELS_FOLDER, cpu.kernel_set(mine)) if mine else None


def _logprobs(root: str | Path, tier: str, cell_id: str, mine: dict | None) -> tuple[Baseline | None, Path]:
    baseline = read(root, tier, cell_id)
    if baseline is not None and cpu.same_kernels(mine, cpu_of(baseline)):
        return baseline, Path(root)
    kernels = _kernels_root(root, mine)
    on_these = read(kernels, tier, cell_id) if kernels is not None else None
    if on_these is not None:
        return on_these, kernels
    if baseline is not None:
        return baseline, Path(root)
    return _on_this_cpu(root, tier, cell_id, mine) or (None, Path(root))


def _load(root: str | Path, tier: str, cell_id: str, mine: dict | None,
          baseline: Baseline | None) -> tuple[Baseline | None, Path | None]:
    if baseline is None or mine is None or cpu.same_cpu(mine, cpu_of(baseline)):
        return baseline, None
    return _on_this_cpu(root, tier, cell_id, mine) or (baseline, None)


def _on_this_cpu(root: str | Path, tier: str, cell_id: str, mine: dict | None) -> tuple[Baseline, Path] | None:
    """The cell's baseline recorded on ``mine``'s kind of CPU under any kernel condition
    (``<root>/kernels/*``), its own kernels first (harness.cpu.native_first), and its root."""
    folder = Path(root, KERNELS_FOLDER)
    if mine is None or not folder.is_dir():
        return None
    found = []
    for kernels in sorted(p for p in folder.iterdir() if p.is_dir()):
        candidate = read(kernels, tier, cell_id)
        if candidate is not None and cpu.same_cpu(mine, cpu_of(candidate)):
            found.append((cpu.native_first(cpu_of(candidate)), kernels, candidate))
    if not found:
        return None
    _, kernels, candidate = min(found, key=lambda f: f[:2])
    return candidate, kernels
