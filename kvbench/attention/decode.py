"""One decode attention over every sequence's cache of a layer, whatever each holds per KV head.

Each cache layer hands over what its next token must attend as a `DecodeKV` (`kvbench.cache.kv_cache`): a dense
layer its keys as they are; Ada-KV's per-head variable layer its flattened heads padded per step; TailorKV's
quantized layer its dequantized keys and values, its offloaded layer the sinks, the recent window, the top-k rows it
fetched for this query and its generated tokens. `decode_attention` attends one new token per sequence over all of
them in one call, per KV head over that head's own valid entries (a mask hides a padded head's padding).

Strategy, by device. On CUDA in fp16/bf16 with flash-attn importable, flash-attn's varlen kernel runs: each
(sequence, KV head) one segment of one query token carrying its G query heads, over the valid entries gathered into
one flat K/V. Otherwise on CUDA every sequence is copied into one padded block and masked: PyTorch's fused
attention (`scaled_dot_product_attention`) in the cache's dtype, or, where the logits are wanted or shaped (soft
cap, ALiBi, window), one batched fp32 matmul, one softmax, one more matmul; decode steps never use cuDNN's fused
kernel (`without_cudnn_attention`). On the CPU that masked math runs per sequence over its own tensors
(`padded=False`): there kernel launches cost little and the padded copy costs more than it saves
(`scripts/bench_attention.py`: padding 32 Ada-KV-like sequences into one block was about 2-3x slower than attending
each where it lies; nested tensors through sdpa 10-30x slower). Sequences of one shape (H2O's at one budget,
TailorKV's offloaded layers at one step) need no padding: they are stacked and attended in one call. Rows whose
layers hand over different head counts (Quest's one row of entries per query head beside layers per KV head) take
one padded or flash call per head count.

What shapes the logits is applied inside, per sequence and per head, as the model would: the softmax scale
(a per-sequence temperature such as BUZZ's log n included), Gemma 2's soft cap `cap * tanh(logits / cap)`, ALiBi
`slope_h * (key position - query position)` over each key's position as attention sees it (original, or its slot
under pos-shift) and a sliding window by position. With `return_logits` the masked fp32 logits come back too, so a
decode-time evictor (H2O, Keyformer, BUZZ) scores the very logits the step attended with. Learned sinks (gpt-oss's
`s_aux`: one more logit per query head in each softmax, with no value; `kvbench.attention.sinks`) join the softmax.

Flash-attn takes the soft cap itself and the per-sequence scale through the query; ALiBi over original positions
after eviction is not a slot distance, which is all its `alibi_slopes` knows, so ALiBi (and a window, sinks, and
evictors' logits) take the padded path. Query head `h * G + g` reads KV head h (GQA).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvbench.attention.sinks import sink_softmax
from kvbench.cache.kv_cache import DecodeKV


def decode_attention(query: Tensor, kvs: Sequence[DecodeKV], scaling: float | Sequence[float], *,
                     softcap: float | None = None, alibi_slopes: Tensor | None = None, window: int | None = None,
                     sinks: Tensor | None = None, return_logits: bool = False,
                     padded: bool | None = None) -> tuple[Tensor, Tensor | None]:
    """Attention of one new token per sequence. `query` `[S, H_q, 1, D]` with S = the rows of all `kvs` together
    (each `DecodeKV` may hold several rows: beams); `scaling` one float or one per row; `alibi_slopes` `[H_q]`;
    `sinks` `[H_q]` the learned sink logits (they join every softmax; the returned logits are the keys' only).
    Returns the output `[S, 1, H_q, D]` in the query's dtype (transformers' attention-function layout) and, with
    `return_logits`, the masked fp32 logits `[S, H_q, L]` over each row's entries padded to the longest (row i's
    first `kvs`-length entries are its own, in its cache order; the rest are -inf).
    `padded`: all rows padded into one tensor (True; CUDA without flash-attn) or each `DecodeKV` over its own
    tensors, no copy (False; the CPU default: there the padded copy costs more than the calls it saves)."""
    rows = sum(kv.keys.shape[0] for kv in kvs)
    if query.shape[0] != rows or query.shape[2] != 1:
        raise ValueError(f"decode attention: query {tuple(query.shape)} must be [{rows}, H_q, 1, D]")
    scale = _scales(scaling, kvs, query.device)
    shaping = dict(softcap=softcap, alibi_slopes=alibi_slopes, window=window, sinks=sinks)
    padded = padded if padded is not None else query.is_cuda
    if (padded or use_flash(query)) and len({kv.keys.shape[1] for kv in kvs}) > 1:
        return _by_layout(query, kvs, scale, return_logits, padded, shaping)
    if use_flash(query) and alibi_slopes is None and window is None and sinks is None and not return_logits:
        return _flash(query, kvs, scale, softcap), None
    positions = alibi_slopes is not None or window is not None
    if padded and query.is_cuda and not (return_logits or positions or softcap is not None or sinks is not None):
        return _sdpa(query, *pad(kvs, positions=False)[:3], scale, _uniform(scaling)), None
    if padded:
        return _attend(query, *pad(kvs, positions=positions), scale, **shaping)
    starts = [0]
    for kv in kvs:
        starts.append(starts[-1] + kv.keys.shape[0])
    outs, logits = [None] * len(kvs), [None] * len(kvs)
    for members in _same_shape(kvs, positions):  # rows of one shape: one matmul, no padding
        rows = [query[starts[i]:starts[i + 1]] for i in members]
        kv = kvs[members[0]] if len(members) == 1 else stack([kvs[i] for i in members], positions)
        out, row_logits = _attend(torch.cat(rows) if len(rows) > 1 else rows[0], kv.keys, kv.values, kv.valid,
                                  kv.positions, torch.cat([scale[starts[i]:starts[i + 1]] for i in members]),
                                  **shaping)
        sizes = [starts[i + 1] - starts[i] for i in members]
        for i, o, x in zip(members, out.split(sizes), row_logits.split(sizes)):
            outs[i], logits[i] = o, x
    if not return_logits:
        return torch.cat(outs), None
    length = max(x.shape[-1] for x in logits)
    return torch.cat(outs), torch.cat([F.pad(x, (0, length - x.shape[-1]), value=float("-inf")) for x in logits])


def _same_shape(kvs: Sequence[DecodeKV], positions: bool) -> list[list[int]]:
    """Indices of `kvs` grouped by what one masked matmul can take without padding: the same heads, length and
    head dims, a mask for all or none, and (when `positions` are read) positions for all or none."""
    groups: dict[tuple, list[int]] = {}
    for i, kv in enumerate(kvs):
        key = (kv.keys.shape[1:], kv.values.shape[1:], kv.keys.dtype, kv.values.dtype, kv.keys.device,
               kv.valid is None, positions and kv.positions is None)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def stack(kvs: Sequence[DecodeKV], positions: bool = True) -> DecodeKV:
    """`DecodeKV`s of one shape as one, their rows in order (`positions`: kept, else dropped)."""
    return DecodeKV(torch.cat([kv.keys for kv in kvs]), torch.cat([kv.values for kv in kvs]),
                    None if kvs[0].valid is None else torch.cat([kv.valid for kv in kvs]),
                    torch.cat([kv.positions for kv in kvs]) if positions and kvs[0].positions is not None else None)


def _by_layout(query: Tensor, kvs: Sequence[DecodeKV], scale: Tensor, return_logits: bool, padded: bool,
               shaping: dict) -> tuple[Tensor, Tensor | None]:
    """Rows whose layers hand over different head counts (Quest's one row of entries per query head beside layers
    per KV head) cannot share one padded block or one flash-attn call: one call per head count, outputs (and logits,
    padded to the longest) put back in row order."""
    starts, rows = [], 0
    for kv in kvs:
        starts.append(rows)
        rows += kv.keys.shape[0]
    out = query.new_empty(rows, 1, query.shape[1], query.shape[-1])
    parts = []
    for heads in sorted({kv.keys.shape[1] for kv in kvs}):
        members = [i for i, kv in enumerate(kvs) if kv.keys.shape[1] == heads]
        index = torch.tensor([starts[i] + r for i in members for r in range(kvs[i].keys.shape[0])],
                             device=query.device)
        got, logits = decode_attention(query[index], [kvs[i] for i in members], scale[index].tolist(),
                                       return_logits=return_logits, padded=padded, **shaping)
        out[index] = got
        parts.append((index, logits))
    if not return_logits:
        return out, None
    length = max(x.shape[-1] for _, x in parts)
    logits = query.new_full((rows, query.shape[1], length), float("-inf"), dtype=torch.float32)
    for index, x in parts:
        logits[index, :, :x.shape[-1]] = x
    return out, logits


def _attend(query: Tensor, keys: Tensor, values: Tensor, valid: Tensor | None, positions: Tensor | None,
            scale: Tensor, softcap: float | None, alibi_slopes: Tensor | None, window: int | None,
            sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The math over one `[S, H_kv, L, D]` block: logits, soft cap, ALiBi and window by position, mask, softmax
    (with the sink logits `[H_q]` in its denominator), values. fp32. Returns the output `[S, 1, H_q, D]` and the
    masked logits `[S, H_q, L]`."""
    s, h_kv, length, d = keys.shape  # (bmm on 3-d views: what `@` runs on 4-d tensors, in fewer dispatched ops)
    q = query.float().reshape(s * h_kv, -1, d)  # [S * H_kv, G, D]
    logits = torch.bmm(q, keys.float().reshape(s * h_kv, length, d).transpose(1, 2))
    logits = logits.view(s, h_kv, -1, length) * scale.view(s, 1, 1, 1)  # [S, H_kv, G, L]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if alibi_slopes is not None or window is not None:
        if positions is None:  # slot = position
            positions = torch.arange(length, device=keys.device).expand(s, h_kv, length)
        distance = (positions - positions[:, :, -1:])[:, :, None].float()  # [S, H_kv, 1, L]; the query is last
        if alibi_slopes is not None:
            logits = logits + alibi_slopes.float().to(logits.device).view(1, h_kv, -1, 1) * distance
        if window is not None:
            inside = distance[:, :, 0] > -window
            valid = inside if valid is None else valid & inside
    if valid is not None:
        logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
    sink = None if sinks is None else sinks.view(1, h_kv, -1, 1)  # query head h * G + g: KV head h, row g
    probs = sink_softmax(logits, sink).view(s * h_kv, -1, length)
    out = torch.bmm(probs, values.float().reshape(s * h_kv, length, -1))  # [S * H_kv, G, D]
    return out.view(s, 1, -1, d).to(query.dtype), logits.view(s, -1, length)


