"""Which methods compress while decoding (`decode_compression.target=T`, kvbench/engine/recompress.py): every
registered method is either refused by the command line's check in one line, before any weights load, naming the
methods that can, or really runs under it (its layers brought back to the target). Prefill-only scorers (CAP,
Compactor, non-causal attention: every prompt query; CriticalKV: the output projection W_o) used to pass the check
and stop with an error while decoding, after the weights loaded; they declare `Method.prefill_needs` now. Threshold
methods (DMS, KVzap) passed it too and then never compressed (their per-head variable layers are not rebuilt while
decoding), and a composition keeping a share of the layer before `then` keeps the budget (a layer just past its
target is too short: it stopped while decoding), are refused now as well, and so are kvpress's per-layer ratios
(`+method.layer_ratios`: int(n (1 - r)) of the tokens seen, a layer that grew with them and ignored the target;
kvpress's DecodingPress does not take a PerLayerCompressionPress either)."""
from __future__ import annotations

import pytest

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate
from kvbench.engine.recompress import DecodeCompression, check, decoding_methods, why_not
from kvbench.methods.wrappers import Compose, PerLayer
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.runs.validate import BadInput, validate
from tests.unit.test_contract import configured
from tests.unit.tiny import prompt, tiny_model

N_PROMPT, NEW, EVERY, TARGET = 40, 17, 8, 24
PREFILL_ONLY = ["cap", "compactor", "critical_kv", "non_causal_attn"]
REFUSED_LATE = {  # what main's check let through: (overrides, the refusal's words)
    **{name: ([f"method={name}"], f"{name} scores at prefill only: it needs ") for name in PREFILL_ONLY},
    **{name: ([f"method={name}"], f"{name} keeps what its score threshold passes") for name in ("dms", "kvzap")},
    "compose": (["method=snapkv", "+method.then=knorm", "+method.first_ratio=0.5"],  # (64 of a layer of 129 > 128)
                "snapkv+knorm scores at prefill only: it needs a layer of at least budget / (1 - first_ratio=0.5)"),
    "layer_ratios": (["method=snapkv", "+method.layer_ratios=[0.5,0.5]"],  # (a layer kept int(seen / 2): no bound)
                     "snapkv+per_layer scores at prefill only: it needs a prompt to take layer_ratios of")}


@pytest.mark.parametrize("case", sorted(REFUSED_LATE))
def test_the_command_line_check_refuses_what_cannot_compress_while_decoding(case, tmp_path):
    overrides, words = REFUSED_LATE[case]
    with pytest.raises(BadInput) as refused:
        validate(["model=tiny_llama", *overrides, "decode_compression.target=128", f"results_dir={tmp_path / 'r'}"])
    text = str(refused.value)
    assert words in text and "\n" not in text, text
    assert f"methods that compress while decoding: {', '.join(decoding_methods())};" in text
    assert not (tmp_path / "r").exists()


def test_a_wrapper_is_refused_where_a_method_it_holds_is():
    snapkv = METHODS["snapkv"]()
    for wrapped in (PerLayer(METHODS["cap"](), whole_layers=[0]),
                    Compose(snapkv, then=METHODS["critical_kv"](window=snapkv.window), first_ratio=0.0)):
        assert why_not(wrapped).startswith("scores at prefill only: it needs ")
    assert why_not(Compose(snapkv, then=METHODS["knorm"](), first_ratio=0.0)) is None
    assert why_not(PerLayer(snapkv, layer_ratios=[0.5, 0.25])).startswith("scores at prefill only: it needs a prompt ")
    assert why_not(PerLayer(snapkv, whole_layers=[0])) is None  # (whole layers grow, the others keep the target)
    assert {"snapkv", "expected_attention", "knorm"} <= set(decoding_methods()) and not \
        set(PREFILL_ONLY) & set(decoding_methods())


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=1)


@pytest.mark.registry
@pytest.mark.parametrize("name", METHODS.names())
def test_every_method_is_refused_or_compresses_while_decoding(name, model):
    """A method the check lets through generates every token, and its layer, grown past the target while
    decoding, is brought back to it."""
    method, setting = configured(name), DecodeCompression(EVERY, TARGET)
    if why_not(method) is not None:
        with pytest.raises(ValueError, match=f"{name} .*; methods that compress while decoding: "):
            check(method, setting)
        return
    check(method, setting)
    lengths = []
    with AttentionCapture(model, window=method.query_window) as capture:
        gen = generate(model, None, method, capture, prompt(N_PROMPT), 16, NEW, eos_ids=set(), recompress=setting,
                       on_logits=lambda t, logits: lengths.append(capture.cache.layers[0].keys.shape[-2]))
    assert len(gen.token_ids) == NEW
    share = method.layer_budgets(N_PROMPT + NEW, 1, TARGET)[0]  # the target; SimLayerKV's (lazy) n_sink + T - n_last
    assert share == (TARGET + method.n_sink - method.n_last if name == "simlayerkv" else TARGET)
    # the prefill kept 16 (SimLayerKV: 19); cut back to the share at step 16, after its token: the most after a step
    assert max(lengths) == share + EVERY - 1  # it grew past the target and was brought back to it
    assert TARGET < max(lengths)
    assert any(after < before for before, after in zip(lengths, lengths[1:]))
