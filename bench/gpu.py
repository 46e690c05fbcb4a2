"""The one-command GPU proof: throughput, MFU, peak memory and the planner's estimate of
three single-GPU fine-tunes, each also run with every speed switch off, as one markdown table.

    python bench/gpu.py                       # on one CUDA GPU (bench/gpu.sh calls this)
    python bench/gpu.py --quick               # qlora-8b and full-1b, all on and compile off, and the peer row
    python bench/gpu.py --check               # CPU, tiny shapes, fp32, 2 steps: keeps the script working in CI
    python bench/gpu.py --cases full-1b --steps 20
    python bench/gpu.py --check --cases moe-qwen3   # the MoE case on CPU (--check runs it only when named)

Nothing is downloaded. The models are random weights in the shapes of meta-llama/Llama-3.1-8B and
meta-llama/Llama-3.2-1B (llmft/plan/shape.py ``KNOWN``, full 128,256-token vocabulary) and of
Qwen3-30B-A3B's layers (``moe-qwen3``, at half its depth and experts; 151,936-token vocabulary), written
once as a local model directory (config.json, safetensors shards generated tensor by tensor on the
GPU, llmft's byte tokenizer) under ``--out``/models and reused by later runs. Each run is a plain
``python -m llmft train`` on that directory, so set-up is a load (and, for QLoRA, quantization on
load) instead of a random init on the CPU.

| case | training |
| --- | --- |
| ``qlora-8b`` | NF4 + double quant, LoRA r=16 all-linear, AdamW, bf16, gradient checkpointing, micro 1 x acc 4 |
| ``lora-8b`` | bf16 base, LoRA r=16 all-linear, AdamW, gradient checkpointing, micro 1 x acc 4 |
| ``full-1b`` | full fine-tune, AdamW on fp32 master weights, bf16 autocast, micro 2 x acc 4 |
| ``long-8b`` | long context: bf16 base, LoRA r=16 all-linear, one packed row of ``--long-seq`` tokens (default 131,072) per step, gradient checkpointing, ``model.activation_offload``, ``model.tiled_mlp``, ``model.chunked_loss``, flash_attention_2 (varlen) or without flash-attn varlen_sdpa, ``distributed.sequence_parallel: 1`` |
| ``moe-qwen3`` | mixture of experts: a ``qwen3_moe`` of Qwen3-30B-A3B's layers at 24 layers and 64 experts, 8 per token (hidden 2048, expert FFN 768; 8.3B parameters, 2.0B active), bf16 base, LoRA r=16 all-linear and on the fused expert weights (``peft.target_experts``), AdamW, gradient checkpointing, micro 1 x acc 4; three variants of the router's balancing loss, ``moe.balance: global_batch`` (first), ``micro_batch`` and ``moe.aux_loss_coef: 0`` (``aux off``), compile and Liger off |

All rows are packed to ``--seq`` tokens (default 4096) from synthetic text with lognormal record
lengths (``long-8b``: to ``--long-seq``, ~200 records a row). Variants: ``all on`` (``model.compile``, ``model.liger_kernels`` where liger-kernel and
CUDA are there, flash_attention_2 where flash-attn is installed, else sdpa), then the same run with
each of those switches off. The table reads each run's metrics.jsonl: median tokens/s and MFU of
the steps after ``--warmup``, the largest ``peak_mem_gb`` (torch.cuda.max_memory_allocated),
``estimate_memory`` without its fixed CUDA-context term, the speed of the all-on run over that
variant, the largest |loss - all-on loss| over the steps (same data order and initial weights), and
the wall time of the whole process (set-up included). A run that fails (OOM, say) is a row that
says so, and the bench goes on. ``long-8b`` runs one variant, ``long``: its switches are the
memory ones; compile and Liger stay off (their fused MLP and the tiled MLP are two ways to do one
thing), and attention is flash_attention_2 where flash-attn is installed, else varlen_sdpa (torch's sdpa
per packed example, ``model.attn_implementation: auto``'s choice; sdpa would build a mask of seq^2 entries).
``moe-qwen3`` runs its own variants, the balancing loss's three modes (docs/moe.md), side by side
in the same columns: tokens/s, MFU (llmft's, which counts the active parameters: the K routed experts
a token uses) and peak memory; its first variant (``global_batch``) stands where "all on" does, so
"all-on speed / this" is the exact loss's cost against each other mode. Compile stays off (the
routed experts' token counts change every step) and so does Liger (these are the loss modes, not the
speed switches); attention is flash_attention_2 where flash-attn is installed, else sdpa. A line
under the table gives its total and active parameters. ``--check`` runs it (tiny: hidden 64, 2
layers, 8 experts top-2) only when ``--cases`` names it: its three CPU runs take longer than the
rest of a CI check should.

``--quick`` (one short call, from a bare machine): ``qlora-8b`` and ``full-1b``, all on and compile
off, 6 steps (medians after 2), and after ``qlora-8b`` the peer row: Hugging Face Trainer + PEFT +
bitsandbytes with the QLoRA recipe on the same model directory (bench/peer_hf.py), with llmft's
tokens/s over the peer's and both peaks. Every case's all-on run (``moe-qwen3``: its ``global_batch``
run) goes through bench/gpu_phases.py: two steps after the measured ones, one timed by phase (data
wait, forward, backward, optimizer) and one profiled (top kernels), printed under "Where the time
goes". ``gpu.md`` is rewritten after every
run, so a bench cut off keeps what finished. A package llmft needs and cannot import is named with
its install command before anything runs; a case's own (bitsandbytes) makes that case's row say so.
"""

