"""LongBench v1 constants: the prompt templates, max new tokens and the task table (one source for the builder,
the report and `scripts/gen_longbench_configs.py`).

`DATASET2PROMPT` and `DATASET2MAXLEN` equal THUDM/LongBench `LongBench/config/dataset2prompt.json` and
`dataset2maxlen.json` (commit 2e00731) byte for byte: `json.dumps(x, indent=4, ensure_ascii=False)` reproduces
each file, whose sha256 is pinned in tests/unit/test_longbench_data.py. Upstream's quirks are kept: "asconcisely"
(twice, narrativeqa), the space in qasper's "\\n\\n Answer", the trailing spaces of multi_news ("all news. \\n"),
passage_count and passage_retrieval_en ("is: "), and of both code prompts ("given below. \\n").
"""
from __future__ import annotations

from dataclasses import dataclass

from kvbench.data.split import split_template

_MULTIDOC_EN = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
    "The following are given passages.\n{context}\n\n"
    "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\n"
    "Question: {input}\nAnswer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered "
    "based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer "
    "\"yes\", \"no\", or \"unanswerable\". Do not provide any explanation."
)

DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the question "
        "asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
        "Story: {context}\n\n"
        "Now, answer the question based on the story asconcisely as you can, using a single phrase if possible. "
        "Do not provide any explanation.\n\n"
        "Question: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question " + _QASPER_RULES + "\n\n"
        "Article: {context}\n\n"
        " Answer the question based on the above article " + _QASPER_RULES + "\n\n"
        "Question: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\n"
        "Now, answer the following question based on the above text, only give me the answer and do not output any "
        "other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
    "hotpotqa": _MULTIDOC_EN,
    "2wikimqa": _MULTIDOC_EN,
    "musique": _MULTIDOC_EN,
    "dureader": (
        "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："
    ),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query in "
        "one or more sentences.\n\nTranscript:\n{context}\n\n"
        "Now, answer the query based on the above meeting transcript in one or more sentences.\n\n"
        "Query: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\n"
        "News:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other words. "
        "The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format should only "
        "contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format must be like "
        "\"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n"
        "请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是："
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# query=agnostic: each template split at its own boundary, right after {context} and its whitespace (the split of
# kvpress's LongBench context/question templates): (context part, question part), joined the template byte for byte
CONTEXT_TEMPLATES: dict[str, str] = {task: split_template(p)[0] for task, p in DATASET2PROMPT.items()}
QUESTION_TEMPLATES: dict[str, str] = {task: split_template(p)[1] for task, p in DATASET2PROMPT.items()}

DATASET2MAXLEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}


@dataclass(frozen=True)
class TaskInfo:
    label: str        # column header in the KV papers' tables (PyramidKV Table 1 / Ada-KV Table 1)
    lang: str         # "en", "zh" or "code" (code counts for both languages in LongBench's averages)
    category: str     # LongBench's task type, as the papers group their columns
    metric: str       # kvbench.metrics.longbench registered name without the "longbench_" prefix


SINGLE, MULTI, SUMM, FEW, SYN, CODE = ("Single-Doc. QA", "Multi-Doc. QA", "Summarization", "Few-shot Learning",
                                       "Synthetic", "Code")
CATEGORIES = (SINGLE, MULTI, SUMM, FEW, SYN, CODE)   # the papers' column-group order

TASKS: dict[str, TaskInfo] = {   # LongBench pred.py order
    "narrativeqa": TaskInfo("NrtvQA", "en", SINGLE, "qa_f1"),
    "qasper": TaskInfo("Qasper", "en", SINGLE, "qa_f1"),
    "multifieldqa_en": TaskInfo("MF-en", "en", SINGLE, "qa_f1"),
    "multifieldqa_zh": TaskInfo("MF-zh", "zh", SINGLE, "qa_f1_zh"),
    "hotpotqa": TaskInfo("HotpotQA", "en", MULTI, "qa_f1"),
    "2wikimqa": TaskInfo("2WikiMQA", "en", MULTI, "qa_f1"),
    "musique": TaskInfo("Musique", "en", MULTI, "qa_f1"),
    "dureader": TaskInfo("DuReader", "zh", MULTI, "rouge_zh"),
    "gov_report": TaskInfo("GovReport", "en", SUMM, "rouge"),
    "qmsum": TaskInfo("QMSum", "en", SUMM, "rouge"),
    "multi_news": TaskInfo("MultiNews", "en", SUMM, "rouge"),
    "vcsum": TaskInfo("VCSUM", "zh", SUMM, "rouge_zh"),
    "trec": TaskInfo("TREC", "en", FEW, "classification"),
    "triviaqa": TaskInfo("TriviaQA", "en", FEW, "qa_f1"),
    "samsum": TaskInfo("SAMSum", "en", FEW, "rouge"),
    "lsht": TaskInfo("LSHT", "zh", FEW, "classification"),
    "passage_count": TaskInfo("PCount", "en", SYN, "count"),
    "passage_retrieval_en": TaskInfo("PRe", "en", SYN, "retrieval"),
    "passage_retrieval_zh": TaskInfo("PRe-zh", "zh", SYN, "retrieval_zh"),
    "lcc": TaskInfo("Lcc", "code", CODE, "code_sim"),
    "repobench-p": TaskInfo("RB-P", "code", CODE, "code_sim"),
}

# pred.py: these are never wrapped in a chat template ("chat models are better off without build prompts")
CHAT_SKIP = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
# eval.py: the prediction is cut to its first line (after leading newlines) before scoring
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")

# Task groups (file stems of data.zip). KV16: the 16 English + code tasks of SnapKV / PyramidKV / Ada-KV, in their
# tables' column order. ALL21: every LongBench task, pred.py order. E13: LongBench-E, pred.py --e order.
# TAILORKV13: TailorKV's 13 tasks (Avg. = their plain mean, checked against its Table 14: 699.0 / 13 = 53.8).
KV16 = ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "gov_report", "qmsum",
        "multi_news", "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p")
ALL21 = tuple(TASKS)
E13 = tuple(f"{t}_e" for t in ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
                               "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc",
                               "repobench-p"))
# TailorKV Tables 3/14: 13 English tasks (no NarrativeQA, MuSiQue, QMSum), in its column order
TAILORKV13 = ("qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec", "samsum",
              "triviaqa", "repobench-p", "lcc", "passage_count", "passage_retrieval_en")
GROUPS = {"longbench": KV16, "longbench_all": ALL21, "longbench_e": E13, "longbench_tailorkv": TAILORKV13}

# LongBench-E buckets, on the record's `length` field (words for English and code, characters for Chinese)
E_BUCKETS = ("0-4k", "4-8k", "8k+")


def base_task(stem: str) -> str:
    """'qasper_e' -> 'qasper' (LongBench-E files share their task's prompt, length and metric)."""
    return stem[:-2] if stem.endswith("_e") and stem[:-2] in TASKS else stem


def length_bucket(length: int) -> str:
    """eval.py `scorer_e`: < 4000 -> "0-4k", < 8000 -> "4-8k", else "8k+"."""
    return E_BUCKETS[0] if length < 4000 else E_BUCKETS[1] if length < 8000 else E_BUCKETS[2]
