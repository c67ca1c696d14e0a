"""PyramidKV's tables: hand-checked cells of each published file (read off the paper, not its spec), the rows and
columns each table's presets produce, and the report on multi-model, memory and needle tables from hand-written
records."""
from __future__ import annotations

import functools
import itertools
import math
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from kvbench.report import load_runs
from kvbench.report.paper import CONFIGS, FIGURES, build_paper_table, has_runs, load_published, preset_table, \
    table_ids, to_markdown
from tests.unit.test_paper_report import longbench_run
from tests.unit.test_report import make_run, niah_records, record

REPO = Path(__file__).resolve().parents[2]


def value(table: str, group: str, label: str, column: str):
    spec = load_published("pyramidkv", table)
    rows = [r for r in spec["rows"] if r["group"] == group and r["label"] == label]
    assert len(rows) == 1, (table, group, label)
    return rows[0]["values"][column]


# (table, row group, row label, column key, the paper's printed number), each read off the paper by eye
HAND_CHECKED = [
    ("t1", "Mistral-7B-Instruct, KV Size = 64", "SLM", "passage_retrieval_en", 27.33),
    ("t1", "LLaMa-3-70B-Instruct, KV Size = 64", "PyramidKV (Ours)", "passage_count", 12.50),  # Table 13: 12.00
    ("t1", "LLaMa-3-8B-Instruct, KV Size = Full", "FKV", "avg", 41.46),
    ("t12", "KV Size = 96", "H2O", "passage_retrieval_en", 77.48),
    ("t12", "KV Size = Full", "FKV", "avg", 42.71),
    ("t13", "KV Size = Full", "FKV", "2wikimqa", 54.90),
    ("t13", "KV Size = 64", "PyramidKV (Ours)", "passage_count", 12.00),
    ("t13", "KV Size = 2048", "SLM", "repobench-p", 68.73),
    ("t14", "", "StreamingLLM", "gov_report", 19.21),
    ("t14", "", "H2O", "gov_report", 24.13),
    ("t14", "", "PyramidKV", "avg", 27.48),
    ("t15", "Mistral-7B, 32k", "KV Cache 64", "pyramidkv", 80.50),
    ("t15", "LLaMa-3-70B, 8k", "KV Cache 128", "h2o", 82.30),
    ("t15", "LLaMa-3-8B, 8k", "KV Cache 96", "streamingllm", None),  # App. O prints no StreamingLLM numbers
    ("t2", "", "512", "memory", 428.0),
    ("t2", "", "512", "ratio", 6.3),
    ("t2", "", "Full", "lcc", 58.76),
    ("t4", "", "Geo.", "musique", 16.6),
    ("t4", "", "Gini.", "passage_retrieval_en", 65.51),
    ("t5", "", "alpha = 40", "trec", 44.00),
    ("t5", "", "alpha = 48", "hotpotqa", 39.04),
    ("t6", "", "beta = 14", "avg", 37.51),
    ("t6", "", "beta = 18", "samsum", 38.93),
    ("t7", "", "MInference", "repobench-p", 5.06),
    ("t7", "", "M. + P.", "avg", 40.47),
    ("t8", "", "PyramidInfer", "avg", 33.94),
    ("t9", "prompt 1024", "generate 1024", "selection_s", 0.01288),
    ("t9", "prompt 4096", "generate 4096", "inference_s", 138.87),
    ("t10", "prompt 2048", "generate 512", "snapkv", 19.54),
    ("t10", "prompt 512", "generate 4096", "streamingllm", 146.37),
]


@pytest.mark.parametrize("table,group,label,column,printed", HAND_CHECKED)
def test_hand_checked_cells(table, group, label, column, printed):
    assert value(table, group, label, column) == printed


