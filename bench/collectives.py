"""Gradient reductions per optimizer step at accumulation 8, per engine, against a loop that syncs
on every micro-step.

Each case is one ``torchrun --nproc_per_node 2`` job on gloo (127.0.0.1) that runs ``llmft train``
in-process with every ``torch.distributed`` collective wrapped and counted (DeepSpeed's comm layer
calls into ``torch.distributed`` too, so ZeRO is counted by the same wrappers; DDP's C++ reducer
is routed through a Python comm hook that calls the default all-reduce). Each collective is
filed under the phase it ran in: the backward of a non-boundary micro-step, the backward of the
boundary micro-step, the engine's ``step`` (clip + optimizer), or elsewhere (forward, the loop's
scalar all-reduces of the token count and the loss). A *gradient reduction* is an all-reduce /
reduce-scatter / reduce of more than ``SCALAR_MAX`` elements; a *reduction-set* is what the
llmft run reduces in one step's boundary backward + ``step`` (DDP: its buckets; FSDP2: one
reduce-scatter per ``fully_shard`` group; ZeRO-1: its buckets).

ZeRO-2 and ZeRO-3 keep only their partition of the gradients, so DeepSpeed reduce-scatters in
every backward, boundary or not (github.com/deepspeedai/DeepSpeed/issues/2252): for them "llmft" and "no skip" are the
same run, and one reduction-set per optimizer step is not possible at accumulation > 1.

"no skip" is the same run with the engine told that every micro-step is a boundary (DDP without
``no_sync``, FSDP2 always ``set_requires_gradient_sync(True)``, DeepSpeed
``set_gradient_accumulation_boundary(True)``): what a loop that forgets the switch does.

    python bench/collectives.py                      # ddp, fsdp, zero1, zero2 (~10 min at load 8)
    python bench/collectives.py --engines ddp zero3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import common

REDUCTIONS = {
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "_reduce_scatter_base",
}
GATHERS = {"all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base", "broadcast"}
SCALAR_MAX = 16  # the loop's [tokens] / [loss, stop] and DeepSpeed's norm / overflow flags are smaller

ENGINES = {
    "ddp": ["distributed.engine=ddp"],
    "fsdp": ["distributed.engine=fsdp"],
    "zero1": ["distributed.engine=deepspeed", "distributed.zero_stage=1"],
    "zero2": ["distributed.engine=deepspeed", "distributed.zero_stage=2"],
    "zero3": ["distributed.engine=deepspeed", "distributed.zero_stage=3"],
}
TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 320,
    "max_position_embeddings": 256,
}


# --- the worker: runs under torchrun ------------------------------------------------------------


def _numel(args, kwargs) -> int:
    import torch

    def size(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel()
        if isinstance(x, (list, tuple)):
            return sum(size(y) for y in x)
        return 0

    return max([size(a) for a in args] + [size(v) for v in kwargs.values()] + [0])


def worker(recipe: str, engine: str, skip: bool, steps: int) -> None:
    import torch.distributed as dist

    from llmft.training import train as llmft_train

    phase = {"now": "other", "boundary": False}
    events: list[dict] = []  # one per collective: phase, op, elements

    for name in REDUCTIONS | GATHERS:
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args, _original=original, _name=name, **kwargs):
            events.append({"phase": phase["now"], "op": _name, "numel": _numel(args, kwargs)})
            return _original(*args, **kwargs)

        setattr(dist, name, counted)

    from llmft.engines import ddp as ddp_mod
    from llmft.engines import deepspeed as ds_mod
    from llmft.engines import fsdp as fsdp_mod

    cls = {"ddp": ddp_mod.DDPEngine, "fsdp": fsdp_mod.FSDPEngine}.get(engine, ds_mod.DeepSpeedEngineAdapter)
    if engine == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        init = cls.__init__

        def ddp_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            # The reducer's own all-reduce is C++; the default hook does the same through Python.
            self.model.register_comm_hook(None, default_hooks.allreduce_hook)

        cls.__init__ = ddp_init

    micro_step, backward, step = cls.micro_step, cls.backward, cls.step

    def wrapped_micro_step(self, boundary):
        phase["boundary"] = boundary
        return micro_step(self, True if not skip else boundary)

    def wrapped_backward(self, loss):
        phase["now"] = "boundary" if phase["boundary"] else "inside"
        try:
            backward(self, loss)
        finally:
            phase["now"] = "other"

    def wrapped_step(self):
        phase["now"] = "step"
        try:
            return step(self)
        finally:
            phase["now"] = "other"

    cls.micro_step, cls.backward, cls.step = wrapped_micro_step, wrapped_backward, wrapped_step
    events.clear()
    assert llmft_train.train(recipe, [f"train.max_steps={steps}"]) == 0
    if int(os.environ.get("RANK", "0")) == 0:
        print("COLLECTIVES " + json.dumps(events), flush=True)


# --- the driver ---------------------------------------------------------------------------------


def start_case(recipe: Path, engine: str, skip: bool, steps: int, out: Path) -> subprocess.Popen:
    cmd = [
        *common.torchrun(2),
        __file__,
        "--worker",
        str(recipe),
        engine,
        "skip" if skip else "noskip",
        str(steps),
        *ENGINES[engine],
        f"run.output_dir={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(common.ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        cmd, stdout=open(out / "stdout.txt", "w"), stderr=open(out / "stderr.txt", "w"), env=env, cwd=common.ROOT
    )


def finish_case(proc: subprocess.Popen, engine: str, skip: bool, out: Path) -> list[dict]:
    if proc.wait(timeout=900) != 0:
        raise SystemExit(
            f"{engine} ({'skip' if skip else 'no skip'}) failed:\n{(out / 'stderr.txt').read_text()[-4000:]}"
        )
    lines = (out / "stdout.txt").read_text().splitlines()
    return json.loads(next(ln for ln in lines if ln.startswith("COLLECTIVES ")).split(" ", 1)[1])


def summarise(events: list[dict], steps: int) -> dict:
    grad = [e for e in events if e["op"] in REDUCTIONS and e["numel"] > SCALAR_MAX]
    by_phase = Counter(e["phase"] for e in grad)
    return {
        "inside": by_phase["inside"] / steps,
        "boundary": by_phase["boundary"] / steps,
        "step": by_phase["step"] / steps,
        "other": by_phase["other"] / steps,
        "total": len(grad) / steps,
        "elements": sum(e["numel"] for e in grad) / steps,
        "ops": sorted({e["op"] for e in grad}),
        "gathers": sum(1 for e in events if e["op"] in GATHERS) / steps,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        recipe, engine, skip, steps, *overrides = sys.argv[2:]
        sys.argv = sys.argv[:1]
        _patch_overrides(overrides)
        worker(recipe, engine, skip == "skip", int(steps))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", nargs="+", default=["ddp", "fsdp", "zero1", "zero2"], choices=list(ENGINES))
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    args = ap.parse_args()

    tmp = common.scratch_dir("llmft-bench-collectives-")
    import random

    rng = random.Random(0)
    data = common.write_text_records(tmp / "train.jsonl", [rng.randint(8, 60) for _ in range(128)])
    recipe = common.base_recipe(tmp / "run", data, seq=64, micro=1, global_batch=16, steps=args.steps)
    recipe["model"]["config"] = dict(TINY)
    recipe["run"]["tensorboard"] = False
    recipe_path = common.write_recipe(tmp / "recipe.yaml", recipe)
    accumulation = 16 // (1 * 2)

    rows = []
    verdicts = []
    for engine in args.engines:
        # Counting does not depend on timing: both variants of an engine run at the same time.
        outs = {skip: tmp / f"run-{engine}-{'skip' if skip else 'noskip'}" for skip in (True, False)}
        procs = {skip: start_case(recipe_path, engine, skip, args.steps, outs[skip]) for skip in (True, False)}
        got = {skip: summarise(finish_case(procs[skip], engine, skip, outs[skip]), args.steps) for skip in procs}

        set_size = got[True]["boundary"] + got[True]["step"]
        for skip in (True, False):
            s = got[skip]
            per_step = s["inside"] + s["boundary"] + s["step"]
            rows.append(
                [
                    engine,
                    "llmft" if skip else "no skip",
                    f"{s['inside']:g}",
                    f"{s['boundary']:g}",
                    f"{s['step']:g}",
                    f"{s['other']:g}",
                    f"{s['elements']:,.0f}",
                    f"{per_step / set_size:g}" if set_size else "-",
                    f"{s['gathers']:g}",
                    ", ".join(s["ops"]),
                ]
            )
        ok = got[True]["inside"] == 0 and set_size > 0
        note = " (by design: partitioned gradients)" if engine in ("zero2", "zero3") and not ok else ""
        verdicts.append(f"{engine}: {'met' if ok else 'NOT met' + note}")

    print(f"machine: {common.machine()}")
    print(
        f"llama hidden {TINY['hidden_size']}, {TINY['num_hidden_layers']} layers; 2 ranks on gloo, micro 1 x "
        f"accumulation {accumulation} x dp 2 = global 16; {args.steps} optimizer steps per run; counts are per "
        f"optimizer step, rank 0 (every rank runs the same collectives)\n"
    )
    header = [
        "engine",
        "loop",
        "grad reductions on the 7 inner micro-steps",
        "on the boundary micro-step",
        "in step()",
        "elsewhere",
        "elements reduced",
        "reduction-sets per step",
        "gathers/broadcasts",
        "ops",
    ]
    print(common.table(header, rows))
    print("\ntarget 1 reduction-set per step (none inside the cycle) vs 8: " + "; ".join(verdicts))


def _patch_overrides(overrides: list[str]) -> None:
    """The worker's engine overrides ride on the ``train`` call: wrap llmft.training.train.train to add them."""
    from llmft.training import train as llmft_train

    original = llmft_train.train

    def train(recipe_path, extra):
        return original(recipe_path, [*overrides, *extra])

    llmft_train.train = train


if __name__ == "__main__":
    main()
