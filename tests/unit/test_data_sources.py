"""Where the data come from (issue 35): every download script reads its source at the commit its revision resolves
to and writes provenance.json; XSum comes from its parquet export (no loading script); each builder hands
provenance.json to the manifest. No Hub here, so what would need the network is replaced by a fake that records what
it was asked (the Hub's answer); `datasets` reads the XSum parquet files for real."""
from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.unit.test_cli import grid_here, records, run_here

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SHA = "c0ffee" + "0" * 34  # a commit, as the Hub would resolve a branch to


def script(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def fake_resolver(asked: list):
    return lambda repo, revision, *a: asked.append((repo, revision)) or (None if revision == "offline" else SHA)


def write_xsum_export(base: Path) -> dict[str, list[dict]]:
    """A look-alike of EdinburghNLP/xsum's refs/convert/parquet tree: default/<split>/NNNN.parquet, the validation
    split in two files, one column more than kvbench keeps."""
    from datasets import Dataset

    rows = {split: [{"document": f"{split} text {i}.", "summary": f"{split} summary {i}.", "id": f"{split[0]}{i}",
                     "extra": i} for i in range(n)] for split, n in (("train", 2), ("validation", 3), ("test", 1))}
    for split, part in (("train", rows["train"]), ("validation", rows["validation"][:2]), ("test", rows["test"])):
        (base / "default" / split).mkdir(parents=True, exist_ok=True)
        Dataset.from_list(part).to_parquet(str(base / "default" / split / "0000.parquet"))
    Dataset.from_list(rows["validation"][2:]).to_parquet(str(base / "default" / "validation" / "0001.parquet"))
    return rows


@pytest.fixture
def xsum_hub(tmp_path, monkeypatch):
    """download_seed_tasks with the Hub's parquet tree in tmp_path/hub; returns (module, rows, resolver calls,
    the (repo, revision) each read was made at)."""
    import datasets

    seed = script("download_seed_tasks")
    rows = write_xsum_export(tmp_path / "hub")
    resolved, read_at = [], []
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(seed, "resolve_revision", fake_resolver(resolved))
    monkeypatch.setattr(seed, "hub_base",
                        lambda repo, revision: read_at.append((repo, revision)) or str(tmp_path / "hub"))
    return seed, rows, resolved, read_at


def test_xsum_reads_its_parquet_export_split_by_split(xsum_hub, tmp_path):
    seed, rows, resolved, read_at = xsum_hub
    out = tmp_path / "data"
    assert seed.main(["xsum", "--out", str(out)]) == 0
    assert resolved == [("EdinburghNLP/xsum", "refs/convert/parquet")]  # the export's branch, resolved first
    assert read_at == [("EdinburghNLP/xsum", SHA)]                      # then read at that commit
    written = [json.loads(line) for line in (out / "xsum" / "validation.jsonl").read_text().splitlines()]
    assert written == [{k: r[k] for k in ("id", "document", "summary")} for r in rows["validation"]]  # both files
    provenance = json.loads((out / "xsum" / "provenance.json").read_text())
    assert provenance["source"] == "EdinburghNLP/xsum" and provenance["data_files"] == "default/validation/*.parquet"
    assert (provenance["revision"], provenance["resolved_revision"]) == ("refs/convert/parquet", SHA)
    assert provenance["rows"] == {"validation": 3} and set(provenance["files"]) == {"validation.jsonl"}
    assert seed.main(["xsum", "--out", str(out), "--split", "test"]) == 0
    assert [json.loads(x)["id"] for x in (out / "xsum" / "test.jsonl").read_text().splitlines()] == ["t0"]


def test_xsum_export_without_a_field_is_one_line(xsum_hub, tmp_path):
    from datasets import Dataset

    seed, *_ = xsum_hub
    Dataset.from_list([{"document": "d", "id": "1"}]).to_parquet(str(tmp_path / "hub/default/test/0000.parquet"))
    with pytest.raises(SystemExit) as e:
        seed.main(["xsum", "--out", str(tmp_path / "data"), "--split", "test"])
    assert str(e.value) == (f"download_seed_tasks: EdinburghNLP/xsum@{SHA}:test has no field summary "
                            "(fields: document, id)")


def test_every_seed_source_is_read_at_the_commit_its_revision_resolves_to(tmp_path, monkeypatch):
    import datasets

    seed = script("download_seed_tasks")
    resolved, loads, files, urls = [], [], [], []
    monkeypatch.setattr(seed, "resolve_revision", fake_resolver(resolved))
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name=None, split=None, revision=None: loads.append(
        (path, name, split, revision)) or [{"id": "x", "article": "a", "highlights": "h\nh", "text": "t"}])

    def hub_file(repo, filename, revision):
        files.append((repo, filename, revision))
        (tmp_path / filename).write_text("{}\n")
        return str(tmp_path / filename)

    monkeypatch.setattr(seed, "hub_file", hub_file)
    monkeypatch.setattr(seed, "fetch_url", lambda url, target: urls.append(url) or target.write_bytes(b"gz"))
    out = tmp_path / "data"
    assert seed.main(["cnn_dailymail", "wikitext_ppl", "lost_in_the_middle", "infinitebench", "--out", str(out),
                      "--cnn-config", "2.0.0"]) == 0
    assert loads == [("abisee/cnn_dailymail", "2.0.0", "validation", SHA),
                     ("Salesforce/wikitext", "wikitext-2-raw-v1", "validation", SHA)]
    assert resolved == [("abisee/cnn_dailymail", "main"), ("Salesforce/wikitext", "main"),
                        ("xinrongzhang2022/InfiniteBench", "main")]  # Lost in the Middle: a commit, no lookup
    assert {r for _, _, r in files} == {SHA} and len(files) == len(seed.INFINITEBENCH_TASKS)
    assert len(urls) == 3 and all(f"/raw/{seed.LITM_COMMIT}/qa_data/10_total_documents/" in u for u in urls)
    cnn = json.loads((out / "cnn_dailymail" / "provenance.json").read_text())
    assert (cnn["config"], cnn["revision"], cnn["resolved_revision"]) == ("2.0.0", "main", SHA)
    litm = json.loads((out / "lost_in_the_middle" / "provenance.json").read_text())
    assert litm["source"] == "github:nelson-liu/lost-in-the-middle" and litm["resolved_revision"] == seed.LITM_COMMIT
    assert len(litm["files"]) == 3
    # --revision replaces the default; a revision the Hub cannot resolve is read as asked and recorded as such
    files.clear()
    assert seed.main(["infinitebench", "--out", str(out), "--revision", "offline"]) == 0
    assert {r for _, _, r in files} == {"offline"}
    ib = json.loads((out / "infinitebench" / "provenance.json").read_text())
    assert (ib["revision"], ib["resolved_revision"]) == ("offline", None)