def test_every_table_has_hand_checked_cells_and_tables_agree_where_the_paper_repeats_rows():
    assert {t for t, *_ in HAND_CHECKED} == set(table_ids("pyramidkv")) - {"t11"}  # t11: test_paper_report
    t1, rows = load_published("pyramidkv", "t1"), {}
    for t, model in [("t11", "LLaMa-3-8B-Instruct"), ("t12", "Mistral-7B-Instruct"), ("t13", "LLaMa-3-70B-Instruct")]:
        for r in load_published("pyramidkv", t)["rows"]:
            rows[(f"{model}, {r['group']}", r["label"])] = r["values"]
    differ = [(r["group"], r["label"], k) for r in t1["rows"] for k, v in r["values"].items()
              if v != rows[(r["group"], r["label"])][k]]
    assert differ == [("LLaMa-3-70B-Instruct, KV Size = 64", "PyramidKV (Ours)", "passage_count")]  # 12.50 vs 12.00
    assert len(t1["rows"]) == 27
    t11 = {(r["group"], r["label"]): r["values"] for r in load_published("pyramidkv", "t11")["rows"]}
    assert load_published("pyramidkv", "t6")["rows"][0]["values"] == t11[("KV Size = 128", "PyramidKV (Ours)")]
    assert load_published("pyramidkv", "t8")["rows"][1]["values"] == t11[("KV Size = 64", "PyramidKV (Ours)")]


def test_notes_name_the_averages_that_do_not_fit_their_rows():
    """The paper's Avg is the mean of its 16 cells (within 0.02: T11 SKV @96 prints 34.51 for 34.52) except where a
    note says otherwise (recomputed here)."""
    for table in table_ids("pyramidkv"):
        spec = load_published("pyramidkv", table)
        if not any(c.get("mean_of_columns") for c in spec["columns"]):
            continue
        keys = [c["key"] for c in spec["columns"] if not c.get("mean_of_columns")]
        off = [(r["group"], r["label"]) for r in spec["rows"]
               if abs(sum(r["values"][k] for k in keys) / len(keys) - r["values"]["avg"]) > 0.02]  # above rounding
        notes = " ".join(spec.get("notes", []))
        if table in ("t1", "t12"):  # Mistral KV 64 (and 96 in Table 12): ~1.1 below the mean
            assert {g for g, _ in off} == ({"Mistral-7B-Instruct, KV Size = 64"} if table == "t1"
                                           else {"KV Size = 64", "KV Size = 96"})
            assert "1.0-1.2 below the mean" in notes
        elif table == "t13":
            assert off == [("KV Size = 64", "PyramidKV (Ours)")] and "12.50 in Table 1" in notes
        elif table == "t7":
            assert off == [("", "MInference")] and "37.89" in notes
        else:
            assert off == [], table


# --- rows and columns against the presets ---------------------------------------------------------------------------
def makefile_value(name: str) -> str:
    """A Makefile variable's `:=` text, with the $(VARIABLE)s it names expanded (TailorKV's shared TAILORKV_EXTRA)."""
    m = re.search(rf"^{name}\s*:=(.*)$", (REPO / "Makefile").read_text(), re.M)
    return re.sub(r"\$\((\w+)\)", lambda ref: makefile_value(ref.group(1)), m.group(1)) if m else ""


def extra_runs(preset: str) -> list[list[str]]:
    """The Makefile's EXTRA_<preset>: each quoted entry's overrides."""
    return [entry.split() for entry in re.findall(r'"([^"]*)"', makefile_value(f"EXTRA_{preset}"))]


def expand(settings: dict[str, str]) -> list[dict[str, str]]:
    """A sweep's settings ({key: "a,b"}) -> one {key: value} per run."""
    keys = list(settings)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(str(settings[k]).split(",") for k in keys))]


@functools.cache  # Table 11's preset feeds five tables
def preset_runs(preset: str) -> tuple[dict, ...]:
    """Every run `make` starts for a preset (its sweep, then its extra runs; a `-m` extra sweeps the preset's swept
    keys too, as Hydra does), as the flattened resolved config plus the manifest's method, model and dataset: what
    the published rows match on."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        hydra = compose("config", overrides=[f"paper={preset}"], return_hydra_config=True).hydra
        swept = {k: str(v) for k, v in hydra.sweeper.params.items()}
        jobs = expand(swept)
        for extra in extra_runs(preset):
            own = dict(o.split("=", 1) for o in extra if o != "-m")
            jobs += expand({**swept, **own} if "-m" in extra else own)
        runs, composed = [], {}
        for job in jobs:  # one compose per method: the other swept keys are plain values, set on its config
            method = job.get("method", hydra.runtime.choices.method)
            if method not in composed:
                cfg = compose("config", overrides=[f"paper={preset}", f"method={method}"])
                composed[method] = {**pd.json_normalize(OmegaConf.to_container(cfg, resolve=False), sep=".")
                                    .iloc[0].to_dict(), "model": cfg.model.name, "dataset": cfg.dataset.name}
            run = {**composed[method], **job, "method": method}
            if method in ("tailorkv", "kivi"):  # the manifest names the variant (the method's `label`): <name>-<bits>
                run["method"] = f"{method}-{run['method.bits']}"
            if run.get("method.whole_layers") is not None:  # a wrapped selector (methods/wrappers.py `label`)
                run["method"] = f"{method}+per_layer"
            runs.append(run)
    return tuple(runs)


@functools.cache
def table_presets(table: str) -> list[str]:
    out = subprocess.run(["make", "-s", "--no-print-directory", "paper-tables"], cwd=REPO, capture_output=True,
                         text=True).stdout
    return next(line.split()[2:] for line in out.splitlines() if line.split()[:2] == ["pyramidkv", table])


@pytest.mark.parametrize("table", table_ids("pyramidkv"))
def test_every_row_and_column_is_run_by_the_tables_presets(table):
    """Each implemented cell's match (row + column, on the row's model and the table's dataset) is met by a run
    `make reproduce-pyramidkv-<table>` starts; and every run of the table's own presets fills some cell."""
    assert_runs_fill_table(load_published("pyramidkv", table), table_presets(table))


