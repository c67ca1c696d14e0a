"""GPU tier: flash-attn's varlen path for per-head variable caches equals the CPU path (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flash_attn")

from kvbench.cache.kv_cache import KVLayer  # noqa: E402
from kvbench.cache.varlen import VarlenLayer, _flash_decode, _torch_decode  # noqa: E402


@pytest.mark.parametrize("decode", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_varlen_equals_torch_path(decode, dtype):
    torch.manual_seed(0)
    n_kv, n, d = 8, 4096, 128
    dense = KVLayer()
    dense.update(torch.randn(1, n_kv, n, d, device="cuda", dtype=dtype),
                 torch.randn(1, n_kv, n, d, device="cuda", dtype=dtype))
    idx = [torch.randperm(n, device="cuda")[: int(torch.randint(16, n, (1,)))].sort().values for _ in range(n_kv)]
    layer = VarlenLayer.from_selection(dense, idx)
    for _ in range(decode):
        layer.update(torch.randn(1, n_kv, 1, d, device="cuda", dtype=dtype),
                     torch.randn(1, n_kv, 1, d, device="cuda", dtype=dtype))
    q = torch.randn(n_kv, 4, d, device="cuda", dtype=dtype)
    torch.testing.assert_close(_flash_decode(q, layer, d**-0.5).float(), _torch_decode(q, layer, d**-0.5),
                               rtol=2e-2, atol=2e-2)
