"""The vLLM engine's module conformance check: the modules vLLM loaded (read inside vLLM by
harness.engines.vllm_worker.read_modules) diffed against the reference model's, module by module:
labels first, then effective weights and biases bit for bit, with the first differing module and
one line per differing module as the result (harness.engines.vllm runs it right after the load)."""
from __future__ import annotations

from harness import records as R
from harness.dialects.names import to_vllm


def _fmt(x: float) -> str:
    return f"{x:.6g}"


def _weight_detail(v, r) -> str | None:
    """None when equal (bit for bit, NaN equal to NaN), else what differs."""
    import torch

    if tuple(v.shape) != tuple(r.shape):
        return f"shape {tuple(v.shape)} in vLLM, {tuple(r.shape)} in the reference"
    if torch.equal(v, r):
        return None
    both_nan = torch.isnan(v) & torch.isnan(r)
    differ = (v != r) & ~both_nan
    n = int(differ.sum())
    if n == 0:
        return None
    delta = (v - r).abs().masked_fill(~differ, 0).nan_to_num(nan=float("inf"))
    flat = int(delta.reshape(-1).argmax())
    idx = tuple(int(i) for i in __import__("numpy").unravel_index(flat, tuple(v.shape)))
    return (f"{n} of {v.numel()} weight elements differ, max |Δ| {_fmt(float(delta.reshape(-1)[flat]))} at "
            f"{list(idx)} (vLLM {_fmt(float(v[idx]))}, reference {_fmt(float(r[idx]))})")


def _bias_detail(vb, rb, n_out: int) -> str | None:
    """None when the biases are equal; a missing bias equals zeros, as vLLM pads fused biases."""
    import torch

    if vb is None and rb is None:
        return None
    vb = torch.zeros(n_out) if vb is None else vb[:n_out]
    rb = torch.zeros(n_out) if rb is None else rb.detach()
    if vb.dtype != torch.float32:
        rb = rb.to(vb.dtype)
    bd = _weight_detail(vb.float(), rb.float())
    return None if bd is None else "bias: " + bd.replace("weight elements", "bias elements")


def _effective_weight_detail(shard: dict, ref_module, vname: str) -> str | None:
    """None when the shard's weight and bias equal the reference module's by compare_modules'
    exactness rule, else what differs (the weight first)."""
    import torch

    v = shard["weight"]
    r = ref_module.weight.detach()
    if shard["label"] == "unquantized" and v.dtype != torch.float32:
        r = r.to(v.dtype)
    v, r = v.float(), r.float()
    if v.shape[0] > r.shape[0] and v.shape[1:] == r.shape[1:] and vname.rsplit(".", 1)[-1] in ("lm_head", "proj_out"):
        v = v[: r.shape[0]]  # vocabulary padding
    wd = _weight_detail(v, r)
    if wd is not None:
        return wd + _rank_of_first_difference(shard, v, r)
    return _bias_detail(shard.get("bias"), getattr(ref_module, "bias", None), r.shape[0])


def _rank_of_first_difference(shard: dict, v, r) -> str:
    """For a shard reassembled from tensor-parallel ranks (harness.engines.vllm_ranks, its
    ``spans``), the rank whose rows or columns hold the first element that differs."""
    spans = shard.get("spans")
    if not spans or v.shape != r.shape:
        return ""
    dim = shard["span_dim"]
    where = int(((v != r) & ~(v.isnan() & r.isnan())).nonzero()[0][dim])
    rank, start, end = next(s for s in spans if s[1] <= where < s[2])
    return f"; first in rank {rank}'s part ({'rows' if dim == 0 else 'columns'} {start}-{end - 1} of {v.shape[dim]})"


def _shard_detail(shard: dict, entry: dict, vname: str, ref_module, ref_label: str) -> str | None:
    """None when vLLM's shard equals the reference module (label, then weights), else what differs."""
    where = f"vLLM {vname}" + (f"[{shard['shard']}]" if shard["shard"] != vname.rsplit('.', 1)[-1] else "")
    where += f" ({entry['quant_method']}{', ' + entry['scheme'] if entry.get('scheme') else ''})"
    note = f"; {shard['note']}" if shard.get("note") else ""
    if shard["label"] != ref_label:
        return f"label {shard['label']} in {where}, {ref_label} in the reference{note}"
    if shard["weight"] is None:
        return f"no readable weight in {where}: {shard.get('note') or 'unknown'}"
    wd = _effective_weight_detail(shard, ref_module, vname)
    return None if wd is None else f"{wd}; {where}, label {shard['label']}{note}"


def _module_detail(reference, modules: dict, name: str, ref_label: str, arch: str) -> str | None:
    """None when vLLM's counterpart of the reference module ``name`` equals it, else what differs
    (or why there is no counterpart)."""
    try:
        vname = to_vllm(name, arch)
    except KeyError as e:
        return f"no vLLM name for it ({e})"
    entry = modules.get(vname)
    if entry is None:
        return f"vLLM has no module {vname}"
    leaf = name.rsplit(".", 1)[-1]
    shards = entry["shards"]
    shard = next((s for s in shards if s["shard"] == leaf), None)
    if shard is None and len(shards) == 1:
        shard = shards[0]
    if shard is None:
        return f"vLLM module {vname} has no shard {leaf} (shards {[s['shard'] for s in shards]})"
    return _shard_detail(shard, entry, vname, reference.model.get_submodule(name), ref_label)


def compare_modules(reference, read: dict, arch: str) -> tuple[R.ModuleDiff | None, list[str], int]:
    """Diff vLLM's modules (``read``, from vllm_worker.read_modules) against the reference model's
    (``reference``: harness.reference.load(path) with fuse=True, as vLLM fuses).

    Exactness rule: labels equal; effective weights equal bit for bit, where the reference's
    weight is first cast to the dtype vLLM holds an unquantized weight in (bfloat16 for the bnb
    cells) and quantized weights are compared in float32; biases likewise (a missing bias equals
    zeros, as vLLM pads fused biases). An LM head's vocabulary padding rows are ignored.
    Returns (the diff of the first differing module or None, one line per differing module,
    modules compared)."""
    compared = list(reference.report.modules.items())
    details = [(name, _module_detail(reference, read["modules"], name, label, arch)) for name, label in compared]
    differing = [(name, detail) for name, detail in details if detail is not None]
    lines = [f"{name}: {detail}" for name, detail in differing]
    if not differing:
        return None, lines, len(compared)
    name, detail = differing[0]
    if len(differing) > 1:
        more = ", ".join(line.split(":", 1)[0] for line in lines[1:6])
        detail += f" (and {len(differing) - 1} more differing modules: {more}{', ...' if len(differing) > 6 else ''})"
    return R.ModuleDiff(first_differing_module=name, detail=detail), lines, len(compared)