from __future__ import annotations

import os

USER_OMP = os.environ.get("OMP_NUM_THREADS")  # before bench.common sets 1 for the CPU benches

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from common import ROOT, table, train_rows, write_recipe, write_text_records  # noqa: E402

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=320,
)
# --check's moe-qwen3: the tiny shape's experts (TINY's 4 heads at head_dim 16)
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)
GOALS = {
    "qlora-8b": "goal: >= 1.3x the peer's tokens/s at <= the peer's peak memory (one H100/H200, 4096-token rows)",
    "full-1b": "goal: >= 45 % MFU (one H100/H200)",
    "long-8b": "goal: 128K tokens on one H200 with offload + tiling, tokens/s reported (beyond: ALST's 500K on 80 GB)",
}
# The long-context switches, applied to long-8b's recipe (docs/benchmarks.md).
LONG_MODEL = {"activation_offload": True, "tiled_mlp": True, "chunked_loss": True}
LONG_DISTRIBUTED = {"sequence_parallel": 1}


@dataclass
class Case:
    name: str
    shape: str  # a key of llmft.plan.shape.KNOWN
    micro: int
    global_batch: int
    lr: float
    peft: dict[str, Any] = field(default_factory=lambda: {"method": "none"})
    quantization: dict[str, Any] | None = None
    gradient_checkpointing: bool = True
    long: bool = False  # long context: rows of --long-seq, the LONG_* switches, one variant
    peer: bool = False  # --quick: the HF Trainer + PEFT + bitsandbytes row beside it (bench/peer_hf.py)
    fields: dict[str, Any] = field(default_factory=dict)  # over KNOWN[shape]: a shape of the case's own
    modes: dict[str, dict[str, Any]] | None = None  # its own variants: name -> the recipe's moe section
    check_when_named: bool = False  # --check runs it only when --cases names it


# moe-qwen3's variants: the router's balancing loss over the global batch, per micro-batch, and off
# (null: the model config's router_aux_loss_coef, 0.001 for qwen3_moe).
MOE_MODES = {
    "global_batch": {"balance": "global_batch", "aux_loss_coef": None},
    "micro_batch": {"balance": "micro_batch", "aux_loss_coef": None},
    "aux off": {"balance": "global_batch", "aux_loss_coef": 0},
}


