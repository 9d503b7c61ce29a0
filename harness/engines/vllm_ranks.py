"""Tensor-parallel ranks (docs/design.md, "Configurations"): the readings taken in each of vLLM's
rank workers, reassembled into what one rank would hold, so that a tensor-parallel cell's module
read and loaded state compare with the one-rank cell's as they are.

Each worker reads its own part (the capture reaches it through vLLM's worker extension,
harness.engines._vllm_rank_capture; ``LLM.apply_model`` returns one reading per rank, in rank
order) and says how it holds it (harness.engines.vllm_worker.tp_layout). The parts are put back
together by that layout, module by module:

- **column-parallel** (q/k/v, gate/up, Whisper's cross-attention k/v): each shard's weight, bias
  and per-row scales by output rows, rank after rank; a KV head held by several ranks
  (``kv_replicas``) once, from the first rank holding it;
- **row-parallel** (o_proj, down_proj): weights by input columns; the bias and scales, which
  every rank holds whole, once;
- **vocabulary-parallel** (embeddings, LM head): each rank's rows of the original vocabulary, then
  the added rows, without the padding;
- **replicated** (norms, convolutions, attention scales): once; an attention layer's head counts
  are per rank and are summed (KV heads counted once).

Whatever every rank should hold whole and the ranks hold differently is not chosen between: the
reassembled entry keeps every rank's value, so the loaded state differs from one rank's there, and
the module reader names the rank.
"""
from __future__ import annotations

from typing import Any

from harness import loaded_state as state
from harness.engines import vllm_worker

WORKER_EXTENSION = "harness.engines._vllm_rank_capture.RankCapture"
_KV_SHARDS = ("k_proj", "v_proj")  # the shards of a QKV module that hold KV heads


def gather_modules(readings: list[dict]) -> dict:
    """The module reads of every rank (vllm_worker.read_modules, in rank order) as one rank's:
    each shard's effective weight reassembled, with the rows or columns each rank held
    (``spans``: [rank, start, end] along ``span_dim``) for the module diff to name the rank."""
    first = readings[0]
    modules = {}
    for name, entry in first["modules"].items():
        parts = [r["modules"][name] for r in readings]
        shards = [_gather_shard([p["shards"][i] for p in parts], entry) for i in range(len(entry["shards"]))]
        modules[name] = {**entry, "shards": shards}
    return {"modules": modules, "packed": first["packed"], "rank": 0, "size": len(readings)}


def _gather_shard(pieces: list[dict], entry: dict) -> dict:
    out = dict(pieces[0])
    weight, spans = _joined_weights([p["weight"] for p in pieces], entry, out["shard"])
    bias = _joined_biases([p["bias"] for p in pieces], entry, out["shard"])
    for what, held in (("weights", weight), ("biases", bias)):
        if isinstance(held, dict):
            out["note"] = f"the ranks hold different {what} ({', '.join(held)}), where each should hold them whole"
    out["weight"] = None if isinstance(weight, dict) else weight
    out["bias"] = bias["rank 0"] if isinstance(bias, dict) else bias
    if spans:
        out["span_dim"], out["spans"] = 1 if entry["parallel"] == "row" else 0, spans
    return out


def _joined_weights(weights: list, layout: dict, shard: str):
    """One shard's weight from every rank's part (:func:`_once` where the module is replicated or
    a part is missing), and the ``[rank, start, end]`` each rank's part spans."""
    import torch

    kind = layout["parallel"]
    if kind == "replicated" or any(w is None for w in weights):
        return _once(weights), []
    if kind == "vocab":
        weights = [_vocab_rows(w, layout["vocab"]) for w in weights]
    dim = 1 if kind == "row" else 0
    kept = _distinct_kv(list(range(len(weights))), layout, shard)
    bounds = [0]
    for r in kept:
        bounds.append(bounds[-1] + weights[r].shape[dim])
    return torch.cat([weights[r] for r in kept], dim=dim), [[r, bounds[i], bounds[i + 1]] for i, r in enumerate(kept)]


def _joined_biases(biases: list, layout: dict, shard: str):
    """One shard's bias from every rank's: by output rows on a column-parallel module, else what
    every rank holds whole (a row-parallel bias is added once, after the reduction)."""
    import torch

    if layout["parallel"] not in ("column", "vocab") or any(b is None for b in biases):
        return _once(biases)
    return torch.cat([biases[r] for r in _distinct_kv(list(range(len(biases))), layout, shard)], dim=0)


def _distinct_kv(ranks: list[int], entry: dict, shard: str) -> list[int]:
    """The ranks whose part of a shard is distinct: a KV head held by ``kv_replicas`` ranks is
    taken from the first of them."""
    replicas = entry.get("kv_replicas") or 1
    if replicas > 1 and shard in _KV_SHARDS:
        return ranks[::replicas]
    return ranks


def _vocab_rows(t, vocab):
    """A vocabulary-parallel part's rows of the original vocabulary and its added rows (its
    padding left out); ``vocab`` as vllm_worker.tp_layout gives it."""
    if vocab is None:
        return t
    import torch

    org, org_padded, added = vocab
    return torch.cat([t[:org], t[org_padded:org_padded + added]]) if added else t[:org]


