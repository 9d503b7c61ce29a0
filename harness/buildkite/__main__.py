"""``python -m harness.buildkite``: the pipeline generator (harness pipeline)."""
import sys

from harness.buildkite import main

sys.exit(main())