LORA = {"method": "lora", "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
CASES = {
    "qlora-8b": Case(
        "qlora-8b",
        "meta-llama/Llama-3.1-8B",
        micro=1,
        global_batch=4,
        lr=2e-4,
        peft=LORA,
        quantization={"bits": 4, "quant_type": "nf4", "double_quant": True},
        peer=True,
    ),
    "lora-8b": Case("lora-8b", "meta-llama/Llama-3.1-8B", micro=1, global_batch=4, lr=2e-4, peft=LORA),
    "full-1b": Case(
        "full-1b", "meta-llama/Llama-3.2-1B", micro=2, global_batch=8, lr=1e-4, gradient_checkpointing=False
    ),
    "long-8b": Case("long-8b", "meta-llama/Llama-3.1-8B", micro=1, global_batch=1, lr=2e-4, peft=LORA, long=True),
    # Qwen3-30B-A3B's layers (hidden 2048, 32 heads, expert FFN 768, top-8) at half its depth and experts
    "moe-qwen3": Case(
        "moe-qwen3",
        "Qwen/Qwen3-30B-A3B",
        micro=1,
        global_batch=4,
        lr=2e-4,
        peft={**LORA, "target_experts": True},
        fields={"num_hidden_layers": 24, "num_experts": 64},
        modes=MOE_MODES,
        check_when_named=True,
    ),
}
LONG_VARIANT = "long"
QUICK_CASES = ("qlora-8b", "full-1b")
OPTIONAL = {"liger-kernel": "liger_kernel.transformers", "flash-attn": "flash_attn"}  # package: module
PEER_VARIANT = "peer: HF Trainer + PEFT + bnb"
# What llmft needs to run at all (pyproject's dependencies, by import name), and what a case needs.
CORE = ("transformers", "peft", "accelerate", "omegaconf", "datasets", "safetensors", "yaml", "deepspeed")


def main() -> int:
    args = parse_args()
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.check:
        print("bench/gpu.py: no CUDA GPU here; use --check for the CPU smoke run", file=sys.stderr)
        return 2
    missing = missing_core()
    if missing:
        print(
            "bench/gpu.py: llmft cannot run here, missing: "
            + "; ".join(missing)
            + ". Install llmft's dependencies from this checkout: pip install -e .",
            file=sys.stderr,
        )
        return 2
    quick = args.quick
    steps = args.steps or (2 if args.check else 6 if quick else 12)
    warmup = args.warmup if args.warmup is not None else (0 if args.check else 2 if quick else 4)
    seq = args.seq or (128 if args.check else 4096)
    long_seq = args.long_seq or (2048 if args.check else 131072)
    long_steps = args.steps or (2 if args.check else 5)  # each step is 32x the tokens of a 4096-token one
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cases = [CASES[c] for c in case_names(args.cases, quick=quick, check=args.check)]

    switches = available_switches(cuda)
    variants = ["all on", "compile off"] if quick else ["all on", *[f"{s} off" for s in switches]]
    data = out / "synthetic.jsonl"
    largest = max(c.global_batch for c in cases)
    tokens_needed = max(c.global_batch * (long_seq if c.long else seq) for c in cases) * (steps + 3) * 1.3
    # records longer than a row are truncated to one row each: enough records for every step's batch
    write_synthetic(data, int(tokens_needed), min_records=largest * (steps + 3))

    report = Report(out / "gpu.md", machine_line(args.check, switches, seq, steps, warmup, long_seq), quick)
    dtype = "fp32" if args.check else "bf16"  # CI: exact enough to compare compile on and off
    for case in cases:
        lacking = case_missing(case)
        if lacking:
            report.add_rows([[case.name, "skipped", f"missing {lacking}", *[""] * 7]])
            continue
        model_dir = ensure_model(out / "models", case, tiny=args.check, cuda=cuda)
        results: dict[str, Result] = {}
        mine = [LONG_VARIANT] if case.long else list(case.modes) if case.modes else variants
        for variant in mine:
            on = {s: s in switches and variant != f"{s} off" for s in ("compile", "liger", "flash")}
            if case.long or case.modes:  # not the speed switches; flash attention where this machine has it
                on = {"compile": False, "liger": False, "flash": "flash" in switches}
            length, n = (long_seq, long_steps) if case.long else (seq, steps)
            run_dir = out / case.name / slug(variant)
            moe = case.modes[variant] if case.modes else None
            recipe = case_recipe(case, model_dir, data, run_dir, on, length, n, dtype, moe)
            phases = n if variant in ("all on", *list(case.modes or ())[:1]) else None  # "where the time goes"
            results[variant] = run(recipe, out / case.name / f"{slug(variant)}.log", args.timeout, cuda, phases)
            done = [v for v in mine if v in results]
            report.set_case(case.name, table_rows(case, results, done, min(warmup, n - 1), n))
            report.phases(case.name, recipe.with_suffix(".phases.json"))
        if quick and case.peer:
            peer = run_peer(case, model_dir, data, out / case.name / "peer", seq, steps, dtype, args.timeout)
            report.peer(case, results.get("all on"), peer, warmup, steps)
        if case.name in GOALS and not args.check:
            report.notes.append(f"- {case.name}: {GOALS[case.name]}")
        if case.modes:
            report.notes.append(f"- {case.name}: {moe_params_line(model_dir)}")
    report.finish()
    print(report.text())
    failed = [r for r in report.all_rows() if str(r[2]).startswith("failed")]
    return 1 if failed and args.check else 0


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU, tiny shapes, fp32, 2 steps, 128-token rows")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="qlora-8b and full-1b, all on and compile off, and the peer row (HF Trainer + PEFT + bitsandbytes)",
    )
    ap.add_argument("--cases", default=None, help="comma-separated, from: " + ", ".join(CASES))
    ap.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per run (default 12; --quick 6; --check 2)"
    )
    ap.add_argument(
        "--warmup", type=int, default=None, help="steps left out of the medians (default 4; --quick 2; --check 0)"
    )
    ap.add_argument("--seq", type=int, default=None, help="tokens per packed row (default 4096; --check 128)")
    ap.add_argument(
        "--long-seq", type=int, default=None, help="tokens per row of long-8b (default 131072; --check 2048)"
    )
    ap.add_argument("--out", default="runs/bench-gpu", help="runs, models, logs and gpu.md go here")
    ap.add_argument("--timeout", type=int, default=900, help="seconds one training run may take")
    return ap.parse_args()


