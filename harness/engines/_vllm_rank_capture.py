"""vLLM's worker extension for tensor-parallel cells (``LLM(worker_extension_cls=...)``;
harness.engines.vllm_ranks).

With more than one rank, vLLM's multiprocessing executor spawns a worker process per rank, fresh
interpreters that the capture and the test-only mutations installed in the engine child never
reach. Each worker imports its worker extension class by name before it builds its model
(``WorkerWrapperBase.init_worker``), so importing this module is what installs them there: the
load timing and effective-weight capture, the loaded state taken at load, the mutations the
child's environment names, and the report of a failed load. Only a worker imports it; the engine
child installs its own.
"""
from __future__ import annotations

import os
from pathlib import Path

from harness.engines import vllm_mutations, vllm_state, vllm_worker
from harness.engines.vllm import RANK_ERRORS_ENV, annotate, mutations_from_env

vllm_worker.install()
vllm_state.install()
vllm_mutations.apply(mutations_from_env())


def _report_load_errors() -> None:
    """A rank whose model loading fails writes the error, annotated as the engine child annotates
    its own (harness.engines.vllm.annotate), where the child reads it (``RANK_ERRORS_ENV``): vLLM
    itself tells the child only that a worker failed."""
    from vllm.model_executor.model_loader import base_loader

    load_model = base_loader.BaseModelLoader.load_model

    def reporting_load_model(self, *args, **kwargs):
        try:
            return load_model(self, *args, **kwargs)
        except Exception as e:
            where = os.environ.get(RANK_ERRORS_ENV)
            if where:
                rank = vllm_worker.tp_rank_and_size()[0]
                Path(where, f"rank{rank}.txt").write_text(f"rank {rank}: {annotate(e, 'building the LLM (loading the checkpoint)')}")
            raise

    base_loader.BaseModelLoader.load_model = reporting_load_model


_report_load_errors()


class RankCapture:
    """Adds nothing to the worker: the import of this module is the capture (see above)."""
