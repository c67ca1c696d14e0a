"""The converted model cache (kvbench/disk/built_once.py): a damaged folder is found and built again, a killed
conversion's temporary is removed once its writer is dead (never while it lives), and a cache that cannot be
written is refused in one line before anything is converted.

Real files, real processes and real signals: writers are subprocesses killed with SIGKILL. The tests run as root
here and in CI, and root writes into a chmod-ed folder, so an unwritable cache is made two honest ways: a path
under a regular file (nobody can create it), and a chmod 555 folder written by a process that lacks
CAP_DAC_OVERRIDE (dropped from its capability bounding set before exec; a non-root user lacks it anyway).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvbench.disk.temporaries import remove_dead_temporaries
from kvbench.disk.built_once import CHECKSUMS, LOCK, ModelCacheError, build_once, check_usable, problem

ROOT = Path(__file__).resolve().parents[2]
PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 24, 1, 2


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama and a writer that saves it (what a conversion writes: safetensors + config)."""
    from kvbench.models.tiny import tiny_random_model

    model = tiny_random_model("llama", seed=3)
    calls = []

    def write(out: Path) -> None:
        calls.append(out)
        model.save_pretrained(out)

    return model, write, calls


def weights_of(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()


def damage_same_size(path: Path) -> None:
    """Flip one byte in the middle (inside the tensors, past the safetensors header); size and mtime kept."""
    stat = path.stat()
    with open(path, "r+b") as f:
        f.seek(stat.st_size // 2)
        byte = f.read(1)
        f.seek(stat.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size


@pytest.mark.parametrize("damage", ["same size", "truncated", "no checksums", "file missing"])
def test_a_damaged_converted_folder_is_found_and_built_again(tmp_path, tiny, damage):
    model, write, calls = tiny
    folder = tmp_path / "models" / "tiny-v1"
    calls.clear()
    assert build_once(folder, "tiny", write) == folder and len(calls) == 1
    assert build_once(folder, "tiny", write) == folder and len(calls) == 1  # whole: used as it is
    weights = folder / "model.safetensors"
    written = weights.read_bytes()
    if damage == "same size":
        damage_same_size(weights)
        expected = "model.safetensors differs from what was written"
    elif damage == "truncated":
        with open(weights, "r+b") as f:
            f.truncate(len(written) // 3)
        expected = f"model.safetensors has {len(written) // 3} bytes, {len(written)} were written"
    elif damage == "no checksums":  # a folder converted by an earlier kvbench
        (folder / CHECKSUMS).unlink()
        expected = f"it has no {CHECKSUMS}"
    else:
        (folder / "config.json").unlink()
        expected = "config.json is missing"
    assert expected in problem(folder)
    assert build_once(folder, "tiny", write) == folder and len(calls) == 2
    assert problem(folder) is None
    assert weights.read_bytes() == written
    loaded, original = weights_of(folder), model.state_dict()
    assert loaded.keys() == original.keys()  # the rebuilt folder loads as the model that was written, bit for bit
    assert all(torch.equal(loaded[name], original[name]) for name in original)
    assert sorted(p.name for p in folder.parent.iterdir()) == [LOCK, "tiny-v1"]  # no temporary, no old copy left


# --- killed writers ----------------------------------------------------------------------------------------------
WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvbench.disk.built_once import build_once

    def write(out):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"x" * 1000)
        print("ready", flush=True)
        sys.stdin.read()  # converting until the test kills it

    build_once(Path(sys.argv[1]), "tiny", write)
""")


def start(code: str, *args: str, **kwargs) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               **kwargs)
    assert process.stdout.readline().strip() == "ready"
    return process


def kill(process: subprocess.Popen) -> int:
    """SIGKILL and reap (a zombie's pid still exists, so its temporaries would rightly be kept)."""
    pid = process.pid
    process.kill()
    process.wait()
    process.stdout.close()
    process.stdin.close()
    return pid


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_killed_conversion_leaves_a_temporary_that_is_removed_only_once_its_writer_is_dead(tmp_path, tiny):
    _, write, calls = tiny
    models = tmp_path / "models"
    folder = models / "tiny-v1"
    writer = start(WRITER, str(folder))
    try:
        tmp = models / f"tiny-v1.tmp{writer.pid}"
        assert (tmp / "model.safetensors").is_file() and not folder.exists()
        # the writer lives (its pid, its lock): nothing is removed, whichever of the two a cleaner asks
        assert remove_dead_temporaries(models, lambda t: models / LOCK) == []
        assert remove_dead_temporaries(models, lambda t: None) == []
        assert tmp.is_dir()
    finally:
        assert kill(writer) == writer.pid
    assert tmp.is_dir() and not folder.exists()  # SIGKILL: nothing of the writer's own cleanup ran
    calls.clear()
    assert build_once(folder, "tiny", write) == folder and len(calls) == 1
    assert not tmp.exists() and problem(folder) is None
    assert sorted(p.name for p in models.iterdir()) == [LOCK, "tiny-v1"]


CONVERTER = textwrap.dedent("""
    import logging, sys
    from pathlib import Path
    from kvbench.disk.built_once import build_once

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")

    def write(out):
        out.mkdir()
        (out / "model.safetensors").write_bytes(sys.argv[2].encode() * 1000)
        print("ready", flush=True)
        sys.stdin.readline()  # until the test lets it finish
        print("wrote", flush=True)

    print("built", build_once(Path(sys.argv[1]), "tiny", write), flush=True)
""")


def test_a_second_process_waits_for_the_conversion_under_way_and_uses_it(tmp_path):
    folder = tmp_path / "models" / "tiny-v1"
    first = start(CONVERTER, str(folder), "A")
    second = subprocess.Popen([sys.executable, "-c", CONVERTER, str(folder), "B"], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    waiting = second.stderr.readline()  # logged once it found the lock held
    assert f"pid {first.pid} is converting a model; waiting for it" in waiting
    out_first, _ = first.communicate("\n")
    out_second, err_second = second.communicate("\n")
    assert (first.returncode, second.returncode) == (0, 0), err_second
    assert out_first.split("\n")[:2] == ["wrote", f"built {folder}"]
    assert out_second.strip() == f"built {folder}"  # its own conversion never ran
    assert (folder / "model.safetensors").read_bytes() == b"A" * 1000 and problem(folder) is None


HOLDER = textwrap.dedent("""
    import fcntl, sys
    lock = open(sys.argv[1], "a")
    fcntl.flock(lock, fcntl.LOCK_EX)
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_a_temporary_is_kept_while_its_pid_lives_or_its_lock_is_held(tmp_path):
    """The two signs of a live writer, one at a time: a kvbench without the lock (pid alive, lock free), and a writer
    on another host of a shared folder (pid unknown here, lock held)."""
    models = tmp_path / "models"
    models.mkdir()
    sleeper = start(HOLDER, str(tmp_path / "unrelated.lock"))  # a live pid holding no lock of the cache
    try:
        by_live_pid = models / f"a.tmp{sleeper.pid}"
        by_live_pid.mkdir()
        holder = start(HOLDER, str(models / LOCK))
        try:
            by_locked = models / f"b.tmp{dead_pid()}"
            by_locked.mkdir()
            assert remove_dead_temporaries(models, lambda t: models / LOCK) == []
        finally:
            kill(holder)
        assert remove_dead_temporaries(models, lambda t: models / LOCK) == [by_locked]
        assert by_live_pid.is_dir()
    finally:
        kill(sleeper)
    assert remove_dead_temporaries(models, lambda t: models / LOCK) == [by_live_pid]
    assert sorted(p.name for p in models.iterdir()) == [LOCK]


# --- an unwritable cache -----------------------------------------------------------------------------------------
def test_a_cache_under_a_regular_file_is_refused_in_one_line_before_converting(tmp_path, tiny):
    _, write, calls = tiny
    (tmp_path / "file").write_text("not a folder")
    folder = tmp_path / "file" / "cache" / "models" / "tiny-v1"
    calls.clear()
    with pytest.raises(ModelCacheError) as refused:
        build_once(folder, "tiny", write)
    message = str(refused.value)
    assert "\n" not in message and str(folder) in message and "KVBENCH_CACHE" in message
    assert "it is not there" in message and "Not a directory" in message
    assert calls == []  # refused before the conversion began


def without_dac_override() -> None:
    """preexec_fn: drop the capabilities that let root write anywhere, so permissions bind (as for a user)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                os._exit(77)  # no CAP_SETPCAP here: the test skips


CHECK = textwrap.dedent("""
    import sys
    from pathlib import Path
    from kvbench.disk.built_once import ModelCacheError, check_usable
    try:
        check_usable(Path(sys.argv[1]), "tiny")
    except ModelCacheError as e:
        sys.exit(str(e))
    print("usable")
""")


def check_in_a_process_without_write_permission(folder: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", CHECK, str(folder)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=without_dac_override)
    if done.returncode == 77:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE here (no CAP_SETPCAP)")
    return done


def test_a_read_only_cache_serves_a_whole_folder_and_refuses_a_damaged_one_naming_it(tmp_path, tiny):
    _, write, _ = tiny
    models = tmp_path / "models"
    folder = models / "tiny-v1"
    build_once(folder, "tiny", write)
    os.chmod(models, 0o555)
    try:
        whole = check_in_a_process_without_write_permission(folder)
        assert (whole.returncode, whole.stdout.strip()) == (0, "usable")
        damage_same_size(folder / "model.safetensors")
        damaged = check_in_a_process_without_write_permission(folder)
        lines = damaged.stderr.strip().splitlines()
        assert damaged.returncode == 1 and len(lines) == 1, damaged.stderr
        assert f"into {folder} (model.safetensors differs from what was written" in lines[0]
        assert "Permission denied" in lines[0] and "KVBENCH_CACHE" in lines[0]
    finally:
        os.chmod(models, 0o755)
    assert "differs" in problem(folder)
    check_usable(folder, "tiny")  # writable again: not refused, the load converts it again


def test_an_unwritable_cache_stops_a_run_in_one_line_before_the_run_folder_is_made(tmp_path):
    """`python -m kvbench.run` on a model the cache has not converted yet (here: a random model, which takes the
    embedded tokenizer), with KVBENCH_CACHE where nothing can be created: one line, exit 1, no run folder."""
    (tmp_path / "file").write_text("not a folder")
    cache = tmp_path / "file" / "cache"
    results = tmp_path / "results"
    env = {**os.environ, "KVBENCH_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "kvbench.run", "model=tiny_llama", "dataset=niah", "limit=1",
                           f"results_dir={results}"], cwd=ROOT, env=env, capture_output=True, text=True)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("kvbench: model cache: SmolLM2-135M-Instruct must be converted into "
                               f"{cache / 'models'}/") and "Not a directory" in lines[0], lines[0]
    assert not results.exists()


def test_a_gguf_model_path_is_checked_against_the_cache_before_any_weights_load(tmp_path, monkeypatch):
    from kvbench.models.checks import check_source, converted_folder
    from kvbench.models.embedded import embedded_gguf_path
    from kvbench.models.loader import ModelSpec

    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "file" / "cache"))
    spec = ModelSpec(name="mine", path=str(embedded_gguf_path()))
    with pytest.raises(ModelCacheError, match=f"^model cache: {embedded_gguf_path().name} must be converted into "
                                              f"{converted_folder(spec.path)} \\(it is not there\\)"):
        check_source(spec)
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))  # writable: the load will convert it
    assert check_source(spec) == "gguf" and not converted_folder(spec.path).exists()