def case_names(cases: str | None, *, quick: bool, check: bool) -> list[str]:
    """The cases to run: ``--cases`` as given, else ``--quick``'s, else every case (under ``--check``,
    every case but those it runs only when named)."""
    if cases:
        return [c for c in cases.split(",") if c]
    if quick:
        return list(QUICK_CASES)
    return [c for c in CASES if not (check and CASES[c].check_when_named)]


# --- switches, models, data -------------------------------------------------------------------


def available_switches(cuda: bool) -> list[str]:
    """The speed switches this machine can turn on; each gets an 'off' variant."""
    found = ["compile"]
    if cuda and _importable("liger_kernel.transformers"):
        found.append("liger")
    if cuda and _importable("flash_attn"):
        found.append("flash")
    return found


def missing_core() -> list[str]:
    """``name (why)`` for each package llmft needs that cannot be imported here."""
    out = []
    for name in CORE:
        why = _import_error(name)
        if why:
            out.append(f"{name} ({why})")
    return out


def case_missing(case: Case) -> str | None:
    """What this machine lacks for ``case``, said as a fix (None: nothing)."""
    if case.quantization is not None:
        why = _import_error("bitsandbytes")
        if why:
            return f"bitsandbytes ({why}): pip install bitsandbytes"
    return None


def _import_error(module: str) -> str | None:
    try:
        __import__(module)
        return None
    except Exception as e:  # an installed package that fails to import is as missing
        return f"{type(e).__name__}: {e}"


def _importable(module: str) -> bool:
    try:
        __import__(module)
        return True
    except Exception:
        return False


