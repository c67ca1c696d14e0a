"""InfiniteBench prompt templates and generation lengths, byte-identical to OpenBMB/InfiniteBench @ 88b3daa
(`src/prompt.py: yarn_mistral_templates`, `src/eval_utils.py: DATA_NAME_TO_MAX_NEW_TOKENS`). Benchmark definitions,
kept verbatim; tests/unit/test_infinitebench.py pins each template by its SHA-256 computed from the upstream file.
"""

# the tasks TailorKV reports (Table 15), in its column order
TAILORKV_TASKS = ("passkey", "number_string", "longdialogue_qa_eng", "longbook_sum_eng", "longbook_choice_eng",
                  "longbook_qa_eng", "longbook_qa_chn", "math_find", "code_debug")

TEMPLATES = {
    "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is",  # noqa: E501
    "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you about the important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is",  # noqa: E501
    "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}",  # noqa: E501
    "longbook_sum_eng": "Summarize the book below.\n\n{context}\n\nSummary:",  # noqa: E501
    "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct answer is",  # noqa: E501
    "longbook_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\nQuestion: {question}\nAnswer:",  # noqa: E501
    "longbook_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案：",  # noqa: E501
    "math_find": "{prefix}\n\n{context}\n\n{input}",  # noqa: E501
    "math_calc": "Let us calculate the intermediate values of an expression.\n\nExpression: 1 + 3 + 4\nValues: [1, 4, 8]\n\nExpression: 8 - 3 + 2 - 4\nValues: [8, 5, 7, 3]\n\nExpression: {context}\nValues:",  # noqa: E501
    "code_run": "There is a function called {func} in the following Python code.\n\n{context}\n\nPlease compute the exact value of {func_call}. The value of {func_call} is",  # noqa: E501
    "code_debug": "Following is a Python code where exactly one of the functions/methods has a deliberate error that makes it crash.\n\n{context}\n\nOptions:\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe correct option is:",  # noqa: E501
    "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a character name is replaced with \"$$MASK$$\", and you should try to guess who that character is.\n\n{context}\n\nThe name that has been replaced with $$MASK$$ is likely",  # noqa: E501
}

MAX_NEW_TOKENS = {"passkey": 6, "number_string": 12, "kv_retrieval": 50, "longbook_sum_eng": 1200,
                  "longbook_choice_eng": 40, "longbook_qa_eng": 40, "longbook_qa_chn": 40,
                  "longdialogue_qa_eng": 40, "math_find": 3, "math_calc": 30000, "code_run": 5, "code_debug": 5}
