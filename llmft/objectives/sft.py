"""SFT: the causal-LM loss, normalised by the target tokens of the whole global batch."""

from __future__ import annotations

from typing import Any

import torch

from llmft.data import batch_targets
from llmft.model import loss as lm_loss
from llmft.objectives import ObjectiveBase, model_inputs
from llmft.objectives.sequences import is_slice


def micro_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], num_items: torch.Tensor | None) -> torch.Tensor:
    """The loss of one micro-batch: the sum of its token losses divided by ``num_items`` (the target
    tokens of the whole global batch), so that summed gradients equal the big batch's. With
    ``num_items`` None: transformers' own token mean over this batch (references in verify).

    A model with the chunked loss installed (``model.chunked_loss``, ``llmft.model.loss``) returns the
    same loss from its LM head, a chunk of tokens at a time, and never holds the whole logits."""
    if is_slice(batch):  # this rank's sequence slice (llmft.data.sequence): targets already shifted
        return _slice_loss(model, batch, num_items)
    head = lm_loss.find(model)
    inputs = model_inputs(batch)  # not what only counts tokens (a packed batch's token_mask)
    if head is not None:
        with lm_loss.targets(head, batch["labels"], num_items):
            return model(**inputs, use_cache=False).logits  # the head returned the loss
    extra = {"num_items_in_batch": num_items} if num_items is not None else {}
    return model(**inputs, labels=batch["labels"], use_cache=False, **extra).loss


def _slice_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], num_items: torch.Tensor | None) -> torch.Tensor:
    """The loss of a sequence slice: its target-token sum / the global batch's count (each target
    token is in one slice, so the slices' gradients sum to the big batch's)."""
    assert num_items is not None, "a sequence slice's loss needs the global count"
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    head = lm_loss.find(model)
    if head is not None:
        with lm_loss.targets(head, batch["shift_labels"], num_items, shifted=True):
            return model(**inputs, use_cache=False).logits  # the head returned the loss
    return lm_loss.shifted_loss(model(**inputs, use_cache=False).logits, batch["shift_labels"], num_items)


class SFTObjective(ObjectiveBase):
    """Next-token loss on the target tokens; no metrics beyond the loss."""

    def count(self, batch: dict[str, Any]) -> int:
        return batch_targets(batch)

    def micro_loss(
        self, model: torch.nn.Module, batch: dict[str, Any], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        return micro_loss(model, batch, num_items), None
