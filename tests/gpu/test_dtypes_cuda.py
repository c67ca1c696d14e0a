"""GPU tier: every method in bf16 on CUDA, fp32 on CUDA through the PyTorch varlen path (flash-attn raises on fp32),
Keyformer's noise drawn on the device, and batched decoding with the batch-1 accounting (skipped without CUDA).
Written without a GPU at hand: run `make gpu-check` on one."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import kvbench.methods  # noqa: E402,F401
from kvbench.engine.batching import Request, generate_batched  # noqa: E402
from kvbench.engine.batching import generate  # noqa: E402
from kvbench.models import AttentionCapture  # noqa: E402
from kvbench.registry import METHODS  # noqa: E402
from tests.unit.test_contract import configured  # noqa: E402
from tests.unit.tiny import prompt, tiny_model  # noqa: E402

N, NEW, BUDGET = 300, 8, 64


def run(model, method, ids, budget=BUDGET):
    window = method.query_window
    with AttentionCapture(model, window=window) as capture:
        return generate(model, None, method, capture, ids, budget, NEW, eos_ids=set())


@pytest.mark.parametrize("name", METHODS.names())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_method_runs_on_cuda(name, dtype):
    model = tiny_model("llama", layers=2).to("cuda", dtype)
    gen = run(model, configured(name), prompt(N).cuda(), None if name == "full" else BUDGET)
    assert len(gen.token_ids) == NEW
    full = run(model, METHODS["full"](), prompt(N).cuda(), None)
    assert gen.token_ids[0] == full.token_ids[0]


def test_keyformer_noise_is_drawn_on_the_device():
    model = tiny_model("llama", layers=2).cuda()
    method = METHODS["keyformer"]()
    state = method.start(N, BUDGET, NEW, seed=1)
    logits = torch.zeros(1, 6, 4, N, device="cuda")
    scores = method.row_score(logits, state, decoding=False)
    assert scores.is_cuda and [d.type for d in state.device_generators] == ["cuda"]
    assert len(run(model, method, prompt(N).cuda()).token_ids) == NEW


@pytest.mark.parametrize("name", ["snapkv", "adakv", "h2o"])
def test_batched_decoding_on_cuda_keeps_the_batch_1_accounting(name):
    model = tiny_model("llama", layers=2).to("cuda", torch.bfloat16)
    method = configured(name)
    prompts = [prompt(n, seed=i).cuda() for i, n in enumerate([300, 180, 250, 120])]
    window = method.query_window
    with AttentionCapture(model, window=window) as capture:
        alone = [generate(model, None, method, capture, ids, BUDGET, NEW, eos_ids=set()) for ids in prompts]
        done = {r.tag: g for r, g in generate_batched(model, None, method, capture,
                                                      [Request(x, BUDGET, NEW, tag=i) for i, x in enumerate(prompts)],
                                                      3, eos_ids=set())}
    for i, one in enumerate(alone):
        assert done[i].token_ids[0] == one.token_ids[0] and len(done[i].token_ids) == NEW
        assert done[i].kept_per_head[0] == one.kept_per_head[0] and done[i].kv_bytes == one.kv_bytes


def test_sampling_on_cuda_draws_from_a_device_generator():
    """Sampled decoding on CUDA (multinomial needs its generator on the logits' device): seeded runs repeat, and
    batched sampling in fp32 gives batch 1's tokens (the same per-sample CUDA stream)."""
    from kvbench.engine.generation import Sampling

    model = tiny_model("llama", layers=2).cuda()
    method, sampling = configured("snapkv"), Sampling(do_sample=True, temperature=1.5, seed=7)
    prompts = [prompt(n, seed=i).cuda() for i, n in enumerate([300, 180, 250])]
    with AttentionCapture(model) as capture:
        alone = [generate(model, None, method, capture, ids, BUDGET, NEW, sampling=sampling, eos_ids=set())
                 for ids in prompts]
        again = generate(model, None, method, capture, prompts[0], BUDGET, NEW, sampling=sampling, eos_ids=set())
        done = {r.tag: g for r, g in generate_batched(model, None, method, capture,
                                                      [Request(x, BUDGET, NEW, tag=i) for i, x in enumerate(prompts)],
                                                      3, sampling, eos_ids=set())}
    assert again.token_ids == alone[0].token_ids
    assert [done[i].token_ids for i in range(3)] == [g.token_ids for g in alone]
