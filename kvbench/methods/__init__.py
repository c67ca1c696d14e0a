"""Compression methods. Importing this package registers the built-in ones in `kvbench.registry.METHODS`.

Add a method: write `kvbench/methods/<name>.py` with a dataclass registered by `@METHODS.register("<name>")`,
import it here, and add `configs/method/<name>.yaml` (`_target_` + the dataclass fields); docs/adding_a_method.md.
"""
from kvbench.methods import (  # noqa: F401
    adakv, buzz, expected_attention, full, h2o, keyformer, knorm, kvzip, pqcache, pyramidkv, quest, snapkv,
    rkv, streamingllm, tailorkv, tova, window,
    chunkkv, critical_kv, cur, keydiff, lagkv, leverage_score, non_causal_attn, random,
)
from kvbench.methods import simlayerkv  # noqa: F401

from kvbench.methods import cap, compactor, finch  # noqa: F401  (kvpress's presses, issue 35)
from kvbench.methods import duo_attention, lukv, qfilter  # noqa: F401  (learned artefacts)
from kvbench.methods import dms, kvzap  # noqa: F401
from kvbench.methods import kvcompose  # noqa: F401
from kvbench.methods import kvgrad  # noqa: F401
from kvbench.methods import cam  # noqa: F401
from kvbench.methods import gear, kvquant, minicache, nacl, scissorhands  # noqa: F401  (KVCache-Factory's 2026 additions, issue 45)
from kvbench.methods import fastkvzip  # noqa: F401
from kvbench.methods import kivi  # noqa: F401  (quantized caches, issue 45)

from kvbench.methods.base import Kind, LayerView, Method

__all__ = ["Kind", "LayerView", "Method"]