def ensure_model(root: Path, case: Case, *, tiny: bool, cuda: bool) -> Path:
    """A local HF model directory with random bf16 weights in the case's shape (reused when complete)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmft.data.tokenizer import byte_tokenizer
    from llmft.plan.shape import KNOWN

    fields = {**KNOWN[case.shape], **case.fields}
    model_type = fields.pop("model_type", "llama")
    if tiny:
        fields.update(TINY, **(TINY_MOE if model_type != "llama" else {}))
    name = (case.name if case.fields else case.shape.split("/")[-1]) + ("-tiny" if tiny else "")
    target = root / name
    if (target / "model.safetensors.index.json").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    tied = fields.pop("tie_word_embeddings", False)
    # Llama 3.1's own context, 131,072: long-8b's rows fit it; qwen3_moe keeps its config's (40,960)
    context = dict(max_position_embeddings=131072, rope_theta=500000.0) if model_type == "llama" else {}
    config = AutoConfig.for_model(model_type, **fields, **context, tie_word_embeddings=tied)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    device = "cuda" if cuda else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[tuple[str, dict[str, torch.Tensor]]] = []
    size = total = 0
    for pname, p in meta.named_parameters():  # tied weights appear once
        if pname.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)
        shard[pname] = t.cpu()
        size += t.numel() * 2
        total += t.numel() * 2
        if size >= 4 * 2**30:
            files.append((f"part-{len(files)}", shard))
            shard, size = {}, 0
    if shard:
        files.append((f"part-{len(files)}", shard))
    for i, (_, tensors) in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, target / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    config.save_pretrained(target)
    _published_names(target / "config.json", config, fields)
    byte_tokenizer().save_pretrained(target)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))  # written last: complete
    return target


def _published_names(path: Path, config: Any, fields: dict[str, Any]) -> None:
    """Spell the shape's fields as the published config.json does: transformers 5 saves qwen3_moe's
    ``num_experts`` as ``num_local_experts`` (its ``attribute_map``), a name llmft's planner does not read
    for that family, so the plan and MFU would count the model as dense."""
    saved = json.loads(path.read_text())
    renamed = {k: a for k, a in config.attribute_map.items() if k in fields and k not in saved and a in saved}
    if renamed:
        for key, alias in renamed.items():
            saved[key] = saved.pop(alias)
        path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def write_synthetic(path: Path, tokens: int, min_records: int = 0) -> None:
    """Lowercase-word records with lognormal byte lengths (median 600), at least ``tokens`` bytes
    and ``min_records`` records in all."""
    if path.is_file() and path.stat().st_size >= tokens and len(path.read_text().splitlines()) >= min_records:
        return
    rng = random.Random(0)
    lengths, total = [], 0
    while total < tokens or len(lengths) < min_records:
        n = max(16, min(6000, round(rng.lognormvariate(math.log(600), 0.8))))
        lengths.append(n)
        total += n
    write_text_records(path, lengths)


def slug(variant: str) -> str:
    return variant.replace(" ", "-")


def case_recipe(
    case: Case,
    model_dir: Path,
    data: Path,
    run_dir: Path,
    on: dict[str, bool],
    seq: int,
    steps: int,
    dtype: str,
    moe: dict[str, Any] | None = None,
) -> Path:
    """The recipe of one run; ``moe``: the recipe's ``moe`` section (a ``modes`` variant)."""
    recipe = {
        "run": {"output_dir": str(run_dir), "seed": 0, "overwrite": True, "tensorboard": False},
        "model": {
            "name_or_path": str(model_dir),
            "dtype": dtype,
            "attn_implementation": "flash_attention_2" if on["flash"] else "sdpa",
            "gradient_checkpointing": case.gradient_checkpointing,
            "quantization": case.quantization,
            "compile": on["compile"],
            "liger_kernels": on["liger"],
        },
        "peft": dict(case.peft),
        "data": {
            "train": str(data),
            "eval": None,
            "eval_fraction": 0.0,
            "max_seq_len": seq,
            "packing": True,
            "shuffle": True,
            "train_on": "all",
            "num_workers": 0 if dtype == "fp32" else 2,  # fp32: the CPU check
        },
        "batch": {"global_batch_size": case.global_batch, "micro_batch_size": case.micro},
        "optim": {"name": "adamw", "lr": case.lr, "scheduler": "constant", "warmup_steps": 0, "max_grad_norm": 1.0},
        "train": {"max_steps": steps, "log_every_steps": 1, "eval_every_steps": None, "progress_bar": False},
        "checkpoint": {"every_steps": None, "keep_last": 1, "resume": "never", "save_optimizer": False},
        "distributed": {"engine": "single", "nnodes": 1, "nproc_per_node": 1},
    }
    if case.long:
        recipe["model"].update(LONG_MODEL)
        # without flash-attn, torch's document-masked attention (sdpa would build a seq^2 mask)
        recipe["model"]["attn_implementation"] = "flash_attention_2" if on["flash"] else "varlen_sdpa"
        recipe["distributed"].update(LONG_DISTRIBUTED)
        recipe["data"]["num_workers"] = 0  # one row a step: nothing to overlap, and no copy of a 128K row per worker
    if moe is not None:
        recipe["moe"] = dict(moe)
    return write_recipe(run_dir.parent / f"{run_dir.name}.yaml", recipe)


