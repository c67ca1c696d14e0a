"""A report row never averages two runs whose settings or samples differ (issue 42, item 2): the demo's NIAH grid
and a sweep at other context lengths, both PyramidKV at KV size 128, are two rows labelled by what differs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from kvbench.report import load_runs, summary_table, to_markdown
from kvbench.report.__main__ import main
from kvbench.report.settings import differing, flatten

DEMO = {"context_lengths": [1000, 2000, 4000, 8000], "depth_percents": [0, 25, 50, 75, 100]}
SWEEP = {"context_lengths": [1000], "depth_percents": [0, 50]}


def niah_run(root: Path, method: str, budget: int | None, dataset: dict, hit, suffix: str, kv: int = 10,
             prefill_s: float = 1.0, name: str = "niah", model: str = "smollm2-135m",
             extra: dict | None = None) -> Path:
    """A run directory as kvbench.run writes it: config.yaml (the resolved config's identifying nodes), manifest,
    one record per (length, depth) of `dataset`; `hit(length, depth)` is the record's score."""
    run = root / name / model / method / f"b{budget}-{suffix}"
    run.mkdir(parents=True)
    config = {"budget": budget, "ratio": None, "seed": 0, "query": "aware", "positions": "original", "limit": None,
              "shard": None, "method": {"_target_": f"kvbench.methods.{method}.X", "window": 8},
              "dataset": {"_target_": "kvbench.data.niah.Niah", **dataset}, "model": {"name": model}, **(extra or {})}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "manifest.json").write_text(json.dumps({
        "method": method, "budget": budget, "ratio": None, "model": model, "dataset": name,
        "dataset_version": "1", "primary_metric": "pyramidkv_recall"}))
    records = [{"id": f"niah-L{n}-d{d}", "score": float(hit(n, d)), "scores": {"pyramidkv_recall": float(hit(n, d))},
                "meta": {"context_length": n, "depth_percent": d}, "kv_bytes": kv, "full_kv_bytes": 100,
                "effective_budget": 128.0, "prefill_s": prefill_s, "decode_tok_s": 5.0}
               for n in dataset["context_lengths"] for d in dataset["depth_percents"]]
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


@pytest.fixture
def demo_and_sweep(tmp_path: Path) -> Path:
    """The demo's grid (20 samples, the 5 at 8000 missed: 75.00) and the sweep's 2 samples (both missed: 0.00), with
    different KV bytes and prefill times, so a mixed row would show numbers neither run has."""
    root = tmp_path / "results"
    niah_run(root, "pyramidkv", 128, DEMO, lambda n, d: n != 8000, "aaaa1111", kv=10, prefill_s=1.0)
    niah_run(root, "pyramidkv", 128, SWEEP, lambda n, d: False, "bbbb2222", kv=50, prefill_s=3.0)
    niah_run(root, "full", None, DEMO, lambda n, d: True, "cccc3333", kv=100)
    return root


def test_runs_whose_dataset_settings_differ_are_separate_labelled_rows(demo_and_sweep: Path):
    table = summary_table(load_runs([demo_and_sweep]))
    pyr = table[table["method"] == "pyramidkv"].set_index("setting")
    demo_label = "dataset.context_lengths=[1000,2000,4000,8000], dataset.depth_percents=[0,25,50,75,100]"
    sweep_label = "dataset.context_lengths=[1000], dataset.depth_percents=[0,50]"
    assert set(pyr.index) == {demo_label, sweep_label}
    assert (pyr.loc[demo_label, "n"], pyr.loc[demo_label, "Acc."]) == (20, pytest.approx(75.0))
    assert (pyr.loc[sweep_label, "n"], pyr.loc[sweep_label, "Acc."]) == (2, 0.0)
    assert (pyr.loc[demo_label, "kv_bytes_frac"], pyr.loc[sweep_label, "kv_bytes_frac"]) == (0.1, 0.5)
    assert (pyr.loc[demo_label, "prefill_s"], pyr.loc[sweep_label, "prefill_s"]) == (1.0, 3.0)
    full = table[table["method"] == "full"]
    assert len(full) == 1 and full["setting"].iloc[0] == "–"  # alone under its key: no label
    md = to_markdown(table)
    assert "| Setting |" in md.splitlines()[0] and f"| {demo_label} |" in md


