"""Imported once by a vLLM environment's fork server (harness.engines.forkserver), never by the
harness itself: what harness.engines._forkserver_preload imports, then the engine module and the
engine's variables (harness.engines.vllm_environment.set_environment), then vLLM, in the order a
fresh vLLM child imports them.
Importing vLLM starts no thread and runs no torch op (checked: ``threading.enumerate()`` holds the
main thread alone, and /proc/self/task shows no thread pool; the one native thread there,
``jemalloc_bg_thd``, comes with pyarrow from the accuracy tasks' imports, in the other fork server
too). vLLM itself sets variables on import (``LD_LIBRARY_PATH``, ``TORCHINDUCTOR_COMPILE_THREADS``,
...): a forked child keeps the server's environment, as a fresh child would have them."""
import importlib

import harness.engines._forkserver_preload  # noqa: F401
import harness.engines.vllm  # noqa: F401
from harness.engines import vllm_environment

vllm_environment.set_environment()
try:
    import vllm  # noqa: F401
    from vllm import LLM, ModelRegistry, SamplingParams  # noqa: F401

    import harness.engines.vllm_state  # noqa: F401
    import harness.engines.vllm_worker  # noqa: F401

    # What every cell's engine start imports lazily, ~560 modules and ~0.4 s a child: the engine
    # core and its scheduler, the executors (one rank, and a process per rank), the CPU worker and
    # attention, the model loader, the compiler of the sampler's rank count, and the model classes
    # of the cpu-tiny fixtures vLLM runs (Llama, Whisper). Each on its own: a candidate build's
    # release may have moved one, and its child then imports that one itself.
    for _module in ("vllm.v1.engine.core", "vllm.v1.core.sched.scheduler", "vllm.v1.executor.uniproc_executor",
                    "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
                    "vllm.v1.worker.cpu_model_runner", "vllm.v1.attention.backends.cpu_attn",
                    "vllm.model_executor.model_loader", "vllm.model_executor.models.llama",
                    "vllm.model_executor.models.whisper", "torch._inductor.compile_fx"):
        try:
            importlib.import_module(_module)
        except ImportError:
            pass

    from torch._inductor import cpu_vec_isa

    # vLLM compiles its sampler's rank count (batched_count_greater_than) in every cell, eager ones
    # too, and torch.compile's CPU code generation first probes which vector ISAs build and load
    # here: a compiler and a python subprocess per ISA, about 1.1 s, remembered per process
    # (functools.cache). Taken once here, with the children's environment, for all of them; it
    # runs subprocesses only, no thread and no torch op.
    cpu_vec_isa.valid_vec_isa_list()
except Exception:  # the child imports it again and its log says why it fails
    pass
