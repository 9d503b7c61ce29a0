"""models.yaml with accuracy tasks left out (not a test module), for tests whose faults the loaded
state and the logprobs catch: a cell's accuracy tasks are most of its time (an in-process llama
cell's 565 forward passes), and what they judge is the matrix suite's and test_accuracy's."""
from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def without_accuracy(path: Path, kept: set[str] = frozenset()) -> Path:
    """models.yaml written to ``path`` with the accuracy tasks of the schemes outside ``kept``
    ("model.scheme") left out; the task files it names stay the repository's."""
    data = yaml.safe_load((REPO / "models.yaml").read_text())
    for task in data["accuracy_tasks"].values():
        if (REPO / task["task"]).is_file():  # a task YAML of the repo, relative to models.yaml
            task["task"] = str(REPO / task["task"])
    for model, m in data["models"].items():
        for scheme, s in m["schemes"].items():
            if f"{model}.{scheme}" not in kept:
                m["schemes"][scheme] = {**(s or {}), "accuracy": []}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
