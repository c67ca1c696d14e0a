"""Model loading (Hub id, local dir, GGUF, the embedded default) and per-instance attention capture.

`AttentionCapture` is imported on first use (PEP 562): it needs transformers' attention registries (about 2.5 s of
imports), which the checks a command runs before any weights load (`kvbench.runs.config.setup`, reached through
`kvbench.models.rotary` and `kvbench.models.loader`) never use, so a bad command line fails fast.
"""
from kvbench.models.loader import ModelSpec, load

__all__ = ["AttentionCapture", "ModelSpec", "load"]


def __getattr__(name: str):
    if name == "AttentionCapture":
        from kvbench.models.capture import AttentionCapture

        return AttentionCapture
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
