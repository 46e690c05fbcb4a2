"""Run under torchrun: DeepSpeed ZeRO-3 engines built on the meta device, compared with the model built whole.

``zero3_meta_probe.py WORKDIR [VARIANT ...]``: for each variant (WORKDIR/NAME/recipe.yaml plus
overrides, see VARIANTS) build the ZeRO-3 engine and, on every rank, the same model whole on CPU;
compare every parameter (gathered) and buffer, the 4-bit statistics, and the logits of one batch.
Then ``llmft train`` WORKDIR/pretrained/recipe.yaml as QLoRA on ZeRO-3 (3 steps, metrics in
WORKDIR/zero3). Throughout, ``from_pretrained`` is watched: no pretrained model may be loaded whole.
Prints one JSON line on rank 0: ``ZERO3_META {...}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from llmft.job.dist import leave_process
from llmft.training.train import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: shared helpers
from mapped import in_weight_file  # noqa: E402

ZERO3 = ["distributed.engine=deepspeed", "distributed.zero_stage=3"]
LORA = ["peft.method=lora", "peft.r=4"]
QLORA = [*LORA, "model.quantization={bits: 4}"]
VARIANTS = {
    "full": ("pretrained", []),
    "lora": ("pretrained", LORA),
    "dora": ("pretrained", ["peft.method=dora", "peft.r=4"]),
    "lora_save_head": ("pretrained", [*LORA, "peft.modules_to_save=[lm_head]"]),
    # tied embeddings, an odd vocabulary (uneven partitions), bf16 weights in several files + index
    "tied_sharded": ("tied", LORA),
    # a reward model on a causal-LM checkpoint: the score head it lacks gets the seeded init
    "reward_full": ("pretrained", ["train.objective=reward"]),
    "reward_lora": ("pretrained", ["train.objective=reward", *LORA]),
    # QLoRA: the NF4 base quantized weight by weight into each rank's partition of the packed bytes
    "qlora": ("pretrained", QLORA),
    # parameters offloaded: DeepSpeed's partition() puts each rank's range in CPU memory
    "qlora_offload": ("pretrained", [*QLORA, "distributed.offload_params=cpu", "distributed.offload_optimizer=cpu"]),
}
FROM_PRETRAINED: list[str] = []


def _watch() -> None:
    from_pretrained = AutoModelForCausalLM.from_pretrained.__func__

    def watched(cls, *args, **kwargs):
        FROM_PRETRAINED.append(str(args[0]) if args else "")
        return from_pretrained(cls, *args, **kwargs)

    AutoModelForCausalLM.from_pretrained = classmethod(watched)


def _gathered(param: torch.Tensor) -> torch.Tensor:
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        return param.data.detach().clone()


def _compare(recipe_path: str, overrides: list[str], env) -> dict:
    from llmft.data.tokenizer import load_tokenizer
    from llmft.engines.deepspeed import DeepSpeedEngineAdapter
    from llmft.model.build import prepare_model
    from llmft.plan.memory import estimate_memory
    from llmft.plan.resolve import load_plan
    from llmft.training.optim import build_optimizer

    plan = load_plan(recipe_path, [*ZERO3, *overrides], world_size=env.world_size)
    recipe = plan.recipe
    tokenizer = load_tokenizer(recipe.model)

    def optimizer(model):
        return build_optimizer(model, recipe.optim, recipe.optim.lr)

    FROM_PRETRAINED.clear()
    rng_before = torch.random.get_rng_state()
    engine = DeepSpeedEngineAdapter(plan, env, tokenizer, optimizer)
    rng_after = torch.random.get_rng_state()
    model = engine.model.module
    out: dict = {"from_pretrained_calls": len(FROM_PRETRAINED), "zero_params": True}
    params = dict(model.named_parameters())
    out["zero_params"] = all(hasattr(p, "ds_tensor") for p in params.values())
    # a frozen weight read in place is partitioned over a group of this rank alone: kept whole
    spread = [p for p in params.values() if p.ds_zero_partition_world_size > 1]
    out["local_fraction"] = sum(p.ds_tensor.numel() for p in spread) / sum(p.ds_numel for p in spread)
    out["kept_whole"] = sorted(
        n for n, p in params.items() if p.ds_zero_partition_world_size == 1 and p.ds_tensor.numel() == p.ds_numel
    )
    torch.random.set_rng_state(rng_before)  # the reference starts from the same global RNG
    quantized = recipe.model.quantization is not None
    # A 4-bit reference is ZeRO-3's whole build (the same packed storage dtype).
    reference = prepare_model(plan if quantized else plan.on_one_process(), tokenizer, torch.device("cpu"))
    out["same_rng_after"] = bool(torch.equal(rng_after, torch.random.get_rng_state()))
    ref_params = dict(reference.named_parameters())
    assert params.keys() == ref_params.keys(), sorted(set(params) ^ set(ref_params))[:5]
    diffs = {}
    for name, p in params.items():
        full = _gathered(p)
        ref = ref_params[name].data
        assert full.dtype == ref.dtype and full.shape == ref.shape, (name, full.dtype, ref.dtype, full.shape, ref.shape)
        if type(ref_params[name]).__name__ == "Params4bit":  # packed bytes: compared as bytes
            diffs[name] = 0.0 if torch.equal(full.view(torch.uint8), ref.view(torch.uint8)) else float("inf")
        else:
            diffs[name] = (full.float() - ref.float()).abs().max().item()
    ref_buffers = dict(reference.named_buffers())
    out["buffer_diff"] = max(
        [(b.float() - ref_buffers[n].float()).abs().max().item() for n, b in model.named_buffers()] or [0.0]
    )
    if quantized:
        import bitsandbytes as bnb
        from fsdp_meta_probe import _same_state

        states = {n: m.weight.quant_state for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
        ref_states = {n: m.weight.quant_state for n, m in reference.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
        assert states.keys() == ref_states.keys() and states, (len(states), len(ref_states))
        out["num_4bit"] = len(states)
        out["quant_state_equal"] = all(_same_state(states[n], ref_states[n]) for n in states)
    out["param_diff"] = max(diffs.values())
    out["worst_param"] = max(diffs, key=diffs.get)
    ids = torch.arange(24).view(2, 12) * 7 % 250
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits.float()
        ref_logits = reference(input_ids=ids).logits.float()
    out["logits_diff"] = (logits - ref_logits).abs().max().item()
    # After the forward: the frozen weights (4-bit ones aside) whose partition is this rank's range
    # of the weight file itself (a mapping, not a copy).
    packed = {id(m.weight) for m in engine.model.modules() if type(m).__name__ == "Linear4bit"}
    frozen = {n: p for n, p in params.items() if not p.requires_grad and id(p) not in packed}
    out["frozen"] = len(frozen)
    out["frozen_mapped"] = sorted(n for n, p in frozen.items() if in_weight_file(p.ds_tensor.data_ptr()))
    # What DeepSpeed holds for the trained parameters beyond their partitions, beside the planner's terms.
    zero = engine.model.optimizer
    lp, master = zero.fp16_partitioned_groups_flat, zero.fp32_partitioned_groups_flat
    out["master_bytes"] = sum(
        m.numel() * m.element_size() for m, p in zip(master, lp, strict=True) if m.data_ptr() != p.data_ptr()
    )
    trained = [p for p in params.values() if p.requires_grad]
    out["persistent_trained_bytes"] = sum(p.ds_numel * p.element_size() for p in trained if p.ds_persist)
    est = estimate_memory(plan)
    out["planned_master_bytes"] = est.master_weights
    out["partition_bytes"] = sum(t.numel() * t.element_size() for t in lp)
    out["planned_adapter_bytes"] = est.adapters  # on the device: partitions (unless offloaded), persistent whole
    return out


def main() -> None:
    from llmft.job.dist import init_distributed, read_env

    sys.path.insert(0, os.path.dirname(__file__))
    workdir, *variants = sys.argv[1:]
    _watch()
    env = read_env()
    init_distributed(env, "auto", 5, force=True)
    report: dict = {}
    for variant in variants:
        recipe, overrides = VARIANTS[variant]
        report[variant] = _compare(os.path.join(workdir, recipe, "recipe.yaml"), overrides, env)
    FROM_PRETRAINED.clear()
    code = train(
        os.path.join(workdir, "pretrained", "recipe.yaml"),
        [*ZERO3, *QLORA, "batch.micro_batch_size=2", "train.max_steps=3", f"run.output_dir={workdir}/zero3"],
    )  # shuts the process group down
    report["train"] = {"code": code, "from_pretrained_calls": len(FROM_PRETRAINED)}
    if env.rank == 0:
        print("ZERO3_META " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
    leave_process(0)  # without the interpreter's teardown (llmft.job.dist.leave_process says why)
