"""GPU tier: the engine's decode attention through flash-attn varlen equals its padded PyTorch path, over a
batch of a per-head variable (Ada-KV) layer and dense layers of other lengths, with a soft cap and per-sequence
scales (skipped without CUDA or flash-attn)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flash_attn")

from kvbench.cache.kv_cache import KVLayer  # noqa: E402
from kvbench.cache.varlen import VarlenLayer  # noqa: E402
from kvbench.attention import decode as attention  # noqa: E402


def dense(n_kv: int, n: int, d: int, dtype) -> KVLayer:
    layer = KVLayer()
    layer.update(torch.randn(1, n_kv, n, d, device="cuda", dtype=dtype),
                 torch.randn(1, n_kv, n, d, device="cuda", dtype=dtype))
    return layer


@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("decode", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_varlen_equals_torch_path(decode, dtype, softcap, monkeypatch):
    torch.manual_seed(0)
    n_kv, n, d = 8, 4096, 128
    idx = [torch.randperm(n, device="cuda")[: int(torch.randint(16, n, (1,)))].sort().values for _ in range(n_kv)]
    layers = [VarlenLayer.from_selection(dense(n_kv, n, d, dtype), idx), dense(n_kv, 700, d, dtype),
              dense(n_kv, 1500, d, dtype)]
    for layer in layers:
        for _ in range(decode + 1):  # (the step's own token is appended before attention)
            layer.update(torch.randn(1, n_kv, 1, d, device="cuda", dtype=dtype),
                         torch.randn(1, n_kv, 1, d, device="cuda", dtype=dtype))
    q = torch.randn(3, n_kv * 4, 1, d, device="cuda", dtype=dtype)
    kvs = [layer.decode_kv(q[i:i + 1]) for i, layer in enumerate(layers)]
    scales = [d**-0.5, d**-0.5 * 0.7, d**-0.5]
    assert attention.use_flash(q)
    flash, _ = attention.decode_attention(q, kvs, scales, softcap=softcap)
    monkeypatch.setattr(attention, "use_flash", lambda query: False)
    torch_path, _ = attention.decode_attention(q, kvs, scales, softcap=softcap)
    torch.testing.assert_close(flash.float(), torch_path.float(), rtol=2e-2, atol=2e-2)
