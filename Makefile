# The two commands of the README. Both build .venv on first use (scripts/bootstrap).
.PHONY: run test venv
venv:
	@scripts/bootstrap
run: venv
	.venv/bin/harness run
test: venv
	.venv/bin/python -m pytest
