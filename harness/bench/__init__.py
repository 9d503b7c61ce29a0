"""harness bench: the performance benchmarks (docs/design.md, "Load time"; README, "Benchmarks")."""
