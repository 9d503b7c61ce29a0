"""Engines: what loads and runs a checkpoint, behind one interface (harness.engines.base).

- ``reference``: this project's own loader (harness.engines.reference)
- ``transformers``: ``from_pretrained`` (harness.engines.transformers)
- ``vllm``: vLLM (harness.engines.vllm; its child code harness.engines.vllm_worker)

Each engine runs a cell in a child process (harness.engines.worker) and returns one result record
(harness.records.Record). Each has one entry in harness.registry. Importing this package imports no engine and no torch.
"""
