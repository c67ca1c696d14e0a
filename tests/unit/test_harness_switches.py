"""The lm-eval harness takes the kvpress-wrapper switches (`method.whole_layers`, `layer_ratios`, `chunk_length`,
`block_size`, `then` + `first_ratio`) as `python -m kvbench.run` takes `+method.<key>`: through
`kvbench.runs.config.build_method`, so the method object is the command's and so is its generation. Before, the
harness handed them to the method's dataclass ("unexpected keyword argument 'whole_layers'")."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("lm_eval")

from lm_eval._cli.utils import key_val_to_dict  # noqa: E402  (lm-eval's own `--model_args` parser)
from lm_eval.api.registry import get_model  # noqa: E402

from kvbench.runs.harness import build_method, model_fields  # noqa: E402
from tests.unit.test_harness_prepare import PROMPT, UNTIL, MAX_NEW, cli_generation, cli_setup  # noqa: E402

SWITCHES = [  # (the command's overrides, the same as lm-eval model arguments)
    (["+method.whole_layers=[0]"], "method.whole_layers=[0]"),
    (["+method.layer_ratios=[0.25,0.5]"], "method.layer_ratios=[0.25,0.5]"),
    (["+method.block_size=16"], "method.block_size=16"),
    (["+method.then=cur", "+method.first_ratio=0.5"], "method.then=cur,method.first_ratio=0.5"),
]


@pytest.mark.parametrize("overrides, model_args", SWITCHES)
def test_a_switch_builds_the_commands_method(overrides, model_args):
    """No weights: lm-eval's command line parses the model arguments, the harness builds the method `setup` builds."""
    _, want, _ = cli_setup("model=tiny_llama", "method=knorm", *overrides)
    args = {k.removeprefix("method."): v for k, v in key_val_to_dict(model_args).items()}
    assert build_method("knorm", args, model_fields("tiny_llama", None)) == want
    assert type(want).__name__ != "Knorm"  # wrapped


def test_a_wrapped_method_through_lm_eval_generates_what_the_command_generates():
    """lm-eval's argument string (`create_from_arg_string`, which leaves `[0]` as text) on the tiny Llama."""
    from lm_eval.api.instance import Instance

    lm = get_model("kvbench").create_from_arg_string("model=tiny_llama,method=knorm,budget=24,method.whole_layers=[0]")
    request = Instance("generate_until", {}, (PROMPT, {"until": UNTIL, "max_gen_toks": MAX_NEW}), 0)
    (text,) = lm.generate_until([request], disable_tqdm=True)
    method, _, want = cli_generation("model=tiny_llama", "method=knorm", "budget=24", "+method.whole_layers=[0]")
    assert lm.method == method and text == want and text.strip()
    assert lm.get_model_info() == {"method_label": "knorm+per_layer"}  # imported runs' name (test_lm_eval_import)


@pytest.mark.parametrize("args, says", [({"whole_layers": [-1]}, "method.whole_layers=[-1]"),
                                        ({"then": "nope", "first_ratio": 0.5}, "Unknown method 'nope'"),
                                        ({"then": "cur"}, "go together")])
def test_a_bad_switch_fails_in_one_line_before_weights_load(args, says):
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        build_method("knorm", args, model_fields("tiny_llama", None))
    assert "\n" not in str(e.value) and str(e.value).startswith("kvbench: ")
