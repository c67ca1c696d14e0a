"""RULER's constants at the pinned code version: model templates, task templates, answer prefixes, max new tokens,
the 13 task configurations and their metrics. Byte for byte as NVIDIA/RULER c5341b4 (2024-12-04):
`scripts/data/template.py`, `scripts/data/synthetic/constants.py`, `scripts/synthetic.yaml`,
`scripts/eval/synthetic/constants.py` (tests/unit/test_ruler_templates.py pins them).
"""
from __future__ import annotations

# The upstream code generation kvbench reproduces, by the `version` prefix of `configs/dataset/ruler.yaml`.
# 2024-12 = the last commit before the 2025 rewrite; kvpress's published RULER data and the KV-cache papers used it.
CODE_VERSIONS = {"2024-12": "NVIDIA/RULER@c5341b4"}

# scripts/data/template.py (`--model_template_type`)
MODEL_TEMPLATES = {
    "base": "{task_template}",
    "meta-chat": "[INST] {task_template} [/INST]",
    "vicuna-chat": "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
                   "helpful, detailed, and polite answers to the user's questions. USER: {task_template} ASSISTANT:",
    "lwm-chat": "You are a helpful assistant. USER: {task_template} ASSISTANT: ",
    "command-r-chat": "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>{task_template}<|END_OF_TURN_TOKEN|>"
                      "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "chatglm-chat": "[gMASK]sop<|user|> \n {task_template}<|assistant|> \n ",
    "RWKV": "User: hi\n\nAssistant: Hi. I am your assistant and I will provide expert full response in full details. "
            "Please feel free to ask any question and I will always answer it\n\nUser: {task_template}\n\nAssistant:",
    "Phi3": "<|user|>\n{task_template}<|end|>\n<|assistant|>\n",
    "meta-llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "jamba": "<|startoftext|><|bom|><|system|> <|eom|><|bom|><|user|> {task_template}<|eom|><|bom|><|assistant|>",
}

# scripts/data/synthetic/constants.py; the 2024 code has the `assgined` typo in the VT answer prefix
TASKS = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                    "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                    "magic {type_needle_v} for {query} mentioned in the provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
                         "variables are assgined the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than others. Memorize "
                    "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
                    "above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the three most "
                    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                    "ignore the dots '....'. What are the three most frequently appeared words in the above coded "
                    "text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do not output any "
                    "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on "
                    "the given documents. Only give me the answer and do not output any other words.\n\nQuestion: "
                    "{query}",
        "answer_prefix": " Answer:",
    },
}

# scripts/synthetic.yaml, in its order (the noise haystack is `repeat` in the 2024 code)
TASK_CONFIGS = {
    "niah_single_1": ("niah", dict(type_haystack="repeat", type_needle_k="words", type_needle_v="numbers",
                                   num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_single_2": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                   num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_single_3": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="uuids",
                                   num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_1": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=4, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_2": ("niah", dict(type_haystack="needle", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multikey_3": ("niah", dict(type_haystack="needle", type_needle_k="uuids", type_needle_v="uuids",
                                     num_needle_k=1, num_needle_v=1, num_needle_q=1)),
    "niah_multivalue": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=1, num_needle_v=4, num_needle_q=1)),
    "niah_multiquery": ("niah", dict(type_haystack="essay", type_needle_k="words", type_needle_v="numbers",
                                     num_needle_k=1, num_needle_v=1, num_needle_q=4)),
    "vt": ("variable_tracking", dict(num_chains=1, num_hops=4)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0)),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}
ALL_TASKS = list(TASK_CONFIGS)

# scripts/eval/synthetic/constants.py: the metric of each task family
METRIC_OF_FAMILY = {"niah": "string_match_all", "variable_tracking": "string_match_all",
                    "common_words_extraction": "string_match_all", "freq_words_extraction": "string_match_all",
                    "qa": "string_match_part"}


def task_metric(task: str) -> str:
    return METRIC_OF_FAMILY[TASK_CONFIGS[task][0]]


def tokens_to_generate(task: str) -> int:
    return TASKS[TASK_CONFIGS[task][0]]["tokens_to_generate"]


def prompt_template(task: str, model_template: str = "base") -> str:
    """`prepare.py`'s `config['template']`: the model template around the task template, then the answer prefix."""
    family = TASKS[TASK_CONFIGS[task][0]]
    return MODEL_TEMPLATES[model_template].format(task_template=family["template"]) + family["answer_prefix"]
