"""``harness pin``: resolve every ``unpinned`` hub revision of models.yaml to the commit its branch
(``main``) points to now, and write it into the file in place.

The edit is made on the text, not by dumping YAML again: the revision's scalar is located by the
YAML composer (its exact start and end in the text) and replaced by the 40-hex commit, so every
comment, anchor, blank line and key order stays as it was (a commit YAML would read as a number
is written quoted). A ``# TODO: pin`` on that line
becomes ``# pinned <date> from main``. The result is validated (harness.matrix) before it is
written, atomically. A model whose revision cannot be resolved (unknown repository, no access, no
network) gets one line ``error: <file>: models.<name>.hub: <what>`` and keeps ``unpinned``; the
others are written regardless, and the exit status is 1.
"""
from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import yaml

from harness import hub
from harness import matrix as M
from harness.matrix import DEFAULT_PATH


def _child(node: yaml.MappingNode, key: str):
    if not isinstance(node, yaml.MappingNode):
        return None
    for k, v in node.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            return v
    return None


def revision_spans(text: str) -> dict[str, tuple[int, int, str]]:
    """model name -> (start, end, value) of its ``hub.revision`` scalar in ``text``."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    models = _child(root, "models")
    out = {}
    for k, model in (models.value if isinstance(models, yaml.MappingNode) else []):
        rev = _child(_child(model, "hub"), "revision") if _child(model, "hub") is not None else None
        if isinstance(rev, yaml.ScalarNode):
            out[k.value] = (rev.start_mark.index, rev.end_mark.index, rev.value)
    return out


def scalar(commit: str) -> str:
    """The commit as a YAML scalar that reads back as that string: plain, or double-quoted when
    YAML would read it as something else (an all-digit commit is an integer)."""
    return commit if yaml.safe_load(commit) == commit else f'"{commit}"'


def apply(text: str, commits: dict[str, str], date: str, ref: str = hub.MAIN) -> str:
    """``text`` with the revision of each model in ``commits`` replaced by its commit."""
    spans = revision_spans(text)
    for name in sorted(commits, key=lambda n: spans[n][0], reverse=True):
        start, end, _ = spans[name]
        line_end = text.find("\n", end)
        line_end = len(text) if line_end < 0 else line_end
        rest = text[end:line_end].replace("# TODO: pin", f"# pinned {date} from {ref}", 1)
        text = text[:start] + scalar(commits[name]) + rest + text[line_end:]
    return text


def run(args) -> int:
    path = Path(args.matrix)
    m = M.load(path)
    text = path.read_text()
    wanted = [(name, model.hub) for name, model in m.models.items()
              if model.hub is not None and model.hub.revision == M.UNPINNED and (not args.model or name in args.model)]
    unknown = sorted(set(args.model or ()) - set(m.models))
    for name in unknown:
        print(f"error: {path}: models.{name}: no such model", file=sys.stderr)
    endpoint = args.endpoint or os.environ.get("HF_ENDPOINT") or None
    print(f"harness pin: {len(wanted)} unpinned hub revision(s) in {path}, resolving {args.ref} via "
          f"{endpoint or 'the public hub'}", flush=True)
    commits: dict[str, str] = {}
    failed = len(unknown)
    for name, h in wanted:
        try:
            commits[name] = hub.commit_of(h.id, args.ref, endpoint=endpoint)
        except Exception as e:
            failed += 1
            print(f"error: {path}: models.{name}.hub: cannot resolve {h.id}@{args.ref}: {hub.short_error(e)}",
                  file=sys.stderr, flush=True)
            continue
        print(f"models.{name}: {h.id}@{args.ref} -> {commits[name]}", flush=True)
    if commits:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        new = apply(text, commits, date, args.ref)
        pinned = M.loads(new, filename=str(path))  # never write a file the harness cannot read
        for name, commit in commits.items():
            assert pinned.models[name].hub.revision == commit, name
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(new)
        os.replace(tmp, path)
        print(f"pinned {len(commits)} revision(s) in {path}", flush=True)
    return 1 if failed else 0


def add_arguments(p) -> None:
    p.add_argument("--matrix", metavar="FILE", default=str(DEFAULT_PATH), help="the matrix file (default: models.yaml)")
    p.add_argument("--model", action="append", metavar="NAME", help="only this model (repeatable)")
    p.add_argument("--ref", default=hub.MAIN, help="the branch or tag to resolve (default: main)")
    p.add_argument("--endpoint", default=None, help="the hub endpoint (default: $HF_ENDPOINT or the public hub)")
