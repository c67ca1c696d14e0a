"""The load benchmark's two figures, from its run directories: accuracy against output throughput with the Pareto
front (the configurations no other beats on both), and each configuration's latency CDFs (TTFT and end-to-end)."""
from __future__ import annotations

import json
from pathlib import Path

from kvbench.serving.figures import pareto_front


def label(summary: dict) -> str:
    budget = "" if summary.get("budget") is None else f" b{summary['budget']}"
    return f"{summary['method']}{budget} {summary['arrival']}"


def write_figures(summaries: list[dict], out: Path) -> list[Path]:
    """pareto.png and latency_cdf.png under `out`; the records are read from each summary's run directory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    done = [s for s in summaries if s.get("output_tok_s") is not None]
    points = [(s["output_tok_s"], s["accuracy"]["mean"]) for s in done]
    fig, ax = plt.subplots(figsize=(6, 4))
    for s, (x, y) in zip(done, points):
        ax.errorbar(x, y, yerr=s["accuracy"]["se"] or 0, fmt="o", label=label(s))
    front = [points[i] for i in pareto_front(points)]
    ax.plot([x for x, _ in front], [y for _, y in front], "k--", lw=1, label="Pareto front")
    ax.set(xlabel="output tokens/s", ylabel="accuracy", title="accuracy vs throughput at a fixed KV pool")
    ax.legend(fontsize=7)
    paths = [out / "pareto.png", out / "latency_cdf.png"]
    fig.savefig(paths[0], dpi=120, bbox_inches="tight")
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in done:
        lines = (Path(s["run_dir"]) / "predictions.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, lines) if "serving" in r]
        for ax, name in zip(axes, ("ttft_s", "e2e_s")):
            values = sorted(r["serving"][name] for r in records)
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=label(s))
    for ax, name in zip(axes, ("time to first token (s)", "end-to-end latency (s)")):
        ax.set(xlabel=name, ylabel="fraction of requests")
        ax.legend(fontsize=7)
    fig.savefig(paths[1], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return paths


def write_ceiling_figure(results: list[dict], path: Path) -> Path:
    """scripts/bench_serving.py's figures, one group of bars per run (`--json` files): the admission the pool
    predicts (full bytes / compressed bytes), the concurrency admitted (M / N), the method's throughput gain over
    the full cache, and the ceiling (transformers' batch-M over batch-N speed-up), with gain / ceiling written above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = (("predicted_admission", "admission predicted (bytes)"), ("admitted", "admitted M / N"),
            ("gain", "throughput gain"), ("ceiling", "ceiling (transformers)"))
    for r in results:  # (M / N from the two summaries where the file predates the field)
        r.setdefault("admitted", r["summaries"][1]["peak_running"] / r["summaries"][0]["peak_running"])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(bars)
    for j, (key, name) in enumerate(bars):
        values = [r[key] for r in results]
        ax.bar([i + j * width for i in range(len(results))], values, width, label=name)
    for i, r in enumerate(results):
        top = max(r[key] for key, _ in bars)
        ax.text(i + 1.5 * width, top * 1.03, f"gain / ceiling {100 * r['gain_over_ceiling']:.0f}%", ha="center",
                fontsize=8)
    ax.set_xticks([i + 1.5 * width for i in range(len(results))],
                  [f"{r['method']} b{r['budget']} vs full\n{r['dataset']}" for r in results])
    ax.set(ylabel="x over the full cache", title="at a KV pool of one full-cache request (SmolLM2-135M, CPU)")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_ylim(0, 1.15 * max(r[key] for r in results for key, _ in bars))
    ax.legend(fontsize=7, loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
