"""Model loading (Hub id, local dir, GGUF, the embedded default) and per-instance attention capture."""
from kvbench.models.capture import AttentionCapture
from kvbench.models.loader import ModelSpec, load

__all__ = ["AttentionCapture", "ModelSpec", "load"]
