"""The tool-calling quickstart's data in the repo is exactly what scripts/make_tools_data.py writes."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "quickstart-tools"
NAMES = ("sft-train.jsonl", "prompts-train.jsonl", "prompts-eval.jsonl")


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def factors(question: str) -> tuple[int, int]:
    a, b = question.removesuffix("=?").split("*")
    return int(a), int(b)


def test_script_regenerates_the_committed_files(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tools_data.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    for name in NAMES:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"{name} differs: rerun the script"


def test_transcripts_are_right_and_eval_products_held_out():
    sft = records(DATA / "sft-train.jsonl")
    seen = []
    direct = 0
    for r in sft:
        m = r["messages"]
        a, b = factors(m[0]["content"])
        seen.append((a, b))
        if len(m) == 2:
            direct += 1
            assert m[1] == {"role": "assistant", "content": str(a * b)}
            continue
        # The order the llmft template's tojson writes: sorted keys, as in the file.
        call = {"function": {"arguments": {"a": a, "b": b}, "name": "multiply"}, "type": "function"}
        assert m[1] == {"content": "", "role": "assistant", "tool_calls": [call]}
        assert json.dumps(m[1]["tool_calls"]) == json.dumps([call])
        assert m[2:] == [
            {"content": str(a * b), "name": "multiply", "role": "tool"},
            {"content": str(a * b), "role": "assistant"},
        ]
    assert 0.3 < direct / len(sft) < 0.5
    for split in ("train", "eval"):
        for r in records(DATA / f"prompts-{split}.jsonl"):
            (msg,) = r["prompt"]
            a, b = factors(msg["content"])
            assert msg["role"] == "user" and r["answer"] == str(a * b)
            seen.append((a, b))
    assert len(seen) == len(set(seen)), "a product occurs twice: eval must be held out"
