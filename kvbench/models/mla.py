"""Multi-head latent attention (MLA: DeepSeek-V2/V3/V3.2, GLM-4.7-Flash, LongCat-Flash, MiniCPM3, Kimi-Linear's
full layers, ...): what kvbench needs to score and evict a latent cache.

Such a layer caches one latent per token for all heads: the cache's "keys" hold the normalised `c_kv`
`[B, 1, n, kv_lora_rank]` and its "values" the rotated shared key part `k_rope` `[B, 1, n, rope]`. Only inside the
attention call does the module expand them per head (`module.expand_kv`: K `[B, H, n, nope + rope]`, V
`[B, H, n, v]`), and that is what the attention function receives. So an entry is a token, not a (token, head)
pair: eviction keeps the same tokens for every head, and the bytes held are the latent's.

kvbench scores it as one KV head shared by every query head (MQA), in the latent space the cache holds. A query head
h's logit over token j is `q_nope_h . (W_UK_h c_j) + q_rope_h . k_rope_j`, which equals `q~_h . k~_j` with the
absorbed query `q~_h = [W_UK_h^T q_nope_h, q_rope_h]` and the latent key `k~_j = [c_j, k_rope_j]` (DeepSeek-V2's
"absorbed" inference; a bias on `kv_b_proj` only adds a per-row constant, which no softmax sees). Methods then see
the model's own logits from keys `[B, 1, n, r + rope]`, and their GQA reduction over the group is the reduction over
all heads, which is what per-token eviction needs. A layer is latent when its attention module expands a latent
(`expand_kv`, the method every MLA module of transformers 5.23 defines), found from the model, not a list.
"""
from __future__ import annotations

import torch
from torch import Tensor


def is_latent(module: torch.nn.Module | None) -> bool:
    """Whether an attention module caches a latent it expands per head at attention time (MLA)."""
    return callable(getattr(module, "expand_kv", None)) and hasattr(module, "kv_b_proj")


def latent_layers(modules: dict[int, torch.nn.Module]) -> frozenset[int]:
    """The layer indices whose attention is MLA."""
    return frozenset(i for i, m in modules.items() if is_latent(m))


def absorb_query(module: torch.nn.Module, query: Tensor) -> Tensor:
    """Per-head queries `[B, H, q, nope + rope]` as the attention call sees them (rotary part last) -> absorbed
    queries `[B, H, q, kv_lora_rank + rope]` whose dot product with `latent_keys` is the model's logit."""
    nope = module.qk_nope_head_dim
    weight = module.kv_b_proj.weight  # [H * (nope + v), r]
    heads = query.shape[1]
    up_keys = weight.view(heads, -1, weight.shape[-1])[:, :nope]  # W_UK per head: [H, nope, r]
    q_nope, q_rope = query[..., :nope], query[..., nope:]
    absorbed = torch.einsum("bhqn,hnr->bhqr", q_nope.float(), up_keys.float())
    return torch.cat([absorbed, q_rope.float()], dim=-1).to(query.dtype)


def latent_keys(latent: Tensor, rope_keys: Tensor) -> Tensor:
    """The one key head a latent cache scores with: `[c_kv, k_rope]` `[B, 1, n, r + rope]`."""
    return torch.cat([latent, rope_keys], dim=-1)


def config_is_latent(config: dict) -> bool:
    """From config.json alone (before weights load): an MLA model names its latent rank. Kimi-Linear's
    `mla_use_nope` configs name it too."""
    text = config.get("text_config") or config
    return bool(text.get("kv_lora_rank"))



def with_sparse_indices(attention_mask: Tensor | None, indices: Tensor, n_keys: int, dtype: torch.dtype) -> Tensor:
    """A DSA layer's mask (DeepSeek-V3.2, GLM-5, ...): the model's own indexer chose `indices` `[B, q, top-k]` among
    the `n_keys` keys of this call, and hands them to any attention function other than eager/sdpa instead of
    folding them into the mask. kvbench's capture is such a function, so it folds them as the model's eager/sdpa
    branch does (a key the indexer did not choose is masked). Over a compressed cache the indexer already scored
    only the kept entries (its keys are evicted in lockstep: `KVLayer.update_indexer`), so `indices` index the keys
    this call receives."""
    b, q = indices.shape[:2]
    unchosen = indices.new_ones((b, q, n_keys), dtype=torch.bool).scatter(-1, indices.long(), False).unsqueeze(1)
    if attention_mask is None:
        return torch.zeros(unchosen.shape, dtype=dtype, device=indices.device).masked_fill(unchosen,
                                                                                           torch.finfo(dtype).min)
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~unchosen
    return attention_mask.masked_fill(unchosen, torch.finfo(dtype).min)
