"""Code, tests and docs cite what a newcomer can open: a guarantee of docs/design.md (G1, G7...)
or a docs page, never a planning document ("SPEC 8") or a tracker thread ("issue 13") that is not
in the repository. An upstream bug is cited by its full address."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UNOPENABLE = re.compile(r"\bSPEC\b|\b[Ii]ssue[ -]#?\d|\b[Tt]he issue\b")


def _files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    for folder in ("llmft", "docs", "tests", "bench", "configs", "launch", "scripts"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh", ".yaml", ".sbatch")]
    return sorted(p for p in files if p.is_file() and p != Path(__file__).resolve())


def test_no_citation_a_reader_cannot_open():
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in _files()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if UNOPENABLE.search(line)
    ]
    assert not hits, "cite docs/design.md (Gn) or a docs page instead:\n" + "\n".join(hits)


def test_the_pattern_leaves_names_that_only_contain_spec():
    assert UNOPENABLE.search("(SPEC 8)") and UNOPENABLE.search("issue 13") and UNOPENABLE.search("issue-15")
    assert not UNOPENABLE.search("SPECIAL_TOKENS, ${TORCH_SPEC:-torch}, DeepSpeed/issues/2252")