def assert_runs_fill_table(spec: dict, presets: list[str]) -> None:
    """Each implemented cell of `spec` is met by a run of `presets`, and every run of the table's own presets (not
    those it borrows) fills some cell."""
    table = spec["id"]
    runs = [(preset_table(p)[1] == table, r) for p in presets for r in preset_runs(p)]
    used = set()
    for row in spec["rows"]:
        if row.get("implemented") is False:
            continue
        for col in spec["columns"]:
            if col.get("mean_of_columns"):
                continue
            want = {**spec.get("match", {}), **row["match"], **col.get("match", {})}
            dataset = col.get("dataset", spec["dataset"])  # a column may read another dataset (TailorKV Table 3)
            hits = {i for i, (_, r) in enumerate(runs)
                    if r["model"] == row.get("model", spec["model"]) and r["dataset"] == dataset
                    and all(k == "budget" and r["method"] == "full" or str(r.get(k)).lower() == str(v).lower()
                            or k.startswith("meta.") and v in r[f"dataset.{k[5:]}s"]  # a sample of the run
                            for k, v in want.items())}
            assert hits, (table, row["label"], col["key"], want)
            used |= hits
    unused = [r for i, (own, r) in enumerate(runs) if own and i not in used]
    assert not unused, [(r["method"], r["budget"], r["model"]) for r in unused]


# --- the report on PyramidKV's multi-model, memory and needle tables ------------------------------------------------
def test_table_1_fills_each_model_block_from_its_own_models_runs(tmp_path):
    longbench_run(tmp_path / "a", "snapkv", 64, {"qasper": [1.0, 0.5]}, model="mistral-7b-instruct-v0.2")
    longbench_run(tmp_path / "b", "snapkv", 64, {"qasper": [0.25]}, model="llama-3-8b-instruct")
    df = load_runs([tmp_path])
    t1 = {(r["group"], r["label"]): r["cells"] for r in build_paper_table(df, "pyramidkv", table="t1").rows}
    assert t1[("Mistral-7B-Instruct, KV Size = 64", "SKV")]["qasper"].rebuilt == 75.0
    assert t1[("Mistral-7B-Instruct, KV Size = 64", "SKV")]["qasper"].published == 17.17
    assert t1[("LLaMa-3-8B-Instruct, KV Size = 64", "SKV")]["qasper"].rebuilt == 25.0
    assert t1[("LLaMa-3-70B-Instruct, KV Size = 64", "SKV")]["qasper"].rebuilt is None
    t13 = build_paper_table(df, "pyramidkv", table="t13")  # the runs are the paper's other models: not Table 13's
    assert not has_runs(t13) and "No matching runs" in to_markdown(t13)
    assert has_runs(build_paper_table(df, "pyramidkv", table="t12"))
    text = to_markdown(build_paper_table(df, "pyramidkv", table="t12"))
    assert "Rebuilt on" not in text and "Note: The paper's Avg of the Mistral KV 64 and 96 rows" in text