# --- running and reading ----------------------------------------------------------------------


@dataclass
class Result:
    recipe: Path
    run_dir: Path
    wall_s: float
    error: str | None


def run(recipe: Path, log: Path, timeout: int, cuda: bool, phases: int | None = None) -> Result:
    """``llmft train recipe`` in its own process; with ``phases`` (the recipe's steps) through
    bench/gpu_phases.py, which adds a step timed by phase and a profiled one."""
    import yaml

    run_dir = Path(yaml.safe_load(recipe.read_text())["run"]["output_dir"])
    if phases is None:
        cmd = [sys.executable, "-m", "llmft", "train", str(recipe)]
    else:
        cmd = [sys.executable, str(ROOT / "bench" / "gpu_phases.py"), str(recipe), "--steps", str(phases)]
    return _run_logged(cmd, run_dir, recipe, log, timeout, cuda)


def _run_logged(cmd: list[str], run_dir: Path, recipe: Path, log: Path, timeout: int, cuda: bool) -> Result:
    env = dict(os.environ)
    if cuda and USER_OMP is None:
        env.pop("OMP_NUM_THREADS", None)  # loading and the data workers want the CPU cores
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "bench"), env.get("PYTHONPATH")) if p)
    print(f"== {' '.join(cmd)}  (log: {log})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout)
            error = None if done.returncode == 0 else f"exit {done.returncode}"
        except subprocess.TimeoutExpired:
            error = f"timeout {timeout} s"
    wall = time.perf_counter() - t0
    if error:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        print(f"   failed ({error}): {' | '.join(tail)}", file=sys.stderr)
    return Result(recipe, run_dir, wall, error)


def moe_params_line(model_dir: Path) -> str:
    """``llmft plan``'s parameters line for the model directory: total and active parameters."""
    from llmft.plan.shape import ModelShape, params_line

    return params_line(ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))) or "dense"


def table_rows(case: Case, results: dict[str, Result], variants: list[str], warmup: int, steps: int) -> list[list[Any]]:
    """One row per finished variant; the medians over steps ``warmup + 1 .. steps`` (the all-on run's
    two added steps, timed by phase and profiled, are left out)."""
    from llmft.plan.memory import CUDA_CONTEXT_BYTES, GIB, estimate_memory
    from llmft.plan.resolve import load_plan

    base = results[variants[0]]  # "all on"; long-8b's one variant
    base_rows = train_rows(base.run_dir)[:steps] if base.error is None else []
    base_tps = _median([r["tokens_per_s"] for r in base_rows[warmup:]])
    out = []
    for variant in variants:
        res = results[variant]
        estimate = (estimate_memory(load_plan(str(res.recipe), [], world_size=1)).total - CUDA_CONTEXT_BYTES) / GIB
        if res.error is not None:
            out.append(
                [
                    case.name,
                    variant,
                    f"failed ({res.error})",
                    "",
                    "",
                    f"{estimate:.1f}",
                    "",
                    "",
                    "",
                    f"{res.wall_s:,.0f}",
                ]
            )
            continue
        rows = train_rows(res.run_dir)[:steps]
        steady = rows[warmup:] or rows
        tps = _median([r["tokens_per_s"] for r in steady])
        mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
        peaks = [r["peak_mem_gb"] for r in steady if r.get("peak_mem_gb") is not None]
        peak = max(peaks) if peaks else None
        gain = base_tps / tps if base_tps and tps else None
        diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(rows, base_rows, strict=False)]
        out.append(
            [
                case.name,
                variant,
                f"{tps:,.0f}",
                f"{statistics.median(mfus):.1%}" if mfus else "n/a",
                f"{peak:.2f}" if peak is not None else "n/a (CPU)",
                f"{estimate:.2f}",
                f"{peak / estimate:.2f}" if peak is not None and estimate > 0 else "n/a",
                "-" if variant == variants[0] else (f"{gain:.3f}" if gain else "n/a"),
                "-" if variant == variants[0] else (f"{max(diffs):.2e}" if diffs else "n/a"),
                f"{res.wall_s:,.0f}",
            ]
        )
    return out


