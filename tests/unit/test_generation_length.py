"""What a generation's record says about its length and its memory while decoding: why it stopped, the KV bytes'
peak and mean over the decode steps, the end-to-end time; checked against hand-worked byte counts."""
from __future__ import annotations

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import Request, generate, generate_batched
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

N = 120


def bytes_per_entry(model) -> int:
    """K and V of one entry in every KV head of every layer, fp32."""
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4


def one(model, name: str, budget, new: int, **kwargs):
    method = METHODS[name]()
    with AttentionCapture(model, window=getattr(method, "window", 0)) as capture:
        return generate(model, None, method, capture, prompt(N), budget, new, **kwargs)


def test_full_cache_peak_and_mean_over_decode_steps_by_hand():
    """n tokens of a full cache: n - 1 decode forwards, after the k-th the cache holds N + k entries per head, so
    the peak is N + n - 1 entries and the mean N + n / 2."""
    model, new = tiny_model("llama"), 9
    gen = one(model, "full", None, new)
    per = bytes_per_entry(model)
    assert len(gen.token_ids) == new and gen.stop_reason == "max_new_tokens"
    assert gen.kv_bytes_decode_peak == per * (N + new - 1)
    assert gen.kv_bytes_decode_mean == pytest.approx(per * (N + new / 2))
    assert gen.timings["e2e_s"] == pytest.approx(gen.timings["prefill_s"] + gen.timings["compress_s"]
                                                 + gen.timings["decode_s"])


