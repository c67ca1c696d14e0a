"""Composite (vision-language) checkpoints: a tiny composite model of each type, saved locally with transformers'
own `save_pretrained`, loads as its text decoder, whose logits on text input equal the composite model's own, and
is checked (or refused, naming its group) from its config.json alone."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as IMAGE_TEXT

from kvbench.models.adapters import check_model_dir
from kvbench.models.composite import load_text_decoder
from kvbench.models.tiny import tiny_type_config

SMALL_VISION = {  # towers shrunk to a few thousand weights (the text decoder is what kvbench runs)
    "gemma3": dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=28, patch_size=14), mm_tokens_per_image=4),
    "mistral3": dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, head_dim=16, image_size=28, patch_size=14)),
    "llama4": dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                                      projector_output_dim=32)),
    "qwen3_5": dict(vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)),
}
EXPECTED = {"gemma3": "gemma3", "mistral3": "mistral", "llama4": "llama4_text", "qwen3_5": "qwen3_5"}  # (hybrid row)


@pytest.fixture(scope="module", params=sorted(SMALL_VISION))
def saved(request, tmp_path_factory):
    model_type = request.param
    cls = CONFIG_MAPPING[model_type]
    text = tiny_type_config(cls().get_text_config(decoder=True).model_type)
    config = cls(text_config=text.to_dict(), **SMALL_VISION[model_type])
    auto = AutoModelForImageTextToText if model_type in IMAGE_TEXT else AutoModelForCausalLM  # as published
    torch.manual_seed(0)
    composite = auto.from_config(config).eval()
    folder = tmp_path_factory.mktemp(model_type)
    composite.save_pretrained(folder)
    return model_type, composite, folder


def test_the_text_decoder_gives_the_composite_models_logits(saved):
    model_type, composite, folder = saved
    text_model = load_text_decoder(str(folder))
    assert sum(p.numel() for p in text_model.parameters()) < sum(p.numel() for p in composite.parameters())
    ids = torch.randint(3, 200, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(text_model(input_ids=ids).logits, composite(input_ids=ids).logits)


def test_a_composite_config_is_checked_as_its_text_decoder(saved):
    model_type, _, folder = saved
    expected = EXPECTED[model_type]
    if expected.endswith(":"):  # its text decoder's group is refused, in one line, from config.json alone
        with pytest.raises(ValueError, match=expected) as err:
            check_model_dir(folder)
        assert "\n" not in str(err.value)
    else:
        assert check_model_dir(folder).family == expected
