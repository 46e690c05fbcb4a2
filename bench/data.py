"""Data at scale: llmft's tokenize-once cache against ``datasets.map(num_proc)``, cache hits, RSS, chat masking.

With a 32k byte-level BPE tokenizer trained here in-process (no download) and synthetic records
generated here (text of median ~300 tokens; chat of 2-12 turns):

1. first build: ``build_data`` into an empty cache (read, tokenize with ``data.num_proc``, pack,
   write Arrow) against the same tokenizer run by ``load_dataset("json") + Dataset.map(batched,
   num_proc)`` on the same file: the ratio is llmft / datasets. Two references: ``tokenizer(texts)``
   (what TRL and LLaMA-Factory run) and the Rust tokenizer's ``encode_batch_fast`` (the call llmft
   makes, without offsets): the second ratio is what llmft's pipeline costs beyond the tokenizer.
2. second build (a resume, requeue or second run): ``build_data`` in a fresh process that finds
   the entry, seconds of data preparation and the CPU time spent tokenizing (none).
3. first optimizer step: ``llmft train`` (a small Llama built from ``model.config``, 1 step of 2
   sequences) from process start to the step's row in ``metrics.jsonl``, into an empty cache,
   against the same ``datasets.map`` reference; then again with the cache filled (a second run).
   Then the same with 2 ranks under ``torchrun`` into another empty cache: one rank tokenizes,
   the other waits and maps the entry, so the whole command's CPU time is about the 1-rank
   command's, not twice it.
4. RSS: a fresh process that reads every row of the cached dataset the way a training rank does
   (``build_data``, ``DataBundle.order``, ``MicroBatchSampler``, ``make_loader`` and its collate,
   in-process loader); its peak RSS above the same process after it imported what a rank imports
   (torch, ``llmft.training.run``) and ran the loader once on a tiny batch, against the size of the Arrow
   cache. Of that: the resident pages of the cache's memory map and the anonymous memory. And the
   same peak of the process that built the entry (step 1; its tokenizing workers are other processes).
5. chat, assistant-only loss: seconds per record for 2- and 12-turn conversations (one render per
   conversation), and the ratio; linear in turns means ~6x (12 turns hold 6x the tokens).

    python bench/data.py                 # 200k text records, 50k chat records (several minutes here)
    python bench/data.py --records 50000 --chat 10000
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import common

WORDS_SEED = 0


def vocabulary(n: int = 20000) -> list[str]:
    rng = random.Random(WORDS_SEED)
    syll = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "an", "el", "or", "is", "um", "th", "st"]
    return ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def sentence(rng: random.Random, words: list[str], n: int) -> str:
    # Zipf-like word frequencies, like natural text, so BPE merges mean something.
    return " ".join(words[min(int(rng.paretovariate(1.1)) - 1, len(words) - 1)] for _ in range(n))


def write_text(path: Path, records: int, words: list[str]) -> None:
    rng = random.Random(1)
    with open(path, "w") as f:
        for _ in range(records):
            n = max(8, int(rng.lognormvariate(math.log(265), 0.5)))  # ~300 tokens median with this tokenizer
            f.write(json.dumps({"text": sentence(rng, words, n)}) + "\n")


def write_chat(path: Path, records: int, turns: int, words: list[str]) -> None:
    rng = random.Random(turns)
    with open(path, "w") as f:
        for _ in range(records):
            msgs = [
                {"role": "user" if t % 2 == 0 else "assistant", "content": sentence(rng, words, 40)}
                for t in range(turns)
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")


def train_tokenizer(text_file: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from llmft.data.tokenizer import BUILTIN_TEMPLATES

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=32000, special_tokens=["<pad>", "<eos>", "<|im_start|>", "<|im_end|>"], show_progress=False
    )

    def lines():
        with open(text_file) as f:
            for i, line in enumerate(f):
                if i >= 20000:
                    break
                yield json.loads(line)["text"]

    tok.train_from_iterator(lines(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", chat_template=BUILTIN_TEMPLATES["chatml"]
    )
    fast.save_pretrained(str(out))
    return out


def recipe(tmp: Path, data: Path, tok: Path, cache: Path, num_proc: int, seq: int = 2048) -> Path:
    r = {
        "run": {"output_dir": str(tmp / "run"), "seed": 0},
        "model": {"config": {"model_type": "llama", "vocab_size": 32000}, "tokenizer": str(tok)},
        "data": {"train": str(data), "max_seq_len": seq, "cache_dir": str(cache), "num_proc": num_proc},
        "batch": {"global_batch_size": 8, "micro_batch_size": 8},
        "train": {"max_steps": 1},
    }
    return common.write_recipe(tmp / f"recipe-{data.stem}.yaml", r)


CHILD = r"""
import json, os, resource, sys, time
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
def mapped(prefix):  # resident bytes of the mappings of files under prefix (the cache)
    total, name = 0, ""
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if not parts[0].endswith(":"):
            name = parts[5] if len(parts) > 5 else ""
        elif parts[0] == "Rss:" and name.startswith(prefix):
            total += int(parts[1]) * 1024
    return total
