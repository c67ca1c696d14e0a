"""Bad input fails in ONE line `kvbench: ...`, before any weights load and before Hydra writes anything.

Most rows of issue #16's table run in-process through `kvbench.runs.validate.validate` (what `python -m kvbench.run`
calls first; nothing in it loads weights: models are checked by their config.json / GGUF header only); a handful
run through the real command line, concurrently, to show the whole path: exit code 1, one stderr line, no files.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvbench.data.ruler import cache
from kvbench.pathnames import check_inside, check_name
from kvbench.runs.config import CONFIG_DIR
from kvbench.runs.validate import BadInput, validate, validate_or_exit
from tests.unit.test_cli import ENV, ROOT

LONGBENCH = ROOT / "tests" / "fixtures" / "longbench"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Broken inputs a user may point kvbench at."""
    tmp = tmp_path_factory.mktemp("inputs")
    (tmp / "not_a_model").mkdir()
    (tmp / "not_a_model" / "weights.bin").write_bytes(b"\0" * 16)
    (tmp / "remote").mkdir()
    (tmp / "remote" / "config.json").write_text(json.dumps(
        {"model_type": "my_own_arch", "auto_map": {"AutoConfig": "modeling.MyConfig",
                                                   "AutoModelForCausalLM": "modeling.MyModel"}}))
    (tmp / "corrupt.gguf").write_bytes(b"GGML" + b"\0" * 60)
    (tmp / "longbench").mkdir()
    lines = (LONGBENCH / "hotpotqa.jsonl").read_text().splitlines()
    (tmp / "longbench" / "hotpotqa.jsonl").write_text("\n".join([lines[0], '{"input": "half a rec', *lines[1:]]))
    return tmp


def rows(t: str) -> list:
    return [
        (["budgt=1"], "key", "Unknown config key 'budgt'. Did you mean: budget? Valid keys: "),
        (["method=snapkv", "method.windw=8"], "field",
         "method snapkv has no field 'windw'. Did you mean: window? Fields: channel_window, gqa_reduce, "
         "granularity, kernel, key_channels, pooling, window"),
        (["budget=[1"], "syntax", "cannot parse the override 'budget=[1'"),
        (["model=hf", f"model.path={t}/no/such/dir"], "path",
         f"model: path='{t}/no/such/dir' does not exist (a local path is never taken for a Hub id)"),
        (["model=hf", f"model.path={t}/missing.gguf"], "gguf", f"model: GGUF file {t}/missing.gguf does not exist"),
        (["model=hf", f"model.path={t}/corrupt.gguf"], "bad-gguf",
         f"model: {t}/corrupt.gguf is not a GGUF file (it starts with b'GGML', expected b'GGUF')"),
        (["model=hf", f"model.path={t}/not_a_model"], "no-config", f"model: {t}/not_a_model has no config.json"),
        (["model=hf", f"model.path={t}/remote"], "remote", "needs remote code (config.json auto_map: AutoConfig, "
         "AutoModelForCausalLM; model_type='my_own_arch' is not built into transformers); kvbench never runs it "
         "unless you set model.trust_remote_code=true"),
        (["model=hf", "model.path=some-org/not-cached-model"], "offline",
         "model: 'some-org/not-cached-model' is a Hub id, the Hub is off (HF_HUB_OFFLINE=1)"),
        (["dataset=longbench", f"dataset.root={t}/longbench", "dataset.tasks=[hotpotqa]"], "longbench",
         f"longbench: {t}/longbench/hotpotqa.jsonl:2: not valid JSON"),
        (["dataset=ruler", "dataset.length=600", "dataset.tasks=[niah_single_1,vt]", f"dataset.cache_dir={t}/cache"],
         "ruler", "ruler: dataset.length=600 is too small for vt (builds from "),
        (["budget=128", "ratio=0.5"], "both", "budget=128 and ratio=0.5 both given"),
        (["limit=0"], "limit0", "limit=0 must be a positive number of samples, or null for all"),
        (["limit=-1"], "limit-1", "limit=-1 must be a positive number of samples"),
        (["model.name=../../../x"], "name", "model: name='../../../x' becomes a folder name, so it must be a plain"),
        (["dataset=ruler", "dataset.version=2024-12.1/../../x"], "version",
         "ruler: version='2024-12.1/../../x' becomes a folder name"),
        (["budget=64,128"], "sweep", "budget=64,128 gives several values: add -m"),
        (["-m", "method=snapkv", "budget=64,16"], "sweep-job", "snapkv: window=32 must be < budget=16"),
        (["model.path=random:mpt", "query=agnostic"], "agnostic-alibi",
         "query=agnostic: mpt has ALiBi attention, which tokens fed on top of a cache"),
        (["model.path=random:mpt", "method=kvzip"], "kvzip-alibi",
         "method=kvzip: mpt has ALiBi attention, which tokens fed on top of a cache"),
        (["model.path=random:gemma2", "dataset=niah_multiturn", "dataset.turns=2"], "turns-window",
         "dataset.turns=2: gemma2 has sliding-window layers, which tokens fed on top of a compressed cache"),
        # issue #31: every value's type, range or choices (kvbench/runs/schema.py); each of these ran before
        (["dataset.max_new_tokens=-3"], "max-new-tokens",
         "niah: dataset.max_new_tokens=-3 must be a positive integer (new tokens per sample)"),
        (["seed=abc"], "seed", "seed='abc' must be an integer >= 0"),
        (["generation.do_sample=true", "generation.temperature=-1"], "temperature",
         "generation.temperature=-1 must be > 0 (the sampling temperature)"),
        (["generation.top_p=2"], "top-p", "generation.top_p=2 must be in (0, 1]"),
        (["method=snapkv", "method.window=8.5"], "float-for-int",
         "snapkv: method.window=8.5 must be a positive integer"),
        (["dataset.context_lengths=[1000.5]"], "float-in-int-list",
         "niah: dataset.context_lengths=[1000.5] must be a list, each item a positive integer"),
        (["method=h2o", "method.gqa_reduce=median"], "literal",
         "h2o: method.gqa_reduce='median' is not one of mean, sum, max"),
        (["report=maybe"], "bool", "report='maybe' must be true or false"),
        (["ratio=abc"], "ratio-type", "ratio='abc' must be a number in [0, 1), or null"),
        (["model.max_prompt_tokens=0"], "prompt-tokens", "model.max_prompt_tokens=0 must be a positive integer"),
        (["model.revision=1234"], "text", "model.revision=1234 must be a string, or null; quote it to pass text: "
         "model.revision=\"'1234'\""),
        (["model.device=gpu"], "device", "model: device='gpu' is not auto or a torch device"),
        (["model.attn_implementation=fast"], "attention", "model: attn_implementation='fast' is not one of eager, "),
        (["dataset=longbench", "dataset.primary_metric=f1"], "score-name",
         "longbench: dataset.primary_metric='f1' is not one of longbench (the score this dataset reports)"),
    ]


