"""`decode_compression.ratio=R` (kvpress's CompressionRatioDecodingPress): while decoding, every `every` generated
tokens each layer is brought to max(1, int(seen * (1 - R))) of the tokens seen, split over the layers as a target is;
checked against hand-worked sizes, kvpress's own (golden lengths), in a batch, and refused in one line where it
cannot run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import Request, generate, generate_batched
from kvbench.engine.recompress import DecodeCompression, check
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from kvbench.runs.config import CONFIG_DIR, config_hash, setup
from tests.unit.test_cli import refusal
from tests.unit.test_recompress import N_PROMPT, decode
from tests.unit.tiny import prompt, tiny_model

EVERY, RATIO, NEW = 16, 0.5, 70
GOLDEN = json.loads((Path(__file__).parents[1] / "fixtures/kvpress_ratiodecode/lengths.json").read_text())["cases"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_streamingllm_keeps_half_of_the_tokens_seen_at_each_compression(model):
    """Hand-worked: 60 prompt tokens kept whole (budget 64); the k-th compression runs at decode step 16k, once that
    step's token is in: 60 + 16k tokens seen, so it keeps int((60 + 16k) / 2) = 30 + 8k entries, positions 0-3 (the
    sinks) and the newest 26 + 8k; between two compressions the layer grows by one entry a step."""
    held = {}
    decode(model, "streamingllm", 64, DecodeCompression(EVERY, ratio=RATIO), new=NEW,
           seen=lambda t, cache: held.__setitem__(t, [layer.positions[0, 0].tolist() for layer in cache.layers]))
    assert len(held) == NEW  # t = 0: the prefill's logits
    for t, layers in held.items():  # t: decode forwards before this one
        if t < EVERY:
            expected = list(range(N_PROMPT + t))
        else:
            k, since = t // EVERY, t % EVERY
            kept, last = 30 + 8 * k, N_PROMPT - 1 + t
            expected = [0, 1, 2, 3] + list(range(last - since - (kept - 4) + 1, last + 1))
        assert all(positions == expected for positions in layers), t


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_each_compression_has_kvpress_size(model, name):
    """kvpress's cache length after each forward (prefill first; scripts/make_kvpress_ratiodecode_goldens.py, on
    SmolLM2: the lengths do not depend on the model) is the length kvbench's layers hold before the next one."""
    case, lengths = GOLDEN[name], []
    method = METHODS[case["method"]]()
    with AttentionCapture(model, window=method.query_window) as capture:
        generate(model, None, method, capture, prompt(case["prompt_tokens"]), case["prompt_tokens"],
                 case["new_tokens"], eos_ids=set(), recompress=DecodeCompression(case["every"], ratio=case["ratio"]),
                 on_logits=lambda t, logits: lengths.append({layer.keys.shape[-2] for layer in capture.cache.layers}))
    assert lengths == [{n} for n in case["lengths"]]


def test_pyramidkv_splits_each_ratios_target_over_its_layers_as_a_target(model):
    """PyramidKV: right after each compression the layers hold its own shares of that compression's target,
    `layer_budgets(seen, layers, int(seen / 2))`: the ratio's target, split as `decode_compression.target`'s."""
    method, after = METHODS["pyramidkv"](window=8), {}
    decode(model, "pyramidkv", 32, DecodeCompression(EVERY, ratio=RATIO), new=NEW,
           seen=lambda t, cache: after.__setitem__(t, [layer.keys.shape[-2] for layer in cache.layers]))
    n_layers = model.config.num_hidden_layers
    for step in range(EVERY, NEW, EVERY):  # looked at before the next step's forward
        seen = N_PROMPT + step
        assert after[step] == method.layer_budgets(seen, n_layers, int(seen * (1 - RATIO))), step
    assert len(set(after[EVERY])) > 1  # a pyramid, not one share


def test_a_batch_equals_each_sample_alone(model):
    """The ratio's layers grow with the length, so they stay out of the fixed-capacity rows."""
    method, setting = METHODS["snapkv"](window=8), DecodeCompression(EVERY, ratio=RATIO)
    requests = [Request(prompt(n, seed=n), 32, new, ()) for n, new in [(N_PROMPT, 40), (N_PROMPT + 20, 50)]]
    with AttentionCapture(model, window=8) as capture:
        together = dict(generate_batched(model, None, method, capture, requests, 2, eos_ids=set(), recompress=setting))
        alone = [g for r in requests for _, g in generate_batched(model, None, method, capture, [r], 1, eos_ids=set(),
                                                                    recompress=setting)]
    for request, single in zip(requests, alone):
        assert together[request].token_ids == single.token_ids
        assert together[request].kv_bytes_decode_peak == single.kv_bytes_decode_peak


def test_a_method_that_cannot_compress_while_decoding_is_refused_naming_the_ratio():
    with pytest.raises(ValueError, match=r"^decode_compression.ratio=0.5: h2o evicts .*ratio=null$") as refused:
        check(METHODS["h2o"](), DecodeCompression(ratio=0.5))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("args, expected", [
    (["decode_compression.ratio=0.5", "decode_compression.target=64"], "set one of them"),
    (["decode_compression.ratio=1.0"], "decode_compression.ratio=1.0 must be in [0, 1)"),
])
def test_bad_combinations_are_refused_in_one_line_before_hydra(tmp_path, args, expected):
    assert expected in refusal("method=snapkv", *args, results=tmp_path)


def test_the_static_step_refuses_it_in_one_line_before_weights_load():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["model=tiny_llama", "method=snapkv", "step=static",
                                           "decode_compression.ratio=0.5"])
    with pytest.raises(ValueError, match="compression while decoding") as refused:
        setup(cfg)
    assert "\n" not in str(refused.value)


def test_the_ratio_names_its_own_run_dir_and_leaves_a_targets_as_it_was():
    """A target's run dirs keep the names they had before `ratio` existed; a ratio's differ from an off switch's."""
    from omegaconf import OmegaConf

    node = lambda **kv: OmegaConf.create({"every": 512, "target": None, **kv})  # noqa: E731
    assert config_hash("m", node(target=64, ratio=None)) == config_hash("m", node(target=64))
    assert config_hash("m", node(ratio=None)) == config_hash("m")
    assert config_hash("m", node(ratio=0.5)) not in {config_hash("m"), config_hash("m", node(ratio=0.25))}
