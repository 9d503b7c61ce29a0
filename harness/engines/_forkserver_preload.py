"""Imported once by a fork server (harness.engines.forkserver), never by the harness itself: every
engine child is then forked with torch, transformers and the harness already imported, instead of
paying several seconds of imports per cell. Nothing here starts a Python thread or runs a torch op,
so no thread pool exists yet when a child is forked. The server's stdout and stderr are /dev/null
(the libraries print warnings on import); each child points them at its cell's log."""
import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import LlamaForCausalLM, WhisperForConditionalGeneration  # noqa: F401

import harness.engines.base  # noqa: F401
import harness.engines.reference  # noqa: F401
import harness.engines.transformers  # noqa: F401
import harness.engines.worker  # noqa: F401
import harness.fixtures  # noqa: F401
import harness.reference  # noqa: F401
import harness.scoring  # noqa: F401
from harness.quant import native
from harness.registry import methods

native.library()  # built (once per machine) and loaded here, not in each child

# each format's libraries (harness.registry.FORMATS), then the accuracy tasks'
for _optional in (*(m.library for m in methods().values() if m.library), "accelerate",
                  "lm_eval.evaluator", "lm_eval.tasks", "harness.accuracy.lm"):  # the accuracy tasks
    try:
        __import__(_optional)
    except Exception:  # an engine that needs it will say so in its own log
        pass