def test_scbench_and_longbench_scripts_pin_their_revision(tmp_path, monkeypatch):
    import zipfile

    scbench, longbench = script("download_scbench"), script("download_longbench")
    resolved, fetched = [], []
    for module in (scbench, longbench):
        monkeypatch.setattr(module, "resolve_revision", fake_resolver(resolved))
    monkeypatch.setattr(scbench, "hub_file", lambda filename, revision: fetched.append((filename, revision))
                        or str(FIXTURES / "scbench" / Path(filename).name))
    assert scbench.main(["scbench_kv", "--out", str(tmp_path / "sc"), "--revision", "v2"]) == 0
    assert fetched == [("data/scbench_kv.jsonl", SHA)]
    sc = json.loads((tmp_path / "sc" / "provenance.json").read_text())
    assert (sc["source"], sc["revision"], sc["resolved_revision"]) == ("microsoft/SCBench", "v2", SHA)

    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.write(FIXTURES / "longbench" / "trec.jsonl", "data/trec.jsonl")
    monkeypatch.setattr(longbench, "fetch_zip", lambda revision: fetched.append(("data.zip", revision)) or archive)
    assert longbench.main(["--root", str(tmp_path / "lb")]) == 0
    assert fetched[-1] == ("data.zip", SHA) and resolved[-1] == ("THUDM/LongBench", "main")
    lb = json.loads((tmp_path / "lb" / "provenance.json").read_text())
    assert (lb["revision"], lb["resolved_revision"], lb["zip"]) == ("main", SHA, None) and "data.zip" in lb["files"]