def run_peer(case: Case, model_dir: Path, data: Path, run_dir: Path, seq: int, steps: int, dtype: str, timeout: int):
    """bench/peer_hf.py on the case's model directory: the HF Trainer + PEFT + bitsandbytes row."""
    import torch

    cmd = [sys.executable, str(ROOT / "bench" / "peer_hf.py"), "--model", str(model_dir), "--data", str(data)]
    cmd += ["--out", str(run_dir), "--seq", str(seq), "--steps", str(steps), "--dtype", dtype]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / "peer.log"
    return _run_logged(cmd, run_dir, run_dir, log, timeout, torch.cuda.is_available())


HEADER = [
    "case",
    "variant",
    "tokens/s",
    "MFU",
    "peak GiB",
    "estimate GiB",
    "peak / estimate",
    "all-on speed / this",
    "max abs loss diff vs all on",
    "run wall s",
]


class Report:
    """gpu.md, rewritten after every run: a bench cut off at any point keeps the rows that finished."""

    def __init__(self, path: Path, machine: str, quick: bool) -> None:
        self.path, self.machine, self.quick = path, machine, quick
        self.rows: dict[str, list[list[Any]]] = {}  # by case, in the order measured
        self.timing: dict[str, dict[str, Any]] = {}  # by case: bench/gpu_phases.py's json
        self.comparisons: list[str] = []
        self.notes: list[str] = []
        self.started = time.perf_counter()
        self.finished = False

    def set_case(self, name: str, rows: list[list[Any]]) -> None:
        self.rows[name] = rows
        self.write()

    def add_rows(self, rows: list[list[Any]]) -> None:
        self.rows.setdefault(rows[0][0], []).extend(rows)
        self.write()

    def all_rows(self) -> list[list[Any]]:
        return [r for rows in self.rows.values() for r in rows]

    def phases(self, name: str, path: Path) -> None:
        if path.is_file():
            self.timing[name] = json.loads(path.read_text())
            self.write()

    def peer(self, case: Case, on: Result | None, peer: Result, warmup: int, steps: int) -> None:
        row, line = peer_row(case, on, peer, warmup, steps)
        self.comparisons.append(line)
        self.add_rows([row])

    def finish(self) -> None:
        self.finished = True
        self.write()

    def text(self) -> str:
        parts = [self.machine, "", table(HEADER, self.all_rows()), ""]
        if self.comparisons:
            parts += ["Against the peer (same model directory, rows and batch; bench/peer_hf.py):", ""]
            parts += [*self.comparisons, ""]
        parts += self.notes
        parts += timing_text(self.timing)
        elapsed = time.perf_counter() - self.started
        parts.append(
            f"\nWhole bench: {elapsed:,.0f} s wall (model directories included)."
            if self.finished
            else f"\n(still running, or cut off: {elapsed:,.0f} s so far; the rows above finished)"
        )
        return "\n".join(parts)

    def write(self) -> None:
        self.path.write_text(self.text() + "\n")


