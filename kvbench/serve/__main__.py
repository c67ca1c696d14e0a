"""`python -m kvbench.serve method=snapkv budget=256 model=... serve.port=8000`: kvbench's engine behind an
OpenAI-compatible server (kvbench.serving.server; docs/serving.md, "The server")."""
import sys

try:
    from kvbench.serving.server import main
except ModuleNotFoundError as e:  # the `serve` extra is not installed
    if e.name not in ("fastapi", "uvicorn", "starlette", "pydantic"):
        raise
    sys.exit(f"kvbench: the server needs {e.name}; install it with: pip install 'kvbench[serve]'")

if __name__ == "__main__":
    main(sys.argv[1:])
