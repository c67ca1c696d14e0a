"""kvpress's wrappers (0.5.5 `PerLayerCompressionPress`, `ChunkPress`, `BlockPress`, `ComposedPress`, `MergingPress`)
as switches on any selector: keys added to its method node, e.g.

    python -m kvbench.run method=snapkv +method.whole_layers=[0]              # layer 0 kept whole (TailorKV's dagger)
    python -m kvbench.run method=snapkv +method.layer_ratios=[0,0.5,...]       # one ratio per layer (kvpress's list)
    python -m kvbench.run method=knorm +method.chunk_length=1024               # each chunk of the prompt on its own
    python -m kvbench.run method=knorm +method.block_size=128                  # block-wise, as keydiff's default
    python -m kvbench.run method=snapkv +method.then=knorm +method.first_ratio=0.5 ratio=0.75   # one, then another
    python -m kvbench.run method=knorm +method.merge=true ratio=0.5            # evicted values merged into kept ones
    python -m kvbench.run method=snapkv budget=128 +method.quantize=kivi2      # what is kept stored at 2 bits (KIVI)

`kvbench.runs.config` takes these keys off the node (unless the method has a field of that name: keydiff's own
`block_size`, chunkkv's `chunk_length`), builds the method, and wraps it here (`wrap`). A wrapper is the method for
the engine: it delegates the selector API (`select`, `layer_budgets`, the windows) and adds its one idea. Its
records name it `<method>+<wrapper>` (`snapkv+per_layer`, `knorm+chunk`, `snapkv+knorm`, `knorm+merge`); its run
directory is the method's, the switches in config.yaml and the directory's hash. Not registered:
there is no `method=chunk`. Chunk and block need a scorer whose `scores(view)` reads no queries (the capture records
only the prompt's last queries, not every chunk's).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from kvbench.methods.base import Kind, LayerView, Method
from kvbench.methods.merging import merged_kept_values


@dataclass
class Switches:
    """The wrapper keys a selector's node may carry (`+method.<key>=...`); their rules: kvbench/runs/schema.py."""

    whole_layers: list[int] | None = None  # layers kept whole (kvpress PerLayerCompressionPress, ratio 0 there)
    layer_ratios: list[float] | None = None  # one compression ratio per layer (kvpress's `compression_ratios`)
    chunk_length: int | None = None  # prompt entries per independently compressed chunk (kvpress ChunkPress)
    block_size: int | None = None  # prompt entries per block of the block-wise pass (kvpress BlockPress)
    then: str | None = None  # a second method (registry name, its YAML's settings) on what the first kept
    first_ratio: float | None = None  # with `then`: the fraction of the prompt the first method removes
    merge: bool | None = None  # evicted values folded into the kept ones (kvpress MergingPress)
    merge_threshold: float | None = None  # with `merge`: the least key cosine at which an entry merges
    merge_fraction: float | None = None  # with `merge`: the share of the passing entries (best cosines) that merge
    quantize: str | None = None  # what is kept stored KIVI-quantized: kivi1, kivi2, kivi4, kivi8 (methods/quantize.py,
    #                              applied by its `wrap_all`, the outermost switch)
    quantize_group: int | None = None  # with `quantize`: tokens per key group, channels per value group (32)
    quantize_residual: int | None = None  # with `quantize`: most recent kept entries in full precision (128)


