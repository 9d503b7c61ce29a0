"""Run a cell's accuracy tasks through lm-eval's own API on the cell's loaded engine (docs/design.md,
"Accuracy").

:func:`evaluate` is called by ``harness.engines.execute.execute`` in the engine child, after the
logprob steps, with the engine still loaded: no second engine start. Each task goes through
lm-eval's evaluator (``lm_eval.evaluator.evaluate``, set up as ``simple_evaluate`` does) with the
``harness`` model (harness.accuracy.lm) and a TaskManager that indexes only what the task needs:
a task YAML in the repo is read here, its local data files made absolute (lm-eval then reads them
with ``datasets``' ``json`` builder, no hub), and handed to lm-eval as an inline config; an lm-eval
task name is looked up among lm-eval's own tasks.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from harness import records as R
from harness.accuracy.spec import CellAccuracyTask


class AccuracyError(RuntimeError):
    """A task that cannot be evaluated as declared (one line)."""


def local_config(path: str | Path) -> tuple[dict, list[Path]]:
    """A task YAML in the repo as an inline lm-eval config, its ``dataset_kwargs.data_files`` made
    absolute (relative to the YAML), and those data files."""
    path = Path(path)
    config = yaml.safe_load(path.read_text())
    files: list[Path] = []
    kwargs = dict(config.get("dataset_kwargs") or {})
    data_files = kwargs.get("data_files")
    if data_files is not None:
        def absolute(p: str) -> str:
            q = (path.parent / p).resolve()
            files.append(q)
            return str(q)

        if isinstance(data_files, str):
            kwargs["data_files"] = absolute(data_files)
        elif isinstance(data_files, list):
            kwargs["data_files"] = [absolute(p) for p in data_files]
        else:
            kwargs["data_files"] = {k: absolute(v) if isinstance(v, str) else [absolute(x) for x in v]
                                    for k, v in data_files.items()}
        config["dataset_kwargs"] = kwargs
    return config, files


def task_hash(task: CellAccuracyTask, resolved: dict | None = None) -> str:
    """sha256 of what lm-eval evaluates: lm-eval's version, few-shot count, limit, metric and
    filter, and the task itself: a local task's YAML text and data files' bytes, or lm-eval's
    resolved config of a named task."""
    import lm_eval

    h = hashlib.sha256()
    h.update(json.dumps({"lm_eval": getattr(lm_eval, "__version__", None), "num_fewshot": task.num_fewshot,
                         "limit": task.limit, "metric": task.metric, "filter": task.filter}, sort_keys=True).encode())
    if task.path is not None:
        h.update(Path(task.path).read_bytes())
        for f in local_config(task.path)[1]:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    else:
        h.update(json.dumps(resolved or {}, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _evaluate(lm, manager, spec, task: CellAccuracyTask) -> dict:
    """``lm_eval.evaluator.evaluate`` on the loaded task, set up as ``simple_evaluate`` sets it up
    (seeds 0, the few-shot count, a default of 0 shots, the few-shot seed). simple_evaluate itself
    also collects the machine's environment (torch's collect_env runs pip, lscpu and friends in
    subprocesses), about a second per call that an engine child has no use for."""
    import random

    import numpy as np
    from lm_eval.evaluator import evaluate
    from lm_eval.utils import set_torch_seed

    random.seed(0)
    np.random.seed(0)
    set_torch_seed(0)
    loaded = manager.load([spec])
    for t in loaded["tasks"].values():
        if task.num_fewshot is not None and t.get_config("num_fewshot") != 0:
            t.set_config(key="num_fewshot", value=task.num_fewshot)
        elif t.get_config("num_fewshot") is None:
            t.set_config(key="num_fewshot", value=0)
        t.set_fewshot_seed(seed=0)
    return evaluate(lm=lm, task_dict=loaded, limit=task.limit, bootstrap_iters=1000, log_samples=True)


def run_task(lm, task: CellAccuracyTask, log: Callable[[str], None] = lambda s: None) -> tuple[R.Accuracy, dict]:
    """One task through lm-eval's evaluator on ``lm``: its result entry, and lm-eval's raw result
    (for the tiny-task builder, which reads the samples)."""
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # no process pool inside an engine child
    t0 = time.perf_counter()
    if task.path is not None:
        config, _ = local_config(task.path)
        manager = TaskManager(include_defaults=False, include_path=str(Path(task.path).parent))
        spec: Any = config
        name = config["task"]
    else:
        manager = TaskManager()
        spec = name = task.task
    log(f"accuracy: {task.name}: lm-eval task {name} (few-shot {task.num_fewshot if task.num_fewshot is not None else 'default'}, "
        f"limit {task.limit or 'none'})")
    res = _evaluate(lm, manager, spec, task)
    results = res["results"].get(name)
    key = f"{task.metric},{task.filter}"
    if results is None or key not in results:
        have = sorted(k for k in (results or {}) if "," in k and "_stderr" not in k)
        raise AccuracyError(f"accuracy task {task.name}: lm-eval reported no {key!r} for {name} (it reported: {', '.join(have) or 'nothing'})")
    value = _number(results[key])
    stderr = _number(results.get(f"{task.metric}_stderr,{task.filter}"))
    samples = [s for s in res.get("samples", {}).get(name, []) if s.get("filter", task.filter) == task.filter]
    samples.sort(key=lambda s: s.get("doc_id", 0))
    items = [_number(s.get(task.metric)) for s in samples]
    n = (res.get("n-samples", {}).get(name) or {}).get("effective", len(samples))
    entry = R.Accuracy(
        task=task.name, lm_eval_task=name, metric=task.metric, filter=task.filter, value=value, stderr=stderr,
        samples=int(n), task_hash=task_hash(task, res.get("configs", {}).get(name)), num_fewshot=task.num_fewshot,
        limit=task.limit, higher_is_better=(res.get("higher_is_better", {}).get(name) or {}).get(task.metric),
        gate=task.gate.model_dump(exclude_none=True), items=items if items and all(i is not None for i in items) else None,
        seconds=time.perf_counter() - t0)
    log(f"accuracy: {task.name}: {task.metric},{task.filter} = {value} (stderr {stderr}, {n} samples, "
        f"{entry.seconds:.1f} s)")
    return entry, res


def make_lm(engine, checkpoint, log: Callable[[str], None] = lambda s: None, **options):
    """The registered ``harness`` lm-eval model over a loaded engine."""
    from lm_eval.api.registry import get_model

    # lazy: lm_eval, which this module imports only where a task runs; importing it registers the model
    import harness.accuracy.lm  # noqa: F401

    return get_model("harness").create_from_arg_obj({"engine": engine, "checkpoint": checkpoint, "log": log, **options})


def evaluate(engine, checkpoint, tasks: Sequence[CellAccuracyTask], log: Callable[[str], None] = lambda s: None) -> list[R.Accuracy]:
    """Every accuracy task of a cell on its loaded engine, in order."""
    lm = make_lm(engine, checkpoint, log)
    return [run_task(lm, t, log)[0] for t in tasks]