t0, c0 = time.time(), time.process_time()
import llmft.training.run  # what a training rank imports
from llmft.data import MicroBatchSampler, build_data, make_loader
from llmft.data.sampler import GlobalOrder
from llmft.data.tokens import TokenDataset
from llmft.plan.batch import BatchPlan
from llmft.recipe import load_recipe
from llmft.data.tokenizer import load_tokenizer
r = load_recipe(sys.argv[1], [])
tok = load_tokenizer(r.model)
tiny = TokenDataset([([1, 2, 3], [-100, 2, 3], None)] * 8)  # the loader's own code pages, before the base
for _ in make_loader(tiny, MicroBatchSampler(GlobalOrder(8, 0, True), BatchPlan(8, 8, 1, 1), 0, num_steps=2), 0, 0, 2):
    pass
open("/proc/self/clear_refs", "w").write("5")  # VmHWM (the peak) restarts from here: imports peak higher
base_rss, base_anon = status("VmRSS"), status("RssAnon")
t1, c1 = time.time(), time.process_time()
data = build_data(r, tok)
t2, c2 = time.time(), time.process_time()
children = resource.getrusage(resource.RUSAGE_CHILDREN)
rows = 0
if sys.argv[2] == "read":  # every row, as the training loop's DataLoader takes them
    ds, g = data.train, r.batch.global_batch_size
    sampler = MicroBatchSampler(data.order(r.run.seed, r.data.shuffle), BatchPlan(g, g, 1, 1), 0, num_steps=-(-len(ds) // g))
    for batch in make_loader(ds, sampler, tok.pad_token_id, 0, 2):
        rows += len(batch["input_ids"])
print(json.dumps({"seconds": t2 - t1, "cpu": c2 - c1 + children.ru_utime + children.ru_stime,
                  "built": data.entries[0]["built"], "bytes": data.entries[0]["bytes"],
                  "tokens": data.stats["tokens"], "records": data.stats["records"], "rows": rows,
                  "base_rss": base_rss, "rss": status("VmRSS"), "anon": status("RssAnon") - base_anon,
                  "cache_rss": mapped(r.data.cache_dir),
                  "peak_rss": status("VmHWM")}))
"""


def run_child(recipe_path: Path, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(common.ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(recipe_path), mode], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_recipe(tmp: Path, data: Path, tok: Path, cache: Path, num_proc: int, name: str = "train") -> Path:
    """``llmft train`` for one optimizer step of 2 sequences of the bench Llama, with the tokenizer's vocabulary."""
    r = common.base_recipe(tmp / f"{name}-run", data, seq=2048, micro=1, global_batch=2, steps=1)
    r["model"]["config"].update(vocab_size=32000, max_position_embeddings=2048)
    r["model"]["tokenizer"] = str(tok)
    r["data"].update(cache_dir=str(cache), num_proc=num_proc)
    r["run"]["tensorboard"] = False
    return common.write_recipe(tmp / f"recipe-{name}.yaml", r)


def _stepped(metrics: Path) -> bool:
    try:
        return any(json.loads(line)["step"] >= 1 for line in metrics.read_text().splitlines())
    except (OSError, ValueError):  # not written yet, or a line half written
        return False


def seconds_to_first_step(recipe_path: Path, nproc: int = 1) -> tuple[float, float]:
    """Wall seconds from starting ``llmft train`` (under ``torchrun`` for ``nproc`` > 1) to its first
    optimizer step's row in metrics.jsonl, and the CPU seconds of the whole command (every rank and
    tokenizing worker, to its end)."""
    import yaml

    run_dir = Path(yaml.safe_load(recipe_path.read_text())["run"]["output_dir"])
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # a previous run's rows
    env = {**os.environ, "PYTHONPATH": str(common.ROOT)}
    log = run_dir.parent / f"{run_dir.name}.log"  # a file, not a pipe: progress bars would fill a pipe
    launcher = common.torchrun(nproc) if nproc > 1 else [sys.executable]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as out:
        t0 = time.time()
        proc = subprocess.Popen([*launcher, "-m", "llmft", "train", str(recipe_path)], env=env, stdout=out, stderr=out)
        while not _stepped(metrics):
            if proc.poll() is not None:
                raise SystemExit(
                    f"llmft train exited {proc.returncode} before its first step:\n{log.read_text()[-3000:]}"
                )
            time.sleep(0.05)
        seconds = time.time() - t0
        if proc.wait():
            raise SystemExit(f"llmft train exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the launcher's waited-for descendants included
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def datasets_map(data: Path, tok_dir: Path, num_proc: int, cache: Path, fast: bool = False) -> tuple[float, float]:
    """The reference: load_dataset("json") + map(tokenize, batched, num_proc), seconds and CPU seconds.

    ``tokenize`` is ``tokenizer(texts)``, as TRL and LLaMA-Factory call it; with ``fast``, the Rust
    tokenizer's ``encode_batch_fast`` (no offsets), the call llmft makes: that reference shows
    what llmft's pipeline costs beyond the tokenizer."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    datasets.disable_progress_bars()

    def tokenize(batch):
        if fast:
            return {"input_ids": [e.ids for e in tok.backend_tokenizer.encode_batch_fast(batch["text"])]}
        return tok(batch["text"])

    t0, c0 = time.time(), time.process_time()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    ds = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(cache))
    ds.map(tokenize, batched=True, num_proc=num_proc, remove_columns=["text"])
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = time.process_time() - c0 + (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return time.time() - t0, cpu


def chat_seconds_per_record(path: Path, tok_dir: Path) -> float:
    from transformers import AutoTokenizer

    from llmft.data.encode import Encoder
    from llmft.data.records import parse_record

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    records = [parse_record(json.loads(line)) for line in open(path)]
    enc = Encoder(tok, "completion")
    t0 = time.process_time()
    for i in range(0, len(records), 256):
        enc.encode_batch(records[i : i + 256])
    assert enc.prefix_renders == 0, "every conversation should take the one-render path"
    return (time.process_time() - t0) / len(records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=200_000, help="text records")
    ap.add_argument("--chat", type=int, default=50_000, help="chat records (half with 2 turns, half with 12)")
    ap.add_argument("--num-proc", type=int, default=2)
    args = ap.parse_args()
    tmp = common.scratch_dir("llmft-bench-data-")
    words = vocabulary()
    print(common.machine())
    text = tmp / "text.jsonl"
    write_text(text, args.records, words)
    tok_dir = train_tokenizer(text, tmp / "tok")

    ref_s, ref_cpu = datasets_map(text, tok_dir, args.num_proc, tmp / "hf")
    fast_s, fast_cpu = datasets_map(text, tok_dir, args.num_proc, tmp / "hf-fast", fast=True)
    r = recipe(tmp, text, tok_dir, tmp / "cache", args.num_proc)
    first = run_child(r, "none")
    second = run_child(r, "read")
    assert first["built"] and not second["built"] and second["rows"] >= second["records"]
    rss_over = second["peak_rss"] - second["base_rss"]
    build_over = first["peak_rss"] - first["base_rss"]
    t = train_recipe(tmp, text, tok_dir, tmp / "cache-train", args.num_proc)
    (step_first, cpu_first), (step_second, _) = seconds_to_first_step(t), seconds_to_first_step(t)
    t2 = train_recipe(tmp, text, tok_dir, tmp / "cache-train-2", args.num_proc, name="train-2")
    (step_two, cpu_two), (step_two_second, _) = seconds_to_first_step(t2, 2), seconds_to_first_step(t2, 2)

    two, twelve = tmp / "chat2.jsonl", tmp / "chat12.jsonl"
    write_chat(two, args.chat // 2, 2, words)
    write_chat(twelve, args.chat // 2, 12, words)
    per2, per12 = chat_seconds_per_record(two, tok_dir), chat_seconds_per_record(twelve, tok_dir)

    mb = 1024 * 1024
    print(
        f"\n{args.records:,} text records, {first['tokens']:,} tokens (median ~{first['tokens'] // args.records} per "
        f"record), max_seq_len 2048, num_proc {args.num_proc}; {args.chat:,} chat records\n"
    )
    rows = [
        ["first build: llmft build_data, s", f"{first['seconds']:.1f}", ""],
        ["  datasets load_dataset + map(num_proc), s", f"{ref_s:.1f}", ""],
        ["  ratio llmft / datasets (wall, CPU)", f"{first['seconds'] / ref_s:.2f}", f"{first['cpu'] / ref_cpu:.2f}"],
        ["  datasets load_dataset + map(num_proc), encode_batch_fast, s", f"{fast_s:.1f}", ""],
        [
            "  ratio llmft / that (wall, CPU): the pipeline beyond the tokenizer",
            f"{first['seconds'] / fast_s:.2f}",
            f"{first['cpu'] / fast_cpu:.2f}",
        ],
        ["second run (cache hit): data preparation, s", f"{second['seconds']:.2f}", f"cpu {second['cpu']:.2f} s"],
        ["llmft train, empty cache: start to first optimizer step, s", f"{step_first:.1f}", ""],
        ["  ratio to datasets load_dataset + map(num_proc)", f"{step_first / ref_s:.2f}", ""],
        ["  ratio to the same with encode_batch_fast", f"{step_first / fast_s:.2f}", ""],
        ["llmft train, cache filled: start to first optimizer step, s", f"{step_second:.1f}", ""],
        ["llmft train, 2 ranks (torchrun), empty cache: to first step, s", f"{step_two:.1f}", ""],
        [
            "  CPU of the whole command, 2 ranks / 1 rank",
            f"{cpu_two / cpu_first:.2f}",
            f"{cpu_two:.0f} s / {cpu_first:.0f} s (tokenizing: once)",
        ],
        ["llmft train, 2 ranks, cache filled: to first step, s", f"{step_two_second:.1f}", ""],
        ["Arrow cache size, MiB", f"{first['bytes'] / mb:.0f}", f"{first['bytes'] / first['tokens']:.1f} B/token"],
        [
            "peak RSS of a rank that read every row, above imports, MiB",
            f"{rss_over / mb:.0f}",
            f"cache map {second['cache_rss'] / mb:.0f}, anonymous {second['anon'] / mb:.1f}; "
            f"{second['peak_rss'] / mb:.0f} in all",
        ],
        ["  ratio RSS / cache size", f"{rss_over / first['bytes']:.2f}", ""],
        [
            "peak RSS of the process that built the entry, above imports, MiB",
            f"{build_over / mb:.0f}",
            f"{build_over / first['bytes']:.2f}x the cache (the tokenizing workers are other processes)",
        ],
        ["chat, assistant-only: 2 turns, ms/record", f"{per2 * 1e3:.3f}", ""],
        ["chat, assistant-only: 12 turns, ms/record", f"{per12 * 1e3:.3f}", ""],
        ["  ratio 12 / 2 turns (6x the tokens)", f"{per12 / per2:.2f}", ""],
    ]
    print(common.table(["measure", "value", "also"], rows))


if __name__ == "__main__":
    main()
