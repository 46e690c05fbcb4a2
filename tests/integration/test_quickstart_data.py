"""The quickstart data in the repo is exactly what scripts/make_quickstart_data.py writes."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "quickstart"


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_script_regenerates_the_committed_files(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_quickstart_data.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("train.jsonl", "eval.jsonl", "prompts-train.jsonl", "prompts-eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"{name} differs: rerun the script"


def test_records_are_short_correct_and_held_out():
    train, evals = records(DATA / "train.jsonl"), records(DATA / "eval.jsonl")
    assert len(train) == 3000 and len(evals) == 200
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    for r in train + evals:
        word = r["completion"][::-1]
        assert r["prompt"] == f"reverse: {word}\n" and 3 <= len(word) <= 6
        # Byte tokenizer: one token per character, plus bos and eos; quickstart.yaml uses max_seq_len 64.
        assert len(r["prompt"]) + len(r["completion"]) < 48


def test_prompt_records_are_the_sft_records_with_their_answer():
    """configs/quickstart-grpo.yaml's prompts: the same prompt text as the SFT records, the reversal as answer."""
    for split in ("train", "eval"):
        sft, prompts = records(DATA / f"{split}.jsonl"), records(DATA / f"prompts-{split}.jsonl")
        assert prompts == [{"prompt": r["prompt"], "answer": r["completion"]} for r in sft]
