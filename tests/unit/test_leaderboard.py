"""kvpress's leaderboard rows (kvbench.report.leaderboard) from hand-written RULER records: the schema, kvpress's
score (each task's string match x 100, averaged over the tasks), the press names and the settings they stand for,
which runs are left out, and the published numbers' file. The protocol itself runs in
tests/integration/test_leaderboard_smoke.py."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from kvbench.report import leaderboard as lb

REPO = Path(__file__).resolve().parents[2]


def write_run(root: Path, method: str, ratio, hits: dict[str, list[bool]], settings: dict | None = None,
              query: str = "agnostic", model_path: str = "meta-llama/Llama-3.1-8B-Instruct", length: int = 4096):
    """A run dir of `method` at `ratio`: per task, one record per hit (the prediction holds the needle or not)."""
    run = root / "ruler" / "llama" / method / f"r{ratio}-{query}-{len(list(root.rglob('manifest.json')))}"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text(json.dumps({
        "method": method, "budget": None, "ratio": ratio, "model": "llama-3.1-8b-instruct", "dataset": "ruler",
        "dataset_version": "2024-12.1", "primary_metric": "string_match", "query": query}))
    (run / "config.yaml").write_text(yaml.safe_dump({"method": settings or {}, "model": {"path": model_path}}))
    records = []
    for task, values in hits.items():
        for k, hit in enumerate(values):
            records.append({"id": f"{task}-{length}-{k}", "prediction": "the 1234" if hit else "none",
                            "references": ["1234"], "score": float(hit), "scores": {"string_match": float(hit)},
                            "meta": {"task": task, "length": length, "index": k}, "new_tokens": 3,
                            "kv_bytes": 25 if method != "full" else 100, "full_kv_bytes": 100,
                            "e2e_s": 2.0, "prefill_s": 1.0, "compress_s": 0.5, "question_s": 0.1, "decode_s": 0.4})
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


def test_rows_follow_kvpress_schema_score_and_names(tmp_path):
    write_run(tmp_path, "full", None, {"niah_single_1": [True] * 4, "vt": [True, True, True, False]})
    write_run(tmp_path, "h2o", 0.75, {"niah_single_1": [True, False, False, False], "vt": [True, True, False, False]},
              {"variant": "prefill_only", "recent_size": 0, "normalize": "observed"})
    rows = lb.leaderboard([tmp_path])
    assert tuple(rows.columns) == (*lb.SCHEMA, *lb.KVBENCH_COLUMNS)
    full, h2o = rows.to_dict("records")  # the full cache first
    assert (full["dataset"], full["data_dir"], full["model"]) == ("ruler", "4096", "meta-llama/Llama-3.1-8B-Instruct")
    assert (full["method"], full["compression_ratio"], full["score"]) == ("no_press", 0.0, 87.5)  # (100 + 75) / 2
    assert (h2o["method"], h2o["compression_ratio"], h2o["score"]) == ("observed_attention", 0.75, 37.5)  # (25+50)/2
    # the average's se from each task's samples: sqrt(se_a^2 + se_b^2) / 2, se = sd / sqrt(n) (x 100)
    se = lambda p: math.sqrt(p * (1 - p) * 4 / 3 / 4) * 100  # noqa: E731  (sample sd of 4 Bernoulli values)
    assert h2o["score_se"] == pytest.approx(math.sqrt(se(0.25) ** 2 + se(0.5) ** 2) / 2)
    assert (h2o["n_samples"], h2o["n_failed"], h2o["n_tasks"], h2o["kv_fraction"], h2o["time_s"]) == (8, 0, 2, .25, 2)


def test_runs_that_are_not_the_leaderboards_are_left_out_and_aware_ones_marked(tmp_path, caplog):
    snapkv = {"window": 64, "kernel": 5, "pooling": "avg"}
    write_run(tmp_path, "snapkv", 0.5, {"vt": [True]})  # kvbench's SnapKV defaults (window 32, max-pool 7)
    write_run(tmp_path, "buzz", 0.5, {"vt": [True]})  # no such press
    write_run(tmp_path, "snapkv", 0.25, {"vt": [True]}, snapkv)
    write_run(tmp_path, "snapkv", 0.25, {"vt": [False]}, snapkv, query="aware")  # the leaderboard's second loop
    rows = lb.leaderboard([tmp_path])
    assert rows[["method", "compression_ratio", "query_aware", "score"]].values.tolist() == [
        ["snapkv", 0.25, False, 100.0], ["snapkv", 0.25, True, 0.0]]
    assert "snapkv ran with method.window=None (kvpress: 64)" in caplog.text
    assert "buzz has no kvpress leaderboard press" in caplog.text
    assert lb.published_score(lb.load_published(), rows.iloc[1]) == (None, None)  # no published aware number


def test_a_printed_number_goes_before_one_read_off_a_plot():
    row = {"model": "meta-llama/Llama-3.1-8B-Instruct", "data_dir": "4096", "method": "snapkv",
           "compression_ratio": 0.25}
    assert lb.published_score(lb.load_published(), row) == (81.8, "kvpress PR #38")
    assert lb.published_score(lb.load_published(), {**row, "method": "knorm"}) == (
        74.7, "≈ kvpress README leaderboard plot")


def test_cli_writes_rows_and_the_published_numbers_beside(tmp_path, capsys):
    write_run(tmp_path, "kvzip", 0.5, {"niah_single_1": [True, True]}, {"sinks": "repeated", "chunk_size": 2048})
    assert lb.main([str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "| kvzip | agnostic | 0.5 | 100.00 ± 0.00 | 95.50 (kvpress PR #93) |" in out
    assert "https://github.com/NVIDIA/kvpress/pull/93" in out
    rows = [json.loads(x) for x in (tmp_path / "out" / "leaderboard.jsonl").read_text().splitlines()]
    assert [r["method"] for r in rows] == ["kvzip"] and set(rows[0]) == {*lb.SCHEMA, *lb.KVBENCH_COLUMNS}
    assert lb.main([str(tmp_path / "out"), "--out", str(tmp_path / "x")]) == 2  # no runs there: one line, no files
    assert capsys.readouterr().err.startswith("kvbench: ") and not (tmp_path / "x").exists()


def test_published_numbers_cite_public_sources_in_the_schema():
    published = lb.load_published()
    names = {s["name"] for s in published["sources"]}
    assert all(s["url"].startswith("https://github.com/NVIDIA/kvpress/") for s in published["sources"])
    assert "shared/" not in json.dumps(published)  # a reader has the sources, not the development notes
    for row in published["rows"]:
        assert set(row) - {"digitized"} == {*published["schema"], "source"} and row["source"] in names
        assert row["compression_ratio"] in (0.0, 0.25, 0.5, 0.75, 0.875) and row["data_dir"] == "4096"
        assert row.get("digitized", False) == (row["source"] == "kvpress README leaderboard plot")
        assert row["model"] in ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-8B")
    spot = {(r["method"], r["compression_ratio"], r["model"][:4], r.get("digitized", False)): r["score"]
            for r in published["rows"]}
    assert spot[("kvzip", 0.25, "meta", False)] == 95.5 and spot[("compactor", 0.75, "Qwen", False)] == 72.3
    assert spot[("random", 0.5, "meta", True)] == 7.6  # read off the README plot


def test_every_leaderboard_press_has_its_kvpress_settings_in_the_preset():
    """The presets' sweeps (the grid, the query-aware loop) run each method with the settings `KVPRESS` checks
    (configs/paper_method)."""
    methods = [m for name in ("kvpress_leaderboard", "kvpress_leaderboard_aware") for m in yaml.safe_load(
        (REPO / "configs" / "paper" / f"{name}.yaml").read_text())["hydra"]["sweeper"]["params"]["method"].split(",")]
    assert set(methods) == set(lb.KVPRESS) and methods.count("snapkv") == 2  # in both loops
    for method in methods:
        base = yaml.safe_load((REPO / "configs" / "method" / f"{method}.yaml").read_text())
        extra = REPO / "configs" / "paper_method" / f"kvpress_leaderboard_{method}.yaml"
        settings = {**base, **(yaml.safe_load(extra.read_text()) if extra.is_file() else {})}
        assert lb.press_name(method, settings) == (lb.KVPRESS[method][0], None), method
