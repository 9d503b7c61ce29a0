"""An engine from another package: the harness's reference loader under the name
``reference-plugin``, so that what it computes is real and equals the reference's.

This module is what the ``harness.engines`` entry point loads whenever harness.registry is
imported: it imports nothing but the registry. The engine class is named by dotted path and
imported only in the engine child that runs a cell.
"""
from harness.registry import EngineSpec

SPEC = EngineSpec(
    "reference-plugin",
    "harness_reference_plugin.engine:ReferencePluginEngine",
    "refp",  # the report's column label
    fuses_shards=True,  # as the reference loader executes fused q/k/v and gate/up
    distributions=("harness-reference-plugin",),  # where its version comes from (harness.probes.installed)
)
