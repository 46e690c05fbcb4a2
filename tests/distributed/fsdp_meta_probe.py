"""Run under torchrun: FSDP2 engines built on the meta device, compared with the model built whole.

``fsdp_meta_probe.py WORKDIR [VARIANT ...]``: for each variant (WORKDIR/NAME/recipe.yaml plus
overrides, see VARIANTS) build the FSDP engine and, on every rank, the same model whole on CPU;
compare every parameter (gathered) and buffer, and the logits of one batch. Then ``llmft train``
WORKDIR/pretrained/recipe.yaml with FSDP (2 steps, metrics in WORKDIR/fsdp). Throughout,
``fully_shard`` and ``from_pretrained`` are watched: on the meta path every tensor must still be on
the meta device when the model is sharded, and no pretrained model may be loaded whole.
Prints one JSON line on rank 0: ``FSDP_META {...}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import llmft.plan.resolve
from llmft.engines import fsdp as fsdp_engine
from llmft.job.dist import leave_process
from llmft.training.train import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers
from mapped import in_weight_file  # noqa: E402

LORA = ["peft.method=lora", "peft.r=4"]
VARIANTS = {
    "full": ("pretrained", []),
    "lora": ("pretrained", LORA),
    "dora_bf16": ("pretrained", ["peft.method=dora", "peft.r=4", "model.dtype=bf16"]),
    "lora_save_head": ("pretrained", [*LORA, "peft.modules_to_save=[lm_head]"]),
    # tied embeddings, an odd vocabulary (uneven shards), bf16 weights in several files + index
    "tied_sharded": ("tied", LORA),
    # a reward model on a causal-LM checkpoint: the score head it lacks gets the seeded init
    "reward_full": ("pretrained", ["train.objective=reward"]),
    "reward_lora": ("pretrained", ["train.objective=reward", *LORA]),
    "fresh_big": ("fresh", LORA),  # a tiny model.config model, treated as if above the threshold
    # QLoRA: the NF4 base quantized weight by weight into each rank's part of the packed bytes
    "qlora": ("pretrained", [*LORA, "model.quantization={bits: 4}"]),
}
WATCH: dict[str, list] = {"fully_shard_devices": [], "from_pretrained": []}


def _watch() -> None:
    original = fsdp_engine.fully_shard

    def fully_shard(module, **kwargs):
        tensors = [*module.parameters(), *module.buffers()]
        WATCH["fully_shard_devices"].append(sorted({t.device.type for t in tensors}))
        return original(module, **kwargs)

    fsdp_engine.fully_shard = fully_shard
    from_pretrained = AutoModelForCausalLM.from_pretrained.__func__

    def watched(cls, *args, **kwargs):
        WATCH["from_pretrained"].append(str(args[0]) if args else "")
        return from_pretrained(cls, *args, **kwargs)

    AutoModelForCausalLM.from_pretrained = classmethod(watched)


def _compare(recipe_path: str, overrides: list[str], env) -> dict:
    from llmft.data.tokenizer import load_tokenizer
    from llmft.model.build import prepare_model
    from llmft.plan.resolve import load_plan
    from llmft.training.optim import build_optimizer

    plan = load_plan(recipe_path, ["distributed.engine=fsdp", *overrides], world_size=env.world_size)
    recipe = plan.recipe
    tokenizer = load_tokenizer(recipe.model)

    def optimizer(model):
        return build_optimizer(model, recipe.optim, recipe.optim.lr)

    WATCH["fully_shard_devices"].clear()
    WATCH["from_pretrained"].clear()
    rng_before = torch.random.get_rng_state()
    engine = fsdp_engine.FSDPEngine(plan, env, tokenizer, optimizer)
    rng_after = torch.random.get_rng_state()
    out: dict = {
        "meta_at_fully_shard": all(devs == ["meta"] for devs in WATCH["fully_shard_devices"]),
        "num_fully_shard": len(WATCH["fully_shard_devices"]),
        "from_pretrained_calls": len(WATCH["from_pretrained"]),
    }
    sharded = [p for p in engine.model.parameters() if isinstance(p, DTensor)]
    out["local_fraction"] = sum(p.to_local().numel() for p in sharded) / sum(p.numel() for p in sharded)
    out["whole"] = sorted(n for n, p in engine.model.named_parameters() if not isinstance(p, DTensor))
    torch.random.set_rng_state(rng_before)  # the reference starts from the same global RNG
    quantized = recipe.model.quantization is not None
    # A 4-bit reference is FSDP's whole build (the same packed storage dtype), before sharding.
    reference = prepare_model(plan if quantized else plan.on_one_process(), tokenizer, torch.device("cpu"))
    # both builds move the global RNG (data order, dropout) alike
    out["same_rng_after"] = bool(torch.equal(rng_after, torch.random.get_rng_state()))
    ref_params = dict(reference.named_parameters())
    diffs, shards_differ = {}, True
    for name, p in engine.model.named_parameters():
        full = _full(p)
        assert full.dtype == ref_params[name].dtype, (name, full.dtype, ref_params[name].dtype)
        if type(ref_params[name]).__name__ == "Params4bit":  # packed bytes: compared as bytes
            same = torch.equal(full.view(torch.uint8), ref_params[name].data.view(torch.uint8))
            diffs[name] = 0.0 if same else float("inf")
            continue
        diffs[name] = (full.float() - ref_params[name].float()).abs().max().item()
        half = full.shape[0] // 2
        if full.dim() == 2 and full.std() > 0 and torch.equal(full[:half], full[half : 2 * half]):
            shards_differ = False  # every rank drew the same numbers for its rows
    ref_buffers = dict(reference.named_buffers())
    out["buffer_diff"] = max(
        [(b.float() - ref_buffers[n].float()).abs().max().item() for n, b in engine.model.named_buffers()] or [0.0]
    )
    if quantized:  # the quantization statistics each 4-bit module keeps (whole on every rank)
        states = {n: m.quant_state for n, m in engine.model.named_modules() if hasattr(m, "quant_state")}
        ref_states = {n: m.quant_state for n, m in reference.named_modules() if hasattr(m, "quant_state")}
        assert states.keys() == ref_states.keys() and states, (len(states), len(ref_states))
        out["num_4bit"] = len(states)
        out["quant_state_equal"] = all(_same_state(states[n], ref_states[n]) for n in states)
    out["param_diff"] = max(diffs.values())
    out["worst_param"] = max(diffs, key=diffs.get)
    out["adapter_diff"] = max([d for n, d in diffs.items() if "lora_" in n] or [0.0])
    out["shards_differ"] = shards_differ
    if recipe.model.config is not None:  # a fresh model: its own seeded init, the same on a rebuild
        again = fsdp_engine.FSDPEngine(plan, env, tokenizer, optimizer).model.named_parameters()
        params = dict(engine.model.named_parameters())
        out["rebuild_diff"] = max((_full(p) - _full(params[n])).abs().max().item() for n, p in again)
        matrices = [_full(p) for n, p in params.items() if p.dim() == 2 and "lora_" not in n]
        out["matrix_std"] = [min(m.std().item() for m in matrices), max(m.std().item() for m in matrices)]
    ids = torch.arange(24).view(2, 12) * 7 % 250
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits.float()
        ref_logits = reference(input_ids=ids).logits.float()
    out["logits_finite"] = bool(logits.isfinite().all())
    # After the forward (FSDP2's lazy init adopted the shards): which frozen weights of the model,
    # 4-bit ones aside, are this rank's rows of the weight file itself (a mapping, not a copy).
    for module in engine.model.modules():  # units kept gathered after forward (root, head) too
        if isinstance(module, FSDPModule):
            module.reshard()
    packed = {id(m.weight) for m in engine.model.modules() if type(m).__name__ == "Linear4bit"}
    frozen = {n: p for n, p in engine.model.named_parameters() if not p.requires_grad and id(p) not in packed}
    out["frozen"] = len(frozen)
    local = {n: p.to_local() if isinstance(p, DTensor) else p for n, p in frozen.items()}
    out["frozen_copied"] = sorted(n for n, t in local.items() if not in_weight_file(t.data_ptr()))
    out["logits_diff"] = (logits - ref_logits).abs().max().item()
    return out


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter whole: gathered when sharded (a CPU run's mapped embedding and head are not)."""
    return p.full_tensor() if isinstance(p, DTensor) else p.data


