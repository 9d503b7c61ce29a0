"""Hub checkpoints: resolving a revision to its commit (``harness pin``) and fetching a checkpoint
once per agent before its cells run (``harness prefetch``; docs/README-buildkite.md, "Pinning and
prefetch").

Everything goes through huggingface_hub, whose endpoint is configurable (``HF_ENDPOINT``, or the
``endpoint`` argument), and whose cache (``HF_HUB_CACHE``, else ``$HF_HOME/hub``) is keyed by
commit: ``models--<owner>--<name>/snapshots/<commit>/``.

**Prefetch.** :func:`prefetch` fetches the files a loader needs of one checkpoint
(:func:`choose_files`: the safetensors weights when there are any, else the ``.bin``/``.pt`` ones;
every config, tokenizer and processor file; never other frameworks' weights) into the hub cache,
then writes a marker, ``<hub cache>/harness-prefetched/<owner>--<name>@<revision>.json``, naming
the snapshot directory. :func:`prefetched` reads it, and the engine child's
``resolve_checkpoint`` loads that directory without any hub call. Each attempt runs in a child
process under its own timeout (``python -m harness.hub fetch``) and is retried after a back-off;
a lock per checkpoint in the cache makes two steps on one agent fetch it once. A checkpoint that
cannot be fetched is the prefetch's failure (exit status 75), never a cell's ``error``, and the
download is never part of a cell's time.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MAIN = "main"
TEMPFAIL = 75  # EX_TEMPFAIL: the prefetch failed; a retry (another attempt, another agent) may succeed
MARKERS = "harness-prefetched"
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".h5", ".onnx", ".onnx_data", ".ot", ".tflite", ".gguf")
OTHER_FRAMEWORK_DIRS = ("onnx", "original", "coreml", "openvino", "tflite")


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)


def ref_for(revision: str) -> str:
    """The revision to ask the hub for: a pinned commit, or ``main`` for ``unpinned``."""
    # lazy: pydantic, yaml, +300 ms (scripts/import-graph --costs)
    from harness.matrix import UNPINNED

    return MAIN if revision == UNPINNED else revision


def commit_of(repo: str, ref: str = MAIN, endpoint: str | None = None, timeout: float = 30.0) -> str:
    """The commit ``ref`` of ``repo`` points to (one hub API call)."""
    from huggingface_hub import HfApi

    info = HfApi(endpoint=endpoint).model_info(repo, revision=ref, timeout=timeout)
    if not info.sha:
        raise ValueError(f"the hub returned no commit for {repo}@{ref}")
    return info.sha


def short_error(e: BaseException) -> str:
    """One line for an exception from the hub client."""
    text = " ".join(str(e).split())
    name = type(e).__name__
    for marker in ("(Request ID", "Please make sure"):
        if marker in text:
            text = text.split(marker)[0].strip()
    return f"{name}: {text}" if text else name


def choose_files(files: Iterable[str]) -> list[str]:
    """The files a loader needs: every non-weight file (configs, tokenizer, processor, code), and
    the safetensors weights when there are any, else the ``.bin``/``.pt``/``.pth`` ones; nothing
    under another framework's folder (``onnx/``, ``original/``, ...)."""
    files = sorted(files)
    keep = [f for f in files if not any(PurePosixPath(f).parts[0] == d for d in OTHER_FRAMEWORK_DIRS)
            or len(PurePosixPath(f).parts) == 1]
    weights = [f for f in keep if f.endswith(WEIGHTS)]
    other = [f for f in keep if not f.endswith(WEIGHTS) and not fnmatch.fnmatch(f, ".git*")]
    safetensors = [f for f in weights if f.endswith(".safetensors")]
    torch_files = [f for f in weights if f.endswith((".bin", ".pt", ".pth"))]
    return sorted(other + (safetensors or torch_files))


def _key(repo: str, revision: str) -> str:
    return f"{repo.replace('/', '--')}@{revision}"


def marker_path(repo: str, revision: str, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / MARKERS / f"{_key(repo, ref_for(revision))}.json"


def prefetched(repo: str, revision: str, cache: Path | None = None) -> Path | None:
    """The snapshot directory a prefetch left for ``repo`` at ``revision`` (None when there is
    none, or it is gone)."""
    try:
        data = json.loads(marker_path(repo, revision, cache).read_text())
    except (OSError, ValueError):
        return None
    snapshot = Path(data.get("snapshot", ""))
    if not snapshot.is_dir() or not all((snapshot / f).exists() for f in data.get("files", [])):
        return None
    return snapshot


def _fetch_once(repo: str, revision: str, endpoint: str | None, cache: Path, log: Callable[[str], None]) -> Path:
    """One attempt, in this process: resolve, choose, download, write the marker."""
    from huggingface_hub import HfApi, hf_hub_download

    ref = ref_for(revision)
    info = HfApi(endpoint=endpoint).model_info(repo, revision=ref, timeout=60)
    commit = info.sha
    if not commit:
        raise ValueError(f"the hub returned no commit for {repo}@{ref}")
    if ref != MAIN and commit != ref:
        raise ValueError(f"{repo}@{ref}: the hub answered with commit {commit}")
    files = choose_files(s.rfilename for s in (info.siblings or []))
    if not files:
        raise ValueError(f"{repo}@{commit}: no files to fetch")
    log(f"prefetch: {repo}@{commit[:12]}: {len(files)} file(s)")
    snapshot = None
    t0 = time.perf_counter()
    for i, name in enumerate(files, 1):
        path = Path(hf_hub_download(repo, name, revision=commit, cache_dir=cache, endpoint=endpoint))
        snapshot = path.parents[len(PurePosixPath(name).parts) - 1]
        log(f"prefetch: {repo}: [{i}/{len(files)}] {name} ({path.stat().st_size / 2**20:.1f} MiB, "
            f"{time.perf_counter() - t0:.0f} s)")
    marker = marker_path(repo, revision, cache)
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"repo": repo, "revision": ref, "commit": commit, "snapshot": str(snapshot),
                               "files": files, "seconds": round(time.perf_counter() - t0, 3)}, indent=1) + "\n")
    os.replace(tmp, marker)
    return snapshot