def test_table_2_memory_and_ratio_from_the_records(tmp_path):
    recs = [record(i, 0.5, meta={"task": "qmsum"}, scores={"longbench": 0.5}, kv_bytes=b, full_kv_bytes=f)
            for i, (b, f) in enumerate([(3 << 20, 12 << 20), (4 << 20, 40 << 20)])]
    make_run(tmp_path, "pyramidkv", 512, recs, dataset="longbench", model="llama-3-8b-instruct", primary="longbench")
    rows = {r["label"]: r["cells"] for r in build_paper_table(load_runs([tmp_path]), "pyramidkv", table="t2").rows}
    assert rows["512"]["memory"].rebuilt == 4.0 and rows["512"]["memory"].published == 428.0  # largest cache, MiB
    assert rows["512"]["ratio"].rebuilt == 10.0  # 100 x 4 MiB / 40 MiB
    assert rows["512"]["qmsum"].rebuilt == 50.0 and rows["1024"]["memory"].note == "not run"


def test_table_15_needle_cells_and_figure(tmp_path):
    grid = {(1000, 0): 1.0, (1000, 100): 0.5, (2000, 0): 0.0, (2000, 100): 1.0}
    for method, budget in [("full", None), ("pyramidkv", 64), ("snapkv", 64), ("streamingllm", 64)]:
        run = make_run(tmp_path, method, budget, niah_records(grid), dataset="niah_pyramidkv",
                       model="llama-3-8b-instruct")
        (run / "config.yaml").write_text("{}")
    table = build_paper_table(load_runs([tmp_path]), "pyramidkv", table="t15")
    rows = {(r["group"], r["label"]): r["cells"] for r in table.rows}
    k64 = rows[("LLaMa-3-8B, 8k", "KV Cache 64")]
    assert k64["pyramidkv"].rebuilt == 62.5 and k64["pyramidkv"].published == 92.9
    assert k64["full"].rebuilt == 62.5 and rows[("LLaMa-3-8B, 8k", "KV Cache 96")]["full"].rebuilt == 62.5
    assert k64["streamingllm"].rebuilt == 62.5 and k64["streamingllm"].published is None
    assert k64["h2o"].note == "not run" and rows[("Mistral-7B, 32k", "KV Cache 64")]["full"].rebuilt is None
    assert "62.50 / –" in to_markdown(table)
    fig = FIGURES["needle"](table)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["FullKV, acc 62.5", "StreamingLLM, KV Size=64, acc 62.5", "SnapKV, KV Size=64, acc 62.5",
                      "PyramidKV, KV Size=64, acc 62.5"]


def test_latency_tables_read_the_timings_of_each_length_pair(tmp_path):
    def rec(i, p, g, prefill, compress, decode):
        return record(i, 1.0, meta={"prompt_length": p, "generation_length": g}, scores={"generated": 1.0},
                      prefill_s=prefill, compress_s=compress, decode_s=decode)

    for method, scale in [("pyramidkv", 1.0), ("snapkv", 2.0)]:
        recs = [rec(0, 512, 512, 0.5 * scale, 0.01, 10.0), rec(1, 512, 1024, 0.5, 0.03, 20.0 * scale)]
        make_run(tmp_path, method, 128, recs, dataset="fixed_length", model="llama-3-8b-instruct", primary="generated")
    df = load_runs([tmp_path])
    t9 = {(r["group"], r["label"]): r["cells"] for r in build_paper_table(df, "pyramidkv", table="t9").rows}
    cell = t9[("prompt 512", "generate 512")]
    assert math.isclose(cell["inference_s"].rebuilt, 10.51) and cell["inference_s"].published == 18.26
    assert math.isclose(cell["selection_s"].rebuilt, 0.01) and cell["allocation_s"].note.startswith("not timed apart")
    assert math.isclose(t9[("prompt 512", "generate 1024")]["inference_s"].rebuilt, 20.53)
    assert t9[("prompt 1024", "generate 512")]["inference_s"].note == "not run"
    text = to_markdown(build_paper_table(df, "pyramidkv", table="t9"))
    assert "0.0100 / 0.0194 (-0.0094)" in text and "– / 0.000003 (not timed apart" in text
    t10 = {(r["group"], r["label"]): r["cells"] for r in build_paper_table(df, "pyramidkv", table="t10").rows}
    assert math.isclose(t10[("prompt 512", "generate 512")]["snapkv"].rebuilt, 11.01)
    assert math.isclose(t10[("prompt 512", "generate 1024")]["snapkv"].rebuilt, 40.53)
    assert t10[("prompt 512", "generate 512")]["h2o"].note == "not run"
