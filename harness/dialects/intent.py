"""Intent analysis: where what a dialect does with a skip entry and what its author evidently
meant disagree.

``intent_disagreements(policy, names)`` reads every entry of a policy against the modules; the
dialect supplies the matching (``Dialect.entry_hits``) and its own module-level checks
(``Dialect.module_disagreements``). The results are ``EntryDisagreement``s; the load report keeps
them as ``harness.reference.report.Disagreement`` (``Disagreement.from_entry``).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from harness import architectures
from harness.dialects import names as spelling_rules
from harness.dialects import patterns
from harness.dialects.base import EntryDisagreement, SkipEntry
from harness.dialects.policy import SkipPolicy


_QUANT = "*+?{"


def literal_dots(pattern: str) -> str:
    """A regex with each unescaped ``.`` outside a character class that is not followed by a
    quantifier made literal (``\\.``): the regex its author evidently meant when the dots were
    path separators. ``.*``, ``.+`` and escaped dots are kept."""
    out: list[str] = []
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if c == "[":
            in_class = True
        elif c == "]":
            in_class = False
        if c == "." and not in_class and not (i + 1 < len(pattern) and pattern[i + 1] in _QUANT):
            out.append("\\.")
        else:
            out.append(c)
        i += 1
    return "".join(out)


_REGEX_META = set("^$*+?{}[]\\|()")


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _intent_core(body: str) -> tuple[str, str] | None:
    r"""Split a regex into (lead, core) as its author evidently meant it: a leading ``.*`` means
    "starting at some component", a trailing ``.*``, ``$`` or ``\.`` means "this module and what is
    under it". ``None`` when nothing is left (``.*`` names everything)."""
    core = body.removeprefix("^")
    lead = ""
    for wild in (".*", ".+"):
        if core.startswith(wild):
            core, lead = core[2:], r"(?:.*\.)?"
            core = core.removeprefix("\\.")
            break
    changed = True
    while changed and core:
        changed = False
        for tail in ("$", ".*", ".+", "\\.", "."):
            if core.endswith(tail) and not (tail in (".*", ".+", ".") and core.endswith("\\" + tail)):
                core = core[: -len(tail)]
                changed = True
                break
    if not core:
        return None
    return lead, core


def _intent(entry: str, name: str) -> bool:
    """What an entry evidently names: a plain entry names a dot-bounded run of components
    (``layers.1`` names ``model.layers.1.mlp``, not ``model.layers.11``; a trailing ``.`` is a
    boundary); a regex, read with literal dots and with a leading/trailing ``.*`` taken as
    "any components", names every module with a dot-bounded prefix it fully matches."""
    is_regex = entry.startswith("re:") or any(c in _REGEX_META for c in entry)
    if not is_regex:
        e = entry.rstrip(".")
        return bool(e) and (name == e or f".{e}." in f".{name}.")
    body = entry[3:] if entry.startswith("re:") else entry
    split = _intent_core(body)
    if split is None:
        return True
    lead, core = split
    rx = lead + literal_dots(core)
    try:
        patterns.check(rx)
    except re.error:
        return False
    if entry.startswith("re:") or lead or body.startswith("^"):
        return any(patterns.fullmatch(rx, p) for p in _prefixes(name))
    # a transformers key with regex syntax: anchored at the start, or a suffix run (endswith)
    parts = name.split(".")
    return any(patterns.fullmatch(rx, ".".join(parts[i:j])) for i in range(len(parts))
               for j in range(i + 1, len(parts) + 1) if i == 0 or j == len(parts))


def _meant(policy: SkipPolicy, spelling: str, name: str) -> bool:
    """The entry's intent, extended for vLLM to a fused module all of whose shards it names."""
    meant = _intent(spelling, name)
    if policy.reader.vllm and policy.fused_mapping and not meant:
        proj = name.split(".")[-1]
        if proj in policy.fused_mapping:
            meant = all(_intent(spelling, name.replace(proj, s)) for s in policy.fused_mapping[proj])
    return meant


def _hits_with_literal_dots(policy: SkipPolicy, entry: SkipEntry, spelling: str, name: str, module_class: Any) -> bool:
    if spelling.startswith("re:"):
        lit = "re:" + literal_dots(spelling[3:])
    elif policy.reader.keys_are_regexes and entry.source != "fqn_to_config":
        lit = literal_dots(spelling)
    else:
        return True
    try:
        return policy.reader.entry_hits(policy, entry, lit, name, module_class)
    except re.error:
        return True


def _is_class_entry(policy: SkipPolicy, spelling: str) -> bool:
    """A class-name target or ignore entry (compressed-tensors ``Linear``): no name intent."""
    return (policy.reader.class_targets and "." not in spelling and not spelling.startswith("re:")
            and spelling[:1].isupper())


