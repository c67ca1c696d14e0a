"""TailorKV's tables: published cells hand-checked against the paper's text, Table 3's class averages against the
per-task Tables 14 and 15 (where they disagree, the notes say so), every implemented cell run by `make
reproduce-tailorkv-<id>` and every run filling a cell, and the report on class averages across two datasets and on
RULER's per-length rows, from hand-written records."""
from __future__ import annotations

import functools
import subprocess

import pytest
import yaml

from kvbench.report import load_runs
from kvbench.report.paper import build_paper_table, load_published, table_ids, to_markdown
from tests.unit.test_paper_pyramidkv import REPO, assert_runs_fill_table
from tests.unit.test_report import make_run, record


def value(table: str, group: str, label: str, column: str):
    rows = [r for r in load_published("tailorkv", table)["rows"] if r["group"] == group and r["label"] == label]
    assert len(rows) == 1, (table, group, label)
    return rows[0]["values"][column]


LLAMA, YI9, YI6 = "Llama-3.1-8B-Instruct", "Yi-9B-200K", "Yi-6B-200K"
# (table, row group, row label, column key, the paper's printed number), each read off the paper by eye
HAND_CHECKED = [
    ("t14", YI9, "Yi-9B", "qasper", 38.4),
    ("t14", YI9, "SnapKV", "passage_retrieval_en", 36.0),
    ("t14", YI9, "TailorKV-1", "passage_retrieval_en", 45.0),
    ("t14", YI6, "Yi-6B", "multi_news", 0.01),
    ("t14", YI6, "TailorKV-2", "avg", 28.2),
    ("t14", LLAMA, "PQCache", "gov_report", 29.0),
    ("t15", LLAMA, "TailorKV-2", "number_string", 89.4),  # printed "TailorKV-1" (twice)
    ("t15", YI9, "Quest", "number_string", 96.9),
    ("t15", YI9, "TailorKV-2", "number_string", 99.7),
    ("t15", YI6, "StreamLLM", "code_debug", 25.8),
    ("t16", f"{LLAMA}, 64k", "Llama-3.1-8B", "cwe", 14.8),
    ("t16", f"{YI9}, 128k", "StreamLLM", "niah_multiquery", 1.14),
    ("t16", f"{YI6}, 128k", "TailorKV-1", "qa_2", 22.7),
    ("t16", f"{LLAMA}, 128k", "TailorKV-2", "vt", 85.6),
    ("t16", f"{YI9}, 64k", "Yi-9B", "avg", 68.1),
    ("t3", LLAMA, "TailorKV-2", "retr", 94.8),
    ("t3", YI9, "PQCache", "synth", 27.8),
    ("t3", YI6, "Yi-6B", "code", 69.8),  # Table 14's Yi-6B Repo/LCC give 59.85 (a note says so)
    ("t3", YI6, "TailorKV-1", "ib_avg", 37.2),
    ("t3", LLAMA, "StreamLLM", "lb_avg", 40.6),
    ("t5", "", "SimLayerKV", "passage_retrieval_en", 95.5),
    ("t5", "", "SimLayerKV", "avg", 52.6),
    ("t5", "", "TailorKV-2", "trec", 70.5),
    ("t8", "", "SnapKV †", "qasper", 32.4),
    ("t8", "", "Quest †", "avg", 47.8),
    ("t8", "", "StreamLLM †", "lcc", 52.8),
    ("t8", "", "SnapKV ‡", "avg", 45.2),
    ("t1", "", "16-bit", "repobench-p", 56.7),
    ("t1", "", "1-bit (KIVI)", "gov_report", 8.3),
    ("t1", "", "L = {0}", "triviaqa", 92.1),  # bold in the paper: the best row; its label is not legible
    ("t1", "", "row 4 (L not legible)", "gov_report", 32.6),
    ("t1", "", "row 5 (L not legible)", "lcc", 59.3),
    ("t1", "", "row 6 (L not legible)", "triviaqa", 89.4),
]


@pytest.mark.parametrize("table,group,label,column,printed", HAND_CHECKED)
def test_hand_checked_cells(table, group, label, column, printed):
    assert value(table, group, label, column) == printed