def sub_view(view: LayerView, idx: Tensor) -> LayerView:
    """The layer restricted to entries `idx` (`[B, H_kv, k]`, per head), as if they were its whole cache. The window
    queries and their bias are kept (a second stage reading queries needs the window among `idx`)."""
    d = view.keys.shape[-1]
    gather = idx.unsqueeze(-1).expand(-1, -1, -1, d)
    bias = view.window_bias
    if bias is not None:  # [B, H_q, w, n]: each query head reads its KV head's entries
        per_q = idx.repeat_interleave(bias.shape[1] // idx.shape[1], dim=1)
        bias = bias.gather(-1, per_q.unsqueeze(2).expand(-1, -1, bias.shape[2], -1))
    scores = None if view.input_scores is None else view.input_scores.gather(2, idx)  # KVzap's, per entry
    positions = idx if view.positions is None else view.positions.gather(2, idx)  # where each entry really sits
    return LayerView(view.layer_idx, view.n_layers, view.keys.gather(2, gather), view.values.gather(2, gather),
                     view.window_queries, view.scaling, bias, view.softcap, view.rotary, view.output_weight,
                     input_scores=scores, positions=positions)


def blockwise(n: int, n_keep: int, block_size: int, score: Callable[[Tensor], Tensor], like: Tensor) -> Tensor:
    """kvpress BlockPress's pass: the first `n_keep` entries are kept, then each following block of `block_size`
    joins them and the `n_keep` best of the union (`score(candidates [B, H, k]) -> [B, H, k]`) stay. Sorted."""
    b, h = like.shape[:2]
    kept = torch.arange(n_keep, device=like.device).expand(b, h, n_keep)
    for start in range(n_keep, n, block_size):
        block = torch.arange(start, min(start + block_size, n), device=like.device).expand(b, h, -1)
        candidates = torch.cat([kept, block], dim=-1)
        kept = candidates.gather(-1, score(candidates).topk(n_keep, dim=-1).indices)
    return kept.sort(dim=-1).values


def chunk_quotas(lengths: list[int], n_keep: int) -> list[int]:
    """Entries each chunk keeps: its share of `n_keep` rounded down (kvpress: int(length (1 - ratio))), the rest
    one each to the last chunks, so that the layer keeps exactly `n_keep`."""
    n = sum(lengths)
    quotas = [length * n_keep // n for length in lengths]
    extra = n_keep - sum(quotas)  # fewer than the chunks: each has room for one more
    for c in reversed(range(len(lengths))):
        if extra and quotas[c] < lengths[c]:
            quotas[c], extra = quotas[c] + 1, extra - 1
    return quotas


class FromPress:
    """A capability flag of `Method` that a wrapper has exactly when the method it wraps has it (class attributes are
    found before `__getattr__` is asked, so without this a wrapper would report the base class's defaults)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, wrapper, owner=None):
        return self if wrapper is None else getattr(wrapper.press, self.name)


@dataclass
class Wrapper(Method):
    """A selector holding another (`press`, kvpress's name); the selector API is the wrapped method's."""

    press: Method = field(default_factory=Method)
    suffix = "wrapped"
    own_storage = FromPress()  # (Ada-KV's per-head layers stay per head under per-layer budgets)
    selects_per_query_head = FromPress()
    prefill_needs = FromPress()
    may_keep_whole = FromPress()
    reads_per_head = FromPress()

    def __post_init__(self):
        if self.press.kind is not Kind.SELECTOR or not self.press.compresses:
            raise ValueError(f"{self.registry_name}: wraps selectors only (methods that pick entries once at "
                             f"prefill); {self.press.registry_name} is a {self.press.kind.value}")
        why = unwrappable(self.press)
        if why:
            raise ValueError(f"{self.registry_name}: {self.press.registry_name} {why}, which a wrapper does not "
                             "hand on; use it unwrapped")

    @property
    def registry_name(self) -> str:
        return f"{getattr(self.press, 'registry_name', type(self.press).__name__)}+{self.suffix}"

    @property
    def label(self) -> str:
        """The records' method name (`snapkv+per_layer`): the published tables tell wrapped runs apart by it."""
        return self.registry_name

    def __getattr__(self, name):  # the wrapped method's knobs (`window`, `n_sink`, ...) read by the engine
        if name.startswith("__") or name == "press":
            raise AttributeError(name)
        return getattr(self.press, name)

    @property
    def query_window(self) -> int:
        return self.press.query_window

    @property
    def kept_window(self) -> int:
        return self.press.kept_window

    def prepare(self, model, tokenizer, *, prefill=None):
        return self.press.prepare(model, tokenizer, prefill=prefill)

    def check_budget(self, budget: int | None) -> None:
        self.press.check_budget(budget)

    def layer_budgets(self, prompt_len: int, n_layers: int, budget: int) -> list[int]:
        return self.press.layer_budgets(prompt_len, n_layers, budget)

    def select(self, view: LayerView, n_keep: int):
        return self.press.select(view, n_keep)

    def merged_values(self, view: LayerView, kept: Tensor) -> Tensor | None:
        return self.press.merged_values(view, kept)

    def stored_layer(self, layer):
        return self.press.stored_layer(layer)


@dataclass
class PerLayer(Wrapper):
    """kvpress `PerLayerCompressionPress`: other budgets in some layers. `whole_layers` keep every entry (on top of
    the budget, which the other layers keep); `layer_ratios` give every layer kvpress's `int(n (1 - r))` instead of
    the run's budget or ratio (at prefill only: `decode_compression` refuses them, via `prefill_needs`)."""

    whole_layers: list[int] = field(default_factory=list)
    layer_ratios: list[float] | None = None
    suffix = "per_layer"

    def __post_init__(self):
        super().__post_init__()
        if any(not isinstance(i, int) or i < 0 for i in self.whole_layers):
            raise ValueError(f"{self.registry_name}: whole_layers={self.whole_layers} must be layer indices >= 0")
        if self.layer_ratios is not None and any(not 0 <= r < 1 for r in self.layer_ratios):
            raise ValueError(f"{self.registry_name}: layer_ratios={self.layer_ratios} must each be in [0, 1)")

    @property
    def prefill_needs(self) -> str | None:
        if self.layer_ratios is not None and not self.press.prefill_needs:
            # (kvpress has no such press either: DecodingPress takes a ScorerPress, PerLayerCompressionPress is not)
            return ("a prompt to take layer_ratios of (int(n (1 - r)) of the tokens seen: a decoding layer's share "
                    "would grow with them, never back to the target)")
        return self.press.prefill_needs

    def layer_budgets(self, prompt_len: int, n_layers: int, budget: int) -> list[int]:
        if self.layer_ratios is not None and len(self.layer_ratios) != n_layers:
            raise ValueError(f"{self.registry_name}: layer_ratios has {len(self.layer_ratios)} values for a model "
                             f"of {n_layers} layers; give one per layer")
        if any(i >= n_layers for i in self.whole_layers):
            raise ValueError(f"{self.registry_name}: whole_layers={self.whole_layers} names a layer the model "
                             f"lacks (layers 0..{n_layers - 1})")
        if self.layer_ratios is None:
            budgets = self.press.layer_budgets(prompt_len, n_layers, budget)
        else:
            budgets = [max(1, int(prompt_len * (1 - r))) for r in self.layer_ratios]
        budgets = [prompt_len if i in self.whole_layers else b for i, b in enumerate(budgets)]
        window = self.press.kept_window
        if any(window >= b for b in budgets if b < prompt_len):
            raise ValueError(f"{self.registry_name}: a layer keeps {min(budgets)} entries, not above the kept window "
                             f"of {window}; raise its budget or lower the window")
        return budgets


@dataclass
class Pieces(Wrapper):
    """Chunk and block score pieces of the layer, each as a layer of its own: the wrapped method must score entries
    from keys and values alone (`scores(view)`, no query window, no kept window)."""

    size_field = ""  # the switch giving the pieces' size

    def __post_init__(self):
        super().__post_init__()
        press, size = self.press, getattr(self, self.size_field)
        if not callable(getattr(press, "scores", None)) or press.query_window or press.kept_window:
            raise ValueError(f"{self.registry_name}: {self.size_field} needs a method that scores every entry from "
                             "keys and values alone (knorm, keydiff, cur, ...: `scores(view)`, no query window, no "
                             f"kept window); {press.registry_name} reads queries or keeps a window")
        if size < 1:
            raise ValueError(f"{self.registry_name}: {self.size_field}={size} must be >= 1")

    @property
    def kept_window(self) -> int:
        return 0


@dataclass
class Chunk(Pieces):
    """kvpress `ChunkPress` (after FINCH): the prompt cut into chunks of `chunk_length`, each scored as a layer of
    its own by the wrapped method's `scores`, each keeping its share of the budget (`chunk_quotas`)."""

    chunk_length: int = 1024
    suffix = "chunk"
    size_field = "chunk_length"

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        n, size = view.prompt_len, self.chunk_length
        starts = list(range(0, n, size))
        quotas = chunk_quotas([min(size, n - s) for s in starts], n_keep)
        b, h = view.keys.shape[:2]
        picked = []
        for start, quota in zip(starts, quotas):
            if quota:
                part = torch.arange(start, min(start + size, n), device=view.keys.device).expand(b, h, -1)
                scores = self.press.scores(sub_view(view, part))
                picked.append(start + scores.topk(quota, dim=-1).indices)
        return torch.cat(picked, dim=-1).sort(dim=-1).values


@dataclass
class Block(Pieces):
    """kvpress `BlockPress` (KeyDiff's block-wise processing, simulated after a full prefill): `blockwise`, each
    union of kept entries and a block scored by the wrapped method's `scores` as a layer of its own."""

    block_size: int = 128
    suffix = "block"
    size_field = "block_size"

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        return blockwise(view.prompt_len, n_keep, self.block_size,
                         lambda candidates: self.press.scores(sub_view(view, candidates)), view.keys)


@dataclass
class Compose(Wrapper):
    """kvpress `ComposedPress` of two: the wrapped method keeps `int(n (1 - first_ratio))` entries, then `then`
    keeps the run's budget of those, scoring them as a layer of their own (its window queries are the prompt's, so
    a `then` that reads queries needs the first to keep at least that window). Budgets are `then`'s. A layer the
    first keeps whole (SimLayerKV's non-lazy layers: `select` returns None) goes whole to `then`, as in kvpress,
    whose ComposedPress hands each press the layer the previous one left. A `then` that may keep a layer whole is
    refused: it would leave the first's count, not the run's budget."""

    then: Method = field(default_factory=Method)
    first_ratio: float = 0.5
    suffix = "compose"

    def __post_init__(self):
        super().__post_init__()
        if self.then.kind is not Kind.SELECTOR or not self.then.compresses:
            raise ValueError(f"{self.registry_name}: then={self.then.registry_name} must be a selector too (a method "
                             f"that picks entries once at prefill); it is a {self.then.kind.value}")
        if self.then.may_keep_whole:
            raise ValueError(f"{self.registry_name}: then={self.then.registry_name} may keep a layer whole, which "
                             f"would keep what {self.press.registry_name} left, not the run's budget; put it first")
        if not 0 <= self.first_ratio < 1:
            raise ValueError(f"{self.registry_name}: first_ratio={self.first_ratio} must be in [0, 1)")
        if self.then.query_window > self.press.kept_window:
            raise ValueError(f"{self.registry_name}: {self.then.registry_name} reads the last "
                             f"{self.then.query_window} queries, so {self.press.registry_name} must keep that window "
                             f"(it keeps {self.press.kept_window})")

    @property
    def registry_name(self) -> str:
        return f"{getattr(self.press, 'registry_name', '?')}+{getattr(self.then, 'registry_name', '?')}"

    @property
    def query_window(self) -> int:
        return max(self.press.query_window, self.then.query_window)

    @property
    def kept_window(self) -> int:
        return self.then.kept_window

    @property
    def may_keep_whole(self) -> bool:
        return False  # a layer the first keeps whole goes to `then`, which keeps the budget (refused otherwise)

    @property
    def prefill_needs(self) -> str | None:
        if self.first_ratio > 0 and not (self.press.prefill_needs or self.then.prefill_needs):
            # (a layer just past its decode-time target holds fewer: the first step would keep less than the budget)
            return f"a layer of at least budget / (1 - first_ratio={self.first_ratio}) entries"
        return self.press.prefill_needs or self.then.prefill_needs

    def check_budget(self, budget: int | None) -> None:
        self.then.check_budget(budget)

    def layer_budgets(self, prompt_len: int, n_layers: int, budget: int) -> list[int]:
        return self.then.layer_budgets(prompt_len, n_layers, budget)

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        n = view.prompt_len
        first = max(1, int(n * (1 - self.first_ratio)))
        if first < n_keep:
            raise ValueError(f"{self.registry_name}: first_ratio={self.first_ratio} keeps {first} of {n} entries, "
                             f"fewer than the budget {n_keep}; lower first_ratio or the budget")
        kept = self.press.select(view, first) if first < n else None
        if kept is None:  # the layer whole (kept so by the first, or first_ratio leaves all): `then` scores it all
            if n_keep == n:
                return torch.arange(n, device=view.keys.device).expand(*view.keys.shape[:2], n)
            return self.then.select(view, n_keep)
        if not isinstance(kept, Tensor):
            raise ValueError(f"{self.registry_name}: {self.press.registry_name} keeps heads of different "
                             "lengths, which a second method cannot take (kvpress refuses AdaKV too)")
        if n_keep == first:
            return kept
        return kept.gather(-1, self.then.select(sub_view(view, kept), n_keep))


@dataclass
class Merge(Wrapper):
    """kvpress `MergingPress`: the wrapped method selects; before the gather, each evicted entry's value is folded
    into the kept entry of its head whose key is most cosine-similar (kvbench/methods/merging.py). Keys, positions
    and the kept sets are the wrapped method's; only the kept values change, and only they are stored."""

    threshold: float = 0.0  # kvpress's similarity_threshold
    fraction: float = 1.0  # kvpress's merge_fraction
    suffix = "merge"
    writes_values = True  # (MLA: refused)

    def __post_init__(self):
        super().__post_init__()
        why = refusal(self.press)
        if why:
            raise ValueError(f"{self.registry_name}: merge needs a method that keeps as many entries "
                             f"in every KV head, once, at prefill; {why}")
        if not 0 <= self.threshold <= 1:
            raise ValueError(f"{self.registry_name}: merge_threshold={self.threshold} must be in [0, 1]")
        if not 0 < self.fraction <= 1:
            raise ValueError(f"{self.registry_name}: merge_fraction={self.fraction} must be in (0, 1]")

    @property
    def prefill_needs(self) -> str | None:
        # (kvpress has no such press either: DecodingPress takes a ScorerPress, MergingPress is not one)
        return self.press.prefill_needs or "a prompt to merge (the merge runs at prefill only, as kvpress's)"

    def merged_values(self, view: LayerView, kept: Tensor) -> Tensor | None:
        if not isinstance(kept, Tensor):
            raise ValueError(f"{self.registry_name}: {self.press.registry_name} kept heads of different lengths, "
                             "which merge cannot fold into")
        return merged_kept_values(view.keys, view.values, kept, self.threshold, self.fraction)


def unwrappable(method: Method) -> str | None:
    """What `method` needs from the engine beyond `select`, which no wrapper hands on; None: nothing."""
    if method.threshold_budget:
        return "keeps what its score threshold passes (no budget for a wrapper to set)"
    if method.scores_inputs:
        return "scores each layer's input during the prefill"
    if method.holds_ranked or method.own_decode_compression(1 << 20) is not None:
        return "compresses again while decoding with its own schedule and ranking"
    return None


def refusal(method: Method) -> str | None:
    """Why merge cannot wrap `method` (or a method it wraps), in a few words; None: it can."""
    while method is not None:
        name = method.registry_name
        if method.own_storage or method.threshold_budget:
            return f"{name} keeps per-head variable layers"
        if method.selects_per_query_head:
            return f"{name} selects per query head (one copy of each KV head per query head)"
        if method.own_decode_compression(1 << 20) is not None:
            return f"{name} compresses again while decoding, where nothing merges"
        if isinstance(method, Compose) and refusal(method.then):
            return refusal(method.then)
        method = method.__dict__.get("press")
    return None


def wrap(method: Method, switches: Switches, then: Method | None = None) -> Method:
    """The method with its switches applied, innermost first: chunk or block, then `then`, then per-layer budgets,
    then merge (its merge acts on what all of them kept). `quantize` is applied last, around all of them, by
    `kvbench.methods.quantize.wrap_all` (it stores what they left)."""
    if switches.chunk_length is not None and switches.block_size is not None:
        raise ValueError("chunk_length and block_size are two ways of cutting the prompt; set one")
    if switches.chunk_length is not None:
        method = Chunk(method, switches.chunk_length)
    if switches.block_size is not None:
        method = Block(method, switches.block_size)
    if (then is None) != (switches.first_ratio is None):
        raise ValueError("+method.then=<method> and +method.first_ratio=<0..1> go together (how much the first "
                         "method removes before the second)")
    if then is not None:
        method = Compose(method, then, switches.first_ratio)
    if switches.whole_layers is not None or switches.layer_ratios is not None:
        method = PerLayer(method, list(switches.whole_layers or []), switches.layer_ratios)
    if not switches.merge and (switches.merge_threshold is not None or switches.merge_fraction is not None):
        raise ValueError("merge_threshold and merge_fraction tune +method.merge=true; add it")
    if switches.merge:
        method = Merge(method, 0.0 if switches.merge_threshold is None else switches.merge_threshold,
                       1.0 if switches.merge_fraction is None else switches.merge_fraction)
    return method
