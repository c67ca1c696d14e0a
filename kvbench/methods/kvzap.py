"""KVzap (Jegou & Jeblick, arXiv 2601.07891): DMS's threshold rule over scores a small learned surrogate predicts from
each layer's attention input. Reference code: NVIDIA/kvpress @ 8bb29b9 (`kvpress/presses/kvzap_press.py: KVzapPress,
KVzapModel`, its leaderboard's `DMSPress(KVzapPress(model_type))`; training: `kvzap/train.py`, `kvzap/data.py`).

Per layer, a linear map or a 2-layer MLP (GELU, hidden 512) turns the post-norm hidden state `[n, hidden]` of each
prompt token into one score per KV head `[n, H_kv]`: a prediction of log KVzip+ (the KVzip score divided by the
attention input's norm and weighted by ‖v W_o‖; `kvzip kvzip_plus=true`). Entries outside the last `window` positions
scoring below `threshold` are evicted (`kvbench.methods.dms`: heads keep different lengths, stored per head; the
compression ratio is an outcome). Scores are computed in fp32 (kvpress: the model's dtype), once per layer from its
prefill input, which is not kept (`Method.input_scores`, called by the capture).

The surrogate's weights (`weights`):
- null: kvpress's Hub repository for the model, `nvidia/KVzap-<model_type>-<model name>` (its config.json and
  model.safetensors: `KVzapModel.save_pretrained`'s files, read as safetensors only, never a pickle), at the pinned
  `revision` (a commit; required for a Hub download, recorded in the manifest); for the embedded SmolLM2 model, the
  linear surrogate shipped in `kvbench/methods/kvzap_surrogates/` (made by scripts/train_kvzap_embedded.py with the
  authors' procedure, see its README);
- a local folder holding those two files (e.g. `kvzap/train.py`'s output for another model);
- `random`: a seeded random linear surrogate shaped for the model (smoke tests; its scores mean nothing).
Defaults: `model_type=mlp` and `threshold=-4` (kvpress's KVzap README); `window=128` (`DMSPress`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from kvbench.methods.base import LayerView
from kvbench.methods.dms import DMS
from kvbench.registry import METHODS

SHIPPED = Path(__file__).with_name("kvzap_surrogates")
EMBEDDED = "SmolLM2-135M-Instruct"  # the embedded model's surrogate ships with kvbench (linear only)


@dataclass
class Surrogate:
    """Per layer `[weight, bias]` (linear) or `[w1, b1, w2, b2]` (MLP: Linear, GELU, Linear), as KVzapModel holds."""

    layers: list[list[Tensor]]
    source: str

    def __call__(self, layer_idx: int, hidden: Tensor) -> Tensor:
        """Scores `[B, H_kv, n]` (fp32) from a layer's attention input `[B, n, hidden]`."""
        params = [p.to(hidden.device) for p in self.layers[layer_idx]]
        x = F.linear(hidden.float(), params[0], params[1])
        if len(params) == 4:
            x = F.linear(F.gelu(x), params[2], params[3])
        return x.transpose(1, 2)

    def check(self, config) -> None:
        """The surrogate must be shaped for this model: one module per layer, hidden size in, KV heads out (one
        output, shared by the heads, for `random`)."""
        heads = 1 if self.source == "random" else getattr(config, "num_key_value_heads", None)
        want = (config.num_hidden_layers, config.hidden_size, heads)
        got = (len(self.layers), self.layers[0][0].shape[1], self.layers[0][-2].shape[0] if heads else None)
        if got != want:
            raise ValueError(f"kvzap: the surrogate {self.source} has (layers, input, output) = {got}, the model "
                             f"{want}; use the model's own surrogate (method.weights)")


