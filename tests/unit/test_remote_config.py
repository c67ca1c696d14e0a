"""A `model=openai` run's config, judged before anything is sent or written: what it refuses (in one line), where
its run directory goes (never an in-process run's), and an unreachable server (kvbench.runs.validate)."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvbench.runs.validate import BadInput, run_dir_of, validate

SERVER = ["model=openai", "model.name=smollm2-135m-instruct"]
NIAH = ["dataset.context_lengths=[300]", "dataset.depth_percents=[50]"]


def closed_port() -> int:
    """A port nothing listens on (bound, then released: nothing else on this machine takes it in between)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dir(overrides: list[str]) -> Path:
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    from kvbench.runs.config import CONFIG_DIR
    from kvbench.runs.validate import compose_job

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3", job_name="kvbench"):
        cfg = compose_job(overrides)
        HydraConfig.instance().set_config(cfg)
        return run_dir_of(cfg, multirun=False)


def test_a_server_run_never_shares_an_in_process_run_directory():
    local = run_dir(["model=smollm2", "method=full", "dataset.context_lengths=[300]"])
    served = run_dir([*SERVER, "method=full", "dataset.context_lengths=[300]"])
    assert local.parent == served.parent  # results/niah/smollm2-135m-instruct/full/, as the user named it
    assert local.name != served.name  # the hash covers the model node: base URL and tokenizer
    other_server = run_dir([*SERVER, "method=full", "dataset.context_lengths=[300]",
                            "model.base_url=http://other:8000/v1"])
    assert other_server.name != served.name
    # how many requests are in flight, and how long one may take, change no result: the same run dir resumes
    assert run_dir([*SERVER, "method=full", "dataset.context_lengths=[300]", "model.concurrency=16",
                    "model.timeout_s=5"]) == served


@pytest.mark.parametrize("args, says", [
    (["method=snapkv"], "model=openai: method=snapkv runs inside kvbench; against a server the compression is the "
                        "server's"),
    (["method=full", "generation.num_beams=4"], "model=openai: generation.num_beams=4: beam search"),
    (["method=full", "query=agnostic"], "model=openai: query=agnostic:"),
    (["method=full", "model.concurrency=0"], "model.concurrency=0 must be a positive integer"),
    (["method=full", "model.send=tokens"], "model.send='tokens' is not one of ids, text"),
    (["method=full", "model.base_url=localhost:8000"], "model: base_url='localhost:8000' is not an http(s) URL"),
    (["method=full", "dataset=wikitext_ppl", "limit=1"], "model=openai: dataset wikitext"),
])
def test_what_a_server_run_refuses_is_one_line_before_anything_is_sent(args, says, tmp_path):
    with pytest.raises(BadInput) as e:
        validate([*SERVER, *([] if "dataset=wikitext_ppl" in args else NIAH), *args, f"results_dir={tmp_path}"])
    assert str(e.value).startswith(says) and "\n" not in str(e.value)
    assert not any(tmp_path.iterdir())


def test_an_unreachable_server_is_one_line_and_nothing_is_written(tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    with pytest.raises(BadInput) as e:
        validate([*SERVER, *NIAH, "method=full", f"model.base_url={url}", f"results_dir={tmp_path}"])
    assert str(e.value).startswith(f"model.base_url={url}: no server answers (ConnectError")
    assert "\n" not in str(e.value) and not any(tmp_path.iterdir())


def test_scores_of_a_server_run_average_its_timings_and_hold_no_kv_ratio():
    from kvbench.runs.store import aggregate

    def record(i: str, score: float, ttft: float, tpot: float | None) -> dict:
        return {"id": i, "score": score, "scores": {"acc": score}, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": 2 * ttft,
                "new_tokens": 3, "budget": None}

    summary = aggregate([record("a", 1.0, 0.5, 0.1), record("b", 0.0, 1.5, None)])
    assert summary["metrics"] == {"acc": 0.5} and summary["n"] == 2
    assert summary["kv_bytes_mean"] is None and summary["kv_ratio"] is None and summary["prefill_s_mean"] is None
    assert (summary["ttft_s_mean"], summary["tpot_s_mean"], summary["e2e_s_mean"]) == (1.0, 0.1, 2.0)