def _like(part, whole):
    """``whole`` of the kind ``part`` is (a parameter, or a plain tensor), as the loaded-state
    digest names a tensor's kind."""
    import torch

    return torch.nn.Parameter(whole, requires_grad=False) if isinstance(part, torch.nn.Parameter) else whole


def _once(values: list):
    """What every rank holds whole: the value, once; every rank's, by rank, where they differ."""
    first = values[0]
    if all(_equal(v, first) for v in values[1:]):
        return first
    return {f"rank {r}": v for r, v in enumerate(values)}


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


# ------------------------------------------------------------------------------ the loaded state


def gather_state(helds: list) -> dict[str, str] | str:
    """The loaded-state digest (harness.engines.vllm_state) of the model the ranks hold together:
    each rank's entries (vllm_state.rank_state, in rank order) reassembled module by module, then
    digested as one rank's are. Where a rank took none, why (a string)."""
    for r, held in enumerate(helds):
        if not isinstance(held, dict):
            return f"rank {r}: {held or 'vLLM model loading did not run through the harness'}"
    first = helds[0]["modules"]
    # every QKV module of a model replicates its KV heads alike; its attention layers count them so
    kv_replicas = max((m["kv_replicas"] for m in first.values()), default=1)
    out = {}
    for name, layout in first.items():
        parts = [h["modules"][name]["entries"] for h in helds]
        out[name] = state.digest_entries(_gather_entries(parts, layout, kv_replicas))
    return out


def _gather_entries(parts: list[dict[str, Any]], layout: dict, kv_replicas: int) -> dict[str, Any]:
    kind = layout["parallel"]
    if "shards" in parts[0] and kind in ("column", "row", "vocab"):
        return _gather_linear(parts, layout)
    if kind == "vocab":
        import torch

        return {k: (_like(parts[0][k], torch.cat([_vocab_rows(p[k], layout["vocab"]) for p in parts]))
                    if k == "weight" else _once([p[k] for p in parts])) for k in parts[0]}
    merged = {k: _once([p[k] for p in parts]) for k in parts[0]}
    for heads in ("num_heads", "num_kv_heads"):
        if heads in parts[0] and isinstance(parts[0][heads], int):
            merged[heads] = sum(p[heads] for p in parts) // (kv_replicas if heads == "num_kv_heads" else 1)
    return merged


def _gather_linear(parts: list[dict[str, Any]], layout: dict) -> dict[str, Any]:
    """A linear's entries (vllm_state.linear_state) of every rank as one rank's."""
    import torch

    kind = layout["parallel"]
    first = parts[0]
    out = {k: _once([p[k] for p in parts]) for k in first if k not in ("shards", "layout", "weight_scale")}
    names, sizes = first["layout"]["shards"], first["layout"]["sizes"]
    out["layout"] = {"shards": names, "sizes": sizes if kind == "row" or None in sizes else
                     [sum(p["layout"]["sizes"][i] for p in parts) // _replicas(layout, n) for i, n in enumerate(names)]}
    out["shards"] = []
    for i, shard in enumerate(first["shards"]):
        pieces = [p["shards"][i] for p in parts]
        merged = {k: _once([q[k] for q in pieces]) for k in shard if k not in ("weight", "bias")}
        merged["weight"] = _joined_weights([q["weight"] for q in pieces], layout, shard["shard"])[0]
        merged["bias"] = _joined_biases([q["bias"] for q in pieces], layout, shard["shard"])
        out["shards"].append(merged)
    out["weight_scale"] = _gather_scale([p.get("weight_scale") for p in parts], kind, parts, layout)
    return out


def _replicas(layout: dict, shard: str) -> int:
    return (layout.get("kv_replicas") or 1) if shard in _KV_SHARDS else 1


def _gather_scale(scales: list, kind: str, parts: list[dict], layout: dict):
    """A linear's weight scale: per output row on a column-parallel linear (one per row this rank
    holds, its shards one after the other), put back shard by shard, rank after rank; else what
    every rank holds whole."""
    import torch

    sizes = [p["layout"]["sizes"] for p in parts]
    per_row = all(isinstance(s, torch.Tensor) and None not in z and s.numel() == sum(z) > 1 for s, z in zip(scales, sizes))
    if kind != "column" or not per_row:
        return _once(scales)
    names = parts[0]["layout"]["shards"]
    split = [list(torch.split(s.reshape(sum(z), -1), z)) for s, z in zip(scales, sizes)]
    pieces = [split[r][i] for i, n in enumerate(names) for r in _distinct_kv(list(range(len(parts))), layout, n)]
    return torch.cat(pieces).reshape(-1, *scales[0].shape[1:])


def rank_timings(model) -> dict[str, Any]:
    """The ``LLM.apply_model`` function for a rank's load timing and timing log lines
    (vllm_worker.TIMINGS, vllm_worker.LOG), which live in the rank's worker process."""
    return {"timings": dict(vllm_worker.TIMINGS), "log": dict(vllm_worker.LOG.values), "lines": list(vllm_worker.LOG.lines)}