def load_surrogate(source: str, revision: str | None = None) -> Surrogate:
    """KVzapModel's files (config.json + model.safetensors) from a local folder or a Hub repository at `revision`."""
    from safetensors.torch import load_file

    folder = Path(source).expanduser()
    if folder.is_dir():
        config_path, weights_path = folder / "config.json", folder / "model.safetensors"
        if not weights_path.is_file():
            raise ValueError(f"kvzap: no model.safetensors in {folder} (KVzapModel.save_pretrained's files; "
                             "pickled weights are never loaded)")
    else:
        if not revision:
            raise ValueError(f"kvzap: weights {source} come from the Hub; pin a commit with method.revision=<sha> "
                             "(or point method.weights at a local folder)")
        from huggingface_hub import hf_hub_download

        config_path, weights_path = (Path(hf_hub_download(source, name, revision=revision))
                                     for name in ("config.json", "model.safetensors"))
    config, tensors = json.loads(config_path.read_text()), load_file(str(weights_path))
    names = ["weight", "bias"] if config.get("hidden_dim") is None else ["0.weight", "0.bias", "2.weight", "2.bias"]
    layers = [[tensors[f"layers.{i}.{name}"].float() for name in names] for i in range(config["n_modules"])]
    return Surrogate(layers, f"{source}@{revision}" if revision and not folder.is_dir() else str(folder))


def random_surrogate(config, seed: int = 0) -> Surrogate:
    """A seeded linear surrogate shaped for `config`, one score per token shared by its KV heads (smoke tests: every
    family, whatever its config calls its KV heads)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    layers = [[torch.randn(1, hidden, generator=generator) / hidden ** 0.5, torch.zeros(1)]
              for _ in range(config.num_hidden_layers)]
    return Surrogate(layers, "random")


@METHODS.register("kvzap")
@dataclass
class KVzap(DMS):
    threshold: float = -4.0  # predicted log KVzip+ below it, outside the window, is evicted (kvpress README)
    window: int = 128  # the last prompt positions, never evicted (DMSPress sliding_window_size)
    model_type: Literal["linear", "mlp"] = "mlp"  # which of kvpress's two surrogates
    weights: str | None = None  # null: kvpress's Hub repo (embedded model: the shipped one); a folder; random
    revision: str | None = None  # the Hub commit of `weights` (required for a download)

    scores_inputs: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.model_type not in ("linear", "mlp"):
            raise ValueError(f"kvzap: model_type={self.model_type!r} is not one of linear, mlp")
        self._surrogate: Surrogate | None = None

    def source(self, model_name: str) -> str:
        """Where the surrogate of the model named `model_name` (a Hub id or a folder) comes from."""
        if self.weights is not None:
            return self.weights
        name = Path(model_name.rstrip("/")).name
        if name.startswith(EMBEDDED):
            if self.model_type != "linear":
                raise ValueError("kvzap: the embedded model ships a linear surrogate only; set method.model_type="
                                 "linear (or method.weights=<folder>)")
            return str(SHIPPED / f"{EMBEDDED}-linear")
        return f"nvidia/KVzap-{self.model_type}-{name}"

    def surrogate(self, config) -> Surrogate:
        """Loaded once (from `config`'s model name unless `weights` says), checked against the model's shape."""
        if self._surrogate is None:
            source = self.source(getattr(config, "name_or_path", "") or "")
            local = source == "random" or Path(source).expanduser().is_dir()
            self._surrogate = (random_surrogate(config) if source == "random"
                               else load_surrogate(source, None if local else self.revision))
            self._surrogate.check(config)
        return self._surrogate

    def prepare(self, model, tokenizer, *, prefill=None) -> dict | None:
        """Load the surrogate before the first sample, so a missing or misshapen file fails the run at its start."""
        return {"kvzap_surrogate": self.surrogate(model.config.get_text_config()).source}

    def input_scores(self, layer_idx: int, hidden: Tensor, config) -> Tensor:
        return self.surrogate(config)(layer_idx, hidden)

    def scores(self, view: LayerView) -> Tensor:
        if view.input_scores is None:
            raise ValueError("kvzap: no scores from the layer's input reached its selection (the prefill ran "
                             "without the capture's input scorer, `capture.input_scorer`)")
        return view.input_scores.expand(-1, view.keys.shape[1], -1)  # (`random`: one score for every head)
