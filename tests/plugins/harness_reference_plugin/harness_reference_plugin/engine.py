"""The plugin's engine: harness.engines.reference.ReferenceEngine, under its own name and version."""
from importlib.metadata import version

from harness.engines.reference import ReferenceEngine


class ReferencePluginEngine(ReferenceEngine):
    name = "reference-plugin"

    def version(self) -> str:
        return version("harness-reference-plugin")
