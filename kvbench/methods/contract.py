"""What a method hands the engine, checked where the engine receives it (docs/adding_a_method.md#what-select-returns).

`select` (KVzip: `select_all`) returns indices into one layer's entries and `KVLayer.keep` gathers them; `layer_budgets`
says how many each layer keeps. A wrong answer there fails late or never: an index past the end fails inside the
cache, indices per query head from a KV-head method silently store H_q heads (n_rep x the memory), duplicates and a
forgotten window pass. `generation.apply_selection` and every caller of `layer_budgets` (compression after the
prefill, inside it, the grid launcher's and batching's `prepare`) go through here, once per layer per sample at
compression (one host sync per layer; nothing per decode step), and a violation raises a one-line ValueError,
`method <name>: select returned ...; expected ...`: the sample's failure record (a run whose samples all fail exits 1).
"""
from __future__ import annotations

from numbers import Integral
from typing import Callable, NoReturn

import torch
from torch import Tensor

from kvbench.methods.base import Method

Fail = Callable[[str, str], NoReturn]  # (what was returned, what was expected) -> the one-line error
FORMS = "a Tensor [B, H, n_keep] or a list of one 1-D tensor per head (per-head variable lengths, batch 1)"


def name_of(method: Method) -> str:
    return getattr(type(method), "registry_name", type(method).__name__)


def layer_budgets(method: Method, prompt_len: int, n_layers: int, budget: int | None) -> list[int]:
    """The method's entries per head for each layer, checked: one positive integer per layer."""
    budgets = method.layer_budgets(prompt_len, n_layers, budget)
    if not isinstance(budgets, (list, tuple)) or len(budgets) != n_layers or not all(
            isinstance(b, Integral) and not isinstance(b, bool) and b >= 1 for b in budgets):
        raise ValueError(f"method {name_of(method)}: layer_budgets returned {str(budgets)[:120]} for "
                         f"{n_layers} layers; expected {n_layers} positive integers, one per layer")
    return [int(b) for b in budgets]


def check_selection(method: Method, idx: Tensor | list[Tensor], layer_idx: int, n: int, batch: int, heads: int,
                    n_keep: int | None = None, source: str = "select") -> None:
    """Raise one line unless `idx` keeps, for each of `heads` stored heads (KV heads; query heads for a method that
    `selects_per_query_head`), int64 indices into the layer's `n` entries, unique, sorted ascending, ending with the
    method's `kept_window` last positions, and exactly `n_keep` of them per head where the form is `[B, H, n_keep]`."""
    def fail(got: str, expected: str) -> NoReturn:
        raise ValueError(f"method {name_of(method)}: {source} returned {got} at layer {layer_idx}; expected {expected}")

    window = method.kept_window
    if isinstance(idx, Tensor):
        check_form(idx, batch, heads, n_keep, method.selects_per_query_head, fail)
        if idx.shape[-1] == 0 and not window:
            return
        if idx.shape[-1] >= max(window, 1) and bool(dense_ok(idx, n, window)):  # the one host sync
            return
        rows = list(idx.reshape(-1, idx.shape[-1]))
    elif isinstance(idx, (list, tuple)):
        check_heads(idx, batch, heads, method.selects_per_query_head, fail)
        rows = list(idx)
        if all(len(row) >= window for row in rows) and bool(heads_ok(rows, n, window)):  # the one host sync
            return
    else:
        fail(f"a {type(idx).__name__}", FORMS)
    diagnose(rows, n, window, batch, heads, fail)


def one_per(per_query_head: bool) -> str:
    if per_query_head:
        return "one per query head"
    return "one per KV head (a method keeping one set per query head declares selects_per_query_head)"


