"""What `select` returns is checked where the engine receives it (`kvbench.methods.contract.check_selection`): each
mistake a new method's author makes, written as a tiny method and run through the real engine on a tiny random
model, fails in one line naming the method and what is wrong, in both compression orders (inside the prefill
forward and after it), and a run whose every sample fails that way exits 1 with that line."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import kvbench.methods  # noqa: F401
from kvbench.engine.batching import generate
from kvbench.methods.base import LayerView, Method, topk_plus_window, window_attention
from kvbench.methods.contract import check_selection
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.tiny import prompt, tiny_model

N, BUDGET, W = 150, 32, 8  # the tiny model: 6 query heads, 2 KV heads


@pytest.fixture
def registry(monkeypatch):
    """Methods registered by this test only: the global registry is restored afterwards."""
    monkeypatch.setattr(METHODS, "_items", dict(METHODS._items))
    return METHODS


@dataclass
class Windowed(Method):
    """The shape of a SnapKV-style method: the last W queries recorded, the last W positions always kept."""

    @property
    def query_window(self) -> int:
        return W

    @property
    def kept_window(self) -> int:
        return W


class PerQueryHead(Windowed):
    """Forgets to combine each KV group's query heads: one index set per query head, from a KV-head method."""

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        attn = window_attention(view.window_queries[:, :, -W:], view.keys, view.scaling)  # [B, H_q, w, n]
        return topk_plus_window(attn[..., :view.prompt_len - W].sum(dim=2), n_keep, view.prompt_len, W)


class Duplicates(Windowed):
    """Protects the window twice, by its scores and by concatenation: window entries come twice."""

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        n = view.prompt_len
        scores = -view.keys.float().norm(dim=-1)
        scores[..., n - W:] = float("inf")
        recent = torch.arange(n - W, n).expand(*scores.shape[:2], W)
        return torch.cat([scores.topk(n_keep - W).indices, recent], dim=-1).sort(dim=-1).values


class ForgotWindow(Windowed):
    """Declares a kept window but picks all n_keep entries from the prefix."""

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        scores = -view.keys.float().norm(dim=-1)[..., :view.prompt_len - W]
        return scores.topk(n_keep).indices.sort(dim=-1).values


class OffByOne(Method):
    """Keeps "the last n_keep entries", one past the end."""

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        n = view.prompt_len
        return torch.arange(n - n_keep + 1, n + 1).expand(*view.keys.shape[:2], n_keep)


MISTAKES = {
    "per_query_head": (PerQueryHead, r"select returned indices for 6 heads \(shape \[1, 6, 32\]\) at layer 0; "
                                     r"expected 2, one per KV head"),
    "duplicates": (Duplicates, r"select returned index 14[2-9] twice in head 0 at layer 0; expected each entry "
                               r"at most once per head"),
    "forgot_window": (ForgotWindow, r"select returned head 0 without the last 8 prompt positions \(142\.\.149\) "
                                    r"at layer 0; expected every head to keep them"),
    "off_by_one": (OffByOne, r"select returned index 150 \(out of range for 150 entries\) at layer 0; expected "
                             r"indices in \[0, 150\)"),
}


@pytest.mark.parametrize("compress_after", ["layer", "prefill"])
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_selection_mistake_fails_in_one_line_naming_the_method(mistake, compress_after, registry):
    cls, expected = MISTAKES[mistake]
    registry.register(mistake)(cls)
    model = tiny_model("llama", layers=2)
    with AttentionCapture(model) as capture, pytest.raises(ValueError) as caught:
        generate(model, None, cls(), capture, prompt(N), BUDGET, 2, eos_ids=set(), compress_after=compress_after)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"method {mistake}: "), message
    assert caught.match(expected)


class ShortSchedule(Method):
    """Keeps the last n_keep entries, right; but its layer schedule misses the last layer (which the prefill order
    used to leave uncompressed, and the in-forward order failed on with an IndexError)."""

    def select(self, view: LayerView, n_keep: int) -> Tensor:
        n = view.prompt_len
        return torch.arange(n - n_keep, n).expand(*view.keys.shape[:2], n_keep)

    def layer_budgets(self, prompt_len: int, n_layers: int, budget: int) -> list[int]:
        return [budget] * (n_layers - 1)


