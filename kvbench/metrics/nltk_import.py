"""NLTK imported without the optional parts that kvbench's scorers never reach.

`import nltk` (which rouge_score runs) imports every NLTK subpackage, and three of them try scikit-learn or SciPy's
stats (the scikit-learn classifier wrapper, association measures, the Gale-Church aligner), which bring pandas: about
1 s of a NIAH run's start-up, for the Porter stemmer and the punkt splitter that the scorers use. NLTK guards each
of those imports (`try: ... except ImportError`), so `import_nltk` refuses them while NLTK imports and allows them
again right after: a later `import sklearn` or `import scipy.stats` works as usual, and NLTK's own features that need
them (SklearnClassifier, Fisher's exact association, Gale-Church) are not used by any scorer. Scores are unchanged.
"""
from __future__ import annotations

import sys

OPTIONAL = ("sklearn", "scipy.stats")  # what NLTK's guarded imports would load, and NLTK's scorers never use


def import_nltk():
    """`import nltk`, once per process, its optional scikit-learn / SciPy stats parts left out; returns the module.
    Call it before importing rouge_score or an NLTK submodule (their own `import nltk` then finds it loaded)."""
    if "nltk" in sys.modules:
        return sys.modules["nltk"]
    refused = [name for name in OPTIONAL if name not in sys.modules]
    for name in refused:
        sys.modules[name] = None  # Python's marker for "import halted": an ImportError, which NLTK catches
    try:
        import nltk
    except ImportError:  # an NLTK whose import needs one of them unguarded: drop what loaded, import it whole below
        for name in [m for m in sys.modules if m == "nltk" or m.startswith("nltk.")]:
            del sys.modules[name]
        nltk = None
    finally:
        for name in refused:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    if nltk is None:
        import nltk
    return nltk
