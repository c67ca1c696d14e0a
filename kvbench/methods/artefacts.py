"""Precomputed artefacts of the learned methods (Q-Filters, DuoAttention head patterns, LU-KV budget curves, Expected
Attention query statistics): where each comes from, pinned, and how it is read without running any pickle.

A method names its artefact by a field: `auto` (the published file for a known Hub model, the file committed under
kvbench/methods/learned/ for the embedded SmolLM2, made by scripts/make_learned_artefacts.py), a local path, or
`prompt` (computed on the fly from the prompt itself). Published files are fetched by commit (Hub: `hf_hub_download`
with a revision; GitHub: raw files at a commit) into `$KVBENCH_CACHE/artefacts`; a published source whose commit
is not known here (no Hub access where this was written) must be given one (`method.revision=<sha>`), as the model
configs' `revision`. Readers: safetensors, numpy `allow_pickle=False`, tab-separated text; never `torch.load`.
"""
from __future__ import annotations

import json
import logging
import urllib.request
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

logger = logging.getLogger(__name__)

LEARNED_DIR = Path(__file__).resolve().parent / "learned"
EMBEDDED = "SmolLM2-135M-Instruct"  # the embedded model's files: LEARNED_DIR / f"{EMBEDDED}_<kind>.<ext>"


def model_id(model) -> str:
    """The model's Hub id as transformers read it (`config.name_or_path`); the embedded model's is its own name."""
    name = str(getattr(model.config, "name_or_path", "") or "")
    return EMBEDDED if EMBEDDED in name else name


def embedded_file(kind: str, ext: str) -> Path:
    return LEARNED_DIR / f"{EMBEDDED}_{kind}.{ext}"


def check_source(owner: str, field: str, value: str, keywords: tuple[str, ...] = ("auto", "prompt")) -> None:
    """For `__post_init__`: one of `keywords` or an existing file (before any weights load)."""
    if value not in keywords and not Path(value).expanduser().is_file():
        raise ValueError(f"{owner}: {field}={value!r} is not a file; give a path or one of {', '.join(keywords)}")


def cache_dir() -> Path:
    from kvbench.models.embedded import cache_root
    return cache_root() / "artefacts"


def hub_file(repo: str, filename: str, revision: str | None, owner: str) -> Path:
    """A file of a Hub repository at a pinned revision (huggingface_hub's cache)."""
    if not revision:
        raise ValueError(f"{owner}: {repo} has no pinned revision here; pass method.revision=<commit> (the commit "
                         f"you checked on https://huggingface.co/{repo}/commits/main)")
    from huggingface_hub import hf_hub_download
    return Path(hf_hub_download(repo, filename, revision=revision))


def github_file(repo: str, commit: str | None, path: str, owner: str) -> Path:
    """A file of a GitHub repository at a pinned commit, downloaded once into `cache_dir()`."""
    if not commit:
        raise ValueError(f"{owner}: {repo} has no pinned commit here; pass method.revision=<commit>")
    out = cache_dir() / repo.replace("/", "+") / commit / path
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        url = f"https://raw.githubusercontent.com/{repo}/{commit}/{urllib.request.quote(path)}"
        logger.info("downloading %s", url)
        urllib.request.urlretrieve(url, out)
    return out


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def read_npy(path: str | Path) -> np.ndarray:
    return np.load(path, allow_pickle=False)


def read_tsv(path: str | Path) -> np.ndarray:
    return np.loadtxt(path, dtype=float, delimiter="\t", ndmin=2)


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def check_shape(owner: str, what: str, got: tuple, expected: tuple) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"{owner}: {what} has shape {list(got)}, the model needs {list(expected)} "
                         "(layers, KV heads, ...): an artefact made for another model?")


def model_shape(model) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head dim) of a decoder's config."""
    config = model.config.get_text_config()
    h_q = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // h_q
    return config.num_hidden_layers, h_q, getattr(config, "num_key_value_heads", None) or h_q, head_dim


def as_float(x) -> Tensor:
    return torch.as_tensor(np.asarray(x), dtype=torch.float32)


def resolve(owner: str, value: str, model, embedded: Path, published) -> Path | None:
    """The artefact file a method's field names for `model`: None for `prompt`; a path as given; for `auto`, the
    committed file of the embedded model or `published(model_id)` (a pinned download; None: nothing published)."""
    if value == "prompt":
        return None
    if value != "auto":
        return Path(value).expanduser()
    name = model_id(model)
    path = embedded if name == EMBEDDED else published(name) if name else None
    if path is None:
        raise ValueError(f"{owner}: no published artefact for model {name!r}; give a file (method.<field>=<path>, "
                         "made as scripts/make_learned_artefacts.py does) or compute it from the prompt (=prompt)")
    return path


def describe(path: Path | None) -> dict:
    """What goes into manifest.json: the file and its sha256 (None: computed from each prompt)."""
    if path is None:
        return {"file": None, "source": "computed from each prompt"}
    import hashlib
    return {"file": str(path), "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


def warn_unprepared(method, what: str) -> None:
    """Once per method instance: no artefact was loaded (prepare never ran), so `what` stands in for it."""
    if not getattr(method, "_warned_unprepared", False):
        logger.warning("%s: no artefact loaded (prepare was not called); %s", method.registry_name, what)
        method._warned_unprepared = True
