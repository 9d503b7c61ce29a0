"""``harness bench``: the performance benchmarks (harness.bench.main; README, "Benchmarks"; docs/bench.md)."""
