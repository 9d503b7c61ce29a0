"""The bench's figures as BENCHMARKS.md and JSON, with a pass/miss line per target of issue 13.

``figures`` is the JSON document ``harness bench --json`` prints::

    {"load": [{size, format, checkpoint_mb, floor_s, reference_s, transformers_s,
               reference_forward_s, transformers_forward_s, reference_peak_mb, transformers_peak_mb,
               reference_peak_extra_mb, transformers_peak_extra_mb}],
     "decode": [{format, shape, decode_s, fill_s, ratio, decodes}],
     "detection": {slowdown_10, slowdown_20, slowdown_50, false_alarm, ...},
     "portability": {condition: {environment, runs, complete_runs, false_alarm_runs, improved_runs,
                                 cells: {cell: {reported, children, error, bound, regressed, improved}}}},
     "pairs": {clean | slowdown_20 | <mutation>: {runs, flagged_runs,
                                                  cells: {cell: {bound, ratios, first_ratios, flagged, second_rounds}}},
               predicted_false_alarm: {least, most}, selected, seconds},
     "matrix": {before_s, after_s, before, after},
     "machine": harness.cpu.describe(), "decoders": harness.quant.native.describe(), "cores", "load_repeats",
     "targets": [...], "profiles": {...}, "notes": [...]}

``*_forward_s`` is load plus one forward pass; ``*_peak_mb`` the peak resident set of the load's
child, ``*_library_mb`` the shared libraries' pages the child faulted in after its imports (a
kernel's code on its first call), and ``*_peak_extra_mb`` the peak less the resident set after
the imports and less the library pages (harness.bench.load). A figure not measured is null, with
the reason in ``notes``.
"""
from __future__ import annotations

import json

from harness.bench import candidate
from harness.loadtime import LATER_LOOK_S
from harness.records import allocation_named

LOAD_VS_TRANSFORMERS = 1.5
PEAK_VS_CHECKPOINT = 1.3
PER_GB_SPREAD = 1.2
DECODE_VS_FILL = 3.0
DETECT_AT_20 = 0.95
FALSE_ALARM = 0.01
MATRIX_SPEEDUP = 0.5
PORTABLE_RUNS = 20


def _all(rows, pred) -> bool | None:
    values = [pred(r) for r in rows]
    if not values or any(v is None for v in values):
        return None
    return all(values)


def _rows_detail(rows: list[dict], pred) -> str:
    if not rows:
        return "not measured"
    missed = [f"{r['size']} {r['format']}" for r in rows if not pred(r)]
    return f"missed by {', '.join(missed)}" if missed else "every size and format"


def _by_format(load: list[dict], key: str) -> list[list[tuple[float, float]]]:
    """Per format, (GB, seconds) of every size measured, smallest first."""
    return [sorted((r["checkpoint_mb"] / 1e3, r[key]) for r in load if r["format"] == fmt and r.get(key))
            for fmt in sorted({r["format"] for r in load})]


def _per_gb_spread(load: list[dict], key: str = "reference_s") -> float | None:
    """The largest, over formats, of max/min seconds per GB across sizes (None: < 2 sizes)."""
    spreads = [max(per_gb) / min(per_gb) for points in _by_format(load, key)
               for per_gb in [[s / gb for gb, s in points]] if len(per_gb) >= 2]
    return max(spreads) if spreads else None


def _marginal_spread(load: list[dict], key: str = "reference_s") -> float | None:
    """The largest, over formats, of max/min seconds per added GB from one size to the next (None:
    < 3 sizes; inf where a larger size took no longer). A fixed cost per load cancels out here, so
    this is the linearity of the cost in the bytes, which the total per GB also charges with that
    fixed cost divided by each size."""
    spreads = []
    for points in _by_format(load, key):
        slopes = [(s1 - s0) / (gb1 - gb0) for (gb0, s0), (gb1, s1) in zip(points, points[1:])]
        if len(slopes) >= 2:
            spreads.append(max(slopes) / min(slopes) if min(slopes) > 0 else float("inf"))
    return max(spreads) if spreads else None