def _same_state(a, b) -> bool:
    """Two bitsandbytes QuantState: the same statistics, bit for bit."""
    ta, tb = a.as_dict(packed=True), b.as_dict(packed=True)
    if ta.keys() != tb.keys():
        return False
    return all(torch.equal(ta[k], tb[k]) if torch.is_tensor(ta[k]) else ta[k] == tb[k] for k in ta)


def main() -> None:
    from llmft.job.dist import init_distributed, read_env

    workdir, *variants = sys.argv[1:]
    _watch()
    env = read_env()
    init_distributed(env, "auto", 5, force=True)
    report: dict = {}
    for variant in variants:
        recipe, overrides = VARIANTS[variant]
        saved = llmft.plan.resolve.WHOLE_INIT_MAX_PARAMS
        if variant == "fresh_big":
            llmft.plan.resolve.WHOLE_INIT_MAX_PARAMS = 0
        try:
            report[variant] = _compare(os.path.join(workdir, recipe, "recipe.yaml"), overrides, env)
        finally:
            llmft.plan.resolve.WHOLE_INIT_MAX_PARAMS = saved
    WATCH["fully_shard_devices"].clear()
    WATCH["from_pretrained"].clear()
    code = train(
        os.path.join(workdir, "pretrained", "recipe.yaml"),
        ["distributed.engine=fsdp", "batch.micro_batch_size=2", f"run.output_dir={workdir}/fsdp"],
    )  # shuts the process group down
    report["train"] = {
        "code": code,
        "meta_at_fully_shard": all(devs == ["meta"] for devs in WATCH["fully_shard_devices"]),
        "from_pretrained_calls": len(WATCH["from_pretrained"]),
    }
    if env.rank == 0:
        print("FSDP_META " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
    leave_process(0)  # without the interpreter's teardown (llmft.job.dist.leave_process says why)
