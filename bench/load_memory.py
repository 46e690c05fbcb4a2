"""Host RAM per rank of a whole training run on 2 ranks (load, two steps, a checkpoint after
each), and of a merged export, phase by phase.

A Llama of a few hundred million parameters is saved in fp32 in ~200 MB safetensors files
(B = their bytes on disk). Each case is one ``llmft`` command as users run it (2 ranks under
torchrun on gloo, ``llmft train``, micro-batch 1, 64 tokens, LoRA r 8; or one ``llmft export
--merge-lora`` process), without ``MALLOC_MMAP_THRESHOLD_`` (removed from the environment if
set): llmft sets glibc's mmap threshold itself (llmft/job/malloc.py). In each process a thread
samples ``RssAnon`` and ``RssFile`` (/proc/self/status) every 5 ms; ``VmHWM`` is not used, as it
mixes in the mapped safetensors pages the ranks share through the page cache. Marks: engine
built (model loaded and sharded), set up, each step, each checkpoint, end; at each, the
anonymous and file-backed memory and the peak of each since the previous mark.

The same command on a tiny pretrained model (the same code path, a few MB of weights) gives the
baseline: interpreter, torch, DeepSpeed, transformers and their buffers. Measured = the larger
rank's peak anonymous memory over the whole command minus the baseline's; beside it the
planner's host RAM per rank for this CPU run (``plan.memory.host_memory_per_rank``, the line
``llmft plan`` prints). Also "by phase": the largest of each phase's peak less the baseline's peak
in the same phase. The baseline's own peak is not its step's (rank 0 draws metrics.png at the
end, and matplotlib stays), so "measured" takes off more than the step held; "by phase" does
not. ``--phases`` adds the per-phase table of every rank, with each step's wall time
(``step_time_s`` of metrics.jsonl) and the rank's CPU time over it (less sensitive to other jobs
on the machine); ``--steps N`` runs N steps instead of two. The data cache is built
once before the measured commands (``llmft prepare``), as a multi-node job is run.

``--against REV`` runs every command a second time with the llmft of git revision ``REV`` of
this repository (unpacked with ``git archive``), the two alternating, so that a change is
measured side by side with what it changes: memory, and the median step time (2nd step on).

    python bench/load_memory.py                   # 218 M parameters, B ~ 870 MB
    python bench/load_memory.py --layers 4 --phases --repeat 1   # smaller and faster
    python bench/load_memory.py --against main --steps 4 --phases --cases "FSDP2 + LoRA"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import common

MB = 10**6
CASES = {  # name: (ranks, recipe overrides, goal as a fraction of B)
    "FSDP2 + LoRA": (2, ["distributed.engine=fsdp"], 0.6),
    "FSDP2 + QLoRA": (2, ["distributed.engine=fsdp", "model.quantization={bits: 4}"], 0.25),
    "ZeRO-3 + LoRA": (2, ["distributed.engine=deepspeed", "distributed.zero_stage=3"], 0.6),
    "ZeRO-3 + QLoRA": (
        2,
        ["distributed.engine=deepspeed", "distributed.zero_stage=3", "model.quantization={bits: 4}"],
        0.25,
    ),
}
EXPORT = "merged export"


def _status() -> dict[str, int]:
    """RssAnon and RssFile of this process, bytes (``VmHWM`` mixes the two: not used)."""
    got = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            got[key] = int(value.split()[0]) * 1024
    return got


class Trace:
    """Anonymous and file-backed resident memory of this process, phase by phase: at each mark the
    current values and the peak of each since the previous mark (a thread samples every 5 ms)."""

    def __init__(self) -> None:
        import threading

        self.phases: list[dict] = []
        self.lock = threading.Lock()
        self.peak = _status()
        self.done = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self.done.wait(0.005):
            now = _status()
            with self.lock:
                self.peak = {k: max(self.peak[k], now[k]) for k in now}

    def mark(self, phase: str, **extra) -> None:
        import time

        now = _status()
        with self.lock:
            peak = {k: max(self.peak[k], now[k]) for k in now}
            self.peak = now
        self.phases.append(
            {
                "phase": phase,
                "anon": now["RssAnon"],
                "file": now["RssFile"],
                "peak_anon": peak["RssAnon"],
                "peak_file": peak["RssFile"],
                "cpu_s": time.process_time(),
                **extra,
            }
        )


def _instrument(trace: Trace) -> None:
    """Mark the phases of ``llmft train``: the engine built (model loaded and sharded), the run set
    up, each step, each checkpoint."""
    from llmft.training import run

    build, setup, ckpt, loop = run.build_engine, run.Run.setup, run.Run.checkpoint, run.train_loop

    def build_engine(*a, **k):
        engine = build(*a, **k)
        trace.mark("engine built")
        return engine

    def setup_run(self):
        got = setup(self)
        trace.mark("set up")
        return got

    def checkpoint(self, st):
        ckpt(self, st)
        trace.mark(f"checkpoint {st.step}")

    def train_loop(*a, **k):
        hooks = a[8]
        log_train = hooks.log_train

        def logged(row):
            log_train(row)
            trace.mark(f"step {row['step']}", step_time_s=row["step_time_s"])

        hooks.log_train = logged
        return loop(*a, **k)

    run.build_engine, run.Run.setup, run.Run.checkpoint, run.train_loop = (
        build_engine,
        setup_run,
        checkpoint,
        train_loop,
    )


def worker(out: str, code: str, argv: list[str]) -> None:
    """One llmft command in this process, with the llmft in ``code``; its memory phase by phase to
    ``out/rank-N.json``."""
    sys.path.insert(0, code)  # before common's repository root
    from llmft.cli import main
    from llmft.job import dist

    trace = Trace()
    trace.mark("start")
    _instrument(trace)

    def report(code: int) -> None:
        trace.mark("end")
        trace.done.set()
        rank = os.environ.get("RANK", "0")
        Path(out, f"rank-{rank}.json").write_text(json.dumps({"code": code, "phases": trace.phases}))

    leave = dist.leave_process

    def leave_process(code: int):  # a rank of a multi-rank run leaves through os._exit
        report(code)
        leave(code)

    dist.leave_process = leave_process
    report(main(argv))


def _save_model(path: Path, config: dict, shard: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.data.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    model.save_pretrained(path, max_shard_size=shard)
    byte_tokenizer().save_pretrained(path)
    del model
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _recipe(work: Path, name: str, model_dir: Path, data: Path, steps: int = 2) -> Path:
    """``steps`` steps (two by default), a checkpoint after each (adapter weights only, no optimizer state)."""
    recipe = common.base_recipe(work / name / "run", data, seq=64, micro=1, global_batch=2, steps=steps)
    recipe["model"] = {"name_or_path": str(model_dir), "dtype": "fp32", "attn_implementation": "sdpa"}
    recipe["peft"] = {"method": "lora", "r": 8, "alpha": 16}
    recipe["checkpoint"].update(every_steps=1, keep_last=2, save_optimizer=False)
    # The data cache is built once before the measured commands (``llmft prepare``), as a
    # multi-node job is run: a rank that builds it imports datasets and pyarrow (~50 MB of
    # anonymous memory that stays), and which rank does is a race.
    recipe["data"]["cache_dir"] = str(work / "data-cache")
    return common.write_recipe(work / name / "recipe.yaml", recipe)


def _prepare(recipe: Path, overrides: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(common.ROOT)}
    cmd = [sys.executable, "-m", "llmft", "prepare", str(recipe), *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=common.ROOT)
    if done.returncode != 0:
        raise SystemExit(f"llmft prepare {recipe} failed:\n{done.stderr[-4000:]}")


def _run(out: Path, ranks: int, argv: list[str], code: Path = common.ROOT) -> list[list[dict]]:
    """Each rank's phases (``Trace``) for one command, run with the llmft in ``code``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}  # what users have
    env["PYTHONPATH"] = str(code)
    entry = [str(Path(__file__).resolve()), "--worker", str(out), "--code", str(code), "--"]
    if ranks == 1:
        cmd = [sys.executable, *entry, *argv]
    else:
        cmd = [*common.torchrun(ranks), *entry, *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=common.ROOT, timeout=3600)
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank-*.json"))]
    if done.returncode != 0 or len(reports) != ranks or any(r["code"] for r in reports):
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}, {len(reports)} reports):\n{done.stderr[-4000:]}")
    return [r["phases"] for r in reports]