def _per_gb_detail(load: list[dict]) -> str:
    """The judged figure and, beside it, the same spread of load+forward and the spreads per added GB."""
    def pair(spread, key: str) -> str:
        ours, theirs = (_num(spread(load, f"{engine}_{key}"), ".2f") for engine in ("reference", "transformers"))
        return f"{ours} (transformers' {theirs})"

    return (f"largest max/min over formats: {pair(_per_gb_spread, 's')}; not judged: load+forward "
            f"{pair(_per_gb_spread, 'forward_s')}; seconds per added GB from size to size, load "
            f"{pair(_marginal_spread, 's')}, load+forward {pair(_marginal_spread, 'forward_s')}")


def targets(fig: dict) -> list[dict]:
    """One entry per target: {target, ok (True / False / None: not measured), detail}."""
    load, decode, det, mx = fig.get("load") or [], fig.get("decode") or [], fig.get("detection") or {}, fig.get("matrix") or {}
    measured = [r for r in load if r.get("reference_s") is not None and r.get("transformers_s") is not None]
    spread = _per_gb_spread(load)
    per_row = (
        ("1a load+forward <= transformers' load+forward",
         lambda r: r["reference_forward_s"] <= r["transformers_forward_s"]),
        (f"1b load <= {LOAD_VS_TRANSFORMERS}x transformers' load",
         lambda r: r["reference_s"] <= LOAD_VS_TRANSFORMERS * r["transformers_s"]),
        (f"1c peak extra memory <= {PEAK_VS_CHECKPOINT}x checkpoint",
         lambda r: r["reference_peak_extra_mb"] <= PEAK_VS_CHECKPOINT * r["checkpoint_mb"]),
    )
    out = [
        *((name, _all(measured, pred), _rows_detail(measured, pred)) for name, pred in per_row),
        (f"1d time per GB constant within {round(100 * (PER_GB_SPREAD - 1))}% across sizes",
         None if spread is None else spread <= PER_GB_SPREAD,
         "not measured (one size)" if spread is None else _per_gb_detail(load)),
        (f"2 decode within {DECODE_VS_FILL:g}x of fill",
         _all(decoded(decode), lambda r: r["ratio"] <= DECODE_VS_FILL), _decode_detail(decode)),
        (f"3 detection >= {100 * DETECT_AT_20:g}% at 20%, false alarms < {100 * FALSE_ALARM:g}%",
         None if det.get("slowdown_20") is None or det.get("false_alarm") is None
         else det["slowdown_20"] >= DETECT_AT_20 and _false_alarm_ok(det),
         _detection_detail(det)),
        (f"4 matrix after <= {MATRIX_SPEEDUP}x before", _matrix_ok(mx), _matrix_detail(mx)),
        (f"5 stored cpu-load baselines: no false alarm in >= {PORTABLE_RUNS} clean runs under each kernel condition",
         _portability_ok(fig.get("portability")), _portability_detail(fig.get("portability"))),
        (f"6 a candidate build's load against the pinned build's, pair by pair: >= {100 * DETECT_AT_20:g}% caught at 20%, "
         f"false alarms < {100 * FALSE_ALARM:g}%", _pairs_ok(fig.get("pairs")), _pairs_detail(fig.get("pairs"))),
        (f"7 a pull-request check (harness run --candidate) <= {candidate.WALL_RATIO_TARGET}x the plain run's wall time",
         candidate.met(fig.get("candidate")), candidate.detail(fig.get("candidate"))),
    ]
    return [{"target": t, "ok": ok, "detail": d} for t, ok, d in out]


def decoded(rows: list[dict]) -> list[dict]:
    """The decode rows target 2 judges: dequantizations (not the unquantized copy, a comparison)."""
    return [r for r in rows if r.get("decodes", True)]


def _decode_detail(decode: list[dict]) -> str:
    judged = decoded(decode)
    if not judged:
        return "not measured"
    worst = max(judged, key=lambda r: r["ratio"])
    copies = "".join(f"; not judged: the {r['format']} copy {r['ratio']:.2f}" for r in decode if r not in judged)
    return f"worst ratio {worst['ratio']:.2f} ({worst['format']}){copies}"


def _matrix_measured(mx: dict) -> bool:
    """Both sides timed on the whole default run (a -k reduced check is not the target's figure)."""
    return mx.get("before_s") is not None and mx.get("after_s") is not None and not mx.get("select")


def _matrix_ok(mx: dict) -> bool | None:
    return mx["after_s"] <= MATRIX_SPEEDUP * mx["before_s"] if _matrix_measured(mx) else None


