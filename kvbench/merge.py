"""`python -m kvbench.merge <run dir>`: merge shards; the code lives in kvbench.runs.merge."""
import sys

from kvbench.runs.merge import main

if __name__ == "__main__":
    sys.exit(main())
