"""`python -m kvbench.serving method=full,snapkv budget=128 dataset=niah serving.pool_requests=2 serving.limit=8`

Every configuration (comma lists of method, budget and any serving.<field> give their product) is validated before
any weights load; the serving settings start from configs/serving/default.yaml (`serving=<preset>`: another file
there); then each runs the load benchmark (kvbench.serving.bench) and one table compares them: admitted
concurrency, throughput, goodput, latency percentiles and accuracy. Any other `key=value` is a run override as for
`python -m kvbench.run` (`dataset.context_lengths=[1000]`, `model=hf model.path=...`). With `model=openai
model.base_url=...` the requests go to that server through the client (kvbench.serving.remote_load): no pool
settings then, the pool is the server's. docs/serving.md."""
from __future__ import annotations

import itertools
import logging
import sys

import yaml

from kvbench.remote.spec import is_remote
from kvbench.runs.api import Engine, RunSpec
from kvbench.runs.config import CONFIG_DIR
from kvbench.serving.bench import check, run_load
from kvbench.serving.remote_load import check as check_server_load
from kvbench.serving.remote_load import run_remote_load
from kvbench.serving.spec import FIELDS, RemoteServingSpec, ServingSpec, serving_node

SWEPT = ("method", "budget", "ratio", "model", "dataset", "batch_size")


def parse(argv: list[str]) -> tuple[list[RunSpec], list[ServingSpec]]:
    """The run specs and serving specs of a command line (comma lists: their product), each checked. The serving
    settings start from configs/serving/default.yaml (`serving=<preset>`: another file there), `serving.<field>=`
    on top."""
    preset = "default"
    spec_values: dict[str, list] = {}
    serving_values: dict[str, list] = {}
    overrides = []
    for arg in argv:
        key, eq, text = arg.partition("=")
        if not eq:
            raise ValueError(f"serving: {arg!r} is not key=value")
        if key == "serving":
            preset = text
        elif key.startswith("serving."):
            name = key.removeprefix("serving.")
            if name not in FIELDS:
                raise ValueError(f"serving: no setting {name!r}; valid: {', '.join(sorted(FIELDS))}")
            serving_values[name] = [yaml.safe_load(v) for v in text.split(",")]
        elif key in SWEPT:
            spec_values[key] = [yaml.safe_load(v) for v in text.split(",")]
        else:
            overrides.append(arg)
    specs = [RunSpec(**dict(zip(spec_values, combo)), overrides=tuple(overrides))
             for combo in itertools.product(*spec_values.values())]
    kind = settings_kind({spec.model for spec in specs})
    servings = [kind.from_config(serving_node(preset, dict(zip(serving_values, combo))))
                for combo in itertools.product(*serving_values.values())]
    return specs, servings


def settings_kind(models: set[str]) -> type[ServingSpec]:
    """ServingSpec for models run here (a pool required), RemoteServingSpec for servers (`model=openai`: the pool
    is the server's); one command is one or the other."""
    remote = {m for m in models if is_remote(model_node(m))}
    if remote and remote != models:
        raise ValueError(f"serving: model={','.join(sorted(remote))} (a server) and model="
                         f"{','.join(sorted(models - remote))} (in-process) need different pool settings; run them "
                         "as two commands")
    return RemoteServingSpec if remote else ServingSpec


def model_node(name: str):
    """configs/model/<name>.yaml, or None (an unknown name is refused by the run's own validation)."""
    from omegaconf import OmegaConf

    path = CONFIG_DIR / "model" / f"{name}.yaml"
    return OmegaConf.load(path) if path.is_file() else None


def table(summaries: list[dict]) -> str:
    """The configurations side by side (Markdown)."""
    head = ("method", "budget", "pool bytes", "arrival", "peak running", "out tok/s", "req/s", "goodput req/s",
            "ttft p50/p99 s", "tpot p50 s", "e2e p50/p99 s", "accuracy ± se", "n")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        acc = s.get("accuracy") or {}
        rows.append("| " + " | ".join(str(x) for x in (
            s["method"], s["budget"], "server's" if s["pool_bytes"] is None else s["pool_bytes"], s["arrival"],
            s.get("peak_running"),
            f"{s.get('output_tok_s') or 0:.2f}", f"{s.get('requests_s') or 0:.3f}",
            f"{s.get('goodput_requests_s') or 0:.3f}",
            f"{s['ttft_s']['p50']:.2f}/{s['ttft_s']['p99']:.2f}" if "ttft_s" in s else "-",
            f"{s['tpot_s']['p50']:.3f}" if "tpot_s" in s else "-",
            f"{s['e2e_s']['p50']:.2f}/{s['e2e_s']['p99']:.2f}" if "e2e_s" in s else "-",
            f"{acc.get('mean') or 0:.3f} ± {acc.get('se') or 0:.3f}", s["n"])) + " |")
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        specs, servings = parse(argv)
        runs = [spec.validate() for spec in specs]  # every configuration checked before any weights load
        for run, serving in itertools.product(runs, servings):
            (check_server_load if run.remote else check)(run, serving)
    except (ValueError, KeyError, FileNotFoundError) as e:
        sys.exit(f"kvbench: {e.args[0] if isinstance(e, KeyError) and e.args else e}")
    summaries, loaded = [], None
    for run in runs:
        same_model = loaded is not None and loaded[0] == run.model
        if run.remote:  # the server generates: the client drives it (kvbench.serving.remote_load)
            summaries += [run_remote_load(run, serving) for serving in servings]
            continue
        with Engine(run, loaded=loaded[1] if same_model else None) as engine:
            loaded = (run.model, (engine.model, engine.tokenizer))
            summaries += [run_load(engine, serving) for serving in servings]
    print(table(summaries))
    from pathlib import Path

    from kvbench.serving.plots import write_figures

    out = Path(servings[0].results_dir) / "serving"
    for path in write_figures(summaries, out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
