"""The predictions.jsonl format: what a valid record is, and which lines of a file are valid, torn or damaged.

The run (kvbench.runs.store), merge and the report read records through `scan`, so a line is judged the same way
everywhere. Only a torn LAST line (no newline, or not JSON: a crash mid-write) is damage a reader may repair by
cutting it; any other invalid line (garbage, a hand edit with a wrong type, a record without an id) is damage that
is set aside (the run) or refused (the report), never a reason to drop the valid records after it (docs/records.md).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable

NUMBER = (int, float)
INT = (int,)
TEXT = (str,)
LIST = (list,)
DICT = (dict,)
# field -> the JSON types it may hold (bool is never a number here); None allowed where the field is nullable
FIELDS: dict[str, tuple[tuple, bool]] = {
    "id": (TEXT, False), "failed": ((bool,), False), "prediction": (TEXT, False), "references": (LIST, False),
    "score": (NUMBER, False), "scores": (DICT, False), "meta": (DICT, False), "query": (TEXT, False),
    "prompt_sha256": (TEXT, False), "prompt_tokens": (INT, False), "question_tokens": (INT, False),
    "new_tokens": (INT, False), "budget": (INT, True), "turn": (INT, False), "turn_mode": (TEXT, False),
    "kept_per_layer": (LIST, False), "kept_per_head": (LIST, False), "kept_head_stats": (LIST, False),
    "kv_bytes": (INT, False), "full_kv_bytes": (INT, False), "kv_bytes_final": (INT, False),
    "kv_bytes_per_layer": (LIST, False), "kv_bytes_per_layer_final": (LIST, False), "host_kv_bytes": (INT, False),
    "effective_budget": (NUMBER, False), "prefill_s": (NUMBER, False), "compress_s": (NUMBER, False),
    "decode_s": (NUMBER, False), "decode_tok_s": (NUMBER, False), "question_s": (NUMBER, False),
    "peak_mem_bytes": (INT, False), "peak_kv_bytes": (INT, False), "kv_bytes_peak": (INT, False),
    "kv_bytes_mean": (NUMBER, False), "stop_reason": (TEXT, False), "e2e_s": (NUMBER, False),
    "prefill_shared_by": (INT, False), "step": (TEXT, False),
    "transfers": (DICT, False), "num_beams": (INT, False), "nll_sum": (NUMBER, False), "n_tokens": (INT, False),
    "evicts_in_stream": ((bool,), False), "error_type": (TEXT, False), "error": (TEXT, False), "where": (TEXT, True),
    "response_cot": (TEXT, False), "follow_up": (DICT, False),  # a dataset's second question (kvbench.runs.follow_up)
    "ttft_s": (NUMBER, True), "tpot_s": (NUMBER, True), "sent_s": (NUMBER, False),  # a server's reply (runs/remote)
    "usage": (DICT, True), "server": (DICT, False), "sent": (TEXT, False),
}
FOLLOW_UP = "follow_up"  # the second request's own fields: typed by FIELDS too
PREDICTION_REQUIRES = ("score", "scores")  # what every reader of a prediction record takes (means, tables)
FAILURE_REQUIRES = ("error_type", "error")


def _type_name(types: tuple) -> str:
    return {NUMBER: "a number", INT: "an integer", TEXT: "a string", LIST: "a list", DICT: "an object"}.get(
        types, "a boolean")


def _is(value, types: tuple) -> bool:
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def _fields_problem(fields: dict, prefix: str = "") -> str | None:
    """The first of `fields` whose value has a type FIELDS does not allow, in a few words."""
    for key, value in fields.items():
        if key not in FIELDS or (value is None and FIELDS[key][1]):
            continue
        types = FIELDS[key][0]
        if not _is(value, types):
            return f"'{prefix}{key}' is {json.dumps(value)[:40]}, not {_type_name(types)}"
    return None


def record_problem(record) -> str | None:
    """Why `record` (one parsed line) is not a valid record, in a few words; None if it is one."""
    if not isinstance(record, dict):
        return f"not a JSON object but {type(record).__name__}"
    if not isinstance(record.get("id"), str) or not record["id"]:
        return "no string 'id'"
    for key in FAILURE_REQUIRES if record.get("failed") is True else PREDICTION_REQUIRES:
        if key not in record:
            return f"no '{key}'"
    problem = _fields_problem(record)
    if problem is None and isinstance(record.get(FOLLOW_UP), dict):
        problem = _fields_problem(record[FOLLOW_UP], f"{FOLLOW_UP}.")
    if problem is not None:
        return problem
    for metric, value in record.get("scores", {}).items():
        if not _is(value, NUMBER):
            return f"scores['{metric}'] is {json.dumps(value)[:40]}, not a number"
    return None


@dataclass(frozen=True)
class Line:
    """One line of a predictions file: its 1-based number, where it starts, its bytes (newline included) and what
    it holds."""

    number: int
    offset: int
    raw: bytes
    record: dict | None  # the record, when the line is a valid one
    problem: str | None  # why it is not (None: valid)
    torn: bool = False  # the last line, cut short by a crash: the only damage a reader may repair by removing it


def scan(raw: bytes) -> list[Line]:
    """Every non-blank line of a predictions file, judged: valid, torn (last and unfinished) or damaged."""
    lines = raw.splitlines(keepends=True)
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    out, offset = [], 0
    for i, line in enumerate(lines):
        offset, at = offset + len(line), offset
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:  # not JSON (or not UTF-8)
            torn = i == last
            out.append(Line(i + 1, at, line, None, f"not valid JSON ({e})", torn))
            continue
        if not line.endswith(b"\n"):  # complete JSON but no newline: the write did not finish
            out.append(Line(i + 1, at, line, None, "no newline at the end (a write cut short)", True))
            continue
        problem = record_problem(record)
        out.append(Line(i + 1, at, line, None if problem else record, problem))
    return out


def is_failure(record: dict) -> bool:
    return record.get("failed") is True


def latest_per_id(records: Iterable[dict]) -> list[dict]:
    """One record per id in first-seen order: the last one written (a retry supersedes the failure before it), but
    never a failure over a prediction."""
    latest: dict[str, dict] = {}
    for r in records:
        if not (is_failure(r) and r["id"] in latest and not is_failure(latest[r["id"]])):
            latest[r["id"]] = r
    return list(latest.values())


# a sample asked twice (kvbench.runs.follow_up) cost both requests: its record's top-level fields describe the first,
# `follow_up` the second; the totals and means a report or scores.json takes over samples add the second's work
ADDED = ("prefill_s", "compress_s", "question_s", "decode_s", "e2e_s", "new_tokens", "kv_bytes", "full_kv_bytes")
LARGEST = ("peak_mem_bytes", "peak_kv_bytes", "kv_bytes_peak")


def with_follow_up_work(record: dict) -> dict:
    """`record` with its second request's work folded in (a record without `follow_up` as it is): times, new tokens
    and the compressed and full KV bytes added, the peaks the larger of the two, `decode_tok_s` and `kv_bytes_mean`
    over both requests' decode steps (each request's steps = its decode_tok_s x decode_s)."""
    second = record.get(FOLLOW_UP)
    if not isinstance(second, dict):
        return record
    out = dict(record)

    def both(key: str) -> bool:
        return _is(record.get(key), NUMBER) and _is(second.get(key), NUMBER)

    for key in ADDED:
        if both(key):
            out[key] = record[key] + second[key]
    for key in LARGEST:
        if both(key):
            out[key] = max(record[key], second[key])
    if both("decode_tok_s") and both("decode_s"):
        steps = [r["decode_tok_s"] * r["decode_s"] for r in (record, second)]
        out["decode_tok_s"] = sum(steps) / out["decode_s"] if out["decode_s"] > 0 else 0.0
        if both("kv_bytes_mean") and sum(steps) > 0:
            means = (record["kv_bytes_mean"], second["kv_bytes_mean"])
            out["kv_bytes_mean"] = (means[0] * steps[0] + means[1] * steps[1]) / sum(steps)
    return out
