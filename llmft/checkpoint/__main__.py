"""``python -m llmft.checkpoint universal CHECKPOINT [--out DIR]``: checkpoint tools."""

from __future__ import annotations

import argparse
import sys

from llmft.errors import UserError
from llmft.plan.engines import load, universal_converter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmft.checkpoint",
        description="Checkpoint tools. universal: convert a DeepSpeed ZeRO 1-3 checkpoint to DeepSpeed's "
        "universal format (what a resume on another world size loads; done automatically on resume).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("universal", help="convert a ZeRO 1-3 checkpoint to DeepSpeed's universal format")
    p.add_argument("checkpoint", help="checkpoints/step-N, checkpoints/latest, or a run directory (its latest)")
    p.add_argument("--out", default=None, help="output directory (default: <step-N>/deepspeed_universal)")
    args = parser.parse_args(argv)
    try:
        # By the registry's dotted path: the engines import checkpoint.layout, so an import of
        # them here would make checkpoint/ and engines/ import each other.
        print(load(universal_converter())(args.checkpoint, args.out))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