def without_cudnn_attention() -> contextlib.AbstractContextManager:
    """Decode steps run PyTorch's fused attention on its flash, memory-efficient or math kernels, never cuDNN's:
    cuDNN builds a graph for every new shape (68 ms each on an H100 with torch 2.11, against 0.09 ms for the call
    itself), and a decode step is a new shape every step, per layer where layers hold different lengths (PyramidKV
    decoded at 1.7 s/token with it, 33 ms without; docs/throughput.md); so do chunks fed on top of a cache. A
    prompt's prefill keeps PyTorch's choice: one shape per prompt, and cuDNN's prefill was faster at 32k-64k tokens."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _sdpa(query: Tensor, keys: Tensor, values: Tensor, valid: Tensor | None, scale: Tensor,
          uniform_scale: float | None) -> Tensor:
    """The padded block through PyTorch's fused attention, in the cache's dtype: CUDA without flash-attn when no
    logits are wanted (the fp32 math of `_attend` copies the whole padded block to fp32 every step: at batch 8 of
    32k-token full Llama-3.1-8B caches, 1 GiB read and 2 GiB written per layer and step). A KV head's G query heads
    are G query rows over that head (GQA without repeating K/V); `valid` masks each head's padding; a per-row scale
    multiplies the query. Returns `[S, 1, H_q, D]`."""
    s, h_q, _, d = query.shape
    h_kv = keys.shape[1]
    q = query.reshape(s, h_kv, h_q // h_kv, d)
    if uniform_scale is None:
        q, uniform_scale = (q.float() * scale.view(s, 1, 1, 1)).to(query.dtype), 1.0
    mask = None if valid is None else valid[:, :, None, :]  # [S, H_kv, 1, L], the same for the G rows
    out = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask, scale=uniform_scale)
    return out.reshape(s, 1, h_q, -1).to(query.dtype)


def _uniform(scaling: float | Sequence[float]) -> float | None:
    """The one softmax scale all rows share, or None when they differ."""
    if isinstance(scaling, (int, float)):
        return float(scaling)
    values = {float(x) for x in scaling}
    return values.pop() if len(values) == 1 else None


def attend(layer, query: Tensor, scaling: float, **shaping) -> Tensor:
    """One layer's decode attention `[B, 1, H_q, D]` for its query `[B, H_q, 1, D]` (batch 1's path; `shaping`:
    `softcap`, `alibi_slopes`, `window`, `sinks` as in `decode_attention`)."""
    return decode_attention(query, [layer.decode_kv(query)], scaling, **shaping)[0]


def chunk_attention(query: Tensor, kv: DecodeKV, scaling: float, softcap: float | None = None,
                    sinks: Tensor | None = None) -> Tensor:
    """A chunk of q tokens `[B, H_q, q, D]` over a layer whose last q entries are those tokens (causal among them)
    and whose other entries (a compressed past: any length, per-head padding masked by `valid`) are all visible:
    the output `[B, q, H_q, D]` in the query's dtype. The prefill of a question on top of a compressed cache
    (`generation.feed`); fp32 masked math, q x L logits (the chunk is short); `sinks` `[H_q]` join each softmax."""
    b, h_q, q_len, d = query.shape
    h_kv, length = kv.keys.shape[1], kv.keys.shape[-2]
    q = query.float().reshape(b, h_kv, h_q // h_kv, q_len, d)
    logits = q @ kv.keys.float()[:, :, None].transpose(-1, -2) * scaling  # [B, H_kv, G, q, L]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    visible = torch.ones(q_len, length, dtype=torch.bool, device=query.device)
    visible[:, length - q_len:] = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()
    visible = visible if kv.valid is None else visible & kv.valid[:, :, None, None, :]
    sink = None if sinks is None else sinks.view(1, h_kv, -1, 1, 1)
    probs = sink_softmax(logits.masked_fill(~visible, float("-inf")), sink)
    out = (probs @ kv.values.float()[:, :, None]).reshape(b, h_q, q_len, -1)
    return out.transpose(1, 2).to(query.dtype)


def pad(kvs: Sequence[DecodeKV], positions: bool = True) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """All rows' keys and values `[S, H_kv, L, D]` (L = the longest; one copy into one buffer), which entries are
    valid `[S, H_kv, L]` (None: all) and, with `positions`, their positions `[S, H_kv, L]`: padding follows each row's
    entries and repeats its newest position, so `positions[..., -1]` is each row's query position."""
    if len(kvs) == 1:
        kv = kvs[0]
        return kv.keys, kv.values, kv.valid, kv.positions if positions else None
    length = max(kv.keys.shape[2] for kv in kvs)
    rows = sum(kv.keys.shape[0] for kv in kvs)
    first = kvs[0].keys
    keys = first.new_zeros(rows, first.shape[1], length, first.shape[-1])
    values = kvs[0].values.new_zeros(rows, first.shape[1], length, kvs[0].values.shape[-1])
    valid = torch.zeros(rows, first.shape[1], length, dtype=torch.bool, device=first.device)
    where = torch.zeros(rows, first.shape[1], length, dtype=torch.long, device=first.device) if positions else None
    start = 0
    for kv in kvs:
        b, _, n, _ = kv.keys.shape
        keys[start:start + b, :, :n] = kv.keys
        values[start:start + b, :, :n] = kv.values
        valid[start:start + b, :, :n] = True if kv.valid is None else kv.valid
        if where is not None:
            pos = kv.positions if kv.positions is not None else torch.arange(n, device=first.device)
            where[start:start + b, :, :n] = pos
            where[start:start + b, :, n:] = where[start:start + b, :, n - 1:n]
        start += b
    return keys, values, valid, where


