"""The command line on `model.path=random:<model_type>` (issue 43's flagship types): snapkv, adakv, h2o, tailorkv and
full run and write records on Qwen3-MoE, Gemma 4 and Llama 4 (generic path: plain, window layers, chunked + NoPE),
gpt-oss (learned sinks) and DeepSeek-V3 (MLA latent), and snapkv on Zamba 2 (a hybrid whose attention blocks carry no
layer index); Inkling (a hybrid kvbench does not run), a method an MLA cache cannot honour and Hunyuan-V4's shared
sparse-indexer layers are refused in one line before any weights load, naming their group (Qwen3.5 and Jamba run:
tests/unit/test_hybrid.py)."""
from __future__ import annotations

import pytest

from tests.unit.test_cli import records, refusal, run_here

NIAH = ["dataset=niah", "dataset.context_lengths=[300]", "dataset.depth_percents=[50]", "dataset.max_new_tokens=3",
        "report=false"]  # (the heatmap and summary: test_cli.py; here the records)
METHODS = {"full": ["method=full"], "snapkv": ["method=snapkv", "method.window=8", "budget=32"],
           "adakv": ["method=adakv", "method.window=8", "budget=32"], "h2o": ["method=h2o", "budget=32"],
           "tailorkv": ["method=tailorkv", "budget=96"],
           # its layers given: identifying them at load prefills TailorKV's ~5k-token calibration prompt, ~40 s in
           # gpt-oss's eager attention; the identification at load runs on Qwen3-MoE and Llama 4
           "tailorkv (layers given)": ["method=tailorkv", "budget=96", "method.quant_layers=[]"]}


@pytest.mark.parametrize("model_type,names", [("qwen3_moe", ["full", "snapkv", "adakv", "h2o", "tailorkv"]),
                                              ("gemma4_text", ["snapkv", "tailorkv (layers given)"]),
                                              ("llama4_text", ["adakv", "tailorkv"]),
                                              ("gpt_oss", ["adakv", "tailorkv (layers given)"]),
                                              ("deepseek_v3", ["snapkv", "h2o"]), ("zamba2", ["snapkv"])])
def test_methods_run_from_the_command_line(model_type, names, tmp_path):
    """(A run costs ~2 s of set-up here: the five methods on one type, two on each of the others.)"""
    for method in (METHODS[name] for name in names):
        run_dir = run_here("model=hf", f"model.path=random:{model_type}", "model.name=tiny", "model.device=cpu",
                           *method, *NIAH, results=tmp_path)
        (record,) = records(run_dir)
        assert "error" not in record, record
        if method[0] == "method=full":
            assert record["kv_bytes"] == record["full_kv_bytes"]
        else:
            assert record["kv_bytes"] < record["full_kv_bytes"], (model_type, method)


@pytest.mark.parametrize("model_type,method,group", [
    ("inkling_text", "snapkv", "hybrid: its attention adds a hidden-state-conditioned relative logit bias"),
    ("hy_v4", "snapkv", "MLA: its \"shared\" sparse-attention indexer layers"),
    ("deepseek_v3", "tailorkv", "MLA: method=tailorkv keeps the cache in layers of its own")])
def test_other_groups_are_refused_in_one_line(model_type, method, group, tmp_path):
    line = refusal("model=hf", f"model.path=random:{model_type}", "model.name=tiny", f"method={method}",
                   *NIAH, results=tmp_path / "results")
    assert group in line


@pytest.mark.parametrize("method,extra,words", [
    ("snapkv", "batch_size=2", "batch_size=2: deepseek_v32 decodes at batch_size=1 only"),
    ("h2o", "query=agnostic", "query=agnostic: deepseek_v32 has a DSA sparse-attention indexer")])
def test_dsa_batching_and_fed_tokens_are_refused_in_one_line(method, extra, words, tmp_path):
    """DeepSeek-V3.2 runs at batch_size=1 over a prompt prefilled whole (tests/unit/test_generic_types.py); one
    indexer call ranks one cache, and kvbench's chunk attention over fed tokens does not apply its top-k."""
    line = refusal("model=hf", "model.path=random:deepseek_v32", "model.name=tiny", f"method={method}", extra,
                   *NIAH, results=tmp_path / "results")
    assert words in line