def check_form(idx: Tensor, batch: int, heads: int, n_keep: int | None, per_query_head: bool, fail: Fail) -> None:
    """The dense form's shape, dtype and count (host-side: no sync)."""
    if idx.dim() != 3:
        fail(f"a tensor of shape {list(idx.shape)}", FORMS)
    if idx.shape[0] != batch:
        fail(f"a batch of {idx.shape[0]}", f"{batch}")
    if idx.shape[1] != heads:
        fail(f"indices for {idx.shape[1]} heads (shape {list(idx.shape)})", f"{heads}, {one_per(per_query_head)}")
    if idx.dtype != torch.long:
        fail(f"{idx.dtype} indices", "torch.int64 (long), what gather and index_select take")
    if n_keep is not None and idx.shape[-1] != n_keep:
        fail(f"{idx.shape[-1]} entries per head", f"n_keep={n_keep} (the Tensor form keeps exactly n_keep per head; "
             "per-head variable lengths are a list)")


def check_heads(idx: list[Tensor], batch: int, heads: int, per_query_head: bool, fail: Fail) -> None:
    """The per-head form's count and each head's tensor (host-side: no sync)."""
    if batch != 1:
        fail(f"a per-head list for a batch of {batch}", "a Tensor [B, H, n_keep] (per-head lists are batch 1)")
    if len(idx) != heads:
        fail(f"{len(idx)} per-head index tensors", f"{heads}, {one_per(per_query_head)}")
    for h, head in enumerate(idx):
        if not isinstance(head, Tensor):
            fail(f"a list holding a {type(head).__name__}", FORMS)
        if head.dim() != 1:
            fail(f"a tensor of shape {list(head.shape)} for head {h}", "one 1-D tensor per head")
        if head.dtype != torch.long:
            fail(f"{head.dtype} indices for head {h}", "torch.int64 (long), what gather and index_select take")


def dense_ok(idx: Tensor, n: int, window: int) -> Tensor:
    """Whether every row of `[B, H, k]` is strictly increasing (so unique and sorted), hence bounded by its first and
    last entries, inside [0, n), and ends with the window (its k - window-th entry is n - window). A 0-d bool tensor:
    the caller syncs once."""
    ok = (idx[..., 1:] > idx[..., :-1]).all() & (idx[..., 0] >= 0).all() & (idx[..., -1] < n).all()
    return ok & (idx[..., -window] == n - window).all() if window else ok


def heads_ok(rows: list[Tensor], n: int, window: int) -> Tensor:
    """`dense_ok` for per-head tensors of different lengths, in one reduction over all."""
    rows = [row for row in rows if len(row)]
    if not rows:
        return torch.tensor(True)
    flat = torch.cat(rows)
    lengths = torch.tensor([len(row) for row in rows], device=flat.device)
    ends = lengths.cumsum(0)
    starts = ends - lengths
    step_ok = flat[1:] > flat[:-1]
    step_ok[starts[1:] - 1] = True  # where a head starts, no order across heads
    ok = step_ok.all() & (flat[starts] >= 0).all() & (flat[ends - 1] < n).all()
    return ok & (flat[ends - window] == n - window).all() if window else ok


def diagnose(rows: list[Tensor], n: int, window: int, batch: int, heads: int, fail: Fail) -> NoReturn:
    """The slow path, once a check failed: what is wrong with the first head that is wrong."""
    for r, row in enumerate(rows):
        where = f"head {r}" if batch == 1 else f"head {r % heads} of batch row {r // heads}"
        if len(row) and (row.min() < 0 or row.max() >= n):
            bad = int(row.min()) if row.min() < 0 else int(row.max())
            fail(f"index {bad} (out of range for {n} entries)", f"indices in [0, {n})")
        ordered = row.sort().values
        twice = ordered[1:][ordered[1:] == ordered[:-1]]
        if len(twice):
            fail(f"index {int(twice[0])} twice in {where}", "each entry at most once per head")
        if len(row) > 1 and (row[1:] < row[:-1]).any():
            fail(f"indices out of order in {where}", "them sorted ascending (.sort(dim=-1).values): kept entries keep "
                 "this order as cache slots (positions=shift places keys by slot)")
        if window and (len(row) < window or int(row[-window]) != n - window):
            fail(f"{where} without the last {window} prompt positions ({n - window}..{n - 1})",
                 f"every head to keep them (kept_window={window}, inside n_keep)")
    raise AssertionError("check_selection: a selection failed its check but no head is wrong")  # pragma: no cover
