"""The reference implementation of skip-aware, quantization-aware loading.

`load(path)` returns `.model` (called like the architecture's transformers model) and `.report`.
"""
from harness.reference.loader import Loaded, load

__all__ = ["Loaded", "load"]