def _matrix_detail(mx: dict) -> str:
    if mx.get("before_s") is None:
        return "not measured"
    text = f"{mx['after_s']:.0f} s vs {mx['before_s']:.0f} s ({mx['after_s'] / mx['before_s']:.2f}x)"
    return text + (f"; only -k {mx['select']!r}: not judged" if mx.get("select") else "")


def _uncalibrated_lines(det: dict) -> list[str]:
    """The same held-out children judged on the load seconds alone, beside the calibrated rule."""
    plain = det.get("uncalibrated")
    if not plain:
        return []

    def rates(d: dict) -> str:
        later = d.get("later_look") or {}
        return (f"20% slowdowns flagged {_num((d.get('rates') or d).get('slowdown_20'), '.0%')} "
                f"(with the later look {_num(later.get('slowdown_20'), '.0%')}), clean runs with a false alarm "
                f"{d['false_alarm_runs']} of {det['clean_runs']} (with the later look "
                f"{_num(later.get('false_alarm'), '.1%')}; modelled {d['predicted_false_alarm']:.2g} per run)")

    return ["", "Without the calibration (the load seconds alone, a rule chosen the same way on the same choice "
                f"runs and judged on the same held-out children): {plain['rule']}. Calibrated: {rates(det)}; "
                f"uncalibrated: {rates(plain)}.", ""]


def _false_alarm_ok(det: dict) -> bool:
    """Observed false alarms < 1% of clean runs, and, where the runs are too few to show it
    (fewer than 100), the normal model's predicted rate too."""
    if det["false_alarm"] >= FALSE_ALARM:
        return False
    predicted = det.get("predicted_false_alarm")  # 0.0 where the model's tail underflows: a pass
    return det.get("clean_runs", 0) >= 1 / FALSE_ALARM or (predicted is not None and predicted < FALSE_ALARM)


def _detection_detail(det: dict) -> str:
    if det.get("slowdown_20") is None:
        return "not measured"
    return (f"at 20%: {100 * det['slowdown_20']:.0f}% of {det['slowed_runs']['slowdown_20']} runs "
            f"({100 * det['cell_rates']['slowdown_20']:.0f}% of {det['slowed_cell_runs']['slowdown_20']} cell-runs); false alarms: "
            f"{det['false_alarm_runs']} of {det['clean_runs']} runs ({det['clean_cell_false_alarms']} of "
            f"{det['clean_cell_runs']} cell-runs), model-predicted {100 * det['predicted_false_alarm']:.2g}% per run")


def _portability_ok(port: dict | None) -> bool | None:
    """Every condition ran its runs on every cell it could time, with the gate's later look, under
    the memory allocation its baselines were timed under, and no false alarm; None where nothing was
    measured. A cell that cannot load under a condition, or has no stored baseline, is reported, not
    judged."""
    if not port:
        return None
    return all(c["complete_runs"] >= PORTABLE_RUNS and c["false_alarm_runs"] == 0 and _gates_later_look(c)
               and not c.get("other_allocation") for c in port.values())


def _gates_later_look(condition: dict) -> bool:
    """Whether a condition's runs looked again as the gate does (loadtime.LATER_LOOK_S; a report
    written before the bench could shorten it did)."""
    return condition.get("later_look_s", LATER_LOOK_S) >= LATER_LOOK_S


def _portability_detail(port: dict | None) -> str:
    if not port:
        return "not measured"
    parts = []
    for name, c in port.items():
        errors = [cell for cell, v in c["cells"].items() if v["error"]]
        parts.append(f"{name}: {c['false_alarm_runs']} of {c['complete_runs']} runs with a false alarm"
                     + (f", {len(errors)} cell(s) not timed" if errors else "")
                     + ("" if _gates_later_look(c) else f", later look {c['later_look_s']:g} s, not the gate's")
                     + (f", timed under {allocation_named(c['allocation'])}, not the memory allocation of "
                        f"{len(c['other_allocation'])} cell(s)' baselines" if c.get("other_allocation") else ""))
    return "; ".join(parts)


