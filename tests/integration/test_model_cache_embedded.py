"""The embedded model's converted cache, damaged as in issue 42 (bytes changed inside model.safetensors, same size
and mtime: runs went on with every prediction empty), is found and converted again to the same bytes.

One real conversion of the embedded GGUF (30-150 s on 2 busy cores) in a private KVBENCH_CACHE holding a damaged copy
of the session's converted folder.
"""
from __future__ import annotations

import json
import os
import shutil

from kvbench.disk.built_once import CHECKSUMS, LOCK, digest, problem
from kvbench.models.embedded import embedded_model_dir


def test_a_damaged_embedded_cache_is_converted_again_to_the_bytes_first_written(tmp_path, monkeypatch, smollm2_dir):
    written = json.loads((smollm2_dir / CHECKSUMS).read_text())["files"]
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    copy = tmp_path / "models" / smollm2_dir.name
    shutil.copytree(smollm2_dir, copy)
    weights = copy / "model.safetensors"
    stat = weights.stat()
    with open(weights, "r+b") as f:  # 4 KiB of zeros in the middle of the tensors
        f.seek(stat.st_size // 2)
        f.write(bytes(4096))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size
    assert "model.safetensors differs from what was written" in problem(copy)

    assert embedded_model_dir() == copy
    assert problem(copy) is None
    assert digest(weights) == written["model.safetensors"]["xxh3_128"]  # the conversion is deterministic
    assert sorted(p.name for p in copy.parent.iterdir()) == [LOCK, smollm2_dir.name]  # no temporary left