def _step_seconds(run_dir: Path) -> list[float]:
    """``step_time_s`` of each train row of the run's metrics.jsonl, the first step left out (it
    also records DeepSpeed's fetch trace and warms the allocator)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows if r.get("split") == "train" and r["step"] > 1]


def _against(rev: str, work: Path) -> Path:
    """The llmft of git revision ``rev`` of this repository, unpacked under ``work``."""
    tree = work / f"code-{rev}"
    tree.mkdir()
    archive = subprocess.run(["git", "archive", rev], cwd=common.ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _peak(ranks: list[list[dict]]) -> int:
    """The largest rank's peak anonymous memory over the whole command."""
    return max(max(p["peak_anon"] for p in phases) for phases in ranks)


def _by_phase(big: list[list[dict]], tiny: list[list[dict]]) -> int:
    """The largest peak in a phase less the tiny run's peak in the same phase, over ranks and phases."""
    return max(
        p["peak_anon"] - t["peak_anon"]
        for phases, base in zip(big, tiny, strict=True)
        for p, t in zip(phases, base, strict=False)
    )


def _lowest(runs: list[list[list[dict]]]) -> list[list[dict]]:
    return min(runs, key=_peak)


def _phase_rows(name: str, big: list[list[dict]], tiny: list[list[dict]], b: int) -> list[list]:
    """Per phase and rank: anonymous memory at the mark and its peak during the phase, less the
    tiny model's, in MB and x B; file pages at the mark (the tiny model's not taken off)."""
    rows = []
    for rank, (phases, base) in enumerate(zip(big, tiny, strict=True)):
        for before, p, t in zip([phases[0], *phases], phases, base, strict=False):
            anon, peak = p["anon"] - t["anon"], p["peak_anon"] - t["peak_anon"]
            times = [p["step_time_s"], p["cpu_s"] - before["cpu_s"]] if "step_time_s" in p else ["-", "-"]
            rows.append([name, rank, p["phase"], anon / MB, peak / MB, peak / b, p["file"] / MB, *times])
    return rows


