"""Preference micro-batches built by hand in the shape of the data contract (docs/preference.md):
``input_ids``, ``labels`` (unshifted, -100 off the targets), ``attention_mask`` (unpacked only),
``position_ids``, ``sequence_index`` (2p: pair p's chosen, 2p + 1: its rejected, -1: padding) and
``num_pairs``. Until the data side collates pair records, tests and probes build them here."""

from __future__ import annotations

import random

import torch
from helpers import write_recipe

IGNORE = -100
PAD = 0


def make_pairs(n: int, seed: int = 0, vocab: int = 320) -> list[tuple[list[int], list[int], list[int]]]:
    """``n`` pairs (prompt, chosen, rejected) of token ids, of very different lengths."""
    rng = random.Random(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(rng.randint(lo, hi))]

    return [(ids(2, 12), ids(1, 14), ids(1, 14)) for _ in range(n)]


def sequences(pairs) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of every sequence, chosen then rejected per pair (prompt masked)."""
    out = []
    for prompt, chosen, rejected in pairs:
        for completion in (chosen, rejected):
            out.append((prompt + completion, [IGNORE] * len(prompt) + completion))
    return out


def collate_pairs(pairs, packed: bool = False) -> dict:
    """The contract micro-batch of ``pairs``: 2P right-padded rows, or one padding-free row."""
    seqs = sequences(pairs)
    if packed:
        ids = [t for s, _ in seqs for t in s]
        labels = [t for _, lab in seqs for t in lab]
        pos = [i for s, _ in seqs for i in range(len(s))]
        index = [k for k, (s, _) in enumerate(seqs) for _ in s]
        rows = {"input_ids": [ids], "labels": [labels], "position_ids": [pos], "sequence_index": [index]}
        batch = {k: torch.tensor(v) for k, v in rows.items()}
    else:
        width = max(len(s) for s, _ in seqs)
        batch = {
            "input_ids": torch.full((len(seqs), width), PAD),
            "labels": torch.full((len(seqs), width), IGNORE),
            "attention_mask": torch.zeros((len(seqs), width), dtype=torch.long),
            "position_ids": torch.zeros((len(seqs), width), dtype=torch.long),
            "sequence_index": torch.full((len(seqs), width), -1),
        }
        for k, (s, lab) in enumerate(seqs):
            n = len(s)
            batch["input_ids"][k, :n] = torch.tensor(s)
            batch["labels"][k, :n] = torch.tensor(lab)
            batch["attention_mask"][k, :n] = 1
            batch["position_ids"][k, :n] = torch.arange(n)
            batch["sequence_index"][k, :n] = k
    batch["num_pairs"] = len(pairs)
    return batch


def micro_batches(pairs, micro: int, packed: bool = False) -> list[dict]:
    """``pairs`` cut into micro-batches of ``micro`` pairs (the last one may be short)."""
    return [collate_pairs(pairs[i : i + micro], packed) for i in range(0, len(pairs), micro)]


# --- one optimizer step of a preference run, its gradients captured --------------------------------


def full_grads(engine) -> dict[str, torch.Tensor]:
    """The whole (reduced) gradient of every trainable parameter, on every rank: DDP's all-reduced
    ``.grad``, FSDP2's sharded one gathered, DeepSpeed's from its partitions."""
    grads = {}
    for name, p in engine.unwrap().named_parameters():
        if not p.requires_grad:
            continue
        if engine.name == "deepspeed":
            from deepspeed.utils import safe_get_full_grad

            g = safe_get_full_grad(p)
        else:
            g = p.grad
            g = g.full_tensor() if hasattr(g, "full_tensor") else g
        grads[name] = g.detach().float().cpu().clone()
    return grads


def preference_step(
    plan, env, micro: list[dict], batch_plan=None, steps: int = 1
) -> tuple[dict[str, torch.Tensor], dict]:
    """Build the plan's engine and objective, run ``steps`` steps of the real loop on this rank's
    ``micro``-batches; return the gradients the optimizer stepped with at the last step and its row.
    (After the first step the policy differs from its reference: a reference that followed the
    policy would show there.)"""
    from llmft.data.tokenizer import load_tokenizer
    from llmft.engines import build_engine
    from llmft.objectives import build_objective
    from llmft.stop import StopRequest
    from llmft.training.loop import LoopConfig, LoopHooks, LoopState, train_loop
    from llmft.training.optim import build_optimizer, build_scheduler

    optim = plan.recipe.optim
    tokenizer = load_tokenizer(plan.recipe.model)
    engine = build_engine(plan, env, tokenizer, lambda m: build_optimizer(m, optim, optim.lr))
    objective = build_objective(plan, engine)
    captured: dict[str, torch.Tensor] = {}
    step = engine.step

    def capture() -> float:
        captured.update(full_grads(engine))  # the last step's stay
        return step()

    engine.step = capture
    rows: list[dict] = []
    hooks = LoopHooks(log_train=rows.append, evaluate=lambda s: None, checkpoint=lambda s: None)
    scheduler = build_scheduler(engine.optimizer, optim, steps)
    args = (engine, objective, scheduler, iter(micro), batch_plan or plan.batch, env, LoopConfig(max_steps=steps))
    train_loop(*args, LoopState(), hooks, StopRequest())
    return captured, rows[-1]


def rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference (max |a - b| / max |b|) over the tensors of two state dicts."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-30)) for k in a)


def run_steps(plan, engine, steps: list[list[dict]], start: int, stop: int, load_from=None, save_to=None) -> dict:
    """Steps ``start`` .. ``stop`` of a pair objective's run through the real loop on a freshly built
    ``engine``, from a saved engine and schedule (``load_from``) or fresh; saves both to ``save_to``.
    Returns the trainable weights."""
    from llmft.job.dist import DistEnv
    from llmft.objectives import build_objective
    from llmft.stop import StopRequest
    from llmft.training.loop import LoopConfig, LoopHooks, LoopState, train_loop
    from llmft.training.optim import build_scheduler

    objective = build_objective(plan, engine)  # dropout off again on the new engine
    scheduler = build_scheduler(engine.optimizer, plan.recipe.optim, len(steps))
    if load_from is not None:
        engine.load(load_from, load_optimizer=True)
        scheduler.load_state_dict(torch.load(load_from / "scheduler.pt"))
    batches = iter([mb for step in steps[start:stop] for mb in step])
    hooks = LoopHooks(log_train=lambda row: None, evaluate=lambda s: None, checkpoint=lambda s: None)
    args = (engine, objective, scheduler, batches, plan.batch, DistEnv(), LoopConfig(max_steps=stop))
    train_loop(*args, LoopState(step=start), hooks, StopRequest())
    if save_to is not None:
        save_to.mkdir()
        engine.save(save_to, save_optimizer=True)
        torch.save(scheduler.state_dict(), save_to / "scheduler.pt")
    return {n: p.detach().clone() for n, p in engine.unwrap().named_parameters() if p.requires_grad}


def preference_plan(tmp_path, objective: str, method: str, micro: int, *extra: str):
    """The resolved plan of a tiny ``objective`` (dpo or reward) recipe under ``tmp_path``: SGD
    without clipping, global batch 4 pairs of ``micro`` per micro-batch, ``peft.method`` r=4,
    attention dropout on (it must not matter: preference runs turn dropout off); ``extra`` overrides."""
    from llmft.plan.resolve import resolve
    from llmft.recipe import load_recipe

    overrides = [
        f"train.objective={objective}",
        f"peft.method={method}",
        "peft.r=4",
        "model.config.attention_dropout=0.1",
        "batch.global_batch_size=4",
        f"batch.micro_batch_size={micro}",
        "optim.name=sgd",
        "optim.max_grad_norm=null",
        *extra,
    ]
    return resolve(load_recipe(write_recipe(tmp_path), overrides))
