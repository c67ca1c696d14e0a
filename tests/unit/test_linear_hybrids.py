"""MiniMax (lightning linear attention beside softmax attention, kept by transformers in its own `MiniMaxCache`),
Kimi Linear (KDA delta-rule layers beside NoPE MLA layers) and Ling 3 (`bailing_hybrid`: KDA beside rotary MLA), on
tiny random models of each (kvbench.models.tiny.HYBRID_TINY: one attention layer between two linear ones).

- The MLA hybrids' full cache generates transformers' own greedy tokens (MiniMax's: tests/unit/test_hybrid.py, with
  the other hybrids).
- Every method keeps test_hybrid.py's contract (compress, then one decode step equals transformers' own uncompressed
  cache, each attention layer through the model's own eager attention masked to the entries kvbench kept), or, on
  the MLA layers, is refused in one line naming what the latent lacks.
- Bytes, hand-worked: the attention layer's K/V shrink with the budget as the tensors held do; the recurrent state
  (MiniMax's lightning state, the conv and KDA states) is reported apart, equal to what transformers' cache holds.
- batch_size=4 gives batch 1's generations (each sample's lightning state joined for the batched forward and back).
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.minimax.modeling_minimax import MiniMaxCache

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import Request, generate, generate_batched
from kvbench.methods.latent import latent_refusal
from kvbench.models import AttentionCapture, ModelSpec
from kvbench.models.loader import is_latent_model
from kvbench.registry import METHODS
from tests.unit.test_families import configured
from tests.unit.test_hybrid import CORE, check_contract, model_of
from tests.unit.tiny import prompt

N = 120


@pytest.mark.parametrize("model_type", ["kimi_linear", "bailing_hybrid"])
def test_the_attention_layer_is_found_as_mla(model_type):
    """(Their full cache against transformers' generate: test_hybrid.py, with the other hybrids.)"""
    with AttentionCapture(model_of(model_type)) as capture:
        assert capture.latent_layers == {0}  # (its one attention layer is found as MLA, from the model)


@pytest.mark.parametrize("model_type,name", [
    (model_type, name) for model_type in ("minimax", "kimi_linear", "bailing_hybrid")
    for name in sorted(METHODS.names())
    if not (model_type == "minimax" and name in CORE)])  # (MiniMax's core methods run in test_hybrid.py)
def test_every_method_keeps_the_contract_or_is_refused(model_type, name):
    if model_type != "minimax" and latent_refusal(METHODS[name]) is not None:
        model = model_of(model_type)
        with AttentionCapture(model) as capture, pytest.raises(ValueError, match=f"^MLA: method={name} ") as err:
            generate(model, None, configured(name), capture, prompt(N), 32, 2, eos_ids=set())
        assert "\n" not in str(err.value)
        return
    check_contract(model_type, name)


def state_nbytes(cache) -> int:
    """Bytes of the linear layers' state in transformers' own cache (MiniMax's `linear_cache`, or the conv and
    recurrent states of `LinearAttentionLayer`s)."""
    if isinstance(cache, MiniMaxCache):
        tensors = [t for t in cache.linear_cache if isinstance(t, torch.Tensor)]
    else:
        tensors = [t for layer in cache.layers if hasattr(layer, "recurrent_states")
                   for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("model_type,full,per_entry,state", [
    # one attention layer, 2 KV heads x head_dim 16 x (K + V) x 4 bytes = 256 per entry; two lightning layers, each
    # a [1, 4 heads, 16, 16] fp32 state: 4096 bytes
    ("minimax", 30720, 256, 8192),
    # one MLA layer: per entry one latent (32) + one shared rotary key (8) for all 4 heads, fp32 = 160 bytes; two KDA
    # layers, each a conv state over q, k and v ([1, 3 x 4 heads x 8, kernel 4] = 384 floats) and a recurrent
    # state [1, 4, 8, 8] (256 floats): 2560 bytes
    ("kimi_linear", 19200, 160, 5120),
    ("bailing_hybrid", 19200, 160, 5120),  # (Ling 3: the same sizes, its latent's rotary part rotated)
])
def test_kv_bytes_shrink_with_the_budget_and_the_state_is_apart(model_type, full, per_entry, state):
    model, ids = model_of(model_type), prompt(N)
    for name, budget in (("full", None), ("snapkv", 32), ("snapkv", 64)):
        held = {}
        with AttentionCapture(model, window=8) as capture:
            gen = generate(model, None, configured(name), capture, ids, budget, 1, eos_ids=set(),
                           on_logits=lambda t, _: held.setdefault("tensors", sum(
                               layer.keys.numel() * 4 + layer.values.numel() * 4 for layer in capture.cache.layers)
                               if capture.cache is not None else None))
        assert gen.kv_bytes == (full if budget is None else budget * per_entry)
        assert held["tensors"] in (None, gen.kv_bytes)  # (full: no cache handed to the capture)
        assert gen.state_bytes == state
    reference = MiniMaxCache() if model_type == "minimax" else DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=reference, use_cache=True)
    assert state_nbytes(reference) == state
    assert gen.full_kv_bytes == full


@pytest.mark.parametrize("model_type", ["minimax", "kimi_linear"])  # (Ling 3's MLA: as Kimi's, rotated)
def test_batch_of_four_equals_batch_one(model_type):
    """Four prompts of different lengths decoding together: each sample's lightning / KDA state goes into the batched
    forward and back, and every generation equals batch 1's."""
    model = model_of(model_type)
    prompts, new = [prompt(n, seed=i) for i, n in enumerate((70, 40, 95, 55))], [6, 3, 6, 5]
    method = configured("snapkv")
    with AttentionCapture(model, window=method.query_window) as capture:
        alone = [generate(model, None, method, capture, ids, 32, k, eos_ids=set()) for ids, k in zip(prompts, new)]
        requests = [Request(ids, 32, k, tag=i) for i, (ids, k) in enumerate(zip(prompts, new))]
        done = {r.tag: g for r, g in generate_batched(model, None, method, capture, requests, 4, eos_ids=set())}
    for i, one in enumerate(alone):
        assert done[i].token_ids == one.token_ids and done[i].kv_bytes == one.kv_bytes
        assert done[i].state_bytes == one.state_bytes > 0


def test_the_capture_hands_kvbench_cache_to_minimax_only_while_attached():
    """MiniMax's forward takes no cache but its own class while `use_cache` is set; the capture hands kvbench's over
    and, once detached, leaves the model refusing other caches as transformers does."""
    model, ids = model_of("minimax"), prompt(16)
    with AttentionCapture(model):
        pass
    with torch.no_grad(), pytest.raises(ValueError, match="MiniMax uses cache of its own"):
        model(ids, past_key_values=DynamicCache(), use_cache=True)


def test_mla_hybrids_are_latent_from_their_config_and_kimi_refuses_position_shift():
    """The command line refuses latent-incompatible methods before weights load (`is_latent_model`); Kimi's NoPE MLA
    has no rotary keys to re-rotate."""
    from kvbench.models.adapters import check_config

    assert all(is_latent_model(ModelSpec("tiny", f"random:{t}")) for t in ("kimi_linear", "bailing_hybrid"))
    assert not is_latent_model(ModelSpec("tiny", "random:minimax"))
    with pytest.raises(ValueError, match="positions=shift: kimi_linear has none positions") as err:
        check_config("kimi_linear").check_shift()
    assert "\n" not in str(err.value)


def test_beam_search_on_minimax_carries_the_lightning_state_with_its_beams():
    """Three beams with the full cache equal transformers' own beam search recomputing every hypothesis from scratch
    (`use_cache=False`): each beam's lightning state is gathered with its cache rows. (Not against its cached beam
    search: transformers 5.23's `MiniMaxCache` inherits a `reorder_cache` that reorders the K/V layers only, so its
    lightning states stay with the wrong beams.)"""
    from kvbench.engine.beam import beam_generate

    model, ids = model_of("minimax"), prompt(40)
    with torch.no_grad():
        greedy = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=2)[0, 40:].tolist()
        expected = model.generate(ids, max_new_tokens=10, num_beams=3, do_sample=False, eos_token_id=2,
                                  pad_token_id=2, length_penalty=1.0, use_cache=False)[0, 40:].tolist()
    assert expected != greedy  # the search really differs from greedy on this prompt
    with AttentionCapture(model) as capture:
        gen = beam_generate(model, None, configured("full"), capture, ids, None, 10, 3, eos_ids={2})
    assert gen.token_ids == [t for t in expected if t != 2]


def test_command_line_runs_minimax_and_refuses_kimi_storage_before_weights_load(tmp_path):
    """`python -m kvbench.run model.path=random:minimax method=snapkv` (in this process) writes a record with the
    lightning state apart; TailorKV on Kimi Linear's MLA layers stops in one line before any weights load."""
    from tests.unit.test_cli import records, refusal, run_here

    niah = ["dataset=niah", "dataset.context_lengths=[300]", "dataset.depth_percents=[50]",
            "dataset.max_new_tokens=3"]
    model = ["model=hf", "model.name=tiny", "model.device=cpu"]
    run_dir = run_here(*model, "model.path=random:minimax", "method=snapkv", "method.window=8", "budget=32", *niah,
                       results=tmp_path)
    (record,) = records(run_dir)
    assert "error" not in record and record["kv_bytes"] == 32 * 2 * 16 * 2 * 2 < record["full_kv_bytes"]  # (bf16)
    assert record["state_bytes"] == 2 * 4 * 16 * 16 * 2  # two lightning layers' [1, 4, 16, 16] states, bf16
    line = refusal(*model, "model.path=random:kimi_linear", "method=tailorkv", *niah, results=tmp_path / "refused")
    assert "MLA: method=tailorkv keeps the cache in layers of its own" in line
