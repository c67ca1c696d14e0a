"""Every registered method end to end in bf16 and fp16 on the CPU (the dtypes GPU runs use): the cache holds the
model's dtype (2 bytes per element, not an fp32 upcast), the bytes match the entries kept, the first token is the
full cache's (prefill is exact in any dtype), and the PyTorch attention paths are the ones taken off CUDA."""
from __future__ import annotations

import pytest
import torch

import kvbench.methods  # noqa: F401
from kvbench.attention import decode as attention
from kvbench.engine.batching import Request, generate_batched
from kvbench.engine.generation import prepare
from kvbench.engine.batching import decode, generate
from kvbench.methods.base import Kind
from kvbench.models import AttentionCapture
from kvbench.registry import METHODS
from tests.unit.test_contract import configured
from tests.unit.tiny import prompt, tiny_model

N, NEW, BUDGET = 150, 6, 48
HALF = [torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", params=HALF, ids=["bf16", "fp16"])
def half_model(request):
    return tiny_model("llama", layers=2).to(request.param), request.param


def run(model, method, budget, positions="original"):
    """`generate`'s steps, keeping the cache: (generation, dtypes of every tensor the layers hold)."""
    window = method.query_window
    with AttentionCapture(model, window=window) as capture:
        prepared = prepare(model, method, capture, prompt(N), budget, NEW, positions)
        gen = decode(model, None, method, capture, prepared, NEW, set(), positions=positions)
    held = [t for layer in prepared.cache.layers for t in vars(layer).values()
            if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return gen, {t.dtype for t in held}


@pytest.mark.parametrize("name", METHODS.names())
def test_method_runs_in_half_precision(name, half_model):
    model, dtype = half_model
    method = configured(name)
    budget = None if name == "full" else BUDGET
    gen, dtypes = run(model, method, budget)
    full, _ = run(model, METHODS["full"](), None)
    assert len(gen.token_ids) == NEW and gen.token_ids[0] == full.token_ids[0]
    assert dtypes == {dtype}  # every tensor the layers hold is in the model dtype: no fp32 upcast kept
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert full.kv_bytes == 2 * N * model.config.num_key_value_heads * head_dim * 2 * model.config.num_hidden_layers
    if method.kind is Kind.STORAGE:  # quantized / offloaded / paged stores account for themselves
        if name == "quest":  # the whole cache stays (+ page metadata in the layers past the dense ones)
            assert gen.kv_bytes >= full.kv_bytes
        else:
            assert gen.kv_bytes < full.kv_bytes
        return
    for kept, nbytes in zip(gen.kept_per_head, gen.kv_bytes_per_layer):
        assert nbytes == sum(kept) * head_dim * 2 * 2  # K and V, 2 bytes each: what is kept is what is held
    if name != "full":
        assert gen.kv_bytes < full.kv_bytes


@pytest.mark.parametrize("name", ["h2o", "streamingllm"])
def test_position_shift_in_half_precision(name, half_model):
    model, dtype = half_model
    gen, dtypes = run(model, METHODS[name](), 40, positions="shift")
    assert len(gen.token_ids) == NEW and dtypes == {dtype}


def test_batched_decoding_in_half_precision(half_model):
    """Batched bf16/fp16 decoding runs and keeps the per-sample accounting of batch 1 (tokens may differ from
    batch 1 where the batched matmul's rounding flips an argmax; see kvbench.engine.batching)."""
    model, _ = half_model
    method = METHODS["adakv"](window=8)
    prompts = [prompt(n, seed=i) for i, n in enumerate([150, 90, 120])]
    with AttentionCapture(model, window=8) as capture:
        alone = [generate(model, None, method, capture, ids, BUDGET, NEW, eos_ids=set()) for ids in prompts]
        done = {r.tag: g for r, g in generate_batched(model, None, method, capture,
                                                      [Request(x, BUDGET, NEW, tag=i) for i, x in enumerate(prompts)],
                                                      3, eos_ids=set())}
    for i, one in enumerate(alone):
        assert done[i].kept_per_head == one.kept_per_head and done[i].kv_bytes == one.kv_bytes
        assert done[i].token_ids[0] == one.token_ids[0] and len(done[i].token_ids) == NEW


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_flash_varlen_only_for_half_precision_on_cuda(dtype, monkeypatch):
    """The flash-attn branch is chosen only for fp16/bf16 CUDA queries; fp32 CUDA and every CPU query take the
    PyTorch path (flash-attn raises on fp32). A meta tensor stands in for a CUDA one's dtype and device checks."""
    monkeypatch.setattr(attention, "_flash_varlen", lambda: object())  # as if flash-attn were importable
    cpu = torch.zeros(1, 4, 1, 8, dtype=dtype)
    assert not attention.use_flash(cpu)

    class CudaLike:
        is_cuda = True

    fake = CudaLike()
    fake.dtype = dtype
    assert attention.use_flash(fake) == (dtype in HALF)