def test_a_commit_needs_no_lookup_and_the_export_is_read_through_hf_paths():
    pinning, seed = script("pinning"), script("download_seed_tasks")
    assert pinning.resolve_revision("any/repo", SHA) == SHA and pinning.resolve_github("any/repo", SHA) == SHA
    assert seed.hub_base("EdinburghNLP/xsum", "refs/convert/parquet") == ("hf://datasets/EdinburghNLP/xsum@"
                                                                         "refs/convert/parquet")
    assert seed.hub_base("a/b", SHA) == f"hf://datasets/a/b@{SHA}"
    assert seed.hub_base("a/b", "v1/x") == "hf://datasets/a/b@v1%2Fx"


BUILDERS = {  # dataset -> (fixture folder, builder arguments)
    "cnn_dailymail": ("cnn_dailymail", {}), "xsum": ("xsum", {}), "wikitext_ppl": ("wikitext_ppl", {}),
    "lost_in_the_middle": ("lost_in_the_middle", {}), "infinitebench": ("infinitebench", {"tasks": ["passkey"]}),
    "scbench": ("scbench", {"tasks": ["scbench_kv"], "limit_per_task": 1}),
    "longbench": ("longbench", {"tasks": ["trec"], "limit_per_task": 1}), "aime25": ("aime25", {}),
}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_each_builder_hands_its_provenance_over(name, tmp_path, smollm2_tokenizer):
    import kvbench.data  # noqa: F401 - registers every builder
    from kvbench.registry import DATASETS

    folder, kwargs = BUILDERS[name]
    root = tmp_path / folder
    shutil.copytree(FIXTURES / folder, root)
    record = {"source": f"org/{name}", "revision": "main", "resolved_revision": SHA}
    (root / "provenance.json").write_text(json.dumps(record))
    dataset = DATASETS[name](root=str(root), **kwargs)
    assert dataset.build(smollm2_tokenizer, 4096) and dataset.provenance == record
    (root / "provenance.json").unlink()
    assert dataset.build(smollm2_tokenizer, 4096) and dataset.provenance == {}  # a folder made by hand


def test_bad_provenance_is_one_line(tmp_path):
    from kvbench.data.jsonl import read_provenance

    (tmp_path / "provenance.json").write_text("{not json")
    with pytest.raises(ValueError) as e:
        read_provenance(tmp_path, "xsum")
    assert str(e.value).startswith(f"xsum: {tmp_path / 'provenance.json'}: not valid JSON") and "\n" not in str(e.value)


def grid_run(*overrides: str, results: Path) -> list[Path]:
    """The grid launcher's sweep in this process: one job per method, run sample-major by `run_grid`."""
    return grid_here([[*overrides, f"method={method}"] for method in ("full", "snapkv")], results)


def test_the_manifest_records_where_the_data_came_from(xsum_hub, tmp_path):
    """XSum through the download script (parquet export, resolved commit), then tiny-model runs on that folder
    through both launchers: Hydra's basic one and the grid (whose configurations share one built dataset)."""
    seed, rows, _, _ = xsum_hub
    assert seed.main(["xsum", "--out", str(tmp_path / "data")]) == 0
    provenance = json.loads((tmp_path / "data" / "xsum" / "provenance.json").read_text())
    assert provenance["resolved_revision"] == SHA
    args = ["model=tiny_llama", "budget=64", "dataset=xsum", f"dataset.root={tmp_path / 'data' / 'xsum'}",
            "dataset.max_new_tokens=3", "limit=2", "report=false"]
    run_dir = run_here(*args, "method=snapkv", results=tmp_path / "basic")
    assert [r["id"] for r in records(run_dir)] == [r["id"] for r in rows["validation"][:2]]
    grid_dirs = grid_run(*args, results=tmp_path / "grid")
    for d in [run_dir, *grid_dirs]:
        assert json.loads((d / "manifest.json").read_text())["dataset_provenance"] == provenance, d
