"""Engines: what loads and runs a checkpoint, behind one interface (harness.engines.base).

- ``reference``: this project's own loader (harness.engines.reference)
- ``transformers``: ``from_pretrained`` (harness.engines.transformers)
- ``vllm``: the vLLM engine issue

Each engine runs a cell in a child process (harness.engines.worker) and returns one result record
(harness.records.Record). Importing this package imports no engine and no torch.
"""
from harness.engines.base import (
    ENGINE_CLASSES,
    Checkpoint,
    Engine,
    EnginePrompt,
    EngineUnavailable,
    InProcessEngine,
    engine_class,
    execute,
    fuses_shards,
    prompts_for,
    resolve_checkpoint,
)

__all__ = [
    "ENGINE_CLASSES",
    "Checkpoint",
    "Engine",
    "EnginePrompt",
    "EngineUnavailable",
    "InProcessEngine",
    "engine_class",
    "execute",
    "fuses_shards",
    "prompts_for",
    "resolve_checkpoint",
]