@pytest.mark.parametrize("index", range(len(rows(""))), ids=[r[1] for r in rows("")])
def test_each_bad_input_is_one_line_before_anything_is_written(inputs, tmp_path, monkeypatch, smollm2_dir, index):
    args, _, expected = rows(str(inputs))[index]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = [] if any(a.startswith("model=") for a in args) else ["model=tiny_llama"]
    with pytest.raises(BadInput) as error:
        validate([*model, *args, f"results_dir={tmp_path / 'results'}"])
    text = str(error.value)
    assert expected in text and "\n" not in text, text
    assert not (tmp_path / "results").exists()


def test_a_good_sweep_passes_and_counts_its_jobs(tmp_path, monkeypatch):
    args = ["-m", "model=tiny_llama", "method=full,snapkv", "budget=64,128", f"results_dir={tmp_path}"]
    assert validate(args) == 4 and not list(tmp_path.iterdir())
    assert validate(["--help"]) == 0  # Hydra's own flags are left to Hydra
    with pytest.raises(SystemExit, match="kvbench: model: path='/no/such' does not exist"):
        validate_or_exit(["model=hf", "model.path=/no/such", f"results_dir={tmp_path}"])
    monkeypatch.setenv("KVBENCH_SKIP_CHECKS", "1")  # paths that exist only on a cluster's compute nodes
    validate_or_exit(["model=hf", "model.path=/no/such", f"results_dir={tmp_path}"])


def test_path_components_stay_plain_names(tmp_path):
    for bad in ("../x", "a/b", ".hidden", "", "a\\b", "..", "x/../../y"):
        with pytest.raises(ValueError, match="must be a plain name"):
            check_name("model: name", bad)
    assert check_name("model: name", "llama-3.1-8b_instruct+v2") == "llama-3.1-8b_instruct+v2"
    with pytest.raises(ValueError, match="outside"):
        cache.cache_file(tmp_path, "../../elsewhere", "vt", 4096, 42, {})
    with pytest.raises(ValueError, match="outside"):
        check_inside(tmp_path / "a" / ".." / ".." / "b", tmp_path, "run directory")


# --- through the command line ---------------------------------------------------------------------------------
def read_only(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)


