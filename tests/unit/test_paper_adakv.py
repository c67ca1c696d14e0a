"""Ada-KV's tables beyond Table 1: Table 2 (LWM-Text-Chat-1M) and the needle Figure 6. Published cells hand-checked
against the paper's text, every implemented cell is run by `make reproduce-adakv-<id>` and every run fills a cell, and
the needle figure draws Ada-KV's own panels from hand-written records."""
from __future__ import annotations

import pytest

from kvbench.report import load_runs
from kvbench.report.paper import CONFIGS, FIGURES, build_paper_table, load_published, table_ids
from tests.unit.test_paper_pyramidkv import assert_runs_fill_table
from tests.unit.test_report import make_run, niah_records


def value(table: str, group: str, label: str, column: str):
    rows = [r for r in load_published("adakv", table)["rows"] if r["group"] == group and r["label"] == label]
    assert len(rows) == 1, (table, group, label)
    return rows[0]["values"][column]


# (table, row group, row label, column key, the paper's printed number), each read off the paper by eye
HAND_CHECKED = [
    ("t2", "Full Cache", "Full Cache", "avg", 29.91),
    ("t2", "Full Cache", "Full Cache", "passage_retrieval_en", 6.50),
    ("t2", "B=128h", "Ada-SnapKV", "trec", 52.50),
    ("t2", "B=128h", "StreamingLLM", "passage_count", 0.50),
    ("t2", "B=256h", "StreamingLLM", "gov_report", 21.06),
    ("t2", "B=512h", "Pyramid", "qmsum", 24.62),
    ("t2", "B=1024h", "Ada-Pyramid", "lcc", 40.85),
    ("t2", "B=1024h", "H2O", "avg", 28.00),
    ("f6", "", "B=128h", "snapkv", 94.84),
    ("f6", "", "B=128h", "adakv", 95.99),
    ("f6", "", "B=128h", "pyramidkv", 96.02),
    ("f6", "", "B=128h", "ada_pyramidkv", 96.69),
    ("f6", "", "B=128h", "full", None),  # the full cache stops at 37K: the paper gives no average
]


@pytest.mark.parametrize("table,group,label,column,printed", HAND_CHECKED)
def test_hand_checked_cells(table, group, label, column, printed):
    assert value(table, group, label, column) == printed


def test_table_2_has_table_1s_layout_and_averages_that_fit_its_rows():
    """Same rows, columns and matches as Table 1, LWM's model; each Avg. is the mean of its 16 cells (to rounding)."""
    t1, t2 = load_published("adakv", "t1"), load_published("adakv", "t2")
    assert t2["columns"] == t1["columns"] and t2["model_config"] == "lwm_text_chat_1m"
    assert [(r["group"], r["label"], r["match"]) for r in t2["rows"]] == [(r["group"], r["label"], r["match"])
                                                                           for r in t1["rows"]]
    keys = [c["key"] for c in t2["columns"] if not c.get("mean_of_columns")]
    for row in t2["rows"]:
        assert abs(sum(row["values"][k] for k in keys) / len(keys) - row["values"]["avg"]) <= 0.02, row["label"]


def test_table_2_runs_lwm_as_the_official_script_and_says_so():
    """runall.sh's LWM block: bf16, --max_length 1048576 (no cut), pred.py's build_chat has no LWM branch; Table 1's
    method settings; the manifest's choices name the LWM reading, not Mistral's 31500 cut."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=["paper=adakv_t2", "method=ada_pyramidkv"])
    assert cfg.model.path == "LargeWorldModel/LWM-Text-Chat-1M" and cfg.model.dtype == "bfloat16"
    assert cfg.model.max_prompt_tokens == 1048576 and cfg.model.chat_template is False
    assert (cfg.method.window, cfg.method.alpha, cfg.method.granularity) == (32, 0.5, "query_head")
    assert cfg.paper_settings.id == "t2" and any("no truncation" in c for c in cfg.paper_settings.choices)
    assert not any("31500" in c for c in cfg.paper_settings.choices)


@pytest.mark.parametrize("table", table_ids("adakv"))
def test_every_row_and_column_is_run_by_the_tables_presets(table):
    """Each implemented cell is met by a run of `make reproduce-adakv-<table>` (its preset + EXTRA_), on the
    row's model and the table's dataset, and each of those runs fills some cell."""
    assert_runs_fill_table(load_published("adakv", table), [f"adakv_{table}"])


def test_figure_6_cells_and_panels_from_needle_records(tmp_path):
    grid = {(1000, 0): 1.0, (1000, 100): 0.5, (5000, 0): 0.0, (5000, 100): 1.0}
    for method, budget in [("full", None), ("snapkv", 128), ("adakv", 128), ("ada_pyramidkv", 128)]:
        run = make_run(tmp_path, method, budget, niah_records(grid), model="lwm-text-chat-1m")
        (run / "config.yaml").write_text("{}")
    table = build_paper_table(load_runs([tmp_path]), "adakv", table="f6")
    cells = table.rows[0]["cells"]
    assert cells["adakv"].rebuilt == 62.5 and cells["adakv"].published == 95.99
    assert cells["full"].rebuilt == 62.5 and cells["full"].published is None
    assert cells["pyramidkv"].rebuilt is None and cells["pyramidkv"].note == "not run"
    fig = FIGURES["needle"](table)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["FullKV, acc 62.5", "SnapKV, KV Size=128, acc 62.5", "Ada-KV, KV Size=128, acc 62.5",
                      "Ada-Pyramid, KV Size=128, acc 62.5"]