def _portability_lines(port: dict | None) -> list[str]:
    if not port:
        return ["not measured"]
    lines = ["Clean runs of the gate against the stored baselines, under each kernel condition this machine "
             "can set (harness.bench.portability): per cell, the calibrated ratio each run reports (its fastest "
             "child, as the runner reports it, its later look's among them) against the bound; `later`: the runs "
             "it was over in every child of its first look and looked at again.", "",
             "| condition | cell | runs | ratio: min | median | max | bound | later | regressed | improved |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, c in port.items():
        for cell, v in c["cells"].items():
            if v["error"]:
                lines.append(f"| {name} | {cell} | 0 | {v['error'][:120]} | | | {v['bound']:.3f} | | | |")
                continue
            lines.append(f"| {name} | {cell} | {_spread(v['reported'])} | {v['bound']:.3f} | {v['later_looks']} | "
                         f"{v['regressed']} | {v['improved']} |")
    lines += ["", "; ".join(f"{name}: {c['false_alarm_runs']} of {c['complete_runs']} runs with a false alarm, "
                            f"{c['improved_runs']} reading improved" for name, c in port.items()) + "."]
    return lines


def _pairs_ok(pairs: dict | None) -> bool | None:
    """Runs slowed by 20% caught in >= 95%; clean runs flagged in < 1%, by count over 100 runs or
    more, else by the normal model's upper end too (harness.bench.pairs)."""
    if not pairs or "slowdown_20" not in pairs or not pairs["clean"]["runs"]:
        return None
    clean, slowed = pairs["clean"], pairs["slowdown_20"]
    if slowed["flagged_runs"] < DETECT_AT_20 * slowed["runs"] or clean["flagged_runs"] >= FALSE_ALARM * clean["runs"]:
        return False
    predicted = pairs.get("predicted_false_alarm")
    return clean["runs"] >= 1 / FALSE_ALARM or (predicted is not None and predicted["most"] < FALSE_ALARM)


def _pairs_detail(pairs: dict | None) -> str:
    if not pairs:
        return "not measured"
    said = [f"{key}: {v['flagged_runs']} of {v['runs']} runs flagged" for key, v in pairs.items() if isinstance(v, dict) and "runs" in v]
    predicted = pairs.get("predicted_false_alarm")
    if predicted is not None:
        said.append(f"clean, model-predicted {100 * predicted['least']:.2g}-{100 * predicted['most']:.2g}% per run "
                    "(confirming rounds independent - every one over)")
    return "; ".join(said)


def _pairs_lines(pairs: dict | None) -> list[str]:
    if not pairs:
        return ["not measured"]
    lines = ["A candidate build against the pinned build in the same run (harness.bench.pairs): per cell and "
             "change, the ratio of the candidate's median load child over the base's in a round of "
             "`loadtime.CANDIDATE_PAIRS` pairs of fresh children, each build first as often, uncalibrated, as the "
             "gate decides it (a round outside the bound confirmed by a second, the one nearer 1 reported; `2nd "
             "rounds`: how many). No baseline is stored or read.", "",
             "| candidate | cell | runs | ratio: min | median | max | bound | 2nd rounds | flagged |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, v in pairs.items():
        if not isinstance(v, dict) or "cells" not in v:
            continue
        for cell, c in v["cells"].items():
            lines.append(f"| {key} | {cell} | {_spread(c['ratios'])} | {c['bound']:.3f} | "
                         f"{c.get('second_rounds', 0)} | {c['flagged']} |")
    lines += ["", _pairs_detail(pairs) + f" ({pairs.get('seconds', 0):.0f} s)."]
    return lines


def _mark(ok: bool | None) -> str:
    return "not measured" if ok is None else "pass" if ok else "MISS"


def _num(x, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _spread(ratios) -> str:
    """``runs | min | median | max`` table cells of a list of ratios (the lower median of an even count)."""
    r = sorted(ratios)
    if not r:
        return "0 | - | - | -"
    return f"{len(r)} | {_num(r[0])} | {_num(r[(len(r) - 1) // 2])} | {_num(r[-1])}"


def _children(repeats: int) -> str:
    return "" if repeats == 1 else f" (of {repeats} such children per engine and checkpoint, the one of median load time)"


def _load_table(load: list[dict]) -> list[str]:
    lines = ["| size | format | checkpoint MB | floor s | reference s | transformers s | reference load+forward s | "
             "transformers load+forward s | reference peak extra MB | transformers peak extra MB | "
             "library pages MB (reference / transformers) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in load:
        lines.append(f"| {r['size']} | {r['format']} | {r['checkpoint_mb']:.0f} | {_num(r['floor_s'])} | "
                     f"{_num(r['reference_s'])} | {_num(r['transformers_s'])} | {_num(r['reference_forward_s'])} | "
                     f"{_num(r['transformers_forward_s'])} | {_num(r['reference_peak_extra_mb'], '.0f')} | "
                     f"{_num(r['transformers_peak_extra_mb'], '.0f')} | {_num(r.get('reference_library_mb'), '.0f')} / "
                     f"{_num(r.get('transformers_library_mb'), '.0f')} |")
    return lines


def _decode_table(decode: list[dict]) -> list[str]:
    lines = ["| format | weight | decode ms | fill ms | decode / fill |", "|---|---|---:|---:|---:|"]
    for r in decode:
        what = r["format"] if r.get("decodes", True) else f"{r['format']} (a copy: not judged)"
        lines.append(f"| {what} | {'x'.join(map(str, r['shape']))} | {1e3 * r['decode_s']:.2f} | "
                     f"{1e3 * r['fill_s']:.2f} | {r['ratio']:.2f} |")
    return lines


def _detection_lines(det: dict) -> list[str]:
    if not det:
        return ["not measured"]
    lines = [f"Rule: {det['rule']}. To apply it: `LOAD_REPEATS = {det['repeats']}`, `STATISTIC = "
             f"\"{det['statistic']}\"` and `CONFIRMATIONS = {det['confirmations']}` in harness/loadtime.py, "
             f"`bounds: {{load_time: {det['threshold']:.3f}}}` on the cpu-load models in models.yaml.", "",
             "A run is one cell-run of every cell of the set: a child, and while the last is over the threshold "
             "the confirmations; the slowdown slows the cells of the engines with a slowdown hook (the reference's "
             "reading, vLLM's weight copies). A run is flagged when any of its cells is. The baseline is each cell's "
             "median child of the first choice runs." + (f" Cells: {', '.join(det['cell_ids'])}." if det.get("selected") else ""), "",
             "| slowdown injected (nominal) | measured (against the clean held-out runs) | runs | runs flagged | cell-runs | cell-runs flagged |",
             "|---:|---:|---:|---:|---:|---:|"]
    for key in ("slowdown_10", "slowdown_20", "slowdown_50"):
        lines.append(f"| {key.split('_')[1]}% | {_num(det['injected'].get(key), '+.1%')} | "
                     f"{det['slowed_runs'].get(key, 0)} | {_num(det.get(key), '.0%')} | "
                     f"{det['slowed_cell_runs'].get(key, 0)} | {_num(det['cell_rates'].get(key), '.0%')} |")
    if det.get("clean_level"):
        lines += ["", "Per cell: where the clean held-out runs sat against the baseline (the drift the gate bears), "
                      "and the slowdown injected at each nominal one: " + "; ".join(
                          f"{cell} {level:.3f}" + "".join(
                              f", {key.split('_')[1]}% {_num(det['injected_by_cell'].get(key, {}).get(cell), '+.1%')}"
                              for key in sorted(det.get("injected_by_cell", {}), key=lambda k: int(k.split('_')[1])))
                          for cell, level in sorted(det["clean_level"].items())) + "."]
    lines += ["", f"Clean held-out runs: {det['clean_runs']} (of {det['cells']} cells each), "
                  f"{det['false_alarm_runs']} with a false alarm ({_num(det['false_alarm'], '.1%')}); "
                  f"{det['clean_cell_false_alarms']} of {det['clean_cell_runs']} clean cell-runs flagged; the normal "
                  f"model of their spread predicts {det['predicted_false_alarm']:.2g} false alarms per run. "
                  f"Confirmation children timed over all held-out runs: {det['confirmation_children']}.",
              *([f"With the gate's later look (a flagged cell-run flags only when the same cell's cell-run half "
                 f"the held-out phase later does too): runs slowed by 20% flagged "
                 f"{_num(det['later_look'].get('slowdown_20'), '.0%')}, clean runs with a false alarm "
                 f"{_num(det['later_look'].get('false_alarm'), '.1%')}."] if det.get("later_look") else []),
              *_uncalibrated_lines(det),
              f"Detection took {det['seconds']:.0f} s.", ""]
    if det.get("mutations"):
        lines += ["Load-time bugs re-introduced into an engine (test-only mutations, timed in the held-out runs):", "",
                  "| mutation | cells | calibrated ratio to the baseline (median) | cell-runs | flagged |", "|---|---|---:|---:|---:|"]
        lines += [f"| {name} | {', '.join(m['cells'])} | {_num(m['ratio'], '.2f')} | {m['cell_runs']} | "
                  f"{_num(m['flagged'], '.0%')} |" for name, m in det["mutations"].items()]
        lines.append("")
    lines += ["Candidates (chosen on the clean choice runs):", "",
              "| loads | statistic | confirmations | spread | threshold | modelled 20% detection | "
              "modelled false alarms per run |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {c['repeats']} | {c['statistic']} | {c['confirmations']} | {100 * c['spread']:.1f}% | "
              f"{c['threshold']:.3f} | {_num(c['modelled_20'], '.2%')} | {_num(c.get('modelled_false_alarm'), '.2g')} |"
              for c in det["candidates"]]
    return lines


def markdown(fig: dict) -> str:
    m = fig.get("machine") or {}
    lines = ["# Benchmarks", "",
             "Written by `harness bench` (README, \"Benchmarks\"); one run. Timings on a shared or busy machine are "
             "noisy: compare the ratios within this run, not the seconds across runs.", "",
             f"Machine: {m.get('model', '?')}; {fig.get('cores', '?')} cores; kernels {', '.join(m.get('flags') or []) or '-'}"
             f"; torch CPU capability {m.get('capability') or '-'}; the reference's decoders: "
             f"{fig.get('decoders') or '-'}.", "",
             "## Targets (issues 13, 31 and 59)", ""]
    lines += [f"- **{_mark(t['ok'])}**: {t['target']} ({t['detail']})" for t in fig.get("targets") or []]
    lines += ["", "## Load", "", "`floor s`: reading the checkpoint's weight files from the page cache into one "
              "preallocated buffer (no loader reads its bytes faster). Load: the engine's load plus touching every "
              f"parameter and buffer, in a fresh child process{_children(fig.get('load_repeats') or 1)}, imports "
              "excluded (the reference's quantized weights stay stored and are first read by the forward pass: "
              "compare load+forward); peak extra: peak RSS less the RSS after imports, less the shared libraries' "
              "pages faulted in after them (a kernel's code is paged in on its first call, like an import; the last "
              "column: add it back for the raw figure).", ""]
    lines += _load_table(fig.get("load") or []) if fig.get("load") else ["not measured"]
    lines += ["", "## Decode", ""] + (_decode_table(fig["decode"]) if fig.get("decode") else ["not measured"])
    lines += ["", "## Load-time detection (cpu-load)", ""] + _detection_lines(fig.get("detection") or {})
    lines += ["", "## Stored load-time baselines across kernel conditions (cpu-load)", ""]
    lines += _portability_lines(fig.get("portability"))
    lines += ["", "## A candidate build's load-time gate, pair by pair (cpu-load)", ""]
    lines += _pairs_lines(fig.get("pairs"))
    lines += ["", "## A pull-request check: a candidate run beside a plain one", ""]
    lines += candidate.lines(fig.get("candidate"))
    mx = fig.get("matrix") or {}
    lines += ["", "## Matrix (`harness run`, cpu-tiny, default options)", ""]
    lines += ([f"Before ({mx['before']}): {mx['before_s']:.0f} s. After ({mx['after']}): {mx['after_s']:.0f} s."]
              if mx.get("before_s") is not None else ["not measured"])
    for name, text in (fig.get("profiles") or {}).items():
        lines += ["", f"## Where the time goes: {name}", "", "```", text.rstrip(), "```"]
    if fig.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in fig["notes"]]
    return "\n".join(lines) + "\n"


def to_json(fig: dict) -> str:
    return json.dumps(fig, indent=1, default=str)


BY_HAND = "## Measured by hand"


def kept_by_hand(old: str) -> str:
    """The hand-written section at the end of the old BENCHMARKS.md (from ``BY_HAND`` on, with the
    rule just above it), which a bench run keeps: the figures it does not measure itself."""
    start = old.find("\n" + BY_HAND)
    if start < 0:
        return ""
    rule = old.rfind("\n---\n", 0, start + 1)
    begin = rule + 1 if rule >= 0 and not old[rule + 5:start].strip() else start + 1
    return "\n" + old[begin:].rstrip("\n") + "\n"
