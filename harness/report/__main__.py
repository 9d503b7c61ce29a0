"""``python -m harness.report RESULTS... -o DIR``: the same as ``harness report``, without
importing anything the report does not need (the Buildkite report step installs only the
harness's light dependencies)."""
import sys

from harness.report import main

sys.exit(main())
