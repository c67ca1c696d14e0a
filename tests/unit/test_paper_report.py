"""`python -m kvbench.report --paper`: each paper's layout, rebuilt values recomputed by hand from hand-written
records, published values from the shipped data file, differences, and the reason every missing cell gives."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from kvbench.report import load_runs
from kvbench.report.paper import (CONFIGS, build_paper_table, headline_id, load_published, paper_names, preset_table,
                                  table_ids, to_markdown)
from tests.unit.test_report import make_run, record

REPO = Path(__file__).resolve().parents[2]
PAPERS = ["adakv", "buzz", "keyformer", "pyramidkv", "tailorkv"]


def longbench_run(root, method, budget, scores_by_task, model="llama-3-8b-instruct", config=None):
    recs = [record(i, s, meta={"task": task, "length": 100, "index": i}, scores={"longbench": s})
            for i, (task, s) in enumerate((t, s) for t, ss in scores_by_task.items() for s in ss)]
    run = make_run(root, method, budget, recs, dataset="longbench", model=model, primary="longbench")
    (run / "config.yaml").write_text(json.dumps(config or {"positions": "original", "method": {}}))
    return run


def test_every_seed_paper_ships_its_published_tables():
    assert paper_names() == PAPERS
    for name in PAPERS:
        assert load_published(name)["headline"] is True  # the table paper=<name> and --paper stand for
        for table in table_ids(name):
            spec = load_published(name, table)
            assert spec["paper"] == name and spec["id"] == table and spec["table"] and spec["source"] and spec["rows"]
            keys = [c["key"] for c in spec["columns"]]
            assert len(set(keys)) == len(keys), (name, table)
            for row in spec["rows"]:
                assert set(row["values"]) == set(keys), (name, table, row["label"])
    assert {n: headline_id(n) for n in PAPERS} == {"adakv": "t1", "buzz": "t2", "keyformer": "t3", "pyramidkv": "t11",
                                                    "tailorkv": "t14"}
    t11 = load_published("pyramidkv", "t11")  # spot checks against the paper's printed cells
    fkv = next(r for r in t11["rows"] if r["label"] == "FKV")
    assert fkv["values"]["narrativeqa"] == 25.70 and fkv["values"]["avg"] == 41.46
    assert [r["label"] for r in t11["rows"][:5]] == ["FKV", "SKV", "H2O", "SLM", "PyramidKV (Ours)"]
    ada = load_published("adakv", "t1")
    assert next(r for r in ada["rows"] if r["match"] == {"method": "adakv", "budget": 128})["values"]["avg"] == 36.71


# A reader has the papers, not the development notes (shared/seeds, shared/specs): every published table cites its
# paper as one can check it (issue 35), and nothing kvbench ships points at those notes.
CITATION = re.compile(r"arXiv \d{4}\.\d{4,5}(?: v\d+)?|(?:MLSys|ICLR|NeurIPS|ICML|Findings of ACL|ACL|EMNLP) 20\d\d")
DEV_NOTES = re.compile(r"shared/seeds|shared/specs|\bspecs/|\bseeds/|\bseed-(?:adakv|buzz|keyformer|pyramidkv|tailorkv)\b"
                       r"|\banchor-(?:benchmarks|kvpress|2026)\b")
SHIPPED = ["kvbench", "docs", "configs", "scripts", "README.md", "Makefile"]
TEXT = {".py", ".md", ".json", ".yaml", ".yml", ".txt", ".toml", ".cfg", ".sh", ".jinja", ".html", ""}


def shipped_files() -> list[Path]:
    files = []
    for top in SHIPPED:
        path = REPO / top
        found = [path] if path.is_file() else sorted(path.rglob("*"))
        files += [f for f in found if f.is_file() and f.suffix in TEXT and "__pycache__" not in f.parts]
    return files


def dev_note_pointers(files: list[Path]) -> list[str]:
    return [f"{f.relative_to(REPO)}:{n}: {line.strip()[:100]}" for f in files
            for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if DEV_NOTES.search(line)]


def test_nothing_shipped_points_at_development_notes():
    files = shipped_files()
    assert len(files) > 300 and REPO / "README.md" in files  # the walk sees kvbench/, docs/, configs/, ...
    assert dev_note_pointers(files) == []


def test_dev_note_pointers_are_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "a.md").write_text("see shared/specs/seed-adakv.md\nthe paper's Table 1\n(seed-buzz.md 5.1)\n"
                                   "specs/anchor-benchmarks.md\nshared/seeds/000_x.txt\nrandom seed 0, seed-paper\n")
    assert [hit.split(":")[1] for hit in dev_note_pointers([tmp_path / "a.md"])] == ["1", "3", "4", "5"]


def test_every_published_table_cites_its_paper():
    for name in PAPERS:
        cited = set()
        for table in table_ids(name):
            source = load_published(name, table)["source"]
            kind = {"t": "Table", "f": "Figure"}[table[0]]
            number = table[1:].upper()  # t11 -> Table 11, tb -> Table B, f7 -> Figure 7
            assert re.search(rf"\b{kind} {number}\b", source), (name, table, source)
            assert CITATION.search(source), (name, table, source)  # an arXiv id or a venue
            assert not DEV_NOTES.search(source), (name, table, source)
            cited.add(tuple(CITATION.findall(source)))
        assert len(cited) == 1, (name, cited)  # every table of a paper cites the same paper


def test_every_table_has_a_make_target_and_presets_that_exist():
    """`make reproduce-<paper>-<id>` exists for exactly the published tables, and the presets it runs exist (none
    only for a table whose every row is marked not implemented, with the reason, or whose runs another command
    makes: `runner`, e.g. Keyformer Table 2's lm-eval runs)."""
    out = subprocess.run(["make", "-s", "--no-print-directory", "paper-tables"], cwd=REPO, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    listed = [line.split() for line in out.stdout.splitlines()]
    assert {(paper, table) for paper, table, *_ in listed} == {(p, t) for p in PAPERS for t in table_ids(p)}
    for paper, table, *presets in listed:
        assert all((CONFIGS / "paper" / f"{preset}.yaml").is_file() for preset in presets), presets
        assert all(preset_table(preset)[0] == paper for preset in presets)
        if not presets:  # a table make cannot run: its runs come from another command (`runner`), or every row
            spec = load_published(paper, table)  # says why nothing can run it here
            assert spec.get("runner") or all(row.get("implemented") is False and row["note"] for row in spec["rows"])


def test_keyformer_table_2_target_runs_lm_eval_once_per_shot_count():
    """`make reproduce-keyformer-t2` (no sweep: lm-eval) runs the harness for 0 and 5 shots, each over every row of
    the published table (its methods and ratio, its tasks) on both models, online, then imports the results."""
    out = subprocess.run(["make", "-n", "-s", "--no-print-directory", "reproduce-keyformer-t2"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.replace("\\\n", " ").splitlines()
    harness = [line.split() for line in lines if "kvbench.harness" in line]
    spec = load_published("keyformer", "t2")
    tasks = {row["match"]["meta.task"] for row in spec["rows"]}
    methods = {(row["match"]["method"], row["match"].get("ratio")) for row in spec["rows"]}
    shots, runs = [], set()
    for words in harness:
        assert "HF_DATASETS_OFFLINE=1" not in words  # the real tables read lm-eval's datasets from the Hub
        shots.append(int(words[words.index("--num_fewshot") + 1]))
        assert set(words[words.index("--tasks") + 1].split(",")) == tasks
        for i in (i for i, w in enumerate(words) if w == "--model_args"):
            args = dict(kv.split("=", 1) for kv in words[i + 1].split(","))
            runs.add((shots[-1], args["model"], args["method"], float(args["ratio"]) if "ratio" in args else None))
    assert sorted(shots) == [0, 5]
    assert runs == {(n, m, method, ratio) for n in (0, 5) for m in ("mpt_7b", "cerebras_gpt_6_7b")
                    for method, ratio in methods}
    assert sum("kvbench.report.lm_eval_runs" in line for line in lines) == 2
    assert "--paper keyformer --table t2" in lines[-1]


def test_unknown_paper_or_table_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown paper 'pyramid'; choose one of adakv, buzz"):
        load_published("pyramid")
    with pytest.raises(ValueError, match="unknown table 't99' for pyramidkv; choose one of .*t11"):
        load_published("pyramidkv", "t99")
    assert preset_table("pyramidkv") == ("pyramidkv", "t11") == preset_table("pyramidkv_smoke")
    assert preset_table("buzz_tb_smoke") == ("buzz", "tb")


def test_pyramidkv_cells_rebuilt_published_difference_and_reasons(tmp_path):
    spec = load_published("pyramidkv")
    tasks = [c["key"] for c in spec["columns"] if c["key"] != "avg"]
    every = {t: [0.5, 0.25] for t in tasks}
    longbench_run(tmp_path, "snapkv", 64, every)
    longbench_run(tmp_path, "h2o", 64, {"qasper": [1.0, 0.0, 0.5]})
    table = build_paper_table(load_runs([tmp_path]), "pyramidkv")
    assert table.model == "llama-3-8b-instruct"
    rows = {(r["group"], r["label"]): r["cells"] for r in table.rows}
    skv = rows[("KV Size = 64", "SKV")]
    assert skv["narrativeqa"].rebuilt == 37.5 and skv["narrativeqa"].published == 19.86
    assert math.isclose(skv["narrativeqa"].diff, 37.5 - 19.86)
    assert skv["avg"].rebuilt == 37.5  # all 16 tasks present: the plain mean
    h2o = rows[("KV Size = 64", "H2O")]
    assert h2o["qasper"].rebuilt == 50.0 and h2o["narrativeqa"].note == "task not in the run"
    assert h2o["avg"].rebuilt is None
    assert rows[("KV Size = 96", "SKV")]["qasper"].note == "not run"  # runs of this table exist here
    text = to_markdown(table)
    assert "37.50 / 19.86 (+17.64)" in text and "– / 20.80 (task not in the run)" in text and "50.00 / 11.34 (+38.66)" in text


def test_other_models_runs_are_used_and_said_so(tmp_path):
    longbench_run(tmp_path, "pyramidkv", 64, {"hotpotqa": [1.0]}, model="smollm2-135m-instruct")
    table = build_paper_table(load_runs([tmp_path]), "pyramidkv")
    assert table.model == "smollm2-135m-instruct" and "not the paper's" in to_markdown(table)
    cell = next(r for r in table.rows if r["label"].startswith("PyramidKV") and "64" in r["group"])["cells"]
    assert cell["hotpotqa"].rebuilt == 100.0


def test_buzz_geometric_mean_matches_on_ratio_positions_and_logn(tmp_path):
    def run(method, ratio, logn, r1, r2, rl):
        recs = [record(0, r1, scores={"buzz_rouge1": r1, "buzz_rouge2": r2, "buzz_rougeL": rl})]
        d = make_run(tmp_path, method, None, recs, dataset="xsum", model="llama-2-7b-chat", primary="buzz_rouge1",
                     tail="")
        manifest = json.loads((d / "manifest.json").read_text())
        manifest["ratio"] = ratio
        (d / "manifest.json").write_text(json.dumps(manifest))
        (d / "config.yaml").write_text(json.dumps({"positions": "shift", "method": {"logn": logn}}))
        d.rename(d.with_name(f"r{ratio}-{method}-{logn}"))

    run("buzz", 0.6, False, 0.20, 0.05, 0.18)
    run("buzz", 0.6, True, 0.30, 0.06, 0.20)
    table = build_paper_table(load_runs([tmp_path]), "buzz")
    rows = {r["label"]: r["cells"] for r in table.rows}
    assert math.isclose(rows["BUZZ"]["40"].rebuilt, (20 * 5 * 18) ** (1 / 3))
    assert math.isclose(rows["BUZZ (with logn)"]["40"].rebuilt, (30 * 6 * 20) ** (1 / 3))
    assert rows["BUZZ"]["40"].published == 12.3 and rows["BUZZ"]["60"].note == "not run"


def test_missing_cells_say_why_without_runs(tmp_path):
    table = build_paper_table(pd.DataFrame(columns=["model", "dataset", "method", "run_dir"]), "keyformer")
    rows = {r["label"]: r["cells"] for r in table.rows}
    expected = ("not run" if Path("data/cnn_dailymail").exists()
                else "dataset not present (data/cnn_dailymail: see configs/dataset/cnn_dailymail.yaml)")
    assert rows["Window"]["rouge2"].note == expected
    assert rows["Keyformer (Org Pos) [Shared]"]["rouge1"].note == expected  # implemented: the spec's reconstruction
    empty = pd.DataFrame(columns=["model", "dataset", "method", "run_dir"])
    pyramid = {r["label"]: r["cells"] for r in build_paper_table(empty, "pyramidkv", table="t4").rows}
    assert pyramid["Geo."]["qasper"].note.startswith("not implemented in kvbench")
    tailor = {r["label"]: r["cells"] for r in build_paper_table(empty, "tailorkv").rows}
    assert not tailor["Quest"]["lcc"].note.startswith("not implemented")  # Quest and PQCache have runs to match
    assert tailor["PQCache"]["lcc"].note == tailor["SnapKV"]["lcc"].note


def test_cli_prints_the_layout_and_writes_files(tmp_path, capsys):
    """`python -m kvbench.report ... --paper` in this process (its main: what the command runs; the command as a
    process: every `make reproduce-<paper>-smoke` in tests/integration/test_paper_smoke.py)."""
    from kvbench.report.__main__ import main

    longbench_run(tmp_path / "results", "snapkv", 64, {"hotpotqa": [1.0]})
    assert main([str(tmp_path / "results"), "--paper", "pyramidkv", "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    assert "Table 11" in out and "| KV Size = 64 | SKV |" in out
    assert {p.name for p in (tmp_path / "report").iterdir()} >= {
        "paper_pyramidkv_t11.md", "paper_pyramidkv_t11.tex", "paper_pyramidkv_t11.csv", "paper_pyramidkv_t11_budget.png"}
    assert main([str(tmp_path / "results"), "--paper", "pyramidkv", "--table", "t11", "--out",
                 str(tmp_path / "one")]) == 0
    assert "| KV Size = 64 | SKV | –" in capsys.readouterr().out
    for argv, message in [(["--paper", "pyramid"], "kvbench: unknown paper 'pyramid'; choose one of adakv, buzz"),
                          (["--paper", "pyramidkv", "--table", "t99"], "kvbench: unknown table 't99'; pyramidkv has t"),
                          (["--table", "t11"], "kvbench: unknown table 't11'; it needs --paper")]:
        with pytest.raises(SystemExit) as bad:
            main([str(tmp_path), *argv, "--out", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert bad.value.code == 2 and err.strip().splitlines()[-1].startswith(message), err
    assert not (tmp_path / "x").exists()  # bad input writes nothing


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONFIGS / "paper").glob("*.yaml")))
def test_every_paper_preset_composes_and_instantiates_its_methods(preset):
    """Each preset and smoke form composes with each method of its sweep; the per-paper method settings apply.
    A full preset whose dataset is not in this kvbench yet (issue #11) must fail naming that dataset."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import kvbench.methods  # noqa: F401
    from kvbench.runs.config import build_method

    if preset.startswith("kvpress_leaderboard"):  # kvpress's leaderboard grid: no published table of a paper
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            swept = compose("config", overrides=[f"paper={preset}"], return_hydra_config=True).hydra.sweeper.params
            methods = str(swept.method).split(",")[:None if preset.endswith(("leaderboard", "aware")) else 1]
            for method in methods:  # each with kvpress's settings (configs/paper_method/kvpress_leaderboard_*)
                cfg = compose("config", overrides=[f"paper={preset}", f"method={method}", "ratio=0.5"])
                assert cfg.query == ("aware" if preset.endswith("aware") else "agnostic")
                assert cfg.paper_settings.name == "kvpress_leaderboard"
                instantiate(cfg.method).check_budget(448)  # ~ the smallest: 0.125 x a 4k RULER context
        assert str(swept.ratio) == "0.25,0.5,0.75,0.875"
        return
    if preset.partition("_")[0] not in paper_names():  # a setting without a published table (paper=reasoning)
        from kvbench.runs.validate import validate

        assert validate(["-m", f"paper={preset}", "model=tiny_llama", "dataset.root=tests/fixtures/gsm8k"]) >= 16
        return
    base, table = preset_table(preset)
    dataset = load_published(base, table)["dataset"]
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        if not preset.endswith("_smoke") and not (CONFIGS / "dataset" / f"{dataset}.yaml").is_file():
            with pytest.raises(Exception, match=dataset):
                compose("config", overrides=[f"paper={preset}"])
            return
        swept = compose("config", overrides=[f"paper={preset}"], return_hydra_config=True).hydra.sweeper.params
        for method in ["full", *str(swept.method).split(",")]:
            cfg = compose("config", overrides=[f"paper={preset}", f"method={method}"])
            assert cfg.paper_settings.name == base and cfg.paper_settings.choices
            assert cfg.paper_settings.id == table  # the manifest's paper block names the table that ran
            if base == "pyramidkv":  # and the reading of the paper that ran, from the run's own settings
                reading = OmegaConf.to_container(cfg.paper_settings, resolve=True)["reading"]
                assert reading == {"streamingllm_recent": cfg.method.get("recent"),
                                   "pyramidkv_exact": cfg.method.get("exact")}
            obj = build_method(cfg.method, lambda node, what: instantiate(node))  # + kvpress-wrapper switches
            instantiate(cfg.dataset)  # the preset's dataset settings fit its dataset (no stray keys from a parent)
            if cfg.budget is not None:
                obj.check_budget(cfg.budget)
            if base in ("pyramidkv", "adakv") and method not in ("full", "streamingllm"):
                assert cfg.method.granularity == "query_head"  # the paper-era layout, per query head
    if base == "pyramidkv" and dataset == "longbench":
        assert cfg.dataset.protocol == "pyramidkv_paper"  # the smoke form keeps the paper's protocol
