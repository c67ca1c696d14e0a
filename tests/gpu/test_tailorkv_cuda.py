"""GPU tier: TailorKV's CUDA path (pinned host pool, side-stream prefetch) selects exactly what the synchronous CPU
reference selects, step by step and layer by layer (skipped without CUDA)."""
from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kvbench.cache import KVCache  # noqa: E402
from kvbench.engine.generation import Prepared, compress, prefill  # noqa: E402
from kvbench.engine.batching import decode  # noqa: E402
from kvbench.methods.tailorkv import TailorKV  # noqa: E402
from kvbench.models import AttentionCapture  # noqa: E402
from tests.unit.tiny import prompt, tiny_model  # noqa: E402

N, NEW = 600, 10


def selections(model, ids):
    """Prefill, convert, decode NEW tokens; returns per-layer lists of (channels, top-k) and the ledger summary."""
    cache = KVCache()
    method = TailorKV(bits=2, quant_layers=[0], start_size=8, recent_size=24, channels=6)
    with AttentionCapture(model) as capture:
        logits = prefill(model, ids, cache)
        ledger = compress(method, cache, capture, 96)
        for layer in cache.layers[1:]:
            layer.selections = []
        tokens = decode(model, None, method, capture, Prepared.from_cache(cache, logits, N, ledger), NEW,
                        eos_ids=set()).token_ids
    return tokens, [layer.selections for layer in cache.layers[1:]], ledger.summary()


def test_cuda_path_selects_identically_to_the_cpu_reference():
    cpu_model = tiny_model("llama", layers=4).double()
    gpu_model = copy.deepcopy(cpu_model).cuda()
    ids = prompt(N)
    cpu_tokens, cpu_sel, cpu_ledger = selections(cpu_model, ids)
    gpu_tokens, gpu_sel, gpu_ledger = selections(gpu_model, ids.cuda())
    assert gpu_tokens == cpu_tokens
    for cpu_layer, gpu_layer in zip(cpu_sel, gpu_sel):
        assert len(cpu_layer) == len(gpu_layer) == NEW - 1
        for (c_ch, c_top), (g_ch, g_top) in zip(cpu_layer, gpu_layer):
            assert torch.equal(c_ch.sort(-1).values, g_ch.sort(-1).values)
            assert torch.equal(c_top, g_top)
    assert gpu_ledger == cpu_ledger


def test_host_pool_is_pinned_and_device_memory_really_shrinks():
    model = tiny_model("llama", layers=4).half().cuda()
    ids = prompt(N).cuda()
    cache = KVCache()
    with AttentionCapture(model) as capture:
        prefill(model, ids, cache)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        full = cache.nbytes()
        compress(TailorKV(quant_layers=[0], start_size=8, recent_size=24), cache, capture, 96)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        assert all(layer.host_keys.is_pinned() for layer in cache.layers[1:])
    assert before - after >= 0.8 * (full - cache.nbytes())  # the offloaded K/V left the device
