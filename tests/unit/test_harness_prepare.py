"""kvbench as an lm-eval model builds and prepares its method as `python -m kvbench.run` does: the method's
`${model.*}` fields read from the model config (TailorKV's published layer split, KVzip's chat template), then
`method.prepare` once the weights are in. Built through lm-eval's own registry and argument string on the tiny Llama
(embedded tokenizer), TailorKV identifies its layer split at load and generates what the command's path generates.
Before, lm-eval ran TailorKV unprepared ("quant_layers is unknown; call prepare(model, tokenizer) first"), and KVzip
and KVgrad could not be built ("Interpolation key 'model.chat_template' not found")."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from hydra import compose, initialize_config_dir  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

import kvbench.harness  # noqa: E402,F401  (registers the `kvbench` model with lm-eval)
from kvbench.engine.batching import generate  # noqa: E402
from kvbench.engine.generation import prefill  # noqa: E402
from kvbench.models import AttentionCapture, load  # noqa: E402
from kvbench.runs.config import CONFIG_DIR, setup  # noqa: E402
from kvbench.runs.harness import build_method, model_fields  # noqa: E402

# > start_size + recent_size (8 + 56) tokens: TailorKV offloads every layer outside its split
PROMPT = ("The keeper of the kvbench lighthouse painted its door blue in 1931, and the harbour board paid for the "
          "paint, the brushes and the ladder. Every spring after that the keeper climbed the ladder again, scraped "
          "the salt from the door and painted it once more, while the gulls watched from the rail of the gallery. "
          "The colour of the door was")
UNTIL, MAX_NEW = ["\n"], 6


def harness_generation(model_args: str) -> tuple[object, str]:
    """(the lm-eval model, its generation for PROMPT), built the way `lm_eval --model kvbench` builds it."""
    lm = get_model("kvbench").create_from_arg_string(model_args)
    request = Instance("generate_until", {}, (PROMPT, {"until": UNTIL, "max_gen_toks": MAX_NEW}), 0)
    (text,) = lm.generate_until([request], disable_tqdm=True)
    return lm, text


def cli_setup(*overrides: str):
    """(config, method, model spec) as `python -m kvbench.run <overrides>` composes and checks them."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    method, _, spec = setup(cfg)
    return cfg, method, spec


def cli_generation(*overrides: str) -> tuple[object, dict | None, str]:
    """(method, what its prepare returned, generation for PROMPT) along `python -m kvbench.run`'s path: the config
    Hydra composes, `setup`, the load, `method.prepare`, the capture, the engine's generation."""
    cfg, method, spec = cli_setup(*overrides)
    model, tokenizer = load(spec)
    prepared = method.prepare(model, tokenizer, prefill=prefill)
    ids = torch.tensor([tokenizer(PROMPT, add_special_tokens=False).input_ids])
    with AttentionCapture(model, window=method.query_window) as capture:
        gen = generate(model, tokenizer, method, capture, ids, cfg.budget, MAX_NEW, stop=tuple(UNTIL),
                       positions=cfg.positions, seed=cfg.seed)
    return method, prepared, gen.text


def test_tailorkv_through_lm_eval_is_prepared_and_generates_what_the_command_generates():
    lm, text = harness_generation("model=tiny_llama,method=tailorkv,budget=80")
    method, prepared, want = cli_generation("model=tiny_llama", "method=tailorkv", "budget=80")
    assert prepared["identification"] is not None  # configs/model/tiny_llama.yaml lists no split: found at load
    assert lm.prepared == prepared
    assert lm.get_model_info() == {"method_prepared": prepared, "method_label": method.label}  # tailorkv-1
    assert lm.method.quant_layers == method.quant_layers and text == want and text.strip()


@pytest.mark.parametrize("model, method", [("smollm2", "tailorkv"), ("smollm2", "kvzip"), ("tiny_llama", "kvgrad")])
def test_fields_that_read_the_model_config_are_the_commands(model, method):
    """No weights: the method the harness builds equals the one `setup` builds from the composed config (the tiny
    Llama's TailorKV, whose split is found at load, in the test above)."""
    _, want, _ = cli_setup(f"model={model}", f"method={method}")
    assert build_method(method, {}, model_fields(model, None)) == want
    if method == "tailorkv":
        assert want.quant_layers == [0]  # configs/model/smollm2.yaml's published split, not identified again