def test_every_table_has_hand_checked_cells_and_repeated_rows_agree():
    assert {t for t, *_ in HAND_CHECKED} == set(table_ids("tailorkv"))
    t14 = {(r["group"], r["label"]): r["values"] for r in load_published("tailorkv", "t14")["rows"]}
    for table, pairs in [("t5", {"Llama-3.1-8B": "Llama-3.1-8B", "TailorKV-1": "TailorKV-1",
                                 "TailorKV-2": "TailorKV-2"}),
                         ("t8", {"Llama-3.1-8B": "Llama-3.1-8B", "StreamLLM ‡": "StreamLLM", "SnapKV ‡": "SnapKV",
                                 "Quest ‡": "Quest", "TailorKV-1": "TailorKV-1", "TailorKV-2": "TailorKV-2"})]:
        rows = {r["label"]: r["values"] for r in load_published("tailorkv", table)["rows"]}
        for label, same in pairs.items():  # the paper repeats Table 14's Llama rows
            assert rows[label] == t14[(LLAMA, same)], (table, label)


def test_table_3_is_the_class_mean_of_tables_14_and_15_except_where_its_notes_say():
    """Each class cell = the mean of its tasks in Table 14 / 15 within the paper's 0.1 (it truncates), and each Avg.
    the mean of all tasks, but for the cells the notes name (recomputed here)."""
    t3 = load_published("tailorkv", "t3")
    per_task: dict = {}  # (model, row) -> Table 14's and Table 15's per-task cells
    for t in ("t14", "t15"):
        for r in load_published("tailorkv", t)["rows"]:
            per_task.setdefault((r["group"], r["label"]), {}).update(r["values"])
    off = []
    for row in t3["rows"]:
        tasks = per_task[(row["group"], row["label"])]
        for col in t3["columns"]:
            mean = sum(tasks[t] for t in col["cell"]["tasks"]) / len(col["cell"]["tasks"])
            if abs(mean - row["values"][col["key"]]) > 0.1 + 1e-9:
                off.append((row["group"], row["label"], col["key"], round(mean, 3)))
    assert off == [(LLAMA, "PQCache", "summ", 27.45), (LLAMA, "TailorKV-2", "novel", 29.55),
                   (YI9, "TailorKV-1", "retr", 99.15), (YI9, "TailorKV-2", "retr", 99.85),
                   (YI6, "Yi-6B", "summ", 1.405), (YI6, "Yi-6B", "code", 59.85), (YI6, "Yi-6B", "dia", 1.0)]
    notes = " ".join(t3["notes"])
    assert all(str(v) in notes for v in (27.45, 29.55, 99.15, 99.85, 1.405, 59.85))


@functools.cache
def tailorkv_presets() -> dict[str, list[str]]:
    out = subprocess.run(["make", "-s", "--no-print-directory", "paper-tables"], cwd=REPO, capture_output=True,
                         text=True).stdout
    return {line.split()[1]: line.split()[2:] for line in out.splitlines() if line.split()[0] == "tailorkv"}


@pytest.mark.parametrize("table", table_ids("tailorkv"))
def test_every_row_and_column_is_run_by_the_tables_presets(table):
    """Each implemented cell (Quest, PQCache, SimLayerKV and the † rows are not) is met by a run of `make
    reproduce-tailorkv-<table>` on the row's model and the column's dataset, and each run of the table's own presets
    fills some cell; the old tailorkv-longbench / tailorkv-ruler targets are gone (one way per table)."""
    assert_runs_fill_table(load_published("tailorkv", table), tailorkv_presets()[table])
    assert "tailorkv-longbench:" not in (REPO / "Makefile").read_text()


def runs(root, dataset, model, method, budget, cells):
    """One run per (method, budget) whose records are `cells`: [(task, length, score), ...]."""
    recs = [record(i, s, meta={"task": task, "length": length}) for i, (task, length, s) in enumerate(cells)]
    run = make_run(root / method, method, budget, recs, dataset=dataset, model=model, primary="score")
    (run / "config.yaml").write_text("{}")


