"""The test-only hooks that the engine child installs from ``HARNESS_TEST_HOOK``
(harness.engines.worker.parse_hooks; docs/testing-hooks.md): ``slowdown``, a load-time regression
inside the reference loader's own work, and ``faults``, degradations the accuracy gates and the
localisation must catch. Nothing here runs unless a test or a benchmark sets the variable."""
