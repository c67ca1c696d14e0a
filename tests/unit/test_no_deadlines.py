"""No test depends on the machine's speed (issue 42: a fixed 600 s timeout failed a Ray sweep on a loaded machine):
no subprocess timeout, no `time.time() + N` deadline in a wait loop. A test waits for an event or for the process
it started to end; a real hang is the CI job's limit to catch, not a number guessed for one machine."""
from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
DEADLINES = re.compile(r"\btimeout\s*=\s*\d|\b(?:time\.time|time\.monotonic|monotonic)\(\)\s*\+\s*\d")


def deadlines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if DEADLINES.search(line)]


def test_the_rule_finds_what_it_forbids():
    assert deadlines("out = subprocess.run(cmd, timeout=600)\n    deadline = time.monotonic() + 400\nok = 1") == [
        "out = subprocess.run(cmd, timeout=600)", "deadline = time.monotonic() + 400"]
    assert deadlines("proc.wait()\nwhile proc.poll() is None:") == []


def test_no_test_waits_against_a_clock():
    allowed = {"second.join(timeout=1.0)"}  # passes whatever the speed: a waiting thread is alive after any wait
    found = {f"{path.relative_to(TESTS)}: {line}" for path in TESTS.rglob("*.py") if path != Path(__file__)
             for line in deadlines(path.read_text()) if line not in allowed}
    assert not found, sorted(found)
