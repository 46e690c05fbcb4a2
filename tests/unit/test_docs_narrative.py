"""User pages state results, not their history: no commit hashes, no dated narrative.

docs/*.md and README.md say what a benchmark measures, the command that reproduces it, the machine
and the numbers, and what a feature guarantees. What changed and when lives in git history. Each
page is checked line by line for:

- a commit-hash-like token: 7 to 40 hex digits with at least one digit and one letter a-f, as a
  word. Not a hash: ``0x...`` (the ``x`` joins it to a longer word), a longer hex string such as a
  sha256 digest (more than 40 digits), a line inside a fenced code block that names ``sha256``, and
  the example ids in ``EXAMPLE_IDS``;
- the words of a change log: "this change", "kept for the record", "earlier attempt", "the day
  before", "this session", "since <date>"... (``NARRATIVE``), in prose and in code blocks alike;
- an ISO date (YYYY-MM-DD) in prose. Dates are allowed only inside fenced code blocks, where they
  are example output, file names or config values.

A failure names file:line and the text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
# Ids in examples that look like a hash and are not one: docs/tracking.md's MLflow run id.
EXAMPLE_IDS = {"e04efa70"}

MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?"
    r"|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\.?"
)
ISO_DATE = r"\d{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])"
DATE = rf"(?:{ISO_DATE}|{MONTH}\s+\d{{1,2}}|\d{{1,2}}\s+{MONTH}|yesterday|last week)"
NARRATIVE = re.compile(
    r"\b(?:"
    r"(?:before )?this change"
    r"|kept for the record"
    r"|earlier attempts?"
    r"|the day before"
    r"|the next day"
    r"|earlier the same day"
    r"|this session"
    r"|what changed since"
    r"|before this work"
    rf"|since {DATE}"
    r")\b",
    re.IGNORECASE,
)
ISO = re.compile(rf"\b{ISO_DATE}\b")
FENCE = re.compile(r"^\s*(```|~~~)")


def narrative_hits(path: Path) -> list[str]:
    """``file:line: what: text`` for every line of ``path`` that tells history."""
    hits = []
    in_code = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
            continue
        found = []
        if not (in_code and "sha256" in line):
            found += [f"commit hash {t!r}" for t in HASH.findall(line) if t not in EXAMPLE_IDS]
        found += [f"narrative {m.group(0)!r}" for m in NARRATIVE.finditer(line)]
        if not in_code:
            found += [f"date {d!r}" for d in ISO.findall(line)]
        if found:
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            hits.append(f"{where}:{number}: {', '.join(found)}: {line.strip()[:140]}")
    return hits


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_tells_no_history(page: Path):
    hits = narrative_hits(page)
    assert not hits, (
        "a user page states what is true now (what a benchmark measures, its command, the machine, the "
        "numbers); what changed and when belongs in git history:\n" + "\n".join(hits)
    )


def test_the_check_finds_hashes_phrases_and_dates(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "\n".join(
            [
                "Measured against 112c61c and 2f26cae.",  # 1: hashes
                "Before this change the planner read 1.15.",  # 2
                "The day before (kept for the record):",  # 3
                "Why the earlier attempt broke resume.",  # 4
                "Measured in this session.",  # 5
                "What changed since the first run.",  # 6
                "Run on 2026-12-04 at load 5.",  # 7: ISO date in prose
                "Slower since Dec 4.",  # 8
                "```bash",  # 9
                "python bench/load_memory.py --against 29a8322   # before this change",  # 10: hash, phrase
                "```",  # 11
            ]
        )
        + "\n"
    )
    hits = narrative_hits(page)
    assert [int(h.split(":")[1]) for h in hits] == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert "commit hash '112c61c'" in hits[0] and "commit hash '2f26cae'" in hits[0]
    assert "narrative 'The day before'" in hits[2] and "narrative 'kept for the record'" in hits[2]
    assert "date '2026-12-04'" in hits[6]
    assert "commit hash '29a8322'" in hits[8] and "narrative 'before this change'" in hits[8]


def test_the_check_leaves_numbers_digests_and_code_dates(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "\n".join(
            [
                "MALLOC_MMAP_THRESHOLD_=33554432, 1000000007 and 0x7f3a9c2e10 are numbers.",
                "deadbeef and cafebabe have no digit; bf16 and 1e9 are short.",
                "This changes nothing; the planner changed in 2.0.",
                "Since the first step, the loss falls; a key changed since the checkpoint is named.",
                "Nothing since decoding 3 tokens; since 2 ranks share it; SHA 1a2b3c is short.",
                "```",
                "sha256  9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  model.safetensors",
                'expected sha256 3f2a1bc9e8d, got 77aa01e9c2f  {"created": "2024-05-01"}',
                '{"run_id": "e04efa70..."}',
                "```",
            ]
        )
        + "\n"
    )
    assert narrative_hits(page) == []