def test_the_command_line_prints_one_line_and_writes_nothing(inputs, tmp_path):
    """Five bad commands at once (each process pays ~5 s of imports): a bad model path and a bad value (issue #31's
    `dataset.max_new_tokens=-3`, which used to run and score 0; any check's failure takes this exit path: sys.exit
    with the line; the other checks' lines are test_each_bad_input's, in this process) and the three read-only cases (a file in .hydra/, which Hydra rewrites, included),
    which need a process: root drops its file-permission override (setpriv) so that read-only folders are read-only
    to it as well."""
    as_user = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root without setpriv cannot see read-only folders as read-only")
        as_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    ro_results = tmp_path / "ro_results"
    ro_results.mkdir()
    existing = tmp_path / "existing"
    run_dir = existing / "niah" / "tiny-llama" / "full" / "b64-x"
    run_dir.mkdir(parents=True)
    (run_dir / "predictions.jsonl").write_text('{"id": "niah-L300-d0"}\n')
    read_only(ro_results)
    read_only(existing)
    hydra_dir = tmp_path / "hydra_file" / "run" / ".hydra"  # issue 42: a read-only file Hydra rewrites at start
    hydra_dir.mkdir(parents=True)
    (hydra_dir / "config.yaml").write_text("budget: 64\n")
    (hydra_dir / "config.yaml").chmod(0o444)
    commands = {
        "path": (["model=hf", f"model.path={inputs}/no/such/dir"], tmp_path / "r3", "does not exist"),
        "ro-results": ([], ro_results, f"results_dir={ro_results} cannot be written"),
        "ro-run-dir": (["method=full", "budget=64", f"hydra.run.dir={run_dir}"], existing, "is read-only"),
        "ro-hydra-file": (["method=full", "budget=64", f"hydra.run.dir={hydra_dir.parent}"], hydra_dir.parent.parent,
                          f"{hydra_dir}/config.yaml is read-only; make it writable (chmod u+w)"),
        "value": (["dataset.max_new_tokens=-3"], tmp_path / "r4",
                  "kvbench: niah: dataset.max_new_tokens=-3 must be a positive integer (new tokens per sample)"),
    }
    before = {name: (results.exists(), sorted(results.rglob("*"))) for name, (_, results, _) in commands.items()}
    procs = {name: subprocess.Popen(
        [*as_user, sys.executable, "-m", "kvbench.run", "model=tiny_llama", *args, f"results_dir={results}"],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, (args, results, _) in commands.items()}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate()
            lines = stderr.strip().splitlines()
            assert proc.returncode == 1 and not stdout.strip(), (name, stdout, stderr)
            assert len(lines) == 1 and lines[0].startswith("kvbench: ") and commands[name][2] in lines[0], (name, stderr)
            results = commands[name][1]
            assert (results.exists(), sorted(results.rglob("*"))) == before[name], name  # nothing created
    finally:
        for path in (ro_results, existing):
            for p in [path, *path.rglob("*")]:
                p.chmod(0o755)


# --- values refused before the heavy imports (issue 42) -------------------------------------------------------
BEFORE_TORCH = "import sys; sys.modules['torch'] = sys.modules['transformers'] = None; sys.argv[0] = 'kvbench.run'; " \
               "from kvbench.runs.run import cli; cli()"
EARLY = {
    "budget": (["budget=-1"], "kvbench: pyramidkv: budget=-1 must be a positive integer (KV entries kept per head "
               "per layer, window included); or use ratio=<0..1>."),
    "budget-text": (["budget=abc"], "kvbench: budget='abc' must be an integer, or null"),
    "ratio": (["ratio=1.5"], "kvbench: ratio=1.5 must be in [0, 1), or null (fraction of prompt entries removed)"),
    "method-sweep": (["-m", "method=snapkv", "method.window=32,0"], "kvbench: snapkv: method.window=0 must be a "
                     "positive integer"),
    "dataset-list": (["dataset.context_lengths=[0]"], "kvbench: niah: dataset.context_lengths=[0] must be a list, "
                     "each item a positive integer (tokens)"),
    "shard": (["shard=3/2"], "kvbench: shard=3/2 must be i/n with n >= 1 and 0 <= i < n, e.g. 0/4"),
}


def test_bad_values_are_refused_before_torch_and_transformers_import(tmp_path):
    """A bad value is refused as fast as a misspelt name: from kvbench/runs/rules.json, before torch and
    transformers are imported (4-60 s). Shown in processes where importing either fails, so a refusal that still
    needed them would end in an ImportError traceback instead of its line; nothing is written."""
    procs = {name: subprocess.Popen([sys.executable, "-c", BEFORE_TORCH, *args, f"results_dir={tmp_path / name}"],
                                    cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (args, _) in EARLY.items()}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate()
        assert (proc.returncode, stdout, stderr) == (1, "", EARLY[name][1] + "\n"), name
    assert not list(tmp_path.iterdir())


def test_a_value_a_method_takes_at_other_settings_is_left_to_setup(tmp_path):
    """The early budget rule holds for a method at its defaults only: Keyformer with budget_fraction ignores the
    budget, DMS always does; neither is refused early, and setup takes them too."""
    from kvbench.runs.rules import check_budget_early

    for argv in (["method=keyformer", "method.budget_fraction=0.5", "budget=-1"], ["method=dms", "budget=-1"]):
        assert validate(["model=tiny_llama", *argv, f"results_dir={tmp_path}"]) == 1
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["method=keyformer", "budget=-1"])
    with pytest.raises(ValueError, match="keyformer: budget=-1 must be a positive integer"):
        check_budget_early(cfg)


# --- broken YAML ----------------------------------------------------------------------------------------------
BROKEN = "_target_: kvbench.methods.snapkv.SnapKV\nwindow: 32\n  kernel: 7\npooling: max\n"  # line 3: indented


def test_a_broken_yaml_config_is_one_line_naming_its_file_and_line(tmp_path):
    """A user's own option (configs/method/mine.yaml) or a hand-edited configs/config.yaml with a syntax error: one
    line naming the file, line and column the parser stopped at, for a run and for a sweep; nothing written."""
    configs, results = tmp_path / "configs", tmp_path / "results"
    shutil.copytree(ROOT / "configs", configs)
    (configs / "method" / "mine.yaml").write_text(BROKEN)
    for argv in (["method=mine"], ["-m", "method=mine", "budget=64,128"]):
        with pytest.raises(BadInput) as error:
            validate(["model=tiny_llama", *argv, f"results_dir={results}"], config_dir=configs)
        assert str(error.value) == (f"{configs}/method/mine.yaml:3:9: not valid YAML: mapping values are not "
                                    "allowed here")  # the colon after `  kernel`
    lines = (configs / "config.yaml").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("limit:"))
    lines[at] = "\t" + lines[at]  # a tab where YAML wants spaces
    (configs / "config.yaml").write_text("\n".join(lines) + "\n")
    for argv in ([], ["-m", "budget=64,128"]):
        with pytest.raises(BadInput) as error:
            validate(["model=tiny_llama", *argv, f"results_dir={results}"], config_dir=configs)
        assert str(error.value) == (f"{configs}/config.yaml:{at + 1}:1: not valid YAML: found character '\\t' that "
                                    "cannot start any token")
    assert not results.exists()


