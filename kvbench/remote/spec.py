"""The `model` node of a run against an OpenAI-compatible server (configs/model/openai.yaml), checked before anything
is sent: where the server is, which model it serves, where the prompts are tokenized (the same tokenizer the
in-process run uses, so the same prompts go out), and how they are sent."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlparse

from omegaconf import OmegaConf

from kvbench.pathnames import check_name

SENDS = ("ids", "text")


class ServerProblem(ValueError):
    """The server cannot run this run: it wants a key, or serves another model (one line)."""


class Unreachable(ServerProblem):
    """No OpenAI-compatible server answers at the base URL (one line, before anything is written)."""


def is_remote(model_node) -> bool:
    """A model node that names a server (`base_url`) rather than weights."""
    return model_node is not None and "base_url" in model_node


@dataclass
class RemoteSpec:
    """Mirrors configs/model/openai.yaml. `name` is the results folder and, unless `served` is set, the model name
    sent in each request (what the server's /v1/models lists)."""

    name: str
    base_url: str  # http://host:port/v1
    tokenizer: str = "embedded"  # where prompts are rendered: embedded | a local dir | a .gguf file | a Hub id
    served: str | None = None  # the served model's name where it is not a plain folder name (org/model)
    send: Literal["ids", "text"] = "ids"  # token ids (exactly the in-process prompt) or the rendered text
    concurrency: int = 4  # requests in flight at once
    timeout_s: float = 600.0  # one request's limit, end to end; past it the sample is a failure record
    api_key_env: str | None = None  # an environment variable holding the server's API key (never the key itself)
    max_prompt_tokens: int = 8000
    chat_template: bool = False  # render prompts with the tokenizer's chat template (as model.chat_template does)
    revision: str | None = None  # the tokenizer's revision (a Hub id)

    def __post_init__(self):
        check_name("model: name", self.name)
        url = urlparse(self.base_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"model: base_url={self.base_url!r} is not an http(s) URL; give the server's OpenAI "
                             "root, e.g. model.base_url=http://localhost:8000/v1")
        if self.send not in SENDS:
            raise ValueError(f"model: send={self.send!r} is not one of {', '.join(SENDS)}")

    @property
    def model_name(self) -> str:
        """The name each request asks the server for."""
        return self.served or self.name

    @property
    def path(self) -> str:
        """Where the generations come from (the manifest's `model_source`)."""
        return f"openai:{self.base_url.rstrip('/')}#{self.model_name}"

    device = "remote"  # (the manifest's hardware.device: generation runs on the server's)
    device_map = None


def check_remote(method, cfg) -> None:
    """What a run against a server refuses, in one line, before anything is sent: compression happens inside the
    server, so kvbench's own methods and their switches cannot apply; and what the wire cannot carry."""
    import importlib.util

    if importlib.util.find_spec("httpx") is None:
        raise ValueError("model=openai sends its requests with httpx, which is not installed; pip install "
                         "'kvbench[serve]' (or httpx)")
    if method.compresses or getattr(method, "registry_name", "full") != "full":
        raise ValueError(f"model=openai: method={getattr(method, 'registry_name', method)} runs inside kvbench; "
                         "against a server the compression is the server's (start it with its own KV compression "
                         "or quantization, docs/serving.md#client), so use method=full")
    refusals = {
        "generation.num_beams": (cfg.generation.get("num_beams", 1) > 1, "beam search is not in the OpenAI "
                                 "completions API; use generation.num_beams=1"),
        "query": (cfg.get("query", "aware") != "aware", "the server prefills the whole prompt; use query=aware"),
        "step": (cfg.get("step", "eager") != "eager", "the decode step is the server's; use step=eager"),
        "decode_compression": (cfg.get("decode_compression") is not None and (
            cfg.decode_compression.get("target") is not None or cfg.decode_compression.get("ratio") is not None),
            "compression while decoding is the server's; leave decode_compression off"),
        "positions": (cfg.get("positions", "original") != "original", "positions are the server's; use "
                      "positions=original"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ValueError(f"model=openai: {key}={OmegaConf.select(cfg, key)}: {why}")


def check_remote_dataset(dataset) -> None:
    """Datasets a run against a server cannot replay: teacher-forced streams need the logits of given tokens,
    conversations feed later turns onto one cache, a second question needs the first reply's cache."""
    if getattr(dataset, "kind", None) == "perplexity":
        raise ValueError(f"model=openai: dataset {dataset.name} scores the logits of given tokens (perplexity), "
                         "which an OpenAI server does not return; run it in-process")
    if getattr(dataset, "turns", 1) > 1:
        raise ValueError(f"model=openai: dataset.turns={dataset.turns} feeds each turn onto one cache; use "
                         "dataset.turns=1 against a server")
    if getattr(dataset, "asks_follow_up", False):
        raise ValueError(f"model=openai: dataset {dataset.name} asks a second question on the first reply's "
                         "cache; run it in-process, or without its follow-up (prompt=cot)")


def load_tokenizer(spec: RemoteSpec):
    """The tokenizer prompts are rendered with (embedded, a .gguf file, a local dir or a Hub id), as the in-process
    run loads it; a missing one is a one-line error (kvbench.models.checks)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from kvbench.models.checks import check_source, source_kind
    from kvbench.models.embedded import embedded_model_dir, ensure_converted, gguf_tag

    kind = source_kind(spec.tokenizer)
    check_source(tokenizer_model(spec))
    if kind in ("embedded", "random"):
        source = embedded_model_dir()
    elif kind == "gguf":
        gguf = Path(spec.tokenizer).expanduser()
        source = ensure_converted(gguf, gguf_tag(gguf))
    else:
        source = spec.tokenizer
    return AutoTokenizer.from_pretrained(str(source), revision=spec.revision, trust_remote_code=False)


def tokenizer_model(spec: RemoteSpec):
    """The tokenizer's source as a local model spec, for the source checks every model gets."""
    from kvbench.models.loader import ModelSpec

    return ModelSpec(name=spec.name, path=spec.tokenizer, revision=spec.revision,
                     max_prompt_tokens=spec.max_prompt_tokens, chat_template=spec.chat_template)
