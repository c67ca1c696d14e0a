"""SCBench's prompt templates and generation lengths (microsoft/MInference @ fb56c91, `scbench/eval_utils.py`), byte for
byte, for the six tasks kvbench builds. tests/unit/test_scbench.py pins each string's sha256 against upstream's.

Four template families, as upstream names them:
- `FIRST_TURN` (`multiturn_templates`): multi-turn mode, turn 0: the context and the first question in one prompt.
- `FOLLOW_UP` (`multiturn_follow_up_templates`): multi-turn mode, turn i > 0 without a chat template: the previous
  turn's reference answer (`pre_ans`, the "golden context"), then the next question.
- `FOLLOW_UP_CHAT` (`multiturn_follow_up_templates_in_chat_tempate`): the question alone; used for turn i > 0 inside a
  chat template, and as every query of the multi-request ("scdq") mode.
- `CONTEXT_ONLY` (`multiturn_templates_scdq`): multi-request mode's shared context prompt (for qa_eng and choice_eng
  upstream keeps a (context, query) pair; the query half equals `FOLLOW_UP_CHAT`).
Upstream's typo "The the correct answer is" (choice_eng, first turn and chat) is kept; its non-chat follow-up reads
"The letter of the correct answer is".
"""
from __future__ import annotations

TASKS = ("scbench_kv", "scbench_prefix_suffix", "scbench_qa_eng", "scbench_choice_eng", "scbench_many_shot",
         "scbench_summary")

_CHOICE_QUESTION = ("Question: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\n"
                    "The the correct answer is")
_KV_INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below.\n\n"
_QA_INSTRUCTION = "Read the book and answer the question. Be very concise in your answer.\n\n"
_CHOICE_INSTRUCTION = "Read the book and answer the question.\n\n"

FIRST_TURN = {
    "scbench_kv": _KV_INSTRUCTION + "{context}\n\n{input}",
    "scbench_prefix_suffix": "{context}\n\n{input}",
    "scbench_qa_eng": _QA_INSTRUCTION + "{context}\n\nQuestion: {question}\nAnswer:",
    "scbench_choice_eng": _CHOICE_INSTRUCTION + "{context}\n\n" + _CHOICE_QUESTION,
    "scbench_many_shot": "{context}\n\n{input}",
    "scbench_summary": "{context}\n\n{input}",
}

FOLLOW_UP = {
    "scbench_kv": "{pre_ans}\n\n{input}",
    "scbench_prefix_suffix": "{pre_ans}\n\n{input}",
    "scbench_qa_eng": "{pre_ans}\n\nQuestion: {question}\nAnswer:",
    "scbench_choice_eng": ("{pre_ans}\n\nQuestion: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\n"
                           "D. {OPTION_D}\n\nThe letter of the correct answer is"),
    "scbench_many_shot": "{pre_ans}\n\n{input}",
    "scbench_summary": "{pre_ans}\n\n{input}",
}

FOLLOW_UP_CHAT = {
    "scbench_kv": "{input}",
    "scbench_prefix_suffix": "{input}",
    "scbench_qa_eng": "Question: {question}\nAnswer:",
    "scbench_choice_eng": _CHOICE_QUESTION,
    "scbench_many_shot": "{input}",
    "scbench_summary": "{input}",
}

CONTEXT_ONLY = {
    "scbench_kv": _KV_INSTRUCTION + "{context}",
    "scbench_prefix_suffix": "{context}",
    "scbench_qa_eng": _QA_INSTRUCTION + "{context}",
    "scbench_choice_eng": _CHOICE_INSTRUCTION + "{context}",
    "scbench_many_shot": "{context}",
    "scbench_summary": "{context}",
}

# DATA_NAME_TO_MAX_NEW_TOKENS: new tokens per turn
MAX_NEW_TOKENS = {"scbench_kv": 150, "scbench_prefix_suffix": 150, "scbench_qa_eng": 40, "scbench_choice_eng": 40,
                  "scbench_many_shot": 10, "scbench_summary": 200}

# in chat-template multi-turn mode upstream appends this to every summary follow-up (after the generation prompt)
SUMMARY_CHAT_PRIMER = "This paper"

# the delimiter upstream's scdq mode cuts chat-rendered prompts at
SCDQ_DELIMITER = "[SEPSEPSEP]"
