"""What every bench script shares: one thread per process, the machine line, synthetic data,
recipes, reading metrics.jsonl and printing a markdown table.

Benchmarks print ratios measured side by side in one run (STYLE.md): absolute numbers on a
shared 2-core machine move with everyone else's load, ratios of interleaved repetitions much less.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import string
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

# Before torch is imported anywhere: both sides of every comparison run on one thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# A small Llama that is not trivial on one CPU thread: 3.3 M parameters, ~20 MFLOP per token.
BENCH_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 688,
    "vocab_size": 320,
    "max_position_embeddings": 1024,
}


def one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def machine() -> str:
    """One line: CPU model, cores, load average, library versions."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{cpu}, {os.cpu_count()} CPUs visible, load average {load} (1/5/15 min); "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )


def scratch_dir(prefix: str) -> Path:
    """A temporary directory for data, recipes and runs, removed when the bench exits."""
    import atexit
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def torchrun(nproc: int) -> list[str]:
    """The command prefix that starts ``nproc`` ranks on this machine: ``torchrun`` with the
    rendezvous on loopback at a free port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1", f"--master_port={port}",
    ]  # fmt: skip


def write_text_records(path: Path, lengths: Iterable[int], seed: int = 0) -> Path:
    """``{"text": ...}`` records of lowercase words, ``n`` bytes each (the byte tokenizer adds bos
    and eos, so a record of ``n`` bytes is ``n + 2`` tokens)."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for n in lengths:
            words: list[str] = []
            size = 0
            while size <= n:
                w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
                words.append(w)
                size += len(w) + 1
            f.write(json.dumps({"text": " ".join(words)[:n]}) + "\n")
    return path


def write_recipe(path: Path, recipe: dict[str, Any]) -> Path:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def base_recipe(out: Path, data: Path, *, seq: int, micro: int, global_batch: int, steps: int) -> dict[str, Any]:
    """A complete recipe for the bench model: fp32, sdpa, AdamW, loader in-process, no checkpoints."""
    return {
        "run": {"output_dir": str(out), "seed": 0, "overwrite": True},
        "model": {"config": dict(BENCH_LLAMA), "dtype": "fp32", "attn_implementation": "sdpa"},
        "data": {"train": str(data), "max_seq_len": seq, "packing": False, "shuffle": True, "num_workers": 0},
        "batch": {"global_batch_size": global_batch, "micro_batch_size": micro},
        "optim": {
            "name": "adamw",
            "lr": 1e-4,
            "weight_decay": 0.0,
            "scheduler": "constant",
            "warmup_steps": 0,
            "max_grad_norm": 1.0,
        },
        "train": {"max_steps": steps, "log_every_steps": 1, "progress_bar": False},
        "checkpoint": {"every_steps": None, "keep_last": 1, "resume": "never", "save_optimizer": False},
    }


def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl train rows; where a step appears twice the later row counts (as in `llmft plot`)."""
    rows: dict[int, dict[str, Any]] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("split") == "train":
            rows[row["step"]] = row
    return [rows[k] for k in sorted(rows)]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def spread(xs: Sequence[float]) -> str:
    """min-max of a list of ratios, for the table."""
    return f"{min(xs):.3f}-{max(xs):.3f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def quiet_llmft() -> None:
    """llmft logs its banner on every in-process run; the bench prints its own table."""
    import logging

    from llmft.training import train as llmft_train

    original = llmft_train.setup_logging

    def setup(env):
        original(env)
        logging.getLogger("llmft").setLevel(logging.WARNING)
        logging.getLogger("llmft.data").setLevel(logging.ERROR)

    llmft_train.setup_logging = setup
