"""Memory of the bounded text paths, measured in a fresh process: a 50 MB completion in a
``rollout.file`` and a 50 MB prompt cost what a short one costs, because each text is cut to a
budget derived from its token limit before the tokenizer sees it (docs/reliability.md, "Bounded
inputs"; the exactness of the cut is tests/unit/test_input_bounds.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# --- memory: a 50 MB completion or prompt costs what a short one costs -----------------------

_PEAK = textwrap.dedent(
    """
    import json, sys

    def rss():
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        return int(status["VmRSS"].split()[0]) << 10, int(status["VmHWM"].split()[0]) << 10

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    from llmft.data.tokenizer import byte_tokenizer
    from llmft.recipe.schema import Recipe
    tok = byte_tokenizer()
    kind, path = sys.argv[1], sys.argv[2]
    if kind == "completion":
        from llmft.objectives.rollout import FileRollout, Prompt
        r = Recipe()
        r.rollout.backend, r.rollout.file, r.rollout.num_generations, r.rollout.max_new_tokens = "file", path, 1, 64
        reset_peak()
        before = rss()[0]
        rollout = FileRollout(r, tok)
        read = rss()[1] - before  # the file's line, its text and its parsed completion
        reset_peak()
        before = rss()[0]
        (ids,) = rollout.complete([Prompt(None, {"prompt": "p"}, 0)], 0, 0)
        result = len(ids)
    else:
        from llmft.data.kinds.prompts import PromptEncoder, PromptRecord
        from llmft.data.records import parse_chat
        text = open(path).read()
        prompt = text if kind == "prompt" else parse_chat([{"role": "user", "content": text}])
        enc = PromptEncoder(tok, 192, 256)
        reset_peak()
        before = rss()[0]
        (got,) = enc.encode_batch([PromptRecord(prompt, b"{}")])
        result, read = str(got), 0
    print(json.dumps({"growth": rss()[1] - before, "read": read, "result": result}))
    """
)


def peak_growth(kind: str, path) -> dict:
    """Run ``_PEAK`` in a fresh process (the llmft this test imports) beside ``path``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, kind, str(path)], capture_output=True, text=True, env=env, cwd=path.parent,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


MB50 = 50_000_000


def test_a_50_mb_completion_is_cut_before_it_is_tokenized(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"prompt": "p", "completions": ["ab " * (MB50 // 3)]}) + "\n")
    got = peak_growth("completion", path)
    read, tokenizing = got["read"] >> 20, got["growth"] >> 20
    print(f"50 MB completion: peak RSS growth {read} MiB reading, {tokenizing} MiB tokenizing")
    assert got["result"] == 64  # max_new_tokens ids, no eos: the completion was longer
    assert got["growth"] < 256 << 20, got  # tokenized whole: ~9 GiB with this tokenizer
    assert got["read"] < 512 << 20, got  # a line at a time: the line, its text, its completion


@pytest.mark.parametrize("kind", ["prompt", "chat"])
def test_a_50_mb_prompt_is_refused_without_tokenizing_it(tmp_path, kind):
    path = tmp_path / "p.txt"
    path.write_text("ab " * (MB50 // 3))
    got = peak_growth(kind, path)
    print(f"50 MB {kind} prompt: peak RSS growth {got['growth'] / 2**20:.0f} MiB")
    assert "its prompt is more than the 192 tokens that leave room for the completion" in got["result"], got
    assert got["growth"] < 512 << 20, got
