"""`python -m kvbench.serve method=snapkv budget=256 model=... serve.port=8000`: kvbench's engine behind an
OpenAI-compatible server (kvbench.serving.server; docs/serving.md, "Server")."""
import sys

from kvbench.serving.server import main

if __name__ == "__main__":
    main(sys.argv[1:])
