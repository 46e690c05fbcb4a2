"""The docs point at things that exist.

- Every relative link in README.md and docs/*.md names an existing file or directory, and a
  ``#fragment`` into a Markdown file names one of its headings (GitHub's anchor rules).
- Every ``llmft ...`` command in a fenced shell block parses with llmft's own argument parser
  (a real subcommand, real options), and every inline ``llmft <word>`` names a real subcommand.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from llmft.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

# Pages that are linked before they are written. A link to one of these passes only while the
# file is absent; once it lands it is checked like any other (anchors included). Remove an
# entry when its file is committed.
ALLOWED_MISSING: set[str] = set()

SHELL_LANGS = {"", "bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
INLINE_LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\((?P<target><[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\((?P<target>[^)\s]+)\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(?P<target>\S+)")
INLINE_CODE = re.compile(r"(`+)(?P<code>.+?)\1")
OPERATORS = {"&&", "||", "|", ";", "(", ")", "&", ">", ">>", "<", "2>"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _split_fences(text: str) -> tuple[list[tuple[int, str]], list[tuple[str, list[tuple[int, str]]]]]:
    """(prose lines, fenced blocks as (language, lines)), each line with its 1-based number."""
    prose: list[tuple[int, str]] = []
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    fence: str | None = None
    for lineno, line in enumerate(text.splitlines(), start=1):
        m = FENCE.match(line)
        if fence is None:
            if m:
                fence = m.group("fence")
                blocks.append((m.group("lang").lower(), []))
            else:
                prose.append((lineno, line))
        elif (
            m and m.group("fence").startswith(fence[0]) and len(m.group("fence")) >= len(fence) and not m.group("lang")
        ):
            fence = None
        else:
            blocks[-1][1].append((lineno, line))
    return prose, blocks


def _strip_inline_code(line: str) -> str:
    return INLINE_CODE.sub("", line)


def _links(path: Path) -> list[tuple[int, str]]:
    prose, _ = _split_fences(path.read_text())
    found = []
    for lineno, line in prose:
        line = _strip_inline_code(line)
        for pattern in (INLINE_LINK, IMAGE_LINK, REF_DEF):
            for m in pattern.finditer(line):
                found.append((lineno, m.group("target").strip("<>")))
    return found


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


def _slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, markup and punctuation dropped, spaces -> hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"[*_~]", lambda m: "_" if m.group(0) == "_" else "", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    prose, _ = _split_fences(path.read_text())
    seen: dict[str, int] = {}
    anchors = set()
    for _, line in prose:
        m = re.match(r"^\s{0,3}#{1,6}\s+(?P<title>.+?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group("title"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    anchors.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text()))
    return anchors


def _link_problems(doc: Path) -> list[str]:
    problems = []
    for lineno, target in _links(doc):
        if _is_external(target):
            continue
        file_part, _, fragment = target.partition("#")
        dest = doc if not file_part else (doc.parent / file_part).resolve()
        where = f"{_rel(doc)}:{lineno}: link {target!r}"
        if not dest.exists():
            try:
                rel = _rel(dest)
            except ValueError:
                rel = str(dest)
            if rel not in ALLOWED_MISSING:
                problems.append(f"{where} points at {rel}, which does not exist")
            continue
        if fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            problems.append(f"{where}: {_rel(dest)} has no heading with anchor #{fragment}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_resolve(doc: Path):
    problems = _link_problems(doc)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_allowed_missing_pages_are_linked_from_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    for rel in ALLOWED_MISSING:
        assert f"({Path(rel).name})" in index, f"docs/README.md should link {rel}"


# --- commands ------------------------------------------------------------------------------------


def _subcommands() -> set[str]:
    parser = build_parser()
    for action in parser._actions:  # argparse keeps subparsers only here
        if action.dest == "command":
            return set(action.choices)
    raise AssertionError("llmft's parser has no subcommands")


def _shell_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Join backslash continuations; keep the first line's number."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for lineno, line in lines:
        line = re.sub(r"^\s*\$\s+", "", line)  # a "$ " prompt
        if pending is not None:
            pending = (pending[0], pending[1] + " " + line.lstrip())
        else:
            pending = (lineno, line)
        if pending[1].rstrip().endswith("\\"):
            pending = (pending[0], pending[1].rstrip()[:-1])
            continue
        out.append(pending)
        pending = None
    if pending is not None:
        out.append(pending)
    return out


def _tokens(line: str) -> list[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    try:
        return list(lex)
    except ValueError:  # an unbalanced quote: not a command line we can check
        return []


def _llmft_invocations(line: str) -> list[list[str]]:
    """Argument lists of every llmft invocation on a shell line (``llmft``, ``python -m llmft``,
    ``-m llmft`` under torchrun/srun, ``--module llmft`` under deepspeed)."""
    tokens = _tokens(line)
    found = []
    command_start = True
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        start = None
        if tok in OPERATORS:
            command_start = True
            i += 1
            continue
        if command_start and ENV_ASSIGNMENT.match(tok):
            i += 1
            continue
        if command_start and tok == "llmft":
            start = i + 1
        elif tok in ("-m", "--module") and i + 1 < len(tokens) and tokens[i + 1] == "llmft":
            start = i + 2
        command_start = False
        if start is not None:
            end = start
            while end < len(tokens) and tokens[end] not in OPERATORS:
                end += 1
            found.append(tokens[start:end])
            i = end
            continue
        i += 1
    return found


def _parse_error(args: list[str]) -> str | None:
    parser = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as e:
        if e.code not in (0, None):
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    return None


def _fenced_commands() -> list[tuple[str, list[str]]]:
    out = []
    for doc in DOCS:
        _, blocks = _split_fences(doc.read_text())
        for lang, lines in blocks:
            if lang not in SHELL_LANGS:
                continue
            for lineno, line in _shell_lines(lines):
                for args in _llmft_invocations(line):
                    out.append((f"{_rel(doc)}:{lineno}", args))
    return out


def test_docs_quote_llmft_commands():
    """Guards the two tests below against a parser that silently finds nothing."""
    commands = _fenced_commands()
    assert len(commands) >= 10, commands
    assert {args[0] for _, args in commands if args} >= {"train", "compile", "export", "plot", "plan", "verify"}


def test_fenced_llmft_commands_parse():
    problems = []
    for where, args in _fenced_commands():
        error = _parse_error(args)
        if error is not None:
            problems.append(f"{where}: `llmft {shlex.join(args)}`: {error}")
    assert not problems, (
        "commands in fenced shell blocks that llmft's parser rejects (write real values, not "
        "placeholders, in shell blocks; put templates in inline code):\n" + "\n".join(problems)
    )


def test_inline_llmft_commands_name_real_subcommands():
    subcommands = _subcommands()
    problems = []
    for doc in DOCS:
        prose, _ = _split_fences(doc.read_text())
        for lineno, line in prose:
            for m in INLINE_CODE.finditer(line):
                # Only spans that are a command (``llmft x``, ``python -m llmft x``), not prose
                # that mentions llmft (error messages quoted inline).
                words = re.sub(r"^python3? -m ", "", m.group("code").strip()).split()
                if len(words) < 2 or words[0] != "llmft":
                    continue
                nxt = words[1].rstrip(":")
                placeholder = nxt.startswith(("-", "<", "[")) or nxt.isupper()
                if not placeholder and nxt not in subcommands:
                    problems.append(f"{_rel(doc)}:{lineno}: `{m.group('code')}`: {nxt!r} is not a subcommand")
    assert not problems, f"subcommands are {sorted(subcommands)}:\n" + "\n".join(problems)


# --- the checkers themselves ----------------------------------------------------------------------


def test_slugs_follow_github():
    assert _slug("5. `llmft verify` before a long job") == "5-llmft-verify-before-a-long-job"
    assert _slug("Export, plot, verify") == "export-plot-verify"
    assert _slug("The stop signal: `distributed.stop_signal`") == "the-stop-signal-distributedstop_signal"


def test_invocations_are_found_in_shell_forms():
    assert _llmft_invocations("llmft train r.yaml optim.lr=1e-4  # comment") == [["train", "r.yaml", "optim.lr=1e-4"]]
    assert _llmft_invocations("pip install -e . && llmft train configs/quickstart.yaml") == [
        ["train", "configs/quickstart.yaml"]
    ]
    assert _llmft_invocations("torchrun --nproc_per_node 2 -m llmft train dir") == [["train", "dir"]]
    assert _llmft_invocations("OMP_NUM_THREADS=1 python -m llmft verify r.yaml --samples 4") == [
        ["verify", "r.yaml", "--samples", "4"]
    ]
    assert _llmft_invocations("deepspeed --module llmft train dir") == [["train", "dir"]]
    assert _llmft_invocations("cat runs/llmft/metrics.jsonl | head") == []
    assert _llmft_invocations("python -m llmft.plan.launch --write-generic launch/") == []


def test_parser_check_rejects_what_llmft_rejects():
    assert _parse_error(["train", "r.yaml"]) is None
    assert _parse_error(["--help"]) is None
    assert _parse_error(["trian", "r.yaml"]) is not None
    assert _parse_error(["export", "run", "--merge"]) is None  # argparse accepts unique prefixes
    assert _parse_error(["export", "run", "--bogus"]) is not None
