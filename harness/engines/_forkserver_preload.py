"""Imported once by the runner's fork server (multiprocessing "forkserver" preload), never by the
harness itself: every engine child is then forked with torch, transformers and the harness already
imported, instead of paying several seconds of imports per cell. Nothing here runs a torch op, so
no thread pool exists yet when a child is forked. The fork server's own stdout and stderr go to
/dev/null (the libraries print warnings on import); each child points them at its cell's log."""
import os

_null = os.open(os.devnull, os.O_WRONLY)
os.dup2(_null, 1)
os.dup2(_null, 2)
os.close(_null)

import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401
from transformers import LlamaForCausalLM, WhisperForConditionalGeneration  # noqa: E402,F401

import harness.engines.base  # noqa: E402,F401
import harness.engines.reference  # noqa: E402,F401
import harness.engines.transformers  # noqa: E402,F401
import harness.engines.worker  # noqa: E402,F401
import harness.fixtures  # noqa: E402,F401
import harness.reference  # noqa: E402,F401
import harness.scoring  # noqa: E402,F401

for _optional in ("bitsandbytes", "torchao", "compressed_tensors", "accelerate",
                  "lm_eval.evaluator", "lm_eval.tasks", "harness.accuracy.lm"):  # the accuracy tasks
    try:
        __import__(_optional)
    except Exception:  # an engine that needs it will say so in its own log
        pass
