"""llmft DPO against an outside implementation, weight for weight: TRL's ``DPOTrainer`` (the version
pinned in the dev extra, pyproject.toml) and ``llmft train`` on the same model dir, the same pairs
in the same order, three SGD steps of ``sigmoid`` DPO with beta 0.1, end at the same weights.

What is aligned, and why:

- tokens: both tokenize the string pairs themselves (TRL: ``prompt``, then ``prompt + chosen + eos``
  with the prompt as the common prefix; llmft: the prompt/completion rule of docs/preference.md).
  With the byte tokenizer these give the same ids (bos, prompt bytes, completion bytes, eos); the
  test asserts it before comparing weights, so a tokenization difference fails as such.
- batch: TRL takes one full micro-batch of 4 pairs per step (``gradient_accumulation_steps=1``),
  where its step loss is the pair mean (with accumulation it divides each micro-batch's mean by the
  accumulation count: equal only when every micro-batch is full). llmft runs micro-batches of 2
  with 2 accumulation steps: its accumulation is the big batch, so the steps must agree anyway.
- order: TRL ``train_sampling_strategy="sequential"``, llmft ``data.shuffle: false``.
- optimizer: plain SGD (no momentum), constant lr, no warmup, no weight decay, no clipping; fp32.
- LoRA: TRL wraps the model with llmft's LoRA config, and its adapters are set to llmft's initial
  ones (LoRA's A is random at init); both references are the model with its adapters disabled.
  Full fine-tune: TRL loads its reference from the model dir; llmft holds a frozen copy.
- dropout: off in both (TRL ``disable_dropout``; llmft always for preference objectives).
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from helpers import save_tiny_pretrained, write_recipe

NUM_PAIRS, GLOBAL, MICRO, STEPS, LR, BETA = 12, 4, 2, 3, 0.5, 0.1


def write_pairs(path, n: int, seed: int = 3):
    """String pairs of different lengths: the correct reversal of a word against a wrong answer."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 12)))
            wrong = word if rng.random() < 0.5 else word[::-1][1:] + "x"
            f.write(json.dumps({"prompt": f"reverse {word}:", "chosen": word[::-1], "rejected": wrong}) + "\n")
    return path


def trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def run_llmft(tmp, model_dir, data, method: str):
    """``llmft train``'s run in this process: initial and final trainable weights, and the token ids
    of every pair in the order the run takes them."""
    from llmft.job.dist import read_env
    from llmft.plan.resolve import load_plan
    from llmft.stop import StopRequest
    from llmft.training.run import Run

    recipe = write_recipe(
        tmp,
        model={"name_or_path": str(model_dir), "dtype": "fp32", "attn_implementation": "eager"},
        data__train=str(data),
    )
    overrides = [
        "train.objective=dpo",
        "preference.loss_type=sigmoid",
        f"preference.beta={BETA}",
        "data.shuffle=false",
        f"batch.global_batch_size={GLOBAL}",
        f"batch.micro_batch_size={MICRO}",
        f"train.max_steps={STEPS}",
        "optim.name=sgd",
        f"optim.lr={LR}",
        "optim.scheduler=constant",
        "optim.warmup_steps=0",
        "optim.weight_decay=0.0",
        "optim.max_grad_norm=null",
        *(["peft.method=lora", "peft.r=4"] if method == "lora" else ["peft.method=none"]),
    ]
    env = read_env()
    run = Run(load_plan(str(recipe), overrides, world_size=1, local_world_size=1), env, StopRequest())
    try:
        run.setup()
        model = run.engine.unwrap()
        initial = trainable(model)
        pairs = [run.data.train[i] for i in range(len(run.data.train))]
        run.restore(None)
        run.fit()
        final = trainable(model)
        peft_config = copy.deepcopy(model.peft_config["default"]) if method == "lora" else None
    finally:
        run.close()
    return initial, final, pairs, peft_config


def run_trl(tmp, model_dir, data, initial, peft_config):
    """TRL's DPOTrainer on the same model dir and pairs; its final trainable weights and the token ids
    its dataset holds."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    args = DPOConfig(
        output_dir=str(tmp / "trl"),
        per_device_train_batch_size=GLOBAL,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,  # 0: no clipping
        beta=BETA,
        loss_type=["sigmoid"],
        train_sampling_strategy="sequential",
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        dataloader_num_workers=0,
        max_length=None,
        disable_dropout=True,
        seed=0,
    )
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=load_dataset("json", data_files=str(data), split="train"),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=peft_config,
    )
    with torch.no_grad():  # LoRA: start from llmft's adapters (A is random at init)
        params = dict(trainer.model.named_parameters())
        for name, value in initial.items():
            params[name].copy_(value)
    assert trainable(trainer.model).keys() == initial.keys()
    tokens = [
        {k: trainer.train_dataset[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
        for i in range(len(trainer.train_dataset))
    ]
    trainer.train()
    return trainable(trainer.model), tokens


def as_trl_tokens(pair: dict) -> dict[str, list[int]]:
    """llmft's pair item as TRL's dataset columns: the prompt is the tokens before the first target."""
    out = {}
    for side in ("chosen", "rejected"):
        ids, labels = list(pair[side]["input_ids"]), list(pair[side]["labels"])
        start = next(t for t, lab in enumerate(labels) if lab != -100)
        out["prompt_ids"] = ids[:start]
        out[f"{side}_ids"] = ids[start:]
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("method", ["lora", "full"])
def test_same_weights_as_trl_dpo_trainer(tmp_path, method):
    model_dir = save_tiny_pretrained(tmp_path / "model", seed=1)
    data = write_pairs(tmp_path / "pairs.jsonl", NUM_PAIRS)
    initial, ours, pairs, peft_config = run_llmft(tmp_path, model_dir, data, method)
    theirs, trl_tokens = run_trl(tmp_path, model_dir, data, initial, peft_config)

    assert [as_trl_tokens(p) for p in pairs] == trl_tokens  # the same token ids, in the same order
    assert ours.keys() == theirs.keys()
    # The steps changed the weights (LoRA's B starts at 0: measured against the weights' own norm).
    moved = max(float((ours[k] - initial[k]).norm() / ours[k].norm()) for k in ours)
    assert moved > 1e-2
    weights = max(rel(ours[k], theirs[k]) for k in ours)
    updates = max(rel(ours[k] - initial[k], theirs[k] - initial[k]) for k in ours if (theirs[k] != initial[k]).any())
    print(f"{method}: weights moved {moved:.2e}; llmft vs TRL: weights {weights:.2e}, updates {updates:.2e}")
    assert weights <= 1e-4
    assert updates <= 1e-4