def test_table_3_classes_read_each_datasets_runs_at_its_budget(tmp_path):
    llama = "llama-3.1-8b-instruct"
    runs(tmp_path / "lb", "longbench_tailorkv", llama, "snapkv", 192,
         [("qasper", 0, 1.0), ("qasper", 0, 0.5), ("multifieldqa_en", 0, 0.25)])
    runs(tmp_path / "ib", "infinitebench", llama, "snapkv", 1024, [("math_find", 0, 1.0), ("math_find", 0, 0.0),
                                                                   ("passkey", 0, 1.0)])
    runs(tmp_path / "ib192", "infinitebench", llama, "snapkv", 192, [("math_find", 0, 1.0)])  # not Table 3's budget
    table = build_paper_table(load_runs([tmp_path]), "tailorkv", table="t3")
    rows = {(r["group"], r["label"]): r["cells"] for r in table.rows}
    snap = rows[(LLAMA, "SnapKV")]
    assert snap["sd_qa"].rebuilt == 50.0 and snap["sd_qa"].published == 35.2  # (75 + 25) / 2
    assert snap["math"].rebuilt == 50.0 and snap["math"].published == 34.0  # the 1024 run only
    assert snap["retr"].rebuilt is None and snap["retr"].note == "task number_string not in the run"
    assert snap["md_qa"].note == "task hotpotqa not in the run"
    assert rows[(YI9, "SnapKV")]["sd_qa"].note == "not run"  # Llama's runs do not fill the Yi rows
    assert rows[(LLAMA, "Quest")]["sd_qa"].note == "not run"  # implemented (quest at 192 and 1024): no run here
    assert "50.00 / 35.20 (+14.80)" in to_markdown(table)


def test_table_16_rows_read_their_length_and_model(tmp_path):
    runs(tmp_path, "ruler", "yi-6b-200k", "tailorkv-2", 1024,
         [("vt", 65536, 1.0), ("vt", 65536, 0.0), ("vt", 131072, 0.25), ("cwe", 131072, 0.5)])
    table = build_paper_table(load_runs([tmp_path]), "tailorkv", table="t16")
    rows = {(r["group"], r["label"]): r["cells"] for r in table.rows}
    assert rows[(f"{YI6}, 64k", "TailorKV-2")]["vt"].rebuilt == 50.0
    assert rows[(f"{YI6}, 128k", "TailorKV-2")]["vt"].rebuilt == 25.0
    assert rows[(f"{YI6}, 128k", "TailorKV-2")]["vt"].published == 14.4
    assert rows[(f"{YI6}, 128k", "TailorKV-2")]["cwe"].rebuilt == 50.0
    assert rows[(f"{YI6}, 64k", "TailorKV-2")]["cwe"].note == "task not in the run"
    assert rows[(f"{YI9}, 64k", "TailorKV-2")]["vt"].rebuilt is None
    assert rows[(f"{LLAMA}, 64k", "TailorKV-1")]["vt"].rebuilt is None


def test_a_smoke_forms_stand_in_lengths_fill_the_rows_they_stand_for(tmp_path):
    """paper_settings.stand_in (tailorkv_t16_smoke): a stand-in model's 512- and 768-token runs fill the 64k and
    128k rows, each its own length's records; without it they match no row; the header names each stand-in."""
    small = "smollm2-135m-instruct"
    runs(tmp_path / "smoke", "ruler", small, "snapkv", 1024,
         [("vt", 512, 1.0), ("vt", 512, 0.0), ("vt", 768, 0.25), ("vt", 1024, 1.0)])
    (config,) = (tmp_path / "smoke").rglob("config.yaml")
    config.write_text(yaml.safe_dump({"paper_settings": {"stand_in": {"length": {65536: 512, 131072: 768}}}}))
    table = build_paper_table(load_runs([tmp_path / "smoke"]), "tailorkv", table="t16")
    rows = {(r["group"], r["label"]): r["cells"] for r in table.rows}
    assert table.model == small and table.stand_ins == ["length 65536 ran as 512", "length 131072 ran as 768"]
    assert rows[(f"{LLAMA}, 64k", "SnapKV")]["vt"].rebuilt == 50.0  # (1 + 0) / 2: the 512-token records
    assert rows[(f"{YI6}, 64k", "SnapKV")]["vt"].rebuilt == 50.0  # a stand-in model fills every block
    assert rows[(f"{LLAMA}, 128k", "SnapKV")]["vt"].rebuilt == 25.0  # not the 1024-token record
    assert "Stand-ins (a smoke form's paper_settings.stand_in): length 65536 ran as 512; length 131072 ran as 768." \
        in to_markdown(table)
    runs(tmp_path / "plain", "ruler", small, "snapkv", 1024, [("vt", 512, 1.0)])  # no stand-in: no row is 512 tokens
    plain = build_paper_table(load_runs([tmp_path / "plain"]), "tailorkv", table="t16")
    assert not any(c.rebuilt is not None for r in plain.rows for c in r["cells"].values()) and not plain.stand_ins