def _scales(scaling, kvs: Sequence[DecodeKV], device) -> Tensor:
    """One softmax scale per row `[S]` (fp32)."""
    rows = [kv.keys.shape[0] for kv in kvs]
    if isinstance(scaling, (int, float)):
        return torch.full((sum(rows),), float(scaling), device=device)
    if len(scaling) == len(kvs) and len(kvs) != sum(rows):  # one per DecodeKV, repeated over its rows
        scaling = [s for s, b in zip(scaling, rows) for _ in range(b)]
    return torch.tensor([float(s) for s in scaling], device=device)


# --- CUDA: flash-attn varlen ------------------------------------------------------------------------------------
def use_flash(query: Tensor) -> bool:
    """flash-attn's varlen kernel only for fp16/bf16 CUDA tensors (it raises on fp32 and has no CPU build)."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _flash_varlen() is not None


@functools.cache
def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _flash(query: Tensor, kvs: Sequence[DecodeKV], scale: Tensor, softcap: float | None) -> Tensor:
    """Each (row, KV head) is one flash-attn 'sequence' of one query token with its G query heads over one KV
    head; its valid entries are gathered into one flat `[N, 1, D]` K/V. The per-row scale multiplies the query."""
    s, h_q, _, d = query.shape
    flat_k, flat_v, lengths = [], [], []
    for kv in kvs:
        valid = kv.valid
        flat_k.append(kv.keys[valid] if valid is not None else kv.keys.reshape(-1, d))
        flat_v.append(kv.values[valid] if valid is not None else kv.values.reshape(-1, d))
        n = kv.keys.shape[2]
        lengths.append(valid.sum(-1).flatten() if valid is not None
                       else torch.full((kv.keys.shape[0] * kv.keys.shape[1],), n, device=query.device))
    lengths = torch.cat(lengths).to(torch.int32)
    h_kv = lengths.numel() // s
    cu_k = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    cu_q = torch.arange(s * h_kv + 1, device=query.device, dtype=torch.int32)
    base = float(scale.max())
    q = (query[:, :, 0].float() * (scale / base)[:, None, None]).to(query.dtype).reshape(s * h_kv, -1, d)
    flat_k, flat_v = (torch.cat(x).to(query.dtype).view(-1, 1, d) for x in (flat_k, flat_v))  # (dequantized: fp32)
    out = _flash_varlen()(q.contiguous(), flat_k, flat_v,
                          cu_q, cu_k, 1, int(lengths.max()), softmax_scale=base, causal=False,
                          softcap=softcap or 0.0)
    return out.reshape(s, 1, h_q, d).to(query.dtype)