def test_merge_reads_a_broken_config_yaml_as_one_line(tmp_path, capsys):
    """merge reads the run directory's config.yaml: hand-edited into invalid YAML, it fails in one line too."""
    from kvbench.runs.merge import main as merge_main
    from tests.unit.test_cli import run_here

    run_dir = run_here("model=tiny_llama", "method=streamingllm", "budget=32", "dataset.context_lengths=[300]",
                       "dataset.depth_percents=[50]", "dataset.metrics=[pyramidkv_recall]", "shard=0/1",
                       results=tmp_path)
    (run_dir / "config.yaml").write_text(BROKEN)
    capsys.readouterr()
    assert merge_main([str(run_dir)]) == 1
    assert capsys.readouterr().err == (f"kvbench: {run_dir}/config.yaml:3:9: not valid YAML: mapping values are "
                                       "not allowed here\n")


def test_ruler_length_tokenizer_revision_is_pinned_and_recorded(smollm2_dir, smollm2_tokenizer):
    from kvbench.data.ruler import Ruler
    from kvbench.data.ruler.length import tokenizer_fingerprint

    ruler = Ruler(tasks=["niah_single_1"], length_tokenizer=str(smollm2_dir))
    counter = ruler.counter_tokenizer(smollm2_tokenizer)
    assert ruler.provenance["length_tokenizer"] == {
        "name": str(smollm2_dir), "revision": None, "resolved_commit": None,  # a local folder has no commit
        "fingerprint": tokenizer_fingerprint(smollm2_tokenizer)} and counter is not smollm2_tokenizer
    missing = Ruler(tasks=["niah_single_1"], length_tokenizer="/no/such/tokenizer", length_tokenizer_revision="abc1")
    with pytest.raises(ValueError, match="ruler: cannot load length_tokenizer='/no/such/tokenizer'"):
        missing.counter_tokenizer(smollm2_tokenizer)
