"""Which methods can run on an MLA latent cache (DeepSeek-V2/V3/V3.2, GLM-4.7-Flash, ...), and the natural reading
of per-head rules there.

An MLA layer stores one latent per token for all heads, scored as one shared KV head (`kvbench.models.mla`). A
method works on it when it picks tokens from scores of that head: every window scorer, accumulated-attention
evictor and reconstruction scorer does (their GQA reduction is then a reduction over all query heads). A per-head
variable selection (Ada-KV's allocation, DMS's and LU-KV's thresholds, KVzip's global top-k) has one head to
allocate over, so it is one index set, kept densely (`as_latent_selection`): Ada-KV on MLA is SnapKV with Ada-KV's
scores. The rest is refused in one line, before weights load (`check_latent`), for what it would need:
- layers with their own storage that kvbench attends itself (TailorKV, Quest, PQCache, DuoAttention's streaming
  heads): an MLA layer can only be attended through the model's own expansion of its latent;
- per-KV-head scores of a layer's input (KVzap, Fast KVzip): they score heads the latent does not have;
- the rotary angles or W_o of per-head keys and values (Expected Attention, CAP, leverage score, CriticalKV):
  the latent's rotary part sits last and its values exist only expanded per head;
- values rewritten in the cache (CaM, `+method.merge`): an MLA cache's value slot holds the rotary keys.
"""
from __future__ import annotations

from torch import Tensor

from kvbench.methods.base import Kind, Method


def latent_refusal(method: Method) -> str | None:
    """Why `method` (an instance or a registered class: capabilities are class flags) cannot run on an MLA layer,
    or None when it can."""
    if method.kind is Kind.STORAGE:
        return ("keeps the cache in layers of its own that kvbench attends itself; an MLA layer is attended only "
                "through the model's expansion of its latent")
    if method.scores_inputs:
        return "scores each KV head from the layer's input, and an MLA layer has one latent head for all query heads"
    if method.reads_per_head:
        return (f"reads the per-head {' and '.join(sorted(method.reads_per_head))} of each layer, which an MLA "
                "layer has only inside the model's expansion of its latent")
    if method.writes_values:
        return "rewrites cached values, and an MLA cache's value slot holds the shared rotary keys"
    return None


def check_latent(method: Method) -> None:
    """Raise a one-line ValueError if `method` cannot run on an MLA (latent) cache."""
    why = latent_refusal(method)
    if why is not None:
        from kvbench.registry import METHODS

        able = [n for n in METHODS.names() if latent_refusal(METHODS[n]) is None]  # (capabilities are class flags)
        raise ValueError(f"MLA: method={method.registry_name} {why}; on this model use one of: {', '.join(able)}")


def as_latent_selection(idx: list[Tensor]) -> Tensor:
    """A per-head variable selection of an MLA layer (one latent head) as the dense `[1, 1, k]` it is."""
    if len(idx) != 1:
        raise ValueError(f"MLA: a per-head selection of {len(idx)} heads on a layer with one latent head")
    return idx[0].view(1, 1, -1)

