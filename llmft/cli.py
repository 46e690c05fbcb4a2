"""Command line: argument parsing only, one function per subcommand.

Heavy imports (torch, deepspeed, transformers) happen inside the subcommands
that need them, so ``llmft compile`` and ``--help`` start instantly.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from llmft.errors import Problem, UserError
from llmft.job.malloc import use_mmap_for_large_blocks
from llmft.stop import Stopped

# The commands that load a model: their host RAM is what docs/benchmarks.md measures.
HEAVY = ("train", "export", "verify")

EXAMPLES = {
    "compile": "llmft compile configs/llama3-8b-lora-fsdp-8gpu.yaml --nproc-per-node 8 --out compiled/\n"
    "  llmft compile configs/tiny-cpu.yaml batch.global_batch_size=16 --nproc-per-node 2",
    "train": "llmft train configs/quickstart.yaml\n"
    "  torchrun --nproc_per_node 2 -m llmft train configs/tiny-cpu.yaml distributed.engine=fsdp\n"
    "  llmft train compiled/            # a directory written by llmft compile",
    "prepare": "llmft prepare configs/quickstart.yaml\n"
    "  llmft prepare recipe.yaml data.cache_dir=/shared/llmft-cache data.num_proc=32   # then train on GPUs",
    "export": "llmft export runs/quickstart --out exported/\n"
    "  llmft export runs/qlora/checkpoints/step-100 --merge-lora --out merged/\n"
    "  llmft export runs/qlora --push-to-hub my-org/my-qlora-adapter",
    "plot": "llmft plot runs/quickstart            # writes runs/quickstart/metrics.png",
    "runs": "llmft runs runs/micro4 runs/micro1-acc4 runs/fsdp-2gpu --out compare.png",
    "plan": "llmft plan configs/llama3-8b-qlora-1gpu.yaml distributed.gpu_memory_gb=24",
    "verify": "llmft verify configs/tiny-cpu.yaml batch.micro_batch_size=2",
    "rollout-server": "llmft rollout-server recipe.yaml --port 8000   # then train with rollout.vllm.mode=server\n"
    "  CUDA_VISIBLE_DEVICES=7 llmft rollout-server recipe.yaml --host 0.0.0.0 --port 8000\n"
    "  CUDA_VISIBLE_DEVICES=6,7 torchrun --nproc_per_node 2 -m llmft rollout-server recipe.yaml "
    "rollout.vllm.tensor_parallel_size=2",
}


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML file, or a directory written by `llmft compile`")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optim.lr=1e-4")


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", type=int, default=None, help="nodes (default: distributed.nnodes)")
    p.add_argument(
        "--nproc-per-node", type=int, default=None, help="processes per node (default: distributed.nproc_per_node)"
    )


def cmd_compile(args: argparse.Namespace) -> int:
    from llmft.plan.compile import compile_recipe
    from llmft.plan.resolve import load_plan

    plan = load_plan(args.recipe, args.overrides, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node)
    out = Path(args.out) if args.out else Path(plan.recipe.run.output_dir) / "compiled"
    try:
        print(compile_recipe(plan, out))
    except OSError as e:  # --out is a file, too long a name, a read-only or full disk
        where = e.filename or out
        raise UserError(
            Problem(str(where), f"cannot be written ({e.strerror or e})", "Choose another --out directory.")
        ) from None
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from llmft.job.dist import leave_process, read_env
    from llmft.training.train import train

    if read_env().world_size == 1:
        return train(args.recipe, args.overrides)
    # A rank of torchrun, the deepspeed launcher or srun leaves without the interpreter's teardown
    # whatever the outcome (leave_process), a user error or a crash included: its messages first.
    try:
        code = _reported(args, lambda: train(args.recipe, args.overrides))
    except BaseException:  # a crash: the traceback, then the same exit
        traceback.print_exc()
        code = 1
    leave_process(code)


def cmd_prepare(args: argparse.Namespace) -> int:
    from llmft.data.prepare import prepare

    print(prepare(args.recipe, args.overrides))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from llmft.export.export import export

    out = export(args.checkpoint, args.out, merge_lora=args.merge_lora, trust_remote_code=args.trust_remote_code)
    print(f"exported to {out}")
    from llmft.checkpoint import resolve_checkpoint
    from llmft.metrics.trackers import record_export

    record_export(resolve_checkpoint(args.checkpoint), out)  # the export path on the tracked run
    if args.push_to_hub:
        from llmft.export.modelcard import push_to_hub

        print(f"pushed to {push_to_hub(out, args.push_to_hub, private=args.private)}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from llmft.metrics.plot import plot_run

    print(f"wrote {plot_run(args.run_dir, args.out)}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from llmft.metrics.plot import compare_runs

    labels = args.labels.split(",") if args.labels else None
    png, table = compare_runs(args.run_dirs, args.out, labels)
    print(table)
    print(f"wrote {png}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from llmft.job.gpu import gpu_memory_gb
    from llmft.plan.report import plan_command

    print(
        plan_command(
            args.recipe,
            args.overrides,
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            measure_gpu=gpu_memory_gb,
        )
    )
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from llmft.training.verify import verify

    return verify(args.recipe, args.overrides, tolerance=args.tolerance, samples=args.samples)


def cmd_rollout_server(args: argparse.Namespace) -> int:
    from llmft.job.dist import timeout_s
    from llmft.model.vllm_server import serve
    from llmft.plan.vllm import vllm_problem
    from llmft.recipe.load import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)  # the model, rollout.vllm, peft; not the rewards
    missing = vllm_problem()
    if missing is not None:
        raise UserError(missing)
    serve(recipe, args.host, args.port, timeout_s(recipe.distributed), ready=lambda s: print(s, flush=True))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmft",
        description="Fine-tune LLMs from one recipe: exact gradient accumulation, DeepSpeed/FSDP2 configs "
        "that agree, checkpoints on accumulation boundaries.",
        epilog="example:\n  llmft train configs/quickstart.yaml\n\nRun `llmft COMMAND --help` for each command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from llmft import __version__

    parser.add_argument("--version", action="version", version=f"llmft {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, helptext: str, fn) -> argparse.ArgumentParser:
        p = sub.add_parser(
            name,
            help=helptext,
            description=helptext,
            epilog="example:\n  " + EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(fn=fn)
        return p

    p = add(
        "compile",
        "resolve a recipe, solve the batch, write DeepSpeed/FSDP/accelerate configs and launch scripts",
        cmd_compile,
    )
    _recipe_args(p)
    _layout_args(p)
    p.add_argument("--out", default=None, help="output directory (default: <run.output_dir>/compiled)")

    p = add("train", "train (one process, torchrun, the deepspeed launcher or srun)", cmd_train)
    _recipe_args(p)

    p = add("prepare", "tokenize and pack the recipe's data into the cache ahead of training", cmd_prepare)
    _recipe_args(p)

    p = add("export", "write a Hugging Face model or PEFT adapter directory from a checkpoint", cmd_export)
    p.add_argument("checkpoint", help="checkpoints/step-N, checkpoints/latest, or a run directory (its latest)")
    p.add_argument("--out", default=None, help="output directory (default: <run>/exported/step-N)")
    p.add_argument("--merge-lora", action="store_true", help="merge LoRA adapters into the base model")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run model code shipped with the base model or checkpoint (only from here: a checkpoint's own "
        "recipe cannot turn it on); read that code first",
    )
    p.add_argument(
        "--push-to-hub",
        default=None,
        metavar="REPO",
        help="upload the export (model card included) to this Hugging Face hub repo (needs `hf auth login`)",
    )
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")

    p = add("plot", "plot train/eval loss, lr and eval metrics of a run to a PNG", cmd_plot)
    p.add_argument("run_dir", help="a run directory holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: <run_dir>/metrics.png)")

    p = add(
        "runs",
        "compare several runs: train/eval loss and lr overlaid in one PNG, and how far each loss curve is "
        "from the first run's",
        cmd_runs,
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    p.add_argument("--out", default="runs.png", help="PNG path (default: runs.png)")
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per run (default: dir names)")

    p = add("plan", "estimate memory per GPU and pick the micro-batch", cmd_plan)
    _recipe_args(p)
    _layout_args(p)

    p = add(
        "verify", "check that micro x accumulation gives the same gradient as one big batch on your data", cmd_verify
    )
    _recipe_args(p)
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest allowed relative difference")
    p.add_argument("--samples", type=int, default=None, help="sequences to use (default: one global batch)")

    p = add(
        "rollout-server",
        "serve the recipe's model in vLLM for online RL's rollout.vllm.mode=server (the trainer syncs its weights in)",
        cmd_rollout_server,
    )
    _recipe_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0: all)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may also follow options (`llmft plan R --nproc-per-node 8 k=v`): argparse leaves
    # them over, and they join the KEY=VALUE list.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    if args.command in HEAVY:
        use_mmap_for_large_blocks()  # before torch allocates anything; see llmft/job/malloc.py
    return _reported(args, lambda: int(args.fn(args) or 0))


def _reported(args: argparse.Namespace, command: Callable[[], int]) -> int:
    """Run ``command``; a user error, an interrupt or a stop request becomes its one message and exit code."""
    try:
        return command()
    except UserError as e:
        print(f"llmft {args.command}: error: {e.render()}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"llmft {args.command}: interrupted", file=sys.stderr)
        return 130
    except Stopped as e:  # the stop request's handler logged the one line it gets
        return e.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
