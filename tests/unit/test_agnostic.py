"""query=agnostic: the context is compressed alone, then the question is prefilled on top of the compressed cache.

Checked against an independent recomputation: one plain forward of the whole prompt (+ the first generated token)
whose attention, per layer and per query head, lets the question rows see only the context entries the method
kept (and every question token causally), while the context rows see the whole context as in a normal prefill.
That is exactly what compressing the context and then prefilling the question must compute, without kvbench's
cache, capture or chunk attention."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

import kvbench.methods  # noqa: F401
from kvbench.data.longbench_prompts import CONTEXT_TEMPLATES, DATASET2PROMPT, QUESTION_TEMPLATES
from kvbench.data.split import context_token_count, cut_context, question_offset, split_template
from kvbench.engine.batching import generate, teacher_force
from kvbench.engine.generation import prepare
from kvbench.methods.base import Kind
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR, config_hash, setup
from tests.unit.tiny import attention_function, prompt, tiny_model

N, Q = 160, 12  # prompt tokens, of which the last Q are the question
METHODS_UNDER_TEST = {  # name -> (kwargs, budget)
    "snapkv": ({"window": 8}, 40), "pyramidkv": ({"window": 8}, 40), "adakv": ({"window": 8}, 40),
    "adakv_qh": ({"window": 8, "granularity": "query_head"}, 40), "streamingllm": ({}, 32),
    "h2o": ({}, 48), "knorm": ({}, 40), "tova": ({}, 40), "expected_attention": ({}, 40),
    "kvzip": ({"chunk_size": 64, "prompt_ids": [[5, 6, 7], [8, 9, 10, 11], [12]]}, 40),
}


def kept_positions(layer) -> list[torch.Tensor]:
    if getattr(layer, "is_varlen", False):  # flattened prompt entries per head, then the dense part (the question)
        heads = layer.flat_positions.split(layer.head_lens.tolist())
        return [torch.cat([p, layer.positions[0, h]]) for h, p in enumerate(heads)]
    return list(layer.positions[0].clone())


def reference_logits(model, ids: torch.Tensor, n_context: int, before: list[list[torch.Tensor]],
                     after: list[list[torch.Tensor]]) -> torch.Tensor:
    """Logits of every row of one forward over `ids` (the prompt + one generated token): the question rows (from
    `n_context` to the prompt's end) see only the context positions in `before` (kept when the context was compressed)
    and the question causally; the generated token's row sees only the positions in `after` (kept once the question
    was fed: a decode-time evictor scores the question and evicts again) and itself."""
    n_heads = model.config.num_attention_heads

    def masked(module, q, k, v, mask, scaling=None, **kw):
        n = k.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        allowed = causal.repeat(n_heads, 1, 1)
        for hq in range(n_heads):  # query head hq reads stored head hq * H_stored // H_q
            per_head = before[module.layer_idx]
            context_seen = torch.zeros(n, dtype=torch.bool)
            context_seen[per_head[hq * len(per_head) // n_heads]] = True
            context_seen[n_context:] = True  # the question (and later tokens), causally
            allowed[hq, n_context:n - 1] &= context_seen
            per_head = after[module.layer_idx]
            allowed[hq, n - 1] = False
            allowed[hq, n - 1, per_head[hq * len(per_head) // n_heads]] = True
            allowed[hq, n - 1, n - 1] = True
        k, v = k.repeat_interleave(n_heads // k.shape[1], 1), v.repeat_interleave(n_heads // v.shape[1], 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[None], scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    with attention_function(model, masked):
        return model(ids).logits[0]


@pytest.mark.parametrize("name", sorted(METHODS_UNDER_TEST))
def test_question_on_compressed_context_equals_masked_dense_recompute(name):
    model, ids = tiny_model("llama"), prompt(N)
    kwargs, budget = METHODS_UNDER_TEST[name]
    method = METHODS[name.removesuffix("_qh")](**kwargs)
    n_context = N - Q
    seen = []
    with AttentionCapture(model, window=method.query_window) as capture:  # the context compressed alone, then all
        before = [kept_positions(layer) for layer in prepare(model, method, capture, ids[:, :n_context], budget,
                                                             4).cache.layers]
        prepared = prepare(model, method, capture, ids, budget, 4, question_len=Q)
        kept = [kept_positions(layer) for layer in prepared.cache.layers]
        token = int(prepared.logits.argmax())
        teacher_force(model, capture, prepared, [token], lambda t, logits: seen.append(logits.clone()))
    assert prepared.prompt_len == N and "question_s" in prepared.timings
    for per_head in before:  # the context was compressed
        assert all((p < n_context).sum() < n_context for p in per_head)
    for per_head in kept:
        if method.kind is Kind.EVICTOR:  # the question scored and evicted with the rest, down to the budget
            assert all(len(p) <= budget for p in per_head)
        else:  # every question token was kept on top
            assert all((p >= n_context).sum() == Q for p in per_head)
    expected = reference_logits(model, torch.cat([ids, torch.tensor([[token]])], 1), n_context, before, kept)
    torch.testing.assert_close(seen[0][0], expected[N - 1], rtol=1e-4, atol=1e-4)  # after the question
    torch.testing.assert_close(seen[1][0], expected[N], rtol=1e-4, atol=1e-4)  # the next step, at position N


@pytest.mark.parametrize("batch_size", [1, 2])
def test_full_cache_agnostic_generates_what_aware_generates(batch_size):
    """One cache, the same tokens: with `full` the split changes nothing but the order of two forwards."""
    from kvbench.engine.batching import Request, generate_batched

    model = tiny_model("qwen2")
    prompts = [prompt(N, seed=s) for s in (1, 2)]
    with AttentionCapture(model) as capture:
        aware = [generate(model, None, METHODS["full"](), capture, p, None, 8) for p in prompts]
        requests = [Request(p, None, 8, question_len=Q) for p in prompts]
        agnostic = {id(r.input_ids): g for r, g in generate_batched(model, None, METHODS["full"](), capture,
                                                                    requests, batch_size)}
    for p, a in zip(prompts, aware):
        b = agnostic[id(p)]
        assert b.token_ids == a.token_ids and len(a.token_ids) == 8 and b.kv_bytes == a.kv_bytes


def test_bad_query_and_beams_are_refused_before_weights_load():
    def check(*overrides):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            setup(compose("config", overrides=["model=tiny_llama", *overrides]))

    check("query=agnostic", "method=snapkv")
    with pytest.raises(ValueError, match="query='sometimes' is not one of aware, agnostic"):
        check("query=sometimes")
    check("query=agnostic", "method=tailorkv")  # every storage method takes a fed chunk (test_tailorkv_feed.py)
    with pytest.raises(ValueError, match="num_beams=1"):
        check("query=agnostic", "generation.num_beams=2")


def test_aware_keeps_its_run_dir_and_agnostic_gets_its_own():
    from hydra.core.hydra_config import HydraConfig

    dirs = {}
    for query in ("aware", "agnostic"):
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=["model=tiny_llama", f"query={query}"], return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            dirs[query] = cfg.hydra.run.dir
    before = config_hash(cfg.method, cfg.dataset, cfg.model, cfg.generation, cfg.seed, cfg.positions)
    assert dirs["aware"].endswith(f"-{before}")  # the hash of the config before `query` existed
    assert not dirs["agnostic"].endswith(f"-{before}") and dirs["agnostic"][:-8] == dirs["aware"][:-8]


def test_ruler_run_dirs_keep_their_hash_until_max_new_tokens_is_set():
    """`dataset.max_new_tokens` came to RULER after its run dirs existed: null leaves the hash as it was."""
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_llama", "dataset=ruler"])
    older = OmegaConf.to_container(cfg.dataset)
    del older["max_new_tokens"]  # the RULER config before the key existed
    nodes = (cfg.method, cfg.model, cfg.generation, cfg.seed, cfg.positions)
    assert config_hash(cfg.dataset, *nodes) == config_hash(OmegaConf.create(older), *nodes)
    cfg.dataset.max_new_tokens = 8
    assert config_hash(cfg.dataset, *nodes) != config_hash(OmegaConf.create(older), *nodes)


# --- where each benchmark's question begins -------------------------------------------------------------------
# kvpress's LongBench question templates start here (its typo fixes aside): an independent statement of the split
QUESTION_STARTS = {
    "narrativeqa": "Now, answer the question based on the story", "qasper": "Answer the question based on the above",
    "multifieldqa_en": "Now, answer the following question",
    "multifieldqa_zh": "现在请基于上面的文章回答下面的问题",
    "hotpotqa": "Answer the question based on the given passages", "2wikimqa": "Answer the question based on the",
    "musique": "Answer the question based on the given", "dureader": "请基于上述文章回答下面的问题",
    "gov_report": "Now, write a one-page summary of the report.", "qmsum": "Now, answer the query based on",
    "multi_news": "Now, write a one-page summary of all the news.", "vcsum": "会议总结：", "trec": "{input}",
    "triviaqa": "{input}", "samsum": "{input}", "lsht": "{input}", "passage_count": "Please enter the final count",
    "passage_retrieval_en": "The following is an abstract.", "passage_retrieval_zh": "下面是一个摘要",
    "lcc": "Next line of code:\n", "repobench-p": "{input}Next line of code:\n",
}


@pytest.mark.parametrize("task", sorted(DATASET2PROMPT))
def test_longbench_split_joins_to_todays_prompt_byte_for_byte(task):
    record = {"context": "Ctx {with} braces\n\n", "input": "Why {not}?"}
    context, question = CONTEXT_TEMPLATES[task], QUESTION_TEMPLATES[task]
    assert context + question == DATASET2PROMPT[task]
    assert context.format(**record) + question.format(**record) == DATASET2PROMPT[task].format(**record)
    assert question.startswith(QUESTION_STARTS[task]) and context.rstrip().endswith("{context}")


def test_split_helpers_on_hand_worked_cases():
    assert split_template("A: {context}\n\nQ: {q}") == ("A: {context}\n\n", "Q: {q}")
    assert split_template("<b> {context} </b>.\n Based on it: {q}", boundary=" Based") == ("<b> {context} </b>.\n",
                                                                                          " Based on it: {q}")
    text = "Q: what? A: 1\n\nbody Q: what? A:"  # a few-shot example repeats the question: the last one counts
    assert question_offset(text, "Q: {q}? A:") == text.rindex("Q: ")
    assert question_offset("no question here", "Q: {q}?") is None

    class Chars:  # a tokenizer with one token per character (prefix tokenization is stable)
        def __call__(self, text, **kw):
            return type("E", (), {"input_ids": [ord(c) for c in text]})()

    assert context_token_count(Chars(), "abcdef", 4, [ord(c) for c in "abcdef"]) == 4
    assert cut_context(90, 100, 60, 30) == 50 and cut_context(20, 100, 60, 30) == 20
    assert cut_context(40, 100, 60, 30) == 30  # the split fell inside the cut: it lands at the cut


# --- the report: aware and agnostic side by side, `--compare aware` paired by sample id ------------------------
def write_run(root, method: str, budget, query: str | None, scores: dict[str, float]):
    import json

    run = root / "niah" / "smollm2" / method / f"b{budget}-{query or 'old'}"
    run.mkdir(parents=True)
    manifest = {"method": method, "budget": budget, "ratio": None, "model": "smollm2", "dataset": "niah",
                "dataset_version": "1", "primary_metric": "pyramidkv_recall", **({"query": query} if query else {})}
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "predictions.jsonl").write_text("".join(json.dumps(
        {"id": i, "score": s, "scores": {"pyramidkv_recall": s}, "kv_bytes": 10, "full_kv_bytes": 100}) + "\n"
        for i, s in scores.items()))


def test_report_puts_modes_side_by_side_and_compares_each_with_its_aware_run(tmp_path, capsys):
    from kvbench.report.__main__ import main

    ids = [f"niah-{k}" for k in range(20)]
    write_run(tmp_path, "full", None, None, {i: 1.0 for i in ids})  # a run from before `query`: aware
    write_run(tmp_path, "full", None, "agnostic", {i: 1.0 for i in ids})
    write_run(tmp_path, "snapkv", 64, "aware", {i: 1.0 for i in ids})
    # agnostic loses the needle on ids 0, 2, ..., 18 and id 19 never ran: 9 / 19 right, paired difference -10 / 19
    write_run(tmp_path, "snapkv", 64, "agnostic", {i: float(k % 2) for k, i in enumerate(ids[:-1])})
    assert main([str(tmp_path), "--out", str(tmp_path / "out"), "--compare", "aware"]) == 0
    rows = {tuple(c.strip() for c in line.split("|")[3:6]): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| smollm2")}
    assert set(rows) == {("FullKV", "–", "aware"), ("FullKV", "–", "agnostic"), ("SnapKV", "64", "aware"),
                         ("SnapKV", "64", "agnostic")}
    snap = rows[("SnapKV", "64", "agnostic")].split("|")
    assert snap[7].strip() == "47.37" and snap[8].strip().startswith("-52.63 [") and snap[8].strip().endswith("†")
    assert rows[("FullKV", "–", "agnostic")].split("|")[8].strip() == "+0.00 [+0.00, +0.00]"
    assert rows[("SnapKV", "64", "aware")].split("|")[8].strip() == "–"  # the reference itself
    note = (tmp_path / "out" / "table.md").read_text()
    assert "the same method with query=aware" in note and "SnapKV 64 agnostic: 0 ids only in this run, 1 only" in note


def test_every_ruler_task_splits_before_its_question(smollm2_tokenizer):
    """RULER's generators reword the template (singular needle wording): every task still finds its question part,
    and the tokens after the split decode to it."""
    from kvbench.data.ruler.templates import ALL_TASKS
    from tests.unit.test_ruler_generation import small

    import re

    ruler = small(tasks=ALL_TASKS, num_samples=1)
    for sample in ruler.build(smollm2_tokenizer):
        assert sample.context_tokens is not None, sample.id
        question = smollm2_tokenizer.decode(sample.input_ids[sample.context_tokens:]).strip()
        starts = [re.split(r"\{\w+\}", q)[0].strip() for q in ruler.question_parts(sample.meta["task"])]
        assert any(question.startswith(s) for s in starts) and sample.prompt.rstrip().endswith(question), sample.id
