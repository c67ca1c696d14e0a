"""What every method shares: the `Method` base, the per-layer view it scores, and the selection helpers.

A method declares its knobs (dataclass fields, mirrored by `configs/method/<name>.yaml`), what it is (`kind`) and
its capabilities (`query_window`, `kept_window`, `selects_per_query_head`), turns a budget into per-layer entry
counts (`layer_budgets`), and picks which entries of one layer survive (`select`). It never loads models, registers
hooks, touches files or frees memory: `kvbench.engine.generation.compress` applies its choice to the cache, after
`kvbench.methods.contract` checked it. The API, with a worked example: docs/adding_a_method.md.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.attention.sinks import sink_softmax
from kvbench.models.rotary import Rotary


class RefusedForModel(ValueError):
    """A method setting that the loaded model cannot take (GEAR's value groups across a token's heads): raised by
    `Method.prepare`, once the model's shape is known and before any sample; the command line shows its one line."""


class Kind(enum.Enum):
    """What a method is; the engine dispatches on it (never on which attributes a class happens to have)."""

    SELECTOR = "prefill selector"  # picks the prompt entries to keep, once, at prefill: `select` (SnapKV, full)
    EVICTOR = "decode-time evictor"  # evicts at prefill and while generating, from scores it accumulates:
    #                                   `DecodingMethod` (H2O, Keyformer, BUZZ, the rolling windows)
    RECONSTRUCTOR = "reconstruction selector"  # scores the prompt by prefilling a reconstruction of it on top of
    #                                   the full cache, then picks entries across all layers and heads: `select_all` (KVzip)
    #                                   (Fast KVzip: a gate scores each layer's input instead, `scores_inputs`)
    STORAGE = "storage"  # keeps every entry in layers with their own storage and retrieval: `attach` (TailorKV)


@dataclass
class LayerView:
    """What a method sees of one layer right after prefill.

    keys/values: `[B, H_kv, n, D]` (post-RoPE keys); window_queries: `[B, H_q, w, D]` post-RoPE, or None;
    window_bias: the model's additive position bias of the window rows `[B, H_q, w, n]` (ALiBi), or None;
    softcap: the model's attention-logit soft cap (Gemma 2: cap * tanh(logits / cap)), or None;
    rotary: the layer's rotary encoding (`kvbench.models.rotary.Rotary`; `Rotary.none()` without RoPE), or None;
    output_weight: the layer's attention output projection W_o `[hidden, H_q * D]` (column block h: query head h),
    for scorers that weigh values by what they add to the output (CriticalKV), or None;
    question_len: how many of the prompt's last entries are its question, handed to methods whose
    `window_is_question` (FINCH) under query=aware; 0 otherwise.
    input_scores: `[B, H_kv, n]`, what the method's `input_scores` gave the layer's prefill input (KVzap), or None.
    positions: `[B, H_kv, n]` each entry's original position where they are not 0..n-1 (a layer compressed again
    while decoding, a wrapper's subset), for scorers that rotate keys back (leverage_score); None: 0..n-1.
    sinks: `[H_q]` the layer's learned sink logits (gpt-oss's `s_aux`), which join each softmax row, or None.
    An MLA layer (DeepSeek) is seen as one latent KV head: keys = [latent, rotary key], window queries absorbed
    into that space (`kvbench.models.mla`), so q . k is the model's own logit; values = the latent.
    """

    layer_idx: int
    n_layers: int
    keys: Tensor
    values: Tensor
    window_queries: Tensor | None
    scaling: float
    window_bias: Tensor | None = None
    softcap: float | None = None
    rotary: Rotary | None = None  # the layer's position encoding (rotary angles), for scorers that rotate queries
    output_weight: Tensor | None = None  # W_o `[hidden, H_q * D]`, for scorers weighing values (CriticalKV)
    question_len: int = 0  # the prompt's last entries that are its question, for `window_is_question` (0: unknown)
    input_scores: Tensor | None = None  # `[B, H_kv, n]` from the layer's attention input (`Method.input_scores`)
    positions: Tensor | None = None  # `[B, H_kv, n]` the entries' original positions; None: 0..n-1 (a prefill)
    sinks: Tensor | None = None  # `[H_q]` learned sink logits (gpt-oss), in every softmax row; None: no sinks

    @property
    def prompt_len(self) -> int:
        return self.keys.shape[-2]

    @property
    def next_position(self) -> int:
        """Where the next token will sit: n after a prefill; one past the newest entry's original position in a layer
        compressed again while decoding (it holds fewer entries than the tokens it has seen), for scorers that place
        queries by position (Expected Attention's window and future queries)."""
        return self.prompt_len if self.positions is None else int(self.positions.max()) + 1