@dataclass
class Outcome:
    repo: str
    revision: str
    snapshot: Path | None = None
    error: str | None = None
    attempts: int = 0
    cached: bool = False


def prefetch(repo: str, revision: str, *, endpoint: str | None = None, cache: Path | None = None,
             attempts: int = 3, timeout_s: float = 1200.0, backoff_s: float = 30.0,
             log: Callable[[str], None] = print) -> Outcome:
    """Fetch one checkpoint, unless this agent already has it: each attempt a child process under
    ``timeout_s``, ``attempts`` in all, ``backoff_s`` (doubling) between them."""
    from filelock import FileLock

    cache = cache or cache_dir()
    out = Outcome(repo, revision)
    marker = marker_path(repo, revision, cache)
    marker.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(marker) + ".lock"):
        snapshot = prefetched(repo, revision, cache)
        if snapshot is not None:
            log(f"prefetch: {repo}@{ref_for(revision)[:12]}: already on this agent ({snapshot})")
            out.snapshot, out.cached = snapshot, True
            return out
        delay = backoff_s
        for attempt in range(1, attempts + 1):
            out.attempts = attempt
            cmd = [sys.executable, "-m", "harness.hub", "fetch", repo, revision, "--cache", str(cache)]
            if endpoint:
                cmd += ["--endpoint", endpoint]
            log(f"prefetch: {repo}@{ref_for(revision)[:12]}: attempt {attempt}/{attempts} (timeout {timeout_s:g} s)")
            proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE, text=True)
            try:
                _, err = proc.communicate(timeout=timeout_s)
                error = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1] if proc.returncode else None
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                error = f"timed out after {timeout_s:g} s"
            snapshot = prefetched(repo, revision, cache) if error is None else None
            if snapshot is not None:
                out.snapshot, out.error = snapshot, None
                return out
            out.error = error or "the fetch left no snapshot"
            log(f"prefetch: {repo}: attempt {attempt} failed: {out.error}")
            if attempt < attempts:
                time.sleep(delay)
                delay *= 2
    return out


def checkpoints(cells) -> list[tuple[str, str]]:
    """The distinct (hub id, revision) of the cells' hub sources, in cell order."""
    seen: dict[tuple[str, str], None] = {}
    for c in cells:
        if c.source_kind == "hub":
            seen.setdefault((c.hub.id, c.hub.revision), None)
    return list(seen)


# ------------------------------------------------------------------------------------- CLI


def add_prefetch_arguments(p) -> None:
    p.add_argument("--attempts", type=int, default=3, help="attempts per checkpoint (default 3)")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="time limit of one attempt (default 1200 s)")
    p.add_argument("--backoff-s", type=float, default=30.0, help="wait before the second attempt, doubling (default 30 s)")
    p.add_argument("--endpoint", default=None, help="the hub endpoint (default: $HF_ENDPOINT or the public hub)")


def run_prefetch(args, cells) -> int:
    """``harness prefetch``: every hub checkpoint of the selected cells; exit 75 when any failed."""
    todo = checkpoints(cells)
    print(f"harness prefetch: {len(todo)} hub checkpoint(s) into {cache_dir()}", flush=True)
    failed = 0
    for repo, revision in todo:
        o = prefetch(repo, revision, endpoint=args.endpoint, attempts=args.attempts, timeout_s=args.timeout_s,
                     backoff_s=args.backoff_s, log=lambda s: print(s, flush=True))
        if o.error:
            failed += 1
            print(f"error: {repo}@{revision}: prefetch failed after {o.attempts} attempt(s): {o.error}",
                  file=sys.stderr, flush=True)
    return TEMPFAIL if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.hub fetch REPO REVISION [--cache DIR] [--endpoint URL]``: one attempt."""
    p = argparse.ArgumentParser(prog="python -m harness.hub")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("repo")
    f.add_argument("revision")
    f.add_argument("--cache", default=None)
    f.add_argument("--endpoint", default=None)
    args = p.parse_args(argv)
    try:
        _fetch_once(args.repo, args.revision, args.endpoint, Path(args.cache) if args.cache else cache_dir(),
                    log=lambda s: print(s, flush=True))
    except Exception as e:
        print(f"error: {args.repo}@{args.revision}: {short_error(e)}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
