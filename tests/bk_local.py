"""Runs a generated Buildkite pipeline locally (not a test module).

``run_pipeline`` executes the command steps whose agent queue is in ``queues`` in dependency
order, the way an agent would: the step's command through ``bash -e -c`` in the checkout, with the
step's env and BUILDKITE_* variables, under its ``timeout_in_minutes``; then its
``artifact_paths`` uploaded. A step with ``allow_dependency_failure`` runs even when its
dependencies failed; otherwise a failed dependency skips it. Steps of other queues (GPU agents)
never run here, as if their agents were lost.

A recording stand-in for ``buildkite-agent`` is put first on PATH: ``artifact upload`` copies
into a local store, ``artifact download`` copies back out of it, ``annotate`` captures the body,
style and context; every call is logged as a JSON line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

STAND_IN = r'''#!{python}
"""A recording stand-in for buildkite-agent (tests/bk_local.py)."""
import fnmatch, json, os, shutil, sys
from pathlib import Path

state = Path(os.environ["BK_LOCAL_STATE"])
store = state / "artifacts"
args = sys.argv[1:]


def log(**extra):
    with open(state / "calls.jsonl", "a") as f:
        f.write(json.dumps({{"argv": args, "cwd": os.getcwd(), **extra}}) + "\n")


def opt(name, default=None):
    if name in args:
        return args[args.index(name) + 1]
    for a in args:
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


if args[:2] == ["artifact", "upload"]:
    pattern = args[2]
    matched = [p for p in Path(".").glob(pattern) if p.is_file()]
    for p in matched:
        dest = store / p.as_posix()
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dest)
    log(uploaded=[p.as_posix() for p in matched])
    sys.exit(0)
if args[:2] == ["artifact", "download"]:
    pattern, dest = args[2], Path(args[3])
    found = sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if p.is_file()) if store.exists() else []
    # buildkite-agent globs: '*' does not cross '/'
    hits = [p for p in found if fnmatch.fnmatchcase(p, pattern) and p.count("/") == pattern.count("/")]
    for p in hits:
        out = dest / p
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(store / p, out)
    log(downloaded=hits)
    if not hits:
        print(f"fatal: no artifacts found for {{pattern!r}}", file=sys.stderr)
        sys.exit(1)
    sys.exit(0)
if args[:1] == ["annotate"]:
    positional = [a for i, a in enumerate(args[1:], 1)
                  if not a.startswith("--") and not (i > 1 and args[i - 1] in ("--style", "--context", "--priority"))]
    body = positional[0] if positional else sys.stdin.read()
    context = opt("--context", "default")
    ann = state / "annotations"
    ann.mkdir(exist_ok=True)
    path = ann / (context + ".json")
    previous = json.loads(path.read_text())["body"] if path.exists() and "--append" in args else ""
    path.write_text(json.dumps({{"context": context, "style": opt("--style", "default"), "body": previous + body}}))
    log(annotated=context)
    sys.exit(0)
log(unsupported=True)
print("stand-in buildkite-agent: unsupported command " + " ".join(args), file=sys.stderr)
sys.exit(2)
'''


@dataclass
class StepRun:
    key: str
    label: str
    status: int | None  # exit status; None when not run
    why: str = ""  # why it did not run
    output: str = ""
    soft_failed: bool = False


@dataclass
class PipelineRun:
    state: Path
    steps: list[StepRun] = field(default_factory=list)

    @property
    def calls(self) -> list[dict]:
        path = self.state / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def annotations(self) -> dict[str, dict]:
        d = self.state / "annotations"
        return {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))} if d.exists() else {}

    def artifact(self, path: str) -> Path:
        return self.state / "artifacts" / path

    def step(self, key: str) -> StepRun:
        return next(s for s in self.steps if s.key == key)


def _command_steps(pipeline: dict) -> list[dict]:
    out = []
    for step in pipeline["steps"]:
        if "group" in step:
            out += step["steps"]
        elif "command" in step or "commands" in step:
            out.append(step)
    return out


def _order(steps: list[dict]) -> list[dict]:
    """Dependency order (Kahn), stable in file order."""
    keys = {s["key"] for s in steps}
    done: set[str] = set()
    out: list[dict] = []
    pending = list(steps)
    while pending:
        for s in pending:
            deps = s.get("depends_on") or []
            deps = [deps] if isinstance(deps, str) else [d if isinstance(d, str) else d["step"] for d in deps]
            if all(d in done or d not in keys for d in deps):
                out.append(s)
                done.add(s["key"])
                pending.remove(s)
                break
        else:
            raise ValueError("dependency cycle")
    return out


def run_pipeline(pipeline: dict, checkout: Path, state: Path, *, queues=("cpu",), env: dict[str, str] | None = None,
                 skip: set[str] = frozenset()) -> PipelineRun:
    """Run the command steps of ``queues`` in dependency order; ``skip``: step keys whose agent is
    lost (they never run)."""
    state.mkdir(parents=True, exist_ok=True)
    bindir = state / "bin"
    bindir.mkdir(exist_ok=True)
    agent = bindir / "buildkite-agent"
    agent.write_text(STAND_IN.format(python=sys.executable))
    agent.chmod(0o755)
    result = PipelineRun(state)
    status: dict[str, int | None] = {}
    for i, step in enumerate(_order(_command_steps(pipeline))):
        key, label = step["key"], step.get("label", step["key"])
        deps = step.get("depends_on") or []
        deps = [deps] if isinstance(deps, str) else [d if isinstance(d, str) else d["step"] for d in deps]
        failed_deps = [d for d in deps if status.get(d) != 0]
        if step.get("agents", {}).get("queue") not in queues:
            why = f"no agent on queue {step.get('agents', {}).get('queue')!r} here"
        elif key in skip:
            why = "agent lost"
        elif failed_deps and str(step.get("allow_dependency_failure", False)).lower() != "true":
            why = f"dependencies failed: {failed_deps}"
        else:
            why = ""
        if why:
            status[key] = None
            result.steps.append(StepRun(key, label, None, why))
            continue
        step_env = {
            **os.environ, **(env or {}),
            "BUILDKITE": "true", "CI": "true", "BUILDKITE_BUILD_ID": "local-build", "BUILDKITE_BUILD_NUMBER": "1",
            "BUILDKITE_JOB_ID": f"job-{i}", "BUILDKITE_STEP_KEY": key, "BUILDKITE_LABEL": label,
            "BUILDKITE_BRANCH": "local", "BUILDKITE_COMMIT": "HEAD", "BK_LOCAL_STATE": str(state),
            **{k: str(v) for k, v in (step.get("env") or {}).items()},
        }
        step_env["PATH"] = f"{bindir}:{step_env.get('PATH', '')}"
        command = step["command"] if isinstance(step.get("command"), str) else "\n".join(step.get("commands") or step["command"])
        try:
            r = subprocess.run(["bash", "-e", "-c", command], cwd=checkout, env=step_env, capture_output=True, text=True,
                               timeout=int(step.get("timeout_in_minutes", 60)) * 60)
            code, out = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            code, out = -1, f"timed out: {e}"
        # the agent uploads artifact_paths after the command, whatever its exit status
        paths = step.get("artifact_paths") or []
        for pattern in [paths] if isinstance(paths, str) else paths:
            subprocess.run([str(agent), "artifact", "upload", pattern], cwd=checkout, env=step_env, check=True)
        soft = step.get("soft_fail")
        soft_failed = code != 0 and (soft is True or (isinstance(soft, list) and any(
            s.get("exit_status") in ("*", code) for s in soft)))
        status[key] = 0 if soft_failed else code
        result.steps.append(StepRun(key, label, code, "", out, soft_failed))
    return result
