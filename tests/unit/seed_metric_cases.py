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

# (task, prediction, label as upstream's get_answer returns it)
INFINITEBENCH_CASES = [
    ("passkey", "71432.", ["71432"]), ("passkey", "The pass key is 7143 2", ["71432"]), ("passkey", "none", ["71432"]),
    ("number_string", " 5830172946 is it", ["5830172946"]), ("number_string", "58301-72946", ["5830172946"]),
    ("kv_retrieval", '"a1b2": "c3d4".', "c3d4"), ("kv_retrieval", "c3d4x", "c3d4"),
    ("longdialogue_qa_eng", "Mara, of course.", ["MARA"]), ("longdialogue_qa_eng", "MARAUDER", ["MARA"]),
    ("longdialogue_qa_eng", "tobias", ["MARA", "TOBIAS"]),
    ("longbook_sum_eng", "A keeper sees her lighthouse go dark in a storm.\nThe harbour board pays.",
     ["A lighthouse keeper sees her light go dark in a storm until the harbour board pays for repairs."]),
    ("longbook_sum_eng", "", ["A lighthouse keeper."]),
    ("longbook_choice_eng", "B", ["Ada", "B"]), ("longbook_choice_eng", "The answer is: B. Ada", ["Ada", "B"]),
    ("longbook_choice_eng", "I think it is A or maybe B", ["Ada", "B"]), ("longbook_choice_eng", "Ada", ["Ada", "B"]),
    ("longbook_choice_eng", "the answer is Ada", ["Ada", "B"]), ("longbook_choice_eng", "", ["Ada", "B"]),
    ("longbook_qa_eng", "For thirty years.", ["thirty years"]), ("longbook_qa_eng", "The Thirty", ["thirty years", "30"]),
    ("longbook_qa_chn", "三十年。", ["三十年"]), ("longbook_qa_chn", "大约三十", ["三十年"]),
    ("math_find", "93", 93), ("math_find", " 93.0", 93), ("math_find", "x", 93), ("math_find", "2.5 then", 2.5),
    ("math_calc", "[1, 4, 8, 7]", [1, 4, 8, 9]), ("math_calc", "5", [1, 4]),
    ("code_run", "The value is `-12`.", -12), ("code_run", "12", -12), ("code_run", "", 3),
    ("code_debug", "B.", ["perimeter", "B"]), ("code_debug", "The correct option is: B", ["perimeter", "B"]),
    ("code_debug", "answer is: perimeter", ["perimeter", "B"]), ("code_debug", "Option B is wrong; A", ["perimeter", "B"]),
    ("code_debug", "perimeter", ["perimeter", "B"]), ("code_debug", "", ["perimeter", "B"]),
]
