# The two commands of the README. Both build .venv on first use (scripts/bootstrap).
# One BLAS/OpenMP thread per process: on a shared 2-core machine, torch's default of one thread per
# core makes every small op contend, and two pytest workers (-n 2) already use both cores.
export OMP_NUM_THREADS ?= 1
# The matrix cells the suite runs (suites/matrix): the default tier and the configuration cells,
# which CI runs here and the generated pipeline in steps of their own (docs/decisions.md). The
# suite's paths are named because pytest knows a conftest's options (--tier, suites/conftest.py)
# when it parses the command line only from the paths given there. The Buildkite suite step runs
# the same (harness/buildkite/suite.py).
SUITE_TIERS = cpu-tiny,cpu-config

.PHONY: run test quick durations venv fuzz
venv:
	@scripts/bootstrap
run: venv
	.venv/bin/harness run
# The import contract first (pyproject.toml, [tool.importlinter]; a second or two), then the suite.
test: venv
	.venv/bin/lint-imports --no-cache
	.venv/bin/python -m pytest -n 2 --tier $(SUITE_TIERS) tests suites
# The developer's loop: the suite without the tests marked slow (they start engines end to end)
# and without the matrix's cells (`harness run` is their command), in under 3 minutes.
quick: venv
	.venv/bin/python -m pytest -n 2 -m "not slow" --ignore=suites/matrix -q
# Record every test's duration in .test_durations, which splits the suite over Buildkite agents
# (harness/buildkite/suite.py): the whole suite once, to run when its shape has changed.
durations: venv
	.venv/bin/python -m pytest -n 2 --tier $(SUITE_TIERS) --store-durations --durations-path .test_durations -q tests suites
# A longer, random run of the fault suite's fuzzing (suites/faults/test_fuzz.py): N examples per
# property (CI runs a fixed few from a fixed seed inside `make test`).
fuzz: venv
	HARNESS_FUZZ_EXAMPLES=$(or $(N),2000) .venv/bin/python -m pytest suites/faults/test_fuzz.py -q -s -p no:cacheprovider
