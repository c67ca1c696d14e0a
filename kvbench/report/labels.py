"""How methods are named in the papers' tables (`h2o` -> `H2O`), and the papers' column order of methods.

Every table, figure and comparison labels a method through `method_label`, so a run shows under one name everywhere.
"""
from __future__ import annotations

# registry name -> name in the papers; the order is the column order of the papers' tables
METHOD_NAMES = {"full": "FullKV", "pyramidkv": "PyramidKV", "snapkv": "SnapKV", "h2o": "H2O",
                "streamingllm": "StreamingLLM", "adakv": "Ada-KV", "ada_pyramidkv": "Ada-Pyramid",
                "keyformer": "Keyformer", "buzz": "BUZZ",
                "tailorkv": "TailorKV", "tailorkv-1": "TailorKV-1", "tailorkv-2": "TailorKV-2",
                "tova": "TOVA", "knorm": "Knorm", "expected_attention": "ExpectedAttention",  # kvpress's spellings
                "kvzip": "KVzip",
                "quest": "Quest", "pqcache": "PQCache",
                "kivi-1": "KIVI-1", "kivi-2": "KIVI-2", "kivi-4": "KIVI-4", "kivi-8": "KIVI-8"}


def method_label(name: str) -> str:
    """The paper's spelling of a method (`h2o` -> `H2O`); unknown methods keep their registry name."""
    return METHOD_NAMES.get(name, name)
