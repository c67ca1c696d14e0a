"""`python -m kvbench.run method=pyramidkv budget=128`: the entry point; the runner lives in kvbench.runs.run."""
from kvbench.runs.run import cli

if __name__ == "__main__":
    cli()
