"""Reward models (``train.objective: reward``): a scalar score head trained on chosen/rejected pairs.

The model is the objective's ``score`` head (``llmft.model.heads``: a sequence classifier with one
label). The score of a sequence is the head's output at its LAST token, what transformers'
sequence-classification models return (their rightmost non-pad token); here the last token is
found from ``sequence_index`` (the contract batch of docs/preference.md), so padded rows and a
padding-free packed row give the same scores. The head's per-token outputs are read from a
forward hook on it: the model runs its own forward (every engine's hooks, FSDP2's unsharding,
ZeRO-3's gathering), and the pooled output transformers computes from ``pad_token_id`` (which a
packed row would confuse) is not used.

Loss (Bradley-Terry, as InstructGPT and TRL's ``RewardTrainer``): ``-log sigmoid(r_chosen -
r_rejected)`` per pair, and, like every preference objective, the micro loss is the sum over this
micro-batch's pairs divided by the global batch's pair count, so any split is the same step.

With sequence parallelism (``distributed.sequence_parallel``) each rank of a group holds a slice
of every sequence; a sequence's last token, marked by the slice's ``sequence_last``
(``llmft.data.sequence``), is in one slice only. Each rank scores the sequences whose last token
it holds (0 for the others) and the group sums the scores with their gradients, as the DPO
objective sums log-probs: every rank then computes the same pair losses and takes 1/N of them.

Metrics (global-batch means, the DPO names where they mean the same thing): ``rewards/chosen``
and ``rewards/rejected`` (the mean scores), ``rewards/accuracy`` (the fraction of pairs whose
chosen score is strictly above the rejected one), ``rewards/margin`` (the mean of r_chosen -
r_rejected). There are no log-probs: a score head predicts no tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from llmft.model.heads import SCORE_MODULE
from llmft.objectives import Models, ObjectiveBase, disable_dropout, model_inputs
from llmft.objectives.sequences import SequenceSlices, is_slice
from llmft.plan.layout import RunPlan


def last_token_positions(sequence_index: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """The flat position (in ``sequence_index.reshape(-1)``) of each sequence's last token, ``[num_sequences]``."""
    flat = sequence_index.reshape(-1)
    positions = torch.arange(flat.numel(), device=flat.device)
    valid = flat >= 0
    last = torch.full((num_sequences,), -1, dtype=torch.long, device=flat.device)
    last = last.scatter_reduce(0, flat[valid], positions[valid], reduce="amax")
    assert bool((last >= 0).all()), "every sequence of a micro-batch has at least one token"
    return last


def sequence_scores(token_scores: torch.Tensor, sequence_index: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Each sequence's score, ``[num_sequences]`` (fp32): the head's output at its last token.
    ``token_scores``: the head's output on every token, ``[R, T, 1]`` (or ``[R, T]``)."""
    flat = token_scores.reshape(sequence_index.numel(), -1)
    assert flat.shape[1] == 1, f"a reward model's head has one output per token, not {flat.shape[1]}"
    return flat[last_token_positions(sequence_index, num_sequences), 0].float()


def slice_scores(token_scores: torch.Tensor, batch: dict[str, Any], num_sequences: int) -> torch.Tensor:
    """A sequence slice's part of each sequence's score, ``[num_sequences]`` (fp32): the head's output
    at the sequence's last token where this slice holds it, 0 where another slice does."""
    last = batch["sequence_last"].reshape(-1)
    flat = token_scores.reshape(last.numel(), -1)
    assert flat.shape[1] == 1, f"a reward model's head has one output per token, not {flat.shape[1]}"
    owners = batch["sequence_index"].reshape(-1)[last]
    return flat.new_zeros(num_sequences, dtype=torch.float32).index_add(0, owners, flat[last, 0].float())


def score_module(model: torch.nn.Module) -> torch.nn.Module:
    """The score head of a (PEFT-wrapped) sequence classifier: PEFT's modules_to_save wrapper of it
    when there is one (its output is the trained copy's)."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    head = getattr(base, SCORE_MODULE, None)
    assert head is not None, f"{type(base).__name__} has no {SCORE_MODULE} head: not built for train.objective=reward"
    return head


class RewardObjective(ObjectiveBase):
    """A Bradley-Terry reward model over the contract batch (see the module docstring)."""

    def __init__(self, plan: RunPlan, models: Models) -> None:
        super().__init__(plan, models)
        policy = models.unwrap()
        disable_dropout(policy)  # the scores of a pair must not depend on how the batch is split
        self._token_scores: torch.Tensor | None = None
        score_module(policy).register_forward_hook(self._keep)
        self.slices = SequenceSlices(plan.layout)

    def _keep(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        self._token_scores = output

    def count(self, batch: dict[str, Any]) -> int:
        return self.slices.count(int(batch["num_pairs"]))

    def scores(self, model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) scores of the micro-batch's pairs, ``[P]`` each."""
        self._token_scores = None
        model(**model_inputs(batch), use_cache=False)
        token_scores, self._token_scores = self._token_scores, None
        assert token_scores is not None, "the forward did not run the score head"
        n = 2 * int(batch["num_pairs"])
        if is_slice(batch):  # this rank's slice: its part of the scores (``sequence_last``), summed over the group
            scores = self.slices.whole(slice_scores(token_scores, batch, n))
        else:
            scores = sequence_scores(token_scores, batch["sequence_index"], n)
        return scores[0::2], scores[1::2]

    def micro_loss(
        self, model: torch.nn.Module, batch: dict[str, Any], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected = self.scores(model, batch)
        margin = chosen - rejected
        # With sequence parallelism every rank of the group has the same scores: each takes 1/N.
        loss = self.slices.share(-F.logsigmoid(margin).sum() / num_items)
        margin = margin.detach()
        sums = torch.stack([chosen.detach().sum(), rejected.detach().sum(), (margin > 0).float().sum(), margin.sum()])
        return loss, self.slices.share(sums)
