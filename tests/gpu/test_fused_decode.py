"""GPU tier: without flash-attn, a logit-free decode step on CUDA runs PyTorch's fused attention over the padded
block; it equals the fp32 masked math of the logit-reading path, over a per-head variable (Ada-KV) layer and dense
layers of other lengths with per-sequence scales (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kvbench.cache.kv_cache import KVLayer  # noqa: E402
from kvbench.cache.varlen import VarlenLayer  # noqa: E402
from kvbench.attention import decode as attention  # noqa: E402


def dense(n_kv: int, n: int, d: int, dtype) -> KVLayer:
    layer = KVLayer()
    layer.update(torch.randn(1, n_kv, n, d, device="cuda", dtype=dtype),
                 torch.randn(1, n_kv, n, d, device="cuda", dtype=dtype))
    return layer


@pytest.mark.parametrize("scales", [[0.088, 0.088 * 0.7, 0.088], [0.088] * 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fused_decode_equals_the_fp32_math(dtype, scales, monkeypatch):
    monkeypatch.setattr(attention, "use_flash", lambda query: False)
    torch.manual_seed(0)
    n_kv, n, d = 8, 4096, 128
    idx = [torch.randperm(n, device="cuda")[: int(torch.randint(16, n, (1,)))].sort().values for _ in range(n_kv)]
    layers = [VarlenLayer.from_selection(dense(n_kv, n, d, dtype), idx), dense(n_kv, 700, d, dtype),
              dense(n_kv, 1500, d, dtype)]
    for layer in layers:  # (the step's own token is appended before attention)
        layer.update(torch.randn(1, n_kv, 1, d, device="cuda", dtype=dtype),
                     torch.randn(1, n_kv, 1, d, device="cuda", dtype=dtype))
    q = torch.randn(3, n_kv * 4, 1, d, device="cuda", dtype=dtype)
    kvs = [layer.decode_kv(q[i:i + 1]) for i, layer in enumerate(layers)]
    fused, _ = attention.decode_attention(q, kvs, scales)
    scale = attention._scales(scales, kvs, "cuda")
    math, _ = attention._attend(q, *attention.pad(kvs, positions=False), scale, None, None, None)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.float(), math.float(), rtol=tol, atol=tol)