def _planned(recipe: Path, ranks: int, overrides: list[str]) -> int:
    """The planner's host RAM per rank (``llmft plan``'s host line, this CPU run's device being the host)."""
    from llmft.plan.memory import host_memory_per_rank
    from llmft.plan.resolve import load_plan

    plan = load_plan(recipe, overrides, nnodes=1, nproc_per_node=ranks)
    return host_memory_per_rank(plan, device_is_host=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--code", default=str(common.ROOT), help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    # A small vocabulary keeps the embedding and head (which FSDP2's root gathers whole for the
    # step) near the share they have in a 70B model (3 %), instead of 40 % of a 32k-vocab toy.
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--shard", default="200MB")
    parser.add_argument("--cases", nargs="*", default=[*CASES, EXPORT])
    # The allocator's arenas and gloo's buffers move a rank's peak by ~20 MB from run to run: the
    # lower of two runs of each command is reported.
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--phases", action="store_true", help="print the memory of every phase and rank")
    parser.add_argument("--steps", type=int, default=2, help="training steps of each run (step time: the 2nd on)")
    parser.add_argument(
        "--against", metavar="REV", help="also run every command with the llmft of git revision REV, alternating"
    )
    args, rest = parser.parse_known_args()
    if args.worker:
        worker(args.worker, args.code, rest[1:] if rest[:1] == ["--"] else rest)
        return
    work = common.scratch_dir("load-memory")
    codes = {"now": common.ROOT} | ({args.against: _against(args.against, work)} if args.against else {})
    data = common.write_text_records(work / "train.jsonl", [200] * 16)
    big = {
        **common.BENCH_LLAMA,
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": args.hidden // 64,
        "intermediate_size": args.hidden * 11 // 4,
        "vocab_size": args.vocab,
    }
    tiny = {**common.BENCH_LLAMA, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
    b = _save_model(work / "big", big, args.shard)
    _save_model(work / "tiny", tiny, args.shard)
    print(common.machine())
    print(f"model: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, fp32; B = {b / MB:.0f} MB")
    rows, phase_rows = [], []
    for name in args.cases:
        ranks, overrides, goal = CASES.get(name, CASES["FSDP2 + LoRA"])
        slug = name.replace(" ", "").replace("+", "-")
        traced: dict[tuple[str, str], list[list[dict]]] = {}
        seconds: dict[str, list[float]] = {code: [] for code in codes}
        for size in ("tiny", "big"):
            recipe = _recipe(work, f"{slug}-{size}", work / size, data, args.steps)
            _prepare(recipe, overrides)
            if name == EXPORT:  # the merged export of a FSDP2 LoRA run, one process
                _run(work / f"{slug}-{size}" / "train", ranks, ["train", str(recipe), *overrides])
                ranks, goal = 1, 0.5
                argv = ["export", str(work / f"{slug}-{size}" / "run"), "--merge-lora", "--out"]
            else:
                argv = ["train", str(recipe), *overrides, "run.overwrite=true"]
            runs: dict[str, list] = {code: [] for code in codes}
            for i in range(args.repeat):
                for code, tree in codes.items():  # alternating: other load on the machine hits both alike
                    out = work / f"{slug}-{size}" / f"rss-{code}-{i}"
                    merged = [str(out / "merged")] if name == EXPORT else []  # export: a new --out each time
                    runs[code].append(_run(out, ranks, [*argv, *merged], tree))
                    if size == "big" and name != EXPORT:
                        seconds[code] += _step_seconds(work / f"{slug}-{size}" / "run")
            for code in codes:
                traced[code, size] = _lowest(runs[code])
        host = None if name == EXPORT else _planned(_recipe(work, f"{slug}-big", work / "big", data), ranks, overrides)
        for code in codes:
            extra = _peak(traced[code, "big"]) - _peak(traced[code, "tiny"])
            phased = _by_phase(traced[code, "big"], traced[code, "tiny"])
            step = statistics.median(seconds[code]) if seconds[code] else None
            rows.append(
                [name, code, ranks, extra / MB, extra / b, goal]
                + ([phased / MB] + ([f"{phased / host:.2f}"] if host and code == "now" else ["-"]))
                + ([host / MB, extra / host] if host and code == "now" else ["-", "-"])
                + [step if step is not None else "-"]
            )
            phase_rows += _phase_rows(f"{name} ({code})", traced[code, "big"], traced[code, "tiny"], b)
            print(
                " | ".join(str(round(c, 3) if isinstance(c, float) else c) for c in rows[-1]), flush=True
            )  # as it comes
    header = [
        "case",
        "code",
        "ranks",
        "peak anon - tiny MB",
        "x B",
        "goal x B",
        "by phase MB",
        "by phase / planner",
        "planner host MB",
        "measured / planner",
    ]
    print(common.table([*header, "step s (median, 2nd step on)"], rows))
    if args.phases:
        header = [
            "case",
            "rank",
            "after",
            "anon - tiny MB",
            "peak in phase - tiny MB",
            "x B",
            "file pages MB",
            "step s",
            "CPU s",
        ]
        print(common.table(header, phase_rows))


if __name__ == "__main__":
    main()
