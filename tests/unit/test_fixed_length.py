"""dataset=fixed_length (PyramidKV's latency tables): exactly P prompt tokens of essay text and exactly G new tokens,
one sample per (P, G); bad grids fail in one line."""
from __future__ import annotations

import pytest

from kvbench.data.latency import FixedLength


def test_exact_prompt_and_generation_lengths(smollm2_tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("Red fox runs. " * 40, encoding="utf-8")  # shorter than P: repeated
    samples = FixedLength(prompt_lengths=[16, 300], generation_lengths=[4, 8], haystack_dir=str(tmp_path)) \
        .build(smollm2_tokenizer, max_prompt_tokens=1000)
    assert [s.id for s in samples] == ["len-P16-G4", "len-P16-G8", "len-P300-G4", "len-P300-G8"]
    text_ids = smollm2_tokenizer.encode("Red fox runs. " * 40, add_special_tokens=False)
    for s in samples:
        p, g = s.meta["prompt_length"], s.meta["generation_length"]
        assert len(s.input_ids) == p and s.max_new_tokens == s.min_new_tokens == g
        bos = [smollm2_tokenizer.bos_token_id] if smollm2_tokenizer.bos_token_id is not None else []
        assert list(s.input_ids) == (bos + (text_ids * 3))[:p]  # BOS (if any), then the text from its start


@pytest.mark.parametrize("kw,message", [({"prompt_lengths": []}, "prompt_lengths=\\[\\] must be distinct"),
                                        ({"generation_lengths": [4, 4]}, "generation_lengths=\\[4, 4\\]")])
def test_bad_grids_fail_in_one_line(kw, message):
    with pytest.raises(ValueError, match=message):
        FixedLength(**kw)


def test_prompts_longer_than_the_model_allows_fail(smollm2_tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("Red fox runs. ", encoding="utf-8")
    with pytest.raises(ValueError, match="prompt length 600 exceeds the model's max_prompt_tokens=500"):
        FixedLength(prompt_lengths=[600], haystack_dir=str(tmp_path)).build(smollm2_tokenizer, max_prompt_tokens=500)
