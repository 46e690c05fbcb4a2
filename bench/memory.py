"""Peak memory against micro-batch size at a fixed global batch, per engine, with
``llmft.plan.memory.estimate_memory`` beside it.

What is measured, on CPU: the peak resident set size (Linux ``VmHWM``) of rank 0 while the
training loop runs, minus its resident size just before the engine is built (data loaded,
every module the build needs already imported). That is every byte the engine and the loop
add: weights, the engine's buffers (DDP buckets, DeepSpeed's flat partitions), gradients,
optimizer state, saved activations, logits, allocator slack. glibc would keep freed
activations mapped and hide the drop between micro-steps, so each run gets
``MALLOC_MMAP_THRESHOLD_=65536``: every tensor over 64 KiB is its own mapping, returned to the
kernel when freed, so RSS follows the live tensors. The peak is reset
(``/proc/self/clear_refs``) when the loop starts, so transient copies made while building the
model (FSDP builds whole, then shards) do not count; what the engine still holds when the loop
starts is shown in its own column.

The estimate printed beside it is ``estimate_memory``'s total without the CUDA context
(``CUDA_CONTEXT_BYTES``; no GPU here) and its activations + logits part. Step time is the
median ``step_time_s`` of the run's later steps relative to the largest micro-batch of the
same engine; the micro-batch sizes of one engine run at the same time, so they share the
machine's load alike (each process's peak RSS is its own).

    python bench/memory.py                        # single, ddp, fsdp, zero2 (~10 min at load 7)
    python bench/memory.py --engines single zero3 --micro 1 2 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import common

ENGINES = {
    "single": (1, ["distributed.engine=single"]),
    "ddp": (2, ["distributed.engine=ddp"]),
    "fsdp": (2, ["distributed.engine=fsdp"]),
    "zero2": (2, ["distributed.engine=deepspeed", "distributed.zero_stage=2"]),
    "zero3": (2, ["distributed.engine=deepspeed", "distributed.zero_stage=3"]),
}
MIB = 2**20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


# --- the worker: one training run, in this process (or one rank of torchrun) -----------------


def worker(recipe: str, overrides: list[str]) -> None:
    import time

    # Import everything the engine build would import lazily, so that its RSS is not counted.
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401

    import llmft.engines
    import llmft.engines.ddp  # noqa: F401
    import llmft.engines.fsdp  # noqa: F401
    import llmft.engines.single  # noqa: F401
    import llmft.model.build  # noqa: F401
    import llmft.model.meta  # noqa: F401
    from llmft.metrics import record as llmft_metrics
    from llmft.training import loop as llmft_loop
    from llmft.training import run as llmft_run
    from llmft.training import train as llmft_train

    if any("deepspeed" in o for o in overrides):
        import llmft.engines.deepspeed  # noqa: F401

    out: dict = {"cpu": []}
    original_build, original_loop = llmft.engines.build_engine, llmft_run.train_loop

    def build_engine(*args, **kwargs):
        out["rss_before_engine"] = _status("VmRSS")
        return original_build(*args, **kwargs)

    def train_loop(*args, **kwargs):
        out["rss_loop_start"] = _status("VmRSS")
        _reset_peak()
        state = original_loop(*args, **kwargs)
        out["peak"] = _status("VmHWM")
        return state

    original_write = llmft_metrics.Metrics.write

    def write(self, row):
        original_write(self, row)
        if row.get("split") == "train":
            out["cpu"].append(time.process_time())

    llmft.engines.build_engine = build_engine
    llmft_run.build_engine = build_engine  # run.py imported the name itself
    llmft_run.train_loop = train_loop
    llmft_loop.train_loop = train_loop
    llmft_metrics.Metrics.write = write
    assert llmft_train.train(recipe, overrides) == 0
    if int(os.environ.get("RANK", "0")) == 0:
        print("MEMORY " + json.dumps(out), flush=True)


# --- the driver ---------------------------------------------------------------------------------


def start_case(recipe: Path, engine: str, micro: int, out: Path) -> subprocess.Popen:
    nproc, overrides = ENGINES[engine]
    args = [__file__, "--worker", str(recipe), *overrides, f"batch.micro_batch_size={micro}", f"run.output_dir={out}"]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [*common.torchrun(nproc), *args]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(common.ROOT),
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        cmd, stdout=open(out / "stdout.txt", "w"), stderr=open(out / "stderr.txt", "w"), env=env, cwd=common.ROOT
    )


def finish_case(proc: subprocess.Popen, engine: str, micro: int, out: Path) -> dict:
    if proc.wait(timeout=900) != 0:
        raise SystemExit(f"{engine} micro {micro} failed:\n{(out / 'stderr.txt').read_text()[-4000:]}")
    lines = (out / "stdout.txt").read_text().splitlines()
    got = json.loads(next(ln for ln in lines if ln.startswith("MEMORY ")).split(" ", 1)[1])
    rows = common.train_rows(out)
    got["step_time"] = common.median([r["step_time_s"] for r in rows[1:]])
    cpu = got["cpu"]
    got["step_cpu"] = common.median([b - a for a, b in zip(cpu, cpu[1:], strict=False)])
    return got


def estimate(recipe: Path, engine: str, micro: int):
    from llmft.plan.memory import CUDA_CONTEXT_BYTES, estimate_memory
    from llmft.plan.resolve import load_plan

    nproc, overrides = ENGINES[engine]
    plan = load_plan(str(recipe), [*overrides, f"batch.micro_batch_size={micro}"], world_size=nproc)
    est = estimate_memory(plan)
    return est.total - CUDA_CONTEXT_BYTES, est.activations + est.logits


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["single", "ddp", "fsdp", "zero2"], choices=list(ENGINES))
    ap.add_argument("--micro", nargs="+", type=int, default=[1, 8], help="micro-batch sizes (per rank)")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    tmp = common.scratch_dir("llmft-bench-memory-")
    # Every record fills max_seq_len: the activations of a micro-batch are exactly micro x seq tokens.
    data = common.write_text_records(tmp / "train.jsonl", [args.seq - 2] * 256)
    recipe = common.base_recipe(
        tmp / "run", data, seq=args.seq, micro=1, global_batch=args.global_batch, steps=args.steps
    )
    recipe["data"]["train_on"] = "all"
    recipe["run"]["tensorboard"] = False
    recipe["batch"]["gradient_accumulation_steps"] = "auto"
    recipe_path = common.write_recipe(tmp / "recipe.yaml", recipe)

    rows = []
    for engine in args.engines:
        nproc = ENGINES[engine][0]
        # The micro-batch sizes of one engine run at the same time: side by side for the step-time
        # ratio (both see the same load), and each process's own peak RSS is unaffected.
        micros = [m for m in args.micro if args.global_batch % (m * nproc) == 0]
        procs = {m: start_case(recipe_path, engine, m, tmp / f"run-{engine}-{m}") for m in micros}
        results = {m: finish_case(proc, engine, m, tmp / f"run-{engine}-{m}") for m, proc in procs.items()}
        if not results:
            continue
        top = max(results)
        for micro, got in results.items():
            measured = got["peak"] - got["rss_before_engine"]
            est_total, est_act = estimate(recipe_path, engine, micro)
            rows.append(
                [
                    engine,
                    micro,
                    args.global_batch // (micro * nproc),
                    f"{measured / MIB:.1f}",
                    f"{est_total / MIB:.1f}",
                    f"{measured / est_total:.2f}",
                    f"{est_act / MIB:.1f}",
                    f"{(got['rss_loop_start'] - got['rss_before_engine']) / MIB:.1f}",
                    f"{got['step_time'] / results[top]['step_time']:.2f}",
                    f"{got['step_cpu'] / results[top]['step_cpu']:.2f}",
                ]
            )
    print(f"machine: {common.machine()}")
    print(
        f"model: llama hidden {common.BENCH_LLAMA['hidden_size']}, {common.BENCH_LLAMA['num_hidden_layers']} layers "
        f"(3.3 M parameters), fp32, sdpa, AdamW; seq {args.seq}, global batch {args.global_batch}; ddp/fsdp/zero: "
        f"2 ranks on gloo, rank 0 shown; {args.steps} steps per run\n"
    )
    header = [
        "engine",
        "micro",
        "accumulation",
        "measured peak MiB",
        "estimate MiB (no CUDA context)",
        "measured / estimate",
        "estimate: activations + logits MiB",
        "of which held before the loop MiB",
        "step time vs largest micro (wall)",
        "(CPU)",
    ]
    print(common.table(header, rows))


if __name__ == "__main__":
    main()
