"""Eval: the objective's loss over the eval set (SFT: token-mean loss and perplexity; preference:
the pair-mean loss and the reward metrics), and exact-match accuracy of greedy generation on eval
prompts. Every rank runs the same number of forward calls (sharded engines
need all ranks in every collective), padding its share with no-target batches.

A stop request cuts an eval short: generation ends at its next token, and after each batch (each
generate() call) every rank votes (``llmft.job.dist.cut_short``); if any was asked to stop, all raise
``stop.Abandoned`` and the eval writes no row (the loop checkpoints and stops)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from llmft import stop
from llmft.data import collate
from llmft.data.sequence import sequence_slice
from llmft.job.dist import DistEnv, all_reduce_sum, cut_short
from llmft.objectives.rollout import stop_criteria
from llmft.plan.layout import RunPlan

if TYPE_CHECKING:
    import numpy as np

    from llmft.engines import Engine
    from llmft.objectives import Objective


def _shard(n: int, rank: int, world: int) -> range:
    per = math.ceil(n / world)
    return range(min(rank * per, n), min((rank + 1) * per, n))


class Evaluator:
    def __init__(self, plan: RunPlan, env: DistEnv, engine: Engine, data, tokenizer, objective: Objective) -> None:
        self.recipe, self.env, self.engine, self.data, self.tokenizer = plan.recipe, env, engine, data, tokenizer
        self.objective = objective
        # examples -> micro-batch, as the training loader collates (a preference run's pairs too).
        self.collate: Callable[[list[Any], int], dict[str, Any]] = collate
        self.counts = plan.objective_spec.counts  # what the eval's count is named by (tokens, pairs, ...)
        self.per_token = self.counts == "tokens"  # a token mean has a perplexity
        self.micro = plan.batch.micro_batch_size
        # Where the parameters are sharded every rank must join every forward of generate() (each
        # gathers its layers from all ranks), also after its own sequences are done: synced_gpus.
        # The plan's decision, not distributed.engine, which may be auto.
        self.synced_gpus = plan.layout.shards_params and plan.layout.dp_size > 1
        # Sequence parallelism: a group shares each eval batch, each rank its slice of the tokens.
        self.layout = plan.layout

    @torch.no_grad()
    def run(self, step: int) -> dict[str, Any] | None:
        with stop.during(stop.EVALUATING):
            return self._run(step)

    def _run(self, step: int) -> dict[str, Any] | None:
        row: dict[str, Any] = {"split": "eval", "step": step}
        if self.data.eval is not None and len(self.data.eval):
            cap = self.recipe.train.eval_max_batches
            own = self.objective.evaluate(
                self.data.eval, self.env, cap * self.micro * self.layout.dp_size if cap else None
            )
            row.update(own if own is not None else self._loss())
        if self.recipe.train.eval_generate_samples and self.data.eval_prompts:
            row.update(self._exact_match())
        return row if len(row) > 2 else None

    def _loss(self) -> dict[str, float]:
        """The objective's loss over the eval set: its summed numerator over its summed count (the
        loss of one batch holding the whole eval set), with its metrics as means over the same count."""
        ds, world, layout = self.data.eval, self.layout.dp_size, self.layout
        n = len(ds)
        if self.recipe.train.eval_max_batches is not None:
            n = min(n, self.recipe.train.eval_max_batches * self.micro * world)
        mine = list(_shard(n, layout.dp_rank(self.env.rank), world))
        num_batches = math.ceil(math.ceil(n / world) / self.micro)
        model = self.engine.model
        model.eval()
        one = torch.tensor(1.0, device=self.env.device)  # the numerator itself: divided once, below
        sums = [0.0] * (2 + len(self.objective.metric_names))  # loss numerator, count, metric sums
        for b in range(num_batches):
            idx = mine[b * self.micro : (b + 1) * self.micro]
            examples = [ds[i] for i in idx] or [ds[0]]  # a rank with no data left runs a dummy batch
            (batch,) = self.objective.prepare([self.collate(examples, self.tokenizer.pad_token_id)])
            if layout.sp > 1:
                batch = sequence_slice(batch, layout.sp_rank(self.env.rank), layout.sp)
            batch = {k: v.to(self.env.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            with self.engine.autocast():
                loss, metric_sums = self.objective.micro_loss(model, batch, one)
            if idx:  # the dummy batch joined the collectives only
                values = [float(loss), float(self.objective.count(batch))]
                values += metric_sums.tolist() if metric_sums is not None else []
                sums = [a + v for a, v in zip(sums, values, strict=True)]
            cut_short("eval", self.env.device)
        loss_sum, count, *metric_totals = all_reduce_sum(sums, self.env.device)
        loss = loss_sum / max(count, 1.0)
        if self.per_token:
            return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(count)}
        return {"loss": loss, self.counts: int(count), **self.objective.metrics(metric_totals, count)}

    def _exact_match(self) -> dict[str, float]:
        prompts = self.data.eval_prompts[: self.recipe.train.eval_generate_samples]
        world, rank = self.env.world_size, self.env.rank
        per = math.ceil(len(prompts) / world)
        mine = prompts[rank * per : (rank + 1) * per]
        real = len(mine)
        mine = mine + [prompts[0]] * (per - real)  # equal work on every rank
        model = self.engine.unwrap()
        model.eval()
        correct = 0
        batch_size = max(self.micro, 8)
        for start in range(0, per, batch_size):
            chunk = mine[start : start + batch_size]
            texts = self._generate([p for p, _ in chunk])
            for j, (text, (_, ref)) in enumerate(zip(texts, chunk, strict=True)):
                if start + j < real and text.strip() == ref.strip():
                    correct += 1
            cut_short("eval generation", self.env.device)
        correct_all, total = all_reduce_sum([float(correct), float(real)], self.env.device)
        return {"exact_match": correct_all / max(total, 1.0), "generated": int(total)}

    def _generate(self, prompt_ids: list[np.ndarray]) -> list[str]:
        tok = self.tokenizer
        width = max(len(p) for p in prompt_ids)
        pad = tok.pad_token_id
        input_ids = torch.full((len(prompt_ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for row, p in enumerate(prompt_ids):  # left-padded, filled from the prompt arrays: no list per token
            if len(p):
                input_ids.numpy()[row, width - len(p) :] = p
                mask[row, width - len(p) :] = 1
        input_ids, mask = input_ids.to(self.env.device), mask.to(self.env.device)
        model = self.engine.unwrap()
        with self.engine.autocast():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=self.recipe.train.eval_max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=tok.eos_token_id,
                synced_gpus=self.synced_gpus,
                stopping_criteria=stop_criteria(),
            )
        return tok.batch_decode(out[:, width:], skip_special_tokens=True)
