import sys
from pathlib import Path

# faultlib sits beside the tests; it is not part of the harness package on purpose.
sys.path.insert(0, str(Path(__file__).parent))