def _one_spelling(policy: SkipPolicy, e: SkipEntry, spelling: str, names: list[str],
                  classes: Mapping[str, Any], out: list[EntryDisagreement]) -> bool:
    """Compare one spelling of an entry with its intent over every module; True if it hit any."""
    d = policy.dialect
    verb = "quantizes" if e.role == "target" else "skips"
    is_class = _is_class_entry(policy, spelling)
    container = any(n.startswith(spelling + ".") for n in names)
    any_hit = False
    for n in names:
        cls = classes.get(n, "Linear")
        try:
            hit = policy.reader.entry_hits(policy, e, spelling, n, cls)
        except re.error as exc:
            out.append(EntryDisagreement(e.raw, None, d, "invalid-regex", f"{spelling!r} is not a valid regex ({exc}); the owner raises"))
            return True
        any_hit = any_hit or hit
        if is_class:
            continue
        meant = _meant(policy, spelling, n)
        if hit and not meant:
            if not _hits_with_literal_dots(policy, e, spelling, n, cls):
                out.append(EntryDisagreement(e.raw, n, d, "wildcard-dot", f"{verb} {n} only because a '.' in {spelling!r} is a regex wildcard"))
            else:
                out.append(EntryDisagreement(e.raw, n, d, "overreach", f"{verb} {n}, which {spelling!r} does not name (not dot-bounded)"))
        elif meant and not hit and e.role == "skip":
            why = ""
            if container and n.startswith(spelling + ".") and policy.reader.exact_containers:
                why = " (the entry names a container; this dialect applies it to that exact module only)"
            out.append(EntryDisagreement(e.raw, n, d, "underreach", f"{spelling!r} names {n} but {d} does not skip it{why}"))
    return any_hit


def _unmatched(policy: SkipPolicy, e: SkipEntry, names: list[str], classes: Mapping[str, Any]) -> EntryDisagreement:
    """An entry that reaches no module: a spelling problem when its memory spelling would."""
    d = policy.dialect
    vllm = policy.reader.vllm
    if policy.arch and not e.raw.startswith("re:") and not vllm:
        alt = [a for a in spelling_rules.normalise_entry(e.raw, policy.arch) if a not in e.match_as]
        alt_hits = [a for a in alt if any(policy.reader.entry_hits(policy, e, a, n, classes.get(n, "Linear")) for n in names)]
        if alt_hits:
            return EntryDisagreement(e.raw, None, d, "spelling", f"matches nothing as written; in memory spelling it is {alt_hits[0]!r}")
    hint = ""
    if vllm and policy.fused_mapping:
        leaf = e.raw.rsplit(".", 1)[-1]
        fused = [k for k, v in policy.fused_mapping.items() if leaf in v and k != leaf]
        if fused:
            hint = f"; vLLM fuses {leaf} into {fused[0]}"
    return EntryDisagreement(e.raw, None, d, "unmatched", f"matches no module{hint}")


def _partial_fused_groups(policy: SkipPolicy, names: list[str], classes: Mapping[str, Any]) -> list[EntryDisagreement]:
    """Fused groups covered in part (vLLM names are fused already, so only unfused spellings have groups)."""
    out = []
    for group in architectures.fusion_groups_by_name(names):
        states = {}
        for n in group:
            try:
                states[n] = policy.skips(n, classes.get(n, "Linear"))
            except (ValueError, re.error):
                states = {}
                break
        if states and len(set(states.values())) > 1:
            skipped = [n.rpartition(".")[2] for n, s in states.items() if s]
            kept = [n.rpartition(".")[2] for n, s in states.items() if not s]
            parent = group[0].rpartition(".")[0]
            out.append(EntryDisagreement(
                ", ".join(skipped), parent, policy.dialect, "partial-fused-group",
                f"{'/'.join(skipped)} skipped but {'/'.join(kept)} quantized under {parent}: "
                "engines that fuse them must load unfused (vLLM raises)"))
    return out


def intent_disagreements(
    policy: SkipPolicy,
    module_names: Iterable[str],
    module_classes: Mapping[str, Any] | None = None,
) -> list[EntryDisagreement]:
    """Where the policy's dialect and the evident intent of its entries disagree, over the given
    modules (the policy's spelling: memory names, or vLLM prefixes for ``vllm-*``; pass the
    quantizable leaves). ``module_classes`` maps names to classes (default ``Linear``).

    Per entry and module: the dialect matches but the dot-bounded intent does not
    (``overreach``, or ``wildcard-dot`` when literal dots would not match), or the reverse
    (``underreach``); per entry: ``unmatched`` / ``spelling`` / ``unread-source`` /
    ``invalid-regex``; per module, from the dialect: ``order-dependent`` (torchao) and
    ``group-precedence`` (compressed-tensors); per fused group: ``partial-fused-group``.
    Class-name targets (compressed-tensors ``Linear``) and ``_default`` carry no name intent and
    are only checked for matching nothing.
    """
    names = list(dict.fromkeys(module_names))
    classes = module_classes or {}
    d = policy.dialect
    out: list[EntryDisagreement] = []
    for e in policy.entries:
        if e.raw == "_default":
            continue
        if not e.honoured:
            out.append(EntryDisagreement(e.raw, None, d, "unread-source", f"{d} never reads {e.source} here; the entry has no effect"))
            continue
        if e.source in ("default", "keep_in_fp32"):
            continue
        any_hit = False
        for spelling in e.match_as:
            any_hit = _one_spelling(policy, e, spelling, names, classes, out) or any_hit
        if not any_hit and names:
            out.append(_unmatched(policy, e, names, classes))
    out.extend(policy.reader.module_disagreements(policy, names, classes))
    out.extend(_partial_fused_groups(policy, names, classes))
    return out