def peer_row(case: Case, on: Result | None, peer: Result, warmup: int, steps: int) -> tuple[list[Any], str]:
    """The peer's table row and the sentence comparing llmft's all-on run with it."""
    wall = f"{peer.wall_s:,.0f}"
    if peer.error is not None:
        log = peer.run_dir.parent / "peer.log"
        lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
        said = next((x for x in reversed(lines) if x.startswith("peer: cannot run")), None)
        what = said or f"failed ({peer.error})"
        return [case.name, PEER_VARIANT, what, *[""] * 6, wall], f"- {case.name}: no peer numbers ({what})"
    rows = train_rows(peer.run_dir)[:steps]
    steady = rows[warmup:] or rows
    tps = _median([r["tokens_per_s"] for r in steady])
    peaks = [r["peak_mem_gb"] for r in steady if r.get("peak_mem_gb") is not None]
    peak = max(peaks) if peaks else None
    mfu = None
    mine = mine_peak = None
    if on is not None and on.error is None:
        from llmft.metrics.flops import detect_device_name, flops_per_token, peak_flops
        from llmft.metrics.flops import mfu as mfu_of
        from llmft.plan.resolve import load_plan
        from llmft.plan.shape import model_shape

        plan = load_plan(str(on.recipe), [], world_size=1)
        shape = model_shape(plan.recipe.model)
        per_token = flops_per_token(shape, plan.recipe.data.max_seq_len, peft=True) if shape else None
        mfu = mfu_of(tps, per_token, peak_flops(detect_device_name())) if per_token and tps else None
        llmft_rows = train_rows(on.run_dir)[:steps]
        mine = _median([r["tokens_per_s"] for r in llmft_rows[warmup:] or llmft_rows])
        mine_peaks = [r["peak_mem_gb"] for r in llmft_rows if r.get("peak_mem_gb") is not None]
        mine_peak = max(mine_peaks) if mine_peaks else None
    gain = mine / tps if mine and tps else None
    row = [
        case.name,
        PEER_VARIANT,
        f"{tps:,.0f}",
        f"{mfu:.1%}" if mfu is not None else "n/a",
        f"{peak:.2f}" if peak is not None else "n/a (CPU)",
        "n/a",
        "n/a",
        f"{gain:.3f}" if gain else "n/a",
        "n/a (its own rows)",
        wall,
    ]
    memory = (
        f", peak allocated {mine_peak:.2f} GiB against the peer's {peak:.2f} GiB ({mine_peak / peak:.2f}x)"
        if peak and mine_peak
        else ""
    )
    speed = f"{gain:.2f}x the peer's tokens/s" if gain else "no all-on run to compare"
    line = f"- {case.name}: llmft all on reads {speed}{memory} (goal: >= 1.3x at <= 1.00x the peer's peak)"
    return row, line


def timing_text(timing: dict[str, dict[str, Any]]) -> list[str]:
    """ "Where the time goes": each case's all-on step by phase, and the top kernels of one step."""
    if not timing:
        return []
    out = [
        "",
        "Where the time goes (all on; one step timed by phase with a device sync around each, one profiled):",
        "",
    ]
    phases = ("data_wait", "forward", "backward", "optimizer")
    rows = []
    for name, t in timing.items():
        if "step_s" not in t:
            continue
        step = t["step_s"]
        other = step - sum(t.get(f"{p}_s", 0.0) for p in phases)
        rows.append([name, f"{step:.3f}", *[f"{t.get(f'{p}_s', 0.0):.3f}" for p in phases], f"{other:.3f}"])
    out.append(table(["case", "step s", "data wait s", "forward s", "backward s", "optimizer s", "other s"], rows))
    for name, t in timing.items():
        kernels = t.get("kernels") or []
        if not kernels:  # the run ended before its profiled step
            continue
        unit = "device" if t.get("device") != "cpu" else "CPU"
        out += ["", f"Top {len(kernels)} by own {unit} time, one step of {name} ({t.get('device')}):", ""]
        out.append(table(["kernel / op", "ms", "calls"], [[k["name"], f"{k['ms']:.2f}", k["calls"]] for k in kernels]))
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def machine_line(check: bool, switches: list[str], seq: int, steps: int, warmup: int, long_seq: int) -> str:
    import torch
    import transformers

    today = datetime.date.today().isoformat()
    if check:
        where = "--check: CPU, tiny shapes (hidden 64, 2 layers); the numbers below measure nothing"
    else:
        where = f"GPU: {torch.cuda.get_device_name()}"
    return (
        f"{today}. {where}; torch {torch.__version__}, transformers {transformers.__version__}. "
        f"Switches on in 'all on': {', '.join(switches)}{_lacking(check)}; packed rows of {seq} tokens "
        f"(long-8b: {long_seq}), "
        f"{steps} steps per run, "
        f"medians over the steps after the first {warmup}."
    )


def _lacking(check: bool) -> str:
    """The optional speed packages this GPU machine lacks (their switch stays off), said plainly."""
    if check:
        return ""
    gone = [f"{pkg} (pip install {pkg})" for pkg, mod in OPTIONAL.items() if not _importable(mod)]
    return f" (not installed, so off: {', '.join(gone)})" if gone else ""


if __name__ == "__main__":
    sys.exit(main())
