"""NLTK imported without its optional scikit-learn / SciPy stats parts (kvbench.metrics.nltk_import): the scorers
that use NLTK give the same values, and scikit-learn and SciPy's stats import as usual afterwards."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREDICTION = "The best things to do: eating sandwiches. Sitting in Dolores Park on sunny days! Dr. Smith agreed."
REFERENCE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."

SCORES = """
from kvbench.metrics.infinitebench import longbook_sum_eng
from kvbench.metrics.niah import rouge1_f_x10
from kvbench.metrics.sentences import sentence_splitter
from kvbench.metrics.summarization import keyformer_rouge, self_bleu
p, r = {p!r}, {r!r}
scores = {{"rouge1_f_x10": rouge1_f_x10(p, [r]), "keyformer": keyformer_rouge(p, r), "self_bleu": self_bleu(p),
          "rougeLsum": longbook_sum_eng(p, r, "official"), "sentences": sentence_splitter()(p)}}
""".format(p=PREDICTION, r=REFERENCE)

CHILD = """
import json, sys
from kvbench.metrics.nltk_import import import_nltk
import_nltk()
loaded = sorted(m for m in ("sklearn", "scipy.stats", "pandas") if m in sys.modules)
""" + SCORES + """
import scipy.stats, sklearn  # refused only while NLTK imported
print(json.dumps({"loaded": loaded, "scores": scores}))
"""
PLAIN = """
import json, nltk, sys  # NLTK whole, scikit-learn and SciPy's stats included
loaded = sorted(m for m in ("sklearn", "scipy.stats", "pandas") if m in sys.modules)
""" + SCORES + """
print(json.dumps({"loaded": loaded, "scores": scores}))
"""


def scores_in_a_fresh_process(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_nltk_scorers_match_and_optional_parts_stay_importable():
    light, whole = scores_in_a_fresh_process(CHILD), scores_in_a_fresh_process(PLAIN)
    assert light["loaded"] == []  # NLTK came without scikit-learn, SciPy's stats and pandas (then imported fine)
    assert whole["loaded"] == ["pandas", "scipy.stats", "sklearn"]  # what a plain `import nltk` brings here
    assert light["scores"] == whole["scores"]
    assert len(whole["scores"]["sentences"]) == 3 and 0 < whole["scores"]["rouge1_f_x10"] < 10
