"""Hand-made cases for the seed-paper metrics (summaries, Self-BLEU outputs, QA answers); shared by the golden
recipe (scripts/make_seed_metric_goldens.py) and tests/unit/test_seed_metrics.py."""

SUMMARY_CASES = [
    {"prediction": "The council voted to reopen the railway bridge. Repairs cost 3.2 million pounds.",
     "reference": "Little Hadley council votes to reopen the old railway bridge .\nRepairs cost 3.2 million pounds ."},
    {"prediction": "Volunteers were counting hedgehogs running in parks\nand the numbers rose sharply.",
     "reference": "Volunteers counted 412 hedgehogs in city parks, up from 268 ."},
    {"prediction": "the the the museum museum opens opens. The Museum opens!",
     "reference": "Museum opens new wing with a glass courtyard on Saturday ."},
    {"prediction": "",
     "reference": "A fire has badly damaged the roof of a bakery, but no one was hurt."},
    {"prediction": "  Mr. Smith went to Washington. He arrived at 5 p.m. on Friday.  ",
     "reference": "Mr. Smith arrived in Washington on Friday at 5 p.m."},
    {"prediction": "Amateurs knocked out the leaders, 2-1; late goals (from a substitute) did it.",
     "reference": "An amateur club scored twice late on to knock the league leaders out of the cup."},
]

SELF_BLEU_CASES = [
    "The bridge will reopen. The bridge will reopen next year. Repairs were costly.",
    "Hedgehog numbers rose. Volunteers counted them at night. Hedgehog numbers rose again.",
    "One sentence without a full stop",
    "A single sentence.",
    "",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the mat.",
]

QA_CASES = [
    {"prediction": "Ada Marlowe painted it.", "answers": ["Ada Marlowe", "Marlowe"]},
    {"prediction": "The answer is: the 212 steps\nDocuments: Ada Marlowe", "answers": ["212"]},
    {"prediction": "It was painted by someone.\nAda Marlowe", "answers": ["Ada Marlowe"]},
    {"prediction": "THE ADA-MARLOWE!", "answers": ["Ada Marlowe"]},
    {"prediction": "adamarlowe", "answers": ["Ada Marlowe"]},
    {"prediction": "An Orvel clock", "answers": ["the Orvel clock"]},
    {"prediction": "", "answers": ["212"]},
]