@dataclass
class Method:
    """Base class: subclasses are dataclasses registered with `@METHODS.register(name)`."""

    kind: ClassVar[Kind] = Kind.SELECTOR
    scores_inputs: ClassVar[bool] = False  # True: `input_scores` scores each layer's prefill input (KVzap)
    threshold_budget: ClassVar[bool] = False  # True: what is kept follows a score threshold, not `budget` (DMS)
    own_storage: ClassVar[bool] = False  # True: compressed layers are not dense (per-head variable, quantized,
    # offloaded): they cannot hold keys a model's sliding window would hide, nor be reordered by beam search
    replay_gradient: ClassVar[bool] = False  # a reconstructor whose replay runs with autograd (KVgrad)
    holds_ranked: ClassVar[bool] = False  # True: its reference keeps the kept entries best first and scores a later
    # selection in that order (R-KV): the engine calls `select_ranked` with the ranking the layer's last one left
    may_keep_whole: ClassVar[bool] = False  # True: `select` may return None (SimLayerKV's non-lazy layers), so
    # a layer compressed while decoding can grow with every token: no fixed bound, no fixed-capacity rows
    reads_per_head: ClassVar[frozenset[str]] = frozenset()  # per-head parts of a layer it reads beyond keys and
    # queries ("rotary angles", "output projection W_o", "KV-head pattern"): an MLA layer has none (methods/latent.py)
    writes_values: ClassVar[bool] = False  # True: it rewrites cached values (CaM, `+method.merge`)
    prefill_needs: ClassVar[str | None] = None  # what `select` needs that only a prefill's view holds (every prompt
    # query, W_o): `decode_compression` refuses the method before weights load; None: it scores a decoding layer too

    @property
    def compresses(self) -> bool:
        return True

    @property
    def takes_chunks(self) -> bool:
        """Whether several tokens can be fed on top of the compressed cache at once (query=agnostic's question, a
        conversation's later turns: `generation.feed`). Dense and per-head layers can; a storage method's layers only
        where it says so (`takes_chunks = True`: Quest, PQCache, TailorKV)."""
        return self.kind is not Kind.STORAGE

    @property
    def query_window(self) -> int:
        """How many of the prompt's last queries the capture records for `select` at prefill (`view.window_queries`;
        0: none, the view's is None). A grid sweep may hand over more (the widest method's): slice the last ones."""
        return 0

    @property
    def kept_window(self) -> int:
        """How many of the prompt's last positions every head's selection keeps, inside `n_keep` (SnapKV's
        observation window; 0: none promised). The engine checks each selection ends with them."""
        return 0

    @property
    def prunes_channels(self) -> bool:
        """True when, after its selection, the method keeps only some key channels of each head (ThinK): the engine
        then stores the layer's prompt keys reduced to `channels_to_keep(view, keys)` (`kvbench/cache/channels.py`)."""
        return False

    def channels_to_keep(self, view: LayerView, keys: Tensor) -> Tensor:  # pragma: no cover - interface
        """The key channels each head keeps, int64 `[B, H_kv, D']` sorted (the same D' in every head), from the
        layer's view and its keys `[B, H_kv, T, D]` after the selection."""
        raise NotImplementedError

    @property
    def window_is_question(self) -> bool:
        """True when the method's observation window is the prompt's question (FINCH): under query=aware the runner
        splits the prompt and `select` gets the question's length as `view.question_len` (the capture then records
        at least that many queries); query=agnostic, which has no question before compression, is refused."""
        return False

    @property
    def selects_per_query_head(self) -> bool:
        """True when `select` returns one index set per query head (`granularity=query_head`, the paper-era
        layout: the cache then holds H_q heads); the engine refuses any other head count."""
        return False

    def prepare(self, model, tokenizer, *, prefill: Callable | None = None) -> dict | None:
        """Once per run, after the model loads: per-run setup whose result goes into manifest.json (TailorKV's
        layer split), or None. `prefill`: the engine's (`kvbench.engine.generation.prefill`), for a setup that runs
        the model (TailorKV's identification); the runner hands it down, since methods do not import the engine."""
        return None

    def check_budget(self, budget: int | None) -> None:
        """Raise ValueError (one line, naming the fix) if `budget` makes no sense for this method."""
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ValueError(f"{self.registry_name}: budget={budget!r} must be a positive integer "
                             "(KV entries kept per head per layer, window included); or use ratio=<0..1>.")

    def check_below_budget(self, field: str, budget: int, why: str = "the window counts inside the budget") -> None:
        """For `check_budget`: `field` (a window kept whole, 0 = none) must leave room in the budget."""
        value = getattr(self, field)
        if value and budget <= value:
            raise ValueError(f"{self.registry_name}: {field}={value} must be < budget={budget} ({why}); lower "
                             f"method.{field} or raise budget.")

    def own_decode_compression(self, budget: int | None) -> tuple[int, int, str] | None:
        """(every, target, "generated" | "sequence") for a method that compresses while decoding by itself (R-KV),
        used unless `decode_compression.target` is set (kvbench.engine.recompress); None: it does not."""
        return None

    def layer_budgets(self, prompt_len: int, n_layers: int, budget: int) -> list[int]:
        """Entries kept per head in each layer. Default: uniform, no compression when the prompt fits."""
        return [min(budget, prompt_len)] * n_layers

    def input_scores(self, layer_idx: int, hidden: Tensor, config) -> Tensor:  # pragma: no cover - interface
        """For a method that `scores_inputs`: per-entry scores `[B, H_kv, n]` from the layer's attention input
        `[B, n, hidden]` at prefill (the capture calls it; `select` reads them as `view.input_scores`); `config`:
        the model's text config."""
        raise NotImplementedError

    def select_ranked(self, view: LayerView, n_keep: int, positions: Tensor,
                      ranked: Tensor | None) -> tuple[Tensor, Tensor]:  # pragma: no cover - interface
        """For a method that `holds_ranked`: `select`'s indices, scored with the entries in its reference's order
        (`ranked`: the positions `[B, H, k]` the layer's last selection ranked, best first, that the reference holds
        first; None: position order), and the positions of the entries it now ranks, best first (`positions`: the
        layer's `[B, H, n]`, ascending, kvbench's storage order)."""
        raise NotImplementedError

    def select(self, view: LayerView, n_keep: int) -> Tensor | list[Tensor] | None:  # pragma: no cover - interface
        """Indices of the layer's entries to keep: int64 `[B, H, n_keep]`, each head's unique, in [0, n), sorted
        ascending, the last `kept_window` positions included; H = KV heads (query heads if
        `selects_per_query_head`). A per-head variable selection (batch 1) returns one such 1-D tensor per head
        instead, of any lengths (`n_keep` is then their mean). None keeps the layer whole (a per-layer choice:
        SimLayerKV's non-lazy layers). Called only when `n_keep < n`; checked by
        `kvbench.methods.contract.check_selection`."""
        raise NotImplementedError

    def merged_values(self, view: LayerView, kept: Tensor) -> Tensor | None:
        """The kept entries' values `[B, H, k, D]` (in `kept`'s order) with the evicted ones folded in, which the
        cache stores instead of the plain kept values (`+method.merge=true`: kvbench.methods.wrappers `Merge`);
        None: the kept values as they are. Called between `select` and the gather."""
        return None

    def stored_layer(self, layer):
        """The layer as this method stores it after its selection (`KVLayer` in, a cache layer out): the base keeps it
        as it is; `+method.quantize` (kvbench.methods.quantize) stores it quantized. Called once per layer, after the
        selection (and merge), inside `generation.compress_layer`."""
        return layer


