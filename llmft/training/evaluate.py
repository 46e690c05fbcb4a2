"""Eval: the objective's loss over the eval set (SFT: token-mean loss and perplexity; preference:
the pair-mean loss and the reward metrics), and exact-match accuracy of greedy generation on eval
prompts. Every rank runs the same number of forward calls (sharded engines
need all ranks in every collective), padding its share with no-target batches.

Which rank evaluates which items is ``llmft.data.sampler.eval_shard``; generation is
``llmft.model.generate``'s, as a rollout's.

A stop request cuts an eval short: generation ends at its next token, and after each batch (each
generate() call) every rank votes (``llmft.job.dist.cut_short``); if any was asked to stop, all raise
``stop.Abandoned`` and the eval writes no row (the loop checkpoints and stops)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from llmft import stop
from llmft.data import collate
from llmft.data.sampler import eval_shard
from llmft.data.sequence import rank_slice
from llmft.job.dist import DistEnv, all_reduce_sum, cut_short
from llmft.model.generate import Generation, HFGenerator, eos_ids
from llmft.model.vllm_backend import vllm_generator
from llmft.plan.layout import RunPlan

if TYPE_CHECKING:
    import numpy as np

    from llmft.engines import Engine
    from llmft.objectives import Objective


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
        self.vllm: Any = None  # train.eval_generate_backend vllm: the engine, made at the first eval

    def close(self) -> None:
        """Stop the eval's vLLM engine, if it made one."""
        if self.vllm is not None:
            close = getattr(self.vllm, "close", None)
            self.vllm = None
            if close is not None:
                close()

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
        mine, per = eval_shard(n, layout.dp_rank(self.env.rank), world)
        num_batches = math.ceil(per / self.micro)
        model = self.engine.model
        model.eval()
        one = torch.tensor(1.0, device=self.env.device)  # the numerator itself: divided once, below
        sums = [0.0] * (2 + len(self.objective.metric_names))  # loss numerator, count, metric sums
        for b in range(num_batches):
            idx = mine[b * self.micro : (b + 1) * self.micro]
            examples = [ds[i] for i in idx] or [ds[0]]  # a rank with no data left runs a dummy batch
            (batch,) = self.objective.prepare([self.collate(examples, self.tokenizer.pad_token_id)])
            batch = rank_slice(batch, layout, self.env.rank)
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
        mine, per = eval_shard(len(prompts), self.env.rank, self.env.world_size)
        real = len(mine)
        share = [prompts[i] for i in mine] + [prompts[0]] * (per - real)  # equal work on every rank
        self.engine.unwrap().eval()
        texts = self._generate([p for p, _ in share])
        correct = sum(text.strip() == ref.strip() for text, (_, ref) in zip(texts[:real], share[:real], strict=True))
        correct_all, total = all_reduce_sum([float(correct), float(real)], self.env.device)
        return {"exact_match": correct_all / max(total, 1.0), "generated": int(total)}

    def _generate(self, prompt_ids: list[np.ndarray]) -> list[str]:
        """Greedy completions of ``prompt_ids`` (the same number on every rank), as text: by
        transformers ``generate()`` on the model as the engine holds it, or (``train.eval_generate_backend:
        vllm``) by a vLLM engine given the trainer's weights first (made at the first eval, kept)."""
        tok = self.tokenizer
        generator: Any
        if self.recipe.train.eval_generate_backend == "vllm":
            if self.vllm is None:
                self.vllm = vllm_generator(self.recipe, self.engine.unwrap(), tok, self.env.device)
            generator = self.vllm
        else:
            generator = HFGenerator(
                self.engine.unwrap(),
                tok.pad_token_id,
                tok.eos_token_id,
                self.env.device,
                self.synced_gpus,
                self.engine.autocast,
            )
        how = Generation(
            max_new_tokens=self.recipe.train.eval_max_new_tokens,
            batch_size=max(self.micro, 8),
            what="eval generation",
            eos=eos_ids(tok),
        )
        return tok.batch_decode(generator.generate(prompt_ids, how), skip_special_tokens=True)
