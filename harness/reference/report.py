"""The load report: what the reference loader found on disk and what it made of it."""
import json
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class FusedGroup:
    parent: str  # in-memory FQN of the module holding the shards, e.g. model.layers.0.self_attn
    kind: str  # qkv, cross-q, cross-kv, gate-up
    shards: list[str]  # in-memory FQNs, in fused order
    fused: bool
    reason: str = ""  # why the group stays unfused; empty when fused
    # How a fused group holds its weights; either way each shard keeps its own stored weight and
    # runs its own matmul where the model calls it, nothing is copied, and the fused projection,
    # where called as one (cross-attention kv), joins them. "requantized": per-tensor FP8 shards
    # read at the group's max scale (their codes remapped, fp8.requantize_fused), which changes
    # their numbers; "per-shard": the shards' numbers as they are. Empty when unfused.
    layout: str = ""


@dataclass
class Disagreement:
    """One disagreement in the load report: the config against the disk ("config-vs-disk"), or a
    skip entry's dialect against its evident intent ("<dialect>:<kind>", from an
    ``harness.dialects.EntryDisagreement``)."""

    module: str
    source: str  # "config-vs-disk" or "<dialect>:<kind>"
    detail: str

    @classmethod
    def from_entry(cls, d) -> "Disagreement":
        """The report's record of an ``EntryDisagreement`` (harness.dialects.intent)."""
        return cls(d.module or "-", f"{d.dialect}:{d.kind}", f"entry {d.entry!r}: {d.explanation}")


# How the loader holds a linear's weight (LoadReport.storage).
STORAGE = {
    "mapped": "float32 on disk: a view of the memory-mapped file, never copied",
    "in-memory": "a float32 tensor in memory: widened from half precision, quantized online, or read from a .bin",
    "stored": "quantized, kept as stored (memory-mapped where the file allows), dequantized on every call",
    "requantized": "per-tensor FP8 kept as stored, read at its fused group's max scale, dequantized on every call",
}


@dataclass
class LoadReport:
    path: str
    architecture: str
    quant_method: str | None
    modules: dict[str, str] = field(default_factory=dict)  # in-memory FQN -> label
    groups: list[FusedGroup] = field(default_factory=list)
    kv_scales: dict[str, dict[str, float]] = field(default_factory=dict)  # attention FQN -> {k_scale, v_scale}
    kv_fake_quant: bool = False
    disagreements: list[Disagreement] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    storage: dict[str, str] = field(default_factory=dict)  # in-memory FQN -> how its weight is held (STORAGE)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def summary(self) -> str:
        """A human-readable report for `harness load`."""
        lines = [
            f"{self.path}: {self.architecture}, quant_method={self.quant_method or 'none'}",
            "labels: " + ", ".join(f"{label}={n}" for label, n in sorted(Counter(self.modules.values()).items())),
            "weights: " + ", ".join(f"{how}={n}" for how, n in sorted(Counter(self.storage.values()).items())),
        ]
        fused = [g for g in self.groups if g.fused]
        layouts = Counter(g.layout for g in fused)
        lines.append(f"fused groups: {len(fused)} of {len(self.groups)}"
                     + (f" ({', '.join(f'{k}={n}' for k, n in layouts.items())})" if layouts else ""))
        if layouts:
            lines.append("  each fused shard keeps its own stored weight and matmul; nothing copied"
                         + ("; requantized: per-tensor FP8 at the group's max scale" if "requantized" in layouts else ""))
        for group in self.groups:
            if not group.fused:
                lines.append(f"  unfused {group.parent} {group.kind}: {group.reason}")
        if self.kv_scales:
            lines.append(f"kv-cache scales: {len(self.kv_scales)} attention modules"
                         f" (fake quantization {'on' if self.kv_fake_quant else 'off'})")
        by_entry: dict[tuple[str, str], list[Disagreement]] = {}
        for d in self.disagreements:
            by_entry.setdefault((d.source, d.detail.split(":", 1)[0]), []).append(d)
        for (source, _), found in by_entry.items():
            more = f" (and {len(found) - 1} more modules)" if len(found) > 1 else ""
            lines.append(f"disagreement [{source}] {found[0].module}: {found[0].detail}{more}")
        for note in self.notes:
            lines.append(f"note: {note}")
        lines.append("timings: " + ", ".join(f"{k}={v * 1000:.1f}ms" for k, v in self.timings.items()))
        return "\n".join(lines)
