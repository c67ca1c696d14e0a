"""`python -m kvbench.run method=pyramidkv budget=128`: the entry point; the runner lives in kvbench.runs.run."""
import sys

if __name__ == "__main__":
    try:
        from kvbench.runs.run import cli
    except KeyboardInterrupt:  # Ctrl-C while Hydra and the runner import: one line, as kvbench.runs.run.cli says it
        print("kvbench: interrupted; every finished sample is kept, rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    cli()