# --- helpers shared by the window-scoring methods (SnapKV, PyramidKV, Ada-KV) ----------------------------------
def window_attention(window_queries: Tensor, keys: Tensor, scaling: float, bias: Tensor | None = None,
                     softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Softmax attention of the last w queries over all n keys: `[B, H_q, w, n]`, fp32.

    The causal mask applies only inside the trailing w x w block (every prefix key precedes every window query).
    `softcap` and `bias` (`[B, H_q, w, n]`, the model's position bias such as ALiBi) shape the logits as the model
    does: soft cap first, then the bias; learned `sinks` `[H_q]` (gpt-oss) join each row's softmax.
    Costs w x n per head; the n x n matrix is never built.
    """
    b, h_q, w, d = window_queries.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    q = window_queries.reshape(b, h_kv, (h_q // h_kv) * w, d)  # group the query heads of each KV head
    logits = (q @ keys.transpose(-1, -2)).float() * scaling  # [B, H_kv, r*w, n]
    logits = logits.view(b, h_q, w, n)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if bias is not None:
        logits = logits + bias[:, :, -w:].float()
    future = torch.ones(w, w, dtype=torch.bool, device=keys.device).triu(1)
    logits[..., n - w:] = logits[..., n - w:].masked_fill(future, float("-inf"))
    return sink_softmax(logits, None if sinks is None else sinks.view(1, h_q, 1, 1))


def reduce_groups(scores: Tensor, n_kv_heads: int, how: Literal["mean", "max", "sum"]) -> Tensor:
    """`[B, H_q, T]` -> `[B, H_kv, T]`: combine the query heads of each KV group."""
    b, h_q, t = scores.shape
    grouped = scores.view(b, n_kv_heads, h_q // n_kv_heads, t)
    return {"mean": grouped.mean, "max": lambda dim: grouped.max(dim).values, "sum": grouped.sum}[how](dim=2)


def pool1d(scores: Tensor, kernel: int, pooling: Literal["max", "avg", "none"]) -> Tensor:
    """Length-preserving 1-D pooling along the sequence, per head (stride 1, padding kernel // 2)."""
    if pooling == "none" or kernel <= 1:
        return scores
    b, h, t = scores.shape
    x = scores.reshape(b * h, 1, t)
    pad = kernel // 2
    if pooling == "max":
        x = F.max_pool1d(x, kernel, stride=1, padding=pad)
    else:
        x = F.avg_pool1d(x, kernel, stride=1, padding=pad)
    return x.reshape(b, h, -1)[..., :t]


def topk_plus_window(scores: Tensor, n_keep: int, prompt_len: int, window: int) -> Tensor:
    """Top `n_keep - window` prefix positions by score, plus the last `window` positions; sorted `[B, H, n_keep]`."""
    b, h, _ = scores.shape
    top = scores.topk(n_keep - window, dim=-1).indices
    recent = torch.arange(prompt_len - window, prompt_len, device=scores.device).expand(b, h, window)
    return torch.cat([top, recent], dim=-1).sort(dim=-1).values