def test_the_report_command_prints_both_rows(demo_and_sweep: Path, tmp_path: Path, capsys):
    assert main([str(demo_and_sweep), "--out", str(tmp_path / "out"), "--compare", "full"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "| PyramidKV |" in line]
    assert len(rows) == 2
    assert any("| 20 | 75.00 |" in r and "[1000,2000,4000,8000]" in r for r in rows)
    assert any("| 2 | 0.00 |" in r and "context_lengths=[1000]," in r for r in rows)


def test_the_same_settings_in_two_folders_are_told_apart_by_folder(demo_and_sweep: Path, tmp_path: Path):
    """A copy of the sweep's run in a second results tree (the same config, samples counted twice if averaged)."""
    other = tmp_path / "other"
    src = next((demo_and_sweep / "niah/smollm2-135m/pyramidkv").glob("b128-bbbb2222"))
    shutil.copytree(src, other / src.relative_to(demo_and_sweep))
    table = summary_table(load_runs([demo_and_sweep, other]))
    settings = sorted(table.loc[table["method"] == "pyramidkv", "setting"])
    assert len(settings) == 3 and all(s.count("run=") == 1 for s in settings)
    assert {int(n) for n in table.loc[table["method"] == "pyramidkv", "n"]} == {20, 2}


def test_a_report_without_a_clash_keeps_its_layout(demo_and_sweep: Path):
    shutil.rmtree(next((demo_and_sweep / "niah/smollm2-135m/pyramidkv").glob("b128-bbbb2222")))
    table = summary_table(load_runs([demo_and_sweep]))
    assert "setting" not in table and "Setting" not in to_markdown(table)


def test_what_names_a_run(tmp_path: Path):
    """Every config key but how, where and on which part of the samples a run ran; the placement keys are the run
    directory hash's own (kvbench.runs.config.PLACEMENT_KEYS)."""
    from kvbench.report.settings import PLACEMENT, identity, setting_labels
    from kvbench.runs.config import PLACEMENT_KEYS

    assert set(PLACEMENT) == set(PLACEMENT_KEYS)
    runs = {}
    for shots, batch in ((0, 1), (5, 8)):  # lm-eval runs (kvbench.report.lm_eval_runs) at two shot counts
        run = tmp_path / f"run{shots}"
        run.mkdir()
        (run / "config.yaml").write_text(yaml.safe_dump({"method": {"window": 8}, "num_fewshot": shots, "limit": 3,
                                                         "batch_size": batch, "model": {"gpus": batch}}))
        runs[str(run)] = ("m", "lm_eval", "snapkv", 64, None, "aware")
    assert identity(tmp_path / "run5") == {"method.window": 8, "num_fewshot": 5}
    assert setting_labels(runs) == {str(tmp_path / "run0"): "num_fewshot=0", str(tmp_path / "run5"): "num_fewshot=5"}


def test_which_keys_differ():
    a = flatten({"dataset": {"lengths": [1, 2], "root": "x"}, "seed": 0})
    b = flatten({"dataset": {"lengths": [1], "root": "x"}, "seed": 0, "positions": "shift"})
    assert a == {"dataset.lengths": [1, 2], "dataset.root": "x", "seed": 0}
    assert differing([a, b]) == ["dataset.lengths", "positions"] and differing([a, a]) == []


def test_a_paper_cell_takes_its_own_presets_run_or_says_why(tmp_path: Path):
    """PyramidKV Table 15's Mistral row at KV size 64: two runs match with different settings. The cell takes none
    and says why; once one of them is the table's preset's run (`paper_settings`), the cell is that run's."""
    from kvbench.report.paper import build_paper_table

    mistral = {"name": "niah_pyramidkv", "model": "mistral-7b-instruct-v0.2"}
    niah_run(tmp_path / "a", "pyramidkv", 64, DEMO, lambda n, d: True, "aaaa1111", **mistral)
    niah_run(tmp_path / "a", "pyramidkv", 64, SWEEP, lambda n, d: False, "bbbb2222", **mistral)

    def cell():
        table = build_paper_table(load_runs([tmp_path / "a"]), "pyramidkv", table="t15")
        (row,) = [r for r in table.rows if r["group"].startswith("Mistral") and r["label"] == "KV Cache 64"]
        return row["cells"]["pyramidkv"]

    clash = cell()
    assert clash.rebuilt is None and clash.note.startswith("2 runs of different settings match (dataset.")
    niah_run(tmp_path / "a", "pyramidkv", 64, {**SWEEP, "depth_percents": [0]}, lambda n, d: False, "dddd4444",
             **mistral, extra={"paper_settings": {"name": "pyramidkv", "id": "t15"}})
    own = cell()
    assert own.rebuilt == 0.0 and own.note == ""
