"""RULER's variable tracking task `vt` (upstream `scripts/data/synthetic/variable_tracking.py` at c5341b4),
rewritten. Python's `random` and numpy's legacy global RNG are both seeded with the task seed, as upstream does.

Layout quirks kept (they are the 2024 data): noise sentences end in "\\n" and are joined by " "; a one-shot example
(3-letter names, made first with a 500-token budget) goes before the task template with its answer and "\\n\\n",
and the sample adds another "\\n\\n"; its names are re-drawn per sample by string replacement; the search measures
the prompt plus the *repr* of the answer list; the answer prefix says "assgined".
"""
from __future__ import annotations

import random
import string

import numpy as np

from kvbench.data.ruler.length import Counter, fit, linear_search
from kvbench.data.ruler.templates import TASKS

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
VT = TASKS["variable_tracking"]


class VariableTracking:
    """One generator run: upstream's module state (seeded RNGs, template, tokenizer) as attributes."""

    def __init__(self, count: Counter, template: str, tokens_to_generate: int, random_seed: int):
        self.count, self.template, self.tokens_to_generate = count, template, tokens_to_generate
        self.rng = random.Random(random_seed)
        self.np_rng = np.random.RandomState(random_seed)

    def name(self, k: int) -> str:
        return "".join(self.rng.choices(string.ascii_uppercase, k=k)).upper()

    def chains(self, num_chains: int, num_hops: int, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        k = 3 if is_icl else 5
        num_hops = min(10, num_hops) if is_icl else num_hops
        names = [self.name(k) for _ in range((num_hops + 1) * num_chains)]
        while len(set(names)) < num_chains * (num_hops + 1):
            names.append(self.name(k))
        var_lists, chain_lists = [], []
        for i in range(0, len(names), num_hops + 1):
            these = names[i:i + num_hops + 1]
            var_lists.append(these)
            chain = [f"VAR {these[0]} = {self.np_rng.randint(10000, 99999)}"]
            chain += [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(num_hops)]
            chain_lists.append(chain)
        return var_lists, chain_lists

    def make_sample(self, num_noises: int, num_chains: int, num_hops: int, is_icl: bool) -> tuple[str, list[str]]:
        var_lists, chain_lists = self.chains(num_chains, num_hops, is_icl)
        sentences = [NOISE] * num_noises
        if len(sentences) <= len(chain_lists[0]):
            sentences = [n + "." if len(n.strip()) > 0 else n for n in [x for s in sentences for x in s.split(".")]]
            if len(sentences) <= len(chain_lists[0]):   # upstream prints "reduces chain length ..."
                chain_lists = [chain[:len(sentences) - 1] for chain in chain_lists]
        for chain in chain_lists:
            positions = sorted(self.rng.sample(range(len(sentences)), len(chain)))
            for j, pos in enumerate(positions):
                sentences.insert(pos + j, chain[j])
        context = " ".join(sentences).replace(". \n", ".\n")

        template = self.template
        if is_icl and template != VT["template"] + VT["answer_prefix"]:
            # the example drops the model template; upstream also collapses the task template's whitespace and its
            # last word ("[/INST]" for meta-chat), so we do too
            cutoff = template.index(VT["template"][:20])
            cutoff_ans = template.index(VT["answer_prefix"][:10])
            template = " ".join(template[cutoff:cutoff_ans].split()[:-1]) + template[cutoff_ans:]
        value = chain_lists[0][0].split("=")[-1].strip()
        return template.format(context=context, query=value, num_v=num_hops + 1), var_lists[0]

    def randomize_icl(self, icl_example: str) -> str:
        cut = icl_example.index(VT["answer_prefix"][-10:])
        for item in icl_example[cut + 10:].strip().split():
            icl_example = icl_example.replace(item, self.name(len(item)))
        return icl_example

    def samples(self, num_samples: int, max_seq_length: int, incremental: int, num_chains: int, num_hops: int,
                icl_example: dict | None = None) -> list[dict]:
        """Upstream `sys_vartrack_w_noise_random` (`add_fewshot` is always true there)."""
        is_icl = icl_example is None
        example_tokens, icl = 0, None
        if icl_example is not None:
            icl = icl_example["input"] + " " + " ".join(icl_example["outputs"]) + "\n\n"
            example_tokens = self.count(icl)

        def measure(n: int) -> int:
            text, answer = self.make_sample(n, num_chains, num_hops, is_icl)
            return self.count(text + f" {answer}")   # the list's repr, as upstream

        budget = max_seq_length - self.tokens_to_generate - example_tokens
        num_noises = linear_search(measure, incremental, budget)

        def attempt(n: int) -> dict:
            text, answer = self.make_sample(n, num_chains, num_hops, is_icl)
            length = self.count(text) + self.tokens_to_generate + example_tokens
            if length > max_seq_length:
                raise ValueError(f"{length} exceeds max_seq_length.")
            return {"input": text, "outputs": answer, "length": length}

        out = []
        for index in range(num_samples):
            rec = fit(attempt, num_noises, incremental, "vt")
            if icl is not None:
                cutoff = rec["input"].index(VT["template"][:20])
                rec["input"] = rec["input"][:cutoff] + self.randomize_icl(icl) + "\n\n" + rec["input"][cutoff:]
            out.append({"index": index, **rec})
        return out


def generate(count: Counter, template: str, max_seq_length: int, tokens_to_generate: int, num_samples: int,
             random_seed: int, num_chains: int, num_hops: int) -> list[dict]:
    """Upstream records `{index, input, outputs, length}`; `length` counts the example as measured before its
    names were re-drawn and without the extra "\\n\\n", as upstream does."""
    gen = VariableTracking(count, template, tokens_to_generate, random_seed)
    (icl,) = gen.samples(1, 500, 5, num_chains, num_hops)
    return gen.samples(num_samples, max_seq_length, 10, num_chains, num_hops, icl_example=icl)
