"""Peak memory of a cache build against the size of its longest record (docs/benchmarks.md).

A JSONL file of one huge text record (20 MB, 50 MB of ASCII words) and 1,000 short ones is built
into an empty cache with ``data.max_seq_len=128`` by ``build_data`` in a fresh process (the byte
tokenizer: one token per byte, the most tokens a text can give). The table gives that process's
peak RSS (``VmHWM``, and its tokenizing workers' ``ru_maxrss``), and the same above the process after
its imports, for each record size; ``--root`` runs another checkout's llmft (e.g. an older commit
unpacked with ``git archive``) for a before/after comparison.

    python bench/record_memory.py                       # 0, 20 and 50 MB
    python bench/record_memory.py --sizes 20 --root /tmp/old-llmft
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, resource, sys
from llmft.data import build_data
from llmft.recipe.schema import Recipe
from llmft.data.tokenizer import byte_tokenizer

def hwm():  # VmHWM: this process's own peak (ru_maxrss would keep the parent's peak across exec)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])

tok = byte_tokenizer()
base = hwm()
r = Recipe()
r.data.train, r.data.cache_dir, r.data.max_seq_len, r.data.num_proc = sys.argv[1], sys.argv[2], 128, int(sys.argv[3])
data = build_data(r, tok)
peak = max(hwm(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # workers: forked, no exec
print(json.dumps({"base_kib": base, "peak_kib": peak, "tokens": data.stats["tokens"],
                  "truncated": data.stats["truncated"]}))
"""


def write_data(path: Path, huge_mb: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        if huge_mb:  # first: the first batch of a process is also tokenized by the full tokenizer call
            letters = np.frombuffer(b"abcdefghij     ", dtype=np.uint8)
            text = letters[rng.integers(0, len(letters), huge_mb * 10**6)].tobytes().decode()
            f.write(json.dumps({"text": text}) + "\n")
        for i in range(1000):
            f.write(json.dumps({"text": f"record {i} " * (i % 20 + 1)}) + "\n")


def measure(huge_mb: int, root: Path, num_proc: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmft-record-memory-") as tmp:
        data = Path(tmp) / "d.jsonl"
        write_data(data, huge_mb)
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(data), str(Path(tmp) / "cache"), str(num_proc)],
            capture_output=True, text=True, env=env, check=False, cwd=tmp,  # cwd: not this checkout's llmft
        )  # fmt: skip
        if out.returncode != 0:
            return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else str(out.returncode)}
        return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[0, 20, 50], help="MB of the huge record")
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose llmft to run")
    p.add_argument("--num-proc", type=int, default=1)
    args = p.parse_args()
    print(f"llmft from {args.root}, max_seq_len 128, data.num_proc {args.num_proc}, peak RSS in MiB")
    print("| longest record | peak RSS | above imports | tokens kept | truncated |")
    print("| --- | --- | --- | --- | --- |")
    for mb in args.sizes:
        m = measure(mb, args.root, args.num_proc)
        if "error" in m:
            print(f"| {mb} MB | failed: {m['error']} | | | |")
            continue
        peak, base = m["peak_kib"] / 1024, m["base_kib"] / 1024
        print(f"| {mb} MB | {peak:,.0f} | {peak - base:,.0f} | {m['tokens']:,} | {m['truncated']} |", flush=True)


if __name__ == "__main__":
    main()