def test_a_decode_time_evictor_holds_its_budget_while_decoding():
    """H2O at budget B keeps B entries per head: after each step's token and eviction the cache holds B per head
    (the new token is in before the layer's eviction, sampled after every layer evicted but the last's)."""
    model, budget, new = tiny_model("llama"), 48, 12
    gen = one(model, "h2o", budget, new)
    per = bytes_per_entry(model)
    layers = model.config.num_hidden_layers
    assert gen.kv_bytes == per * budget
    # at the step's sampling point every layer holds B, but the last, which still holds B + 1
    assert gen.kv_bytes_decode_peak == per * budget + per // layers
    assert gen.kv_bytes_decode_mean == pytest.approx(per * budget + per // layers)


def test_stop_reason_names_what_ended_the_generation():
    model = tiny_model("llama")
    free = one(model, "full", None, 8)
    third = free.token_ids[2]
    assert one(model, "full", None, 8, stop_token_ids=(third,)).stop_reason == "stop"
    ended = one(model, "full", None, 8, eos_ids={third})
    assert ended.stop_reason == "eos" and ended.token_ids == free.token_ids[:2]
    assert one(model, "full", None, 0).stop_reason == "max_new_tokens"


def test_a_batch_reports_each_samples_own_decode_bytes():
    model, method = tiny_model("llama"), METHODS["snapkv"](window=8)
    requests = [Request(prompt(n), 40, new, ()) for n, new in [(N, 5), (N + 30, 9)]]
    with AttentionCapture(model, window=8) as capture:
        batched = {r.max_new_tokens: g for r, g in generate_batched(model, None, method, capture, requests, 2)}
        alone = {r.max_new_tokens: g for r in requests
                 for _, g in generate_batched(model, None, method, capture, [Request(r.input_ids, 40,
                                                                                       r.max_new_tokens, ())], 1)}
    per = bytes_per_entry(model)
    for new, gen in batched.items():
        assert gen.kv_bytes_decode_peak == alone[new].kv_bytes_decode_peak == per * (40 + new - 1)
        assert gen.kv_bytes_decode_mean == pytest.approx(alone[new].kv_bytes_decode_mean)
        assert gen.stop_reason == "max_new_tokens"
    assert torch.equal(torch.tensor(batched[5].token_ids), torch.tensor(alone[5].token_ids))


# --- the report: length, inflation, memory and time per method and budget --------------------------------------
def test_length_ratio_joins_each_sample_to_its_full_cache_length():
    import pandas as pd

    from kvbench.report.lengths import add_length_ratio

    rows = [("full", "a", 10), ("full", "b", 4), ("h2o", "a", 15), ("h2o", "b", 4), ("h2o", "c", 7),
            ("full", "z", 0), ("h2o", "z", 3)]
    df = pd.DataFrame([{"model": "m", "dataset": "d", "query": "aware", "method": m, "id": i, "new_tokens": n}
                       for m, i, n in rows], index=[70, 3, 12, 5, 40, 8, 1])  # an index with gaps, out of order
    ratio = add_length_ratio(df).set_index(["method", "id"])["length_ratio"]
    assert ratio[("h2o", "a")] == 1.5 and ratio[("h2o", "b")] == 1.0 and ratio[("full", "a")] == 1.0
    assert pd.isna(ratio[("h2o", "c")]) and pd.isna(ratio[("h2o", "z")])  # no full record; full wrote nothing


def test_the_report_writes_the_length_table_and_figure(tmp_path):
    from kvbench.report.__main__ import main as report_main
    from kvbench.report.labels import method_label
    from tests.unit.test_cli import records, run_here

    base = ["model=tiny_llama", "dataset.context_lengths=[300]", "dataset.depth_percents=[0,100]",
            "dataset.metrics=[pyramidkv_recall]", "dataset.max_new_tokens=6"]
    dirs = {("full", None): run_here(*base, "method=full", results=tmp_path)}
    for budget in (64, 96):
        for method in ("h2o", "streamingllm"):
            dirs[(method, budget)] = run_here(*base, f"method={method}", f"budget={budget}", results=tmp_path)
    assert report_main([str(tmp_path), "--lengths", "--out", str(tmp_path / "report")]) == 0
    lines = (tmp_path / "report" / "lengths.md").read_text().splitlines()
    table = [line for line in lines if line.startswith("| tiny-llama")]
    assert len(table) == 5 and "FullKV" in table[0]
    rows = {(cells[2], cells[3]): cells for cells in ([c.strip() for c in line.strip("|").split("|")]
                                                      for line in table)}
    full = {r["id"]: r["new_tokens"] for r in records(dirs[("full", None)])}
    for (method, budget), run_dir in dirs.items():
        recs = records(run_dir)
        cells = rows[(method_label(method), str(budget) if budget else "–")]
        lengths = [r["new_tokens"] for r in recs]
        assert cells[6].startswith(f"{sum(lengths) / len(lengths):.1f}")
        ratio = sum(r["new_tokens"] / full[r["id"]] for r in recs) / len(recs)
        assert cells[7].startswith(f"{ratio:.3f}")
        peak = sum(r["kv_bytes_peak"] for r in recs) / len(recs) / 2 ** 20
        assert cells[9].startswith(f"{peak:.2f}")
        e2e = sum(r["e2e_s"] for r in recs) / len(recs)
        assert cells[11].startswith(f"{e2e:.2f}")
    assert (tmp_path / "report" / "lengths_tiny-llama_niah.png").stat().st_size > 0


def test_gsm8k_runs_of_two_methods_at_two_budgets_get_the_length_table_and_figure(tmp_path):
    """Done as the long-generation issue asks: H2O and decode-enabled SnapKV at two budgets and the full cache on
    gsm8k's fixture; the report writes lengths.md by itself (a long-generation dataset) with a row per run."""
    from kvbench.report.__main__ import main as report_main
    from tests.unit.test_cli import run_here

    base = ["model=tiny_llama", "dataset=gsm8k", "dataset.root=tests/fixtures/gsm8k", "dataset.max_new_tokens=12",
            "limit=2", "report=false"]
    run_here(*base, "method=full", results=tmp_path)
    for budget in (48, 64):
        run_here(*base, "method=h2o", f"budget={budget}", results=tmp_path)
        run_here(*base, "method=snapkv", "method.window=8", f"budget={budget}", f"decode_compression.target={budget}",
                 "decode_compression.every=4", results=tmp_path)
    assert report_main([str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    rows = [line for line in (tmp_path / "report" / "lengths.md").read_text().splitlines()
            if line.startswith("| tiny-llama | gsm8k")]
    assert len(rows) == 5
    assert (tmp_path / "report" / "lengths_tiny-llama_gsm8k.png").stat().st_size > 0
