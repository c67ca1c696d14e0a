"""scripts/download_ruler_qa.py pins SQuAD v2.0 dev and HotpotQA dev distractor by sha256: a download or a copy in
the folder with another checksum is refused, `--sha256 NAME=HEX` accepts a copy the user vouches for, and
provenance.json (each file's sha256, the pin, the URL) reaches the RULER run's manifest. No network here: the
sources are served by a fake `urlopen` with the test look-alikes, whose checksums are not the pinned ones."""
from __future__ import annotations

import hashlib
import io
import json
import shutil

import pytest

from kvbench.data.ruler import Ruler
from tests.unit.test_data_sources import FIXTURES, script

QA = FIXTURES / "ruler" / "qa"
NAMES = ("dev-v2.0.json", "hotpot_dev_distractor_v1.json")


def lookalike_sha(name: str) -> str:
    return hashlib.sha256((QA / name).read_bytes()).hexdigest()


@pytest.fixture
def download(monkeypatch):
    """The script with every URL answered by the look-alike of the file it names; returns (module, URLs asked)."""
    module = script("download_ruler_qa")
    asked = []

    def urlopen(url, timeout):
        asked.append(url)
        return io.BytesIO((QA / url.rsplit("/", 1)[1]).read_bytes())
    monkeypatch.setattr(module.urllib.request, "urlopen", urlopen)
    return module, asked


def test_sources_are_pinned_by_size_and_sha256():
    module = script("download_ruler_qa")
    assert set(module.SOURCES) == set(NAMES)
    assert module.SOURCES["dev-v2.0.json"].sha256.startswith("80a5225e") and module.SOURCES["dev-v2.0.json"].size
    assert module.SOURCES["hotpot_dev_distractor_v1.json"].sha256.startswith("4e9ecb5c")
    assert all(len(s.sha256) == 64 and s.urls for s in module.SOURCES.values())


def test_a_download_with_another_checksum_is_refused_and_not_saved(download, tmp_path, capsys):
    module, asked = download
    assert module.main(["--out", str(tmp_path)]) == 1
    assert not list(tmp_path.iterdir())           # nothing saved, no provenance.json
    assert len(asked) == 3                        # both HotpotQA URLs tried
    err = capsys.readouterr().err
    assert f"not the expected {module.SOURCES['dev-v2.0.json'].sha256} (4,370,528 bytes); not saved" in err


def test_a_vouched_checksum_is_accepted_and_recorded_then_a_changed_copy_is_refused(download, tmp_path, capsys):
    module, _ = download
    vouched = {name: lookalike_sha(name) for name in NAMES}
    args = ["--out", str(tmp_path), *[f"--sha256={n}={h}" for n, h in vouched.items()]]
    assert module.main(args) == 0
    record = json.loads((tmp_path / "provenance.json").read_text())
    assert record["files"] == vouched and record["vouched_sha256"] == vouched
    assert record["pinned_sha256"] == {n: s.sha256 for n, s in module.SOURCES.items()}
    assert record["urls"]["dev-v2.0.json"] == module.SOURCES["dev-v2.0.json"].urls[0]

    assert module.main(args) == 0 and "already there, sha256 matches" in capsys.readouterr().out
    (tmp_path / "dev-v2.0.json").write_text("{}")
    assert module.main(args) == 1 and "another or a damaged copy" in capsys.readouterr().err
    assert module.main(["--out", str(tmp_path)]) == 1    # the look-alike is not the pinned file either


def test_bad_sha256_argument_is_one_line():
    module = script("download_ruler_qa")
    with pytest.raises(SystemExit, match="'squad.json' is not one of dev-v2.0.json, hotpot_dev_distractor_v1.json"):
        module.main(["--sha256", "squad.json=" + "0" * 64])
    with pytest.raises(SystemExit, match="give the file's 64 hex digits"):
        module.main(["--sha256", "dev-v2.0.json=abc"])


def test_ruler_hands_the_qa_provenance_to_the_manifest(tmp_path, smollm2_tokenizer):
    shutil.copy(QA / "dev-v2.0.json", tmp_path)
    record = {"source": "RULER qa", "files": {"dev-v2.0.json": lookalike_sha("dev-v2.0.json")}}
    (tmp_path / "provenance.json").write_text(json.dumps(record))
    ruler = Ruler(tasks=["qa_1", "niah_single_1"], length=1024, num_samples=1, qa_root=str(tmp_path), cache_dir="")
    assert ruler.build(smollm2_tokenizer) and ruler.provenance["qa_sources"] == record
    (tmp_path / "provenance.json").unlink()
    assert ruler.build(smollm2_tokenizer) and "qa_sources" not in ruler.provenance  # a folder made by hand
