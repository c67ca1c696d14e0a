"""`python -m kvbench.harness ...` / `import kvbench.harness`: lm-eval with the `kvbench` model registered.

The model lives in kvbench.runs.harness; importing this module registers it with lm-eval.
"""
from kvbench.runs.harness import KVBenchLM, main

__all__ = ["KVBenchLM", "main"]

if __name__ == "__main__":
    main()