@pytest.mark.parametrize("compress_after", ["layer", "prefill"])
def test_a_layer_schedule_of_the_wrong_length_fails_in_one_line(compress_after, registry):
    registry.register("short_schedule")(ShortSchedule)
    model = tiny_model("llama", layers=2)
    with AttentionCapture(model) as capture, pytest.raises(ValueError) as caught:
        generate(model, None, ShortSchedule(), capture, prompt(N), BUDGET, 2, eos_ids=set(),
                 compress_after=compress_after)
    assert str(caught.value) == ("method short_schedule: layer_budgets returned [32] for 2 layers; expected 2 "
                                 "positive integers, one per layer")


def test_right_selections_pass_and_wrong_forms_are_named():
    """The check alone, on hand-made selections: what passes (dense, per-head lists, the window kept), and the
    forms a method can get wrong besides the four above (type, dtype, count, order, per-head lists)."""
    method = METHODS["snapkv"](window=4)  # kept_window 4

    def problem(idx, n_keep: int | None = 6, heads: int = 2, batch: int = 1) -> str | None:
        try:
            check_selection(method, idx, layer_idx=3, n=10, batch=batch, heads=heads, n_keep=n_keep)
        except ValueError as exc:
            assert "\n" not in str(exc) and str(exc).startswith("method snapkv: select returned ")
            return str(exc).removeprefix("method snapkv: select returned ")
        return None

    good = torch.tensor([[[0, 3, 6, 7, 8, 9], [1, 2, 6, 7, 8, 9]]])
    assert problem(good) is None
    assert problem([good[0, 0], good[0, 1, 1:]], n_keep=None) is None  # per-head lengths differ
    assert problem(good.repeat(2, 1, 1), batch=2) is None
    assert problem(good[0].tolist(), n_keep=None).startswith("a list holding a list at layer 3; expected a Tensor "
                                                             "[B, H, n_keep]")
    assert problem(good.int()).startswith("torch.int32 indices at layer 3; expected torch.int64")
    assert problem(good[..., 1:]).startswith("5 entries per head at layer 3; expected n_keep=6")
    assert problem(good[0]).startswith("a tensor of shape [2, 6] at layer 3; expected a Tensor [B, H, n_keep]")
    assert problem(good.flip(-1)).startswith("indices out of order in head 0 at layer 3; expected them sorted "
                                             "ascending")
    assert problem(good - 1) == "index -1 (out of range for 10 entries) at layer 3; expected indices in [0, 10)"
    assert problem(torch.cat([good, good], dim=0)).startswith("a batch of 2 at layer 3; expected 1")
    assert problem([good[0, 0]], n_keep=None).startswith("1 per-head index tensors at layer 3; expected 2")
    assert problem([good[0, 0], good[0, 1, :-1]], n_keep=None).startswith(
        "head 1 without the last 4 prompt positions (6..9) at layer 3")
    assert problem([good[0, 0], good[0, 1, [0, 0, 2, 3, 4, 5]]], n_keep=None).startswith("index 1 twice in head 1")
    assert problem([good[0, 0], good[0, 1, :, None]], n_keep=None).startswith(
        "a tensor of shape [6, 1] for head 1 at layer 3; expected one 1-D tensor per head")


def test_a_run_whose_method_selects_out_of_range_exits_1_with_that_line(tmp_path):
    """The issue's case: every sample failed inside the cache and the message named no method. Now each failure
    record says what the method did, and the command ends with it and exit code 1."""
    from tests.unit.test_cli import ENV, ROOT, records, run_dirs
    from tests.unit.test_nothing_lost import NEEDLE

    out = subprocess.run([sys.executable, "-m", "kvbench.run", *NEEDLE, "dataset.context_lengths=[300]",
                          "method._target_=tests.unit.faulty.OffByOneSnapKV", f"results_dir={tmp_path}"], cwd=ROOT,
                         env=ENV, capture_output=True, text=True)
    assert out.returncode == 1, out.stderr[-2000:]
    (run_dir,) = run_dirs(tmp_path)
    errors = [r["error"] for r in records(run_dir)]
    assert len(errors) == 2 and all(e.startswith("method snapkv_off_by_one: select returned index ") for e in errors)
    last = out.stderr.strip().splitlines()[-1]
    assert "succeeded (2 failed); the first: ValueError: method snapkv_off_by_one: select returned index " in last
