"""KVzip+, DMS and KVzap against kvpress 0.5.5 itself: the entries each press keeps (the complement of what it masks)
per layer and KV head on the embedded model, 2 prompts (tests/fixtures/kvpress_kvzipfam, made by
scripts/make_kvpress_goldens_kvzipfam.py in kvpress's venv; KVzap with kvbench's shipped surrogate, loaded by
kvpress's own `KVzapModel.from_pretrained`). Entries kvpress scored within 1e-5 of a DMS threshold, and KVzip+ rows
whose cut fell on a near-tie, may differ (none did when the goldens were made)."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.cache.kv_cache import KVCache
from kvbench.engine.generation import Prefilled, compress, prefill, prepare, reconstruct
from kvbench.models import AttentionCapture, ModelSpec, load
from kvbench.registry import METHODS
from tests.unit.test_kvpress_oracle import kept_positions

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
GOLDEN = json.loads((FIXTURES / "kvpress_kvzipfam" / "goldens.json").read_text())
PROMPTS = json.loads((FIXTURES / "kvpress" / "prompts.json").read_text())["ids"]


def case_key(case: dict) -> tuple:
    return case["name"], case["prompt"], case.get("ratio")


@pytest.fixture(scope="module")
def kept():
    """kvbench's kept positions for every golden case: per prompt one prefill (KVzap's surrogate scoring its inputs),
    of which KVzip+ reconstructs once and compresses a copy per ratio, and DMS and KVzap each compress a copy."""
    model, tokenizer = load(ModelSpec(name="smollm2", path="embedded"))
    zip_plus = METHODS["kvzip"](sinks="repeated", chunk_size=2048, kvzip_plus=True)
    zip_plus.prepare(model, tokenizer)
    by_prompt: dict[int, dict[str, dict]] = {}
    for case in GOLDEN["cases"]:
        by_prompt.setdefault(case["prompt"], {}).setdefault(case["name"], []).append(case)
    runs = {}
    with AttentionCapture(model) as capture:
        for p, cases in by_prompt.items():
            ids = torch.tensor([PROMPTS[p]])
            n = ids.shape[1]
            dms, kvzap = (METHODS[name](threshold=cases[name][0]["threshold"], window=cases[name][0]["window"],
                                        **({"model_type": "linear"} if name == "kvzap" else {}))
                          for name in ("dms", "kvzap"))
            kvzap.prepare(model, tokenizer)
            capture.reset()
            capture.input_scorer = partial(kvzap.input_scores, config=model.config)
            cache = KVCache()
            logits = prefill(model, ids, cache)
            shared = Prefilled(cache, logits, 0.0, input_scores=dict(capture.input_scores))
            for name, method in (("dms", dms), ("kvzap", kvzap)):
                runs[name, p, None] = kept_positions(prepare(model, method, capture, ids, None, 1,
                                                             prefilled=shared).cache)
            capture.reset()
            reconstruct(model, zip_plus, capture, cache, ids, n // 2)
            scores = capture.key_scores
            for case in cases["kvzip_plus"]:
                compressed, capture.key_scores = cache.clone(), scores
                compress(zip_plus, compressed, capture, max(1, int(n * (1 - case["ratio"]))))
                runs[case_key(case)] = kept_positions(compressed)
            capture.reset()
    return runs


@pytest.mark.parametrize("name", ["kvzip_plus", "dms", "kvzap"])
def test_kvbench_keeps_what_kvpress_keeps(kept, name):
    cases = [case for case in GOLDEN["cases"] if case["name"] == name]
    assert len(cases) >= 2
    for case in cases:
        ours, near = kept[case_key(case)], {tuple(x) for x in case["near"]}
        sizes = set()
        for layer, heads in enumerate(case["kept"]):
            for head, mask in enumerate(heads):
                theirs = {i for i in range(len(PROMPTS[case["prompt"]])) if int(mask, 16) >> i & 1}
                sizes.add(len(theirs))
                diff = ours[layer][head] ^ theirs
                if name == "kvzip_plus" and (layer, head) in near:
                    assert len(ours[layer][head]) == len(theirs)
                    continue
                assert all((layer, head, i) in near for i in diff), (case_key(case), layer, head, sorted(diff)[:5])
        assert len(sizes) > 1  # heads keep different counts
