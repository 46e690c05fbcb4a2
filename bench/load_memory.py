"""Host RAM of loading and training a pretrained model on 2 ranks, and of a merged export.

A Llama of a few hundred million parameters is saved in fp32 in ~200 MB safetensors files
(B = their bytes on disk). Each case is one ``llmft`` command (2 ranks under torchrun on gloo,
1 training step, micro-batch 1, 64 tokens; or one ``llmft export --merge-lora`` process); each
process reports its peak resident set (``VmHWM``: anonymous memory and touched file pages) twice:
when the model is loaded (built, sharded, restored: ``Run.fit`` starts) and when the command ends.
The same command on a tiny pretrained model (the same code path, a few MB of weights) gives the
baseline: interpreter, torch, DeepSpeed, transformers and their buffers. Measured = peak minus
that baseline, per rank (the larger of the two ranks).

- "loaded" is the host RAM of loading, what the goals in docs/benchmarks.md bound (on a GPU the weights go
  to the device from there); beside it the planner's host RAM per rank
  (``plan.memory.host_memory_per_node`` / ranks per node).
- "whole run" adds the training step. On this CPU the step's working set (gathered layers,
  activations, gradients, optimizer state), which a GPU holds in device memory, is host memory
  too; beside it the larger of the planner's host RAM and its per-GPU step estimate
  (``estimate_memory``, less the CUDA context).

The commands run as users run them: without ``MALLOC_MMAP_THRESHOLD_`` (removed from the
environment if set). llmft fixes glibc's mmap threshold itself (llmft/malloc.py).

    python bench/load_memory.py                   # 218 M parameters, B ~ 870 MB
    python bench/load_memory.py --layers 4        # smaller and faster
"""

from __future__ import annotations

import argparse
import json
import os
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


def _vmhwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


def worker(out: str, argv: list[str]) -> None:
    """One llmft command in this process; its peak RSS to ``out/rank-N.json`` when it is done."""
    from llmft import run
    from llmft.cli import main

    loaded = {}
    fit = run.Run.fit

    def fit_after_load(self):  # the model is built, sharded and restored: the loading peak
        loaded["peak"] = _vmhwm()
        return fit(self)

    run.Run.fit = fit_after_load
    code = main(argv)
    rank = os.environ.get("RANK", "0")
    report = {"code": code, "peak": _vmhwm(), "load": loaded.get("peak", 0)}
    Path(out, f"rank-{rank}.json").write_text(json.dumps(report))


def _save_model(path: Path, config: dict, shard: str) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    model.save_pretrained(path, max_shard_size=shard)
    byte_tokenizer().save_pretrained(path)
    del model
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def _recipe(work: Path, name: str, model_dir: Path, data: Path) -> Path:
    recipe = common.base_recipe(work / name / "run", data, seq=64, micro=1, global_batch=2, steps=1)
    recipe["model"] = {"name_or_path": str(model_dir), "dtype": "fp32", "attn_implementation": "sdpa"}
    recipe["peft"] = {"method": "lora", "r": 8, "alpha": 16}
    recipe["checkpoint"]["save_optimizer"] = False
    return common.write_recipe(work / name / "recipe.yaml", recipe)


def _run(out: Path, ranks: int, argv: list[str]) -> dict[str, int]:
    """Peak RSS of the command's largest rank: over the whole command, and when loading was done."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}  # what users have
    env["PYTHONPATH"] = str(common.ROOT)
    entry = [str(Path(__file__).resolve()), "--worker", str(out), "--"]
    if ranks == 1:
        cmd = [sys.executable, *entry, *argv]
    else:
        cmd = [*common.torchrun(ranks), *entry, *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=common.ROOT, timeout=3600)
    reports = [json.loads(f.read_text()) for f in sorted(out.glob("rank-*.json"))]
    if done.returncode != 0 or len(reports) != ranks or any(r["code"] for r in reports):
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-4000:]}")
    return {k: max(r[k] for r in reports) for k in ("peak", "load")}


def _planned(recipe: Path, ranks: int, overrides: list[str]) -> tuple[int, int]:
    """The planner's host RAM per rank for loading, and its estimate of the training step's memory
    per rank (the GPU's, less the CUDA context: on a CPU run it is host RAM too)."""
    from llmft.plan.memory import CUDA_CONTEXT_BYTES, estimate_memory, host_memory_per_node
    from llmft.plan.resolve import load_plan

    plan = load_plan(recipe, overrides, nnodes=1, nproc_per_node=ranks)
    host = host_memory_per_node(plan, device_is_host=True)  # this CPU run's device is the host
    return host // ranks, estimate_memory(plan).total - CUDA_CONTEXT_BYTES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    # A small vocabulary keeps the embedding and head (which FSDP2's root gathers whole for the
    # step) near the share they have in a 70B model (3 %), instead of 40 % of a 32k-vocab toy.
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--shard", default="200MB")
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    # The allocator's arenas and gloo's buffers move a rank's peak by ~20 MB from run to run: the
    # lower of two runs of each command is reported.
    parser.add_argument("--repeat", type=int, default=2)
    args, rest = parser.parse_known_args()
    if args.worker:
        worker(args.worker, rest[1:] if rest[:1] == ["--"] else rest)
        return
    work = common.scratch_dir("load-memory")
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
    rows = []
    for name in args.cases:
        ranks, overrides, goal = CASES[name]
        slug = name.replace(" ", "").replace("+", "-")
        peaks = {}
        for size in ("tiny", "big"):
            recipe = _recipe(work, f"{slug}-{size}", work / size, data)
            argv = ["train", str(recipe), *overrides, "run.overwrite=true"]
            runs = [_run(work / f"{slug}-{size}" / f"rss-{i}", ranks, argv) for i in range(args.repeat)]
            peaks[size] = {k: min(r[k] for r in runs) for k in ("peak", "load")}
        host, step = _planned(_recipe(work, f"{slug}-big", work / "big", data), ranks, overrides)
        extra = peaks["big"]["peak"] - peaks["tiny"]["peak"]
        load = peaks["big"]["load"] - peaks["tiny"]["load"]
        whole = max(host, step)  # on a CPU the step's memory is host memory too
        rows.append(
            [
                name,
                ranks,
                load / MB,
                load / b,
                goal,
                host / MB,
                load / host,
                extra / MB,
                extra / b,
                whole / MB,
                extra / whole,
            ]
        )
        if name == "FSDP2 + LoRA":  # the merged export of this run, one process
            exports = {}
            for size in ("tiny", "big"):
                run = work / f"{slug}-{size}" / "run"
                out = work / f"{slug}-{size}" / "merged"
                argv = ["export", str(run), "--merge-lora", "--out", str(out)]
                exports[size] = _run(work / f"{slug}-{size}" / "rss-export", 1, argv)
            extra = exports["big"]["peak"] - exports["tiny"]["peak"]
            rows.append(
                ["merged export of the FSDP2 LoRA run", 1, "-", "-", 0.5, "-", "-", extra / MB, extra / b, "-", "-"]
            )
    header = [
        "case",
        "ranks",
        "loaded - tiny MB",
        "x B",
        "goal x B",
        "planner host MB",
        "loaded / planner",
        "whole run - tiny MB",
        "x B",
        "planner step MB",
        "whole / planner",
    ]
    print(common.table(header, rows))


if __name__ == "__main__":
    main()
