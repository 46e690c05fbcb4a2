"""The head a run trains on top of the decoder, as the objective's record names it
(``ObjectiveSpec.head``, ``llmft.plan.objectives``): the causal-LM head (``lm``), or a scalar score
head (``score``, reward models).

- ``lm``: ``AutoModelForCausalLM``, the model as it is saved.
- ``score``: ``AutoModelForSequenceClassification`` with ``num_labels: 1`` (a ``score`` linear layer,
  hidden size -> 1, no bias, on every token's last hidden state) and ``pad_token_id`` set on its
  config, as transformers' sequence-classification models need it to find a row's last token. A
  causal-LM checkpoint has no ``score`` weight: it starts from llmft's seeded init
  (``initial_head_weights``: normal(0, ``initializer_range``) drawn from ``run.seed``, the
  distribution of transformers' own init), so that a model built whole, on the meta device
  (FSDP2) or partitioned (ZeRO-3) starts from the same head on every engine and world size. A
  checkpoint that has one (a reward model trained before) is loaded as it is. With LoRA/DoRA/QLoRA
  the head is trained and saved with the adapter (PEFT ``task_type: SEQ_CLS``, which puts
  ``score`` in ``modules_to_save``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterator

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from llmft.model.adapters import base_key
from llmft.plan.objectives import objective_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from llmft.recipe.schema import Recipe

log = logging.getLogger("llmft")

LM, SCORE = "lm", "score"
MODEL_CLASSES = {LM: AutoModelForCausalLM, SCORE: AutoModelForSequenceClassification}
PEFT_TASK_TYPES = {LM: "CAUSAL_LM", SCORE: "SEQ_CLS"}
SCORE_MODULE = "score"  # transformers' name of the scalar head (GenericForSequenceClassification.score)


def recipe_head(recipe: Recipe) -> str:
    """The head of ``recipe``'s objective (its registry record's ``head``)."""
    return objective_of(recipe).head


def model_class(head: str) -> Any:
    return MODEL_CLASSES[head]


def configure(config: PretrainedConfig, head: str, tokenizer: Any) -> None:
    """A score head's config: one label, and the pad token that marks where a row's text ends."""
    if head != SCORE:
        return
    config.num_labels = 1
    text = config.get_text_config()
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None:
        pad = text.pad_token_id if text.pad_token_id is not None else text.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    config.pad_token_id = text.pad_token_id = pad
    if pad is not None and pad == getattr(tokenizer, "eos_token_id", None):
        log.warning(
            "the tokenizer's pad token is its eos token (id %d): training scores each sequence at its last token "
            "(its eos), but transformers' sequence classifier scores the rightmost token that is not pad, the one "
            "before a final eos; give the tokenizer a pad token of its own for an export that scores alike",
            pad,
        )


def head_keys(model: torch.nn.Module) -> dict[str, torch.Size]:
    """The score head's parameters of a base model (PEFT's inner model): base-model name -> shape;
    empty for an LM head."""
    score = getattr(model, SCORE_MODULE, None)
    if score is None or not type(model).__name__.endswith("ForSequenceClassification"):
        return {}
    # PEFT's modules_to_save wrapper holds the head twice (original and trained copy): one base name
    return {base_key(f"{SCORE_MODULE}.{name}"): p.shape for name, p in score.named_parameters()}


def initial_head_weights(model: torch.nn.Module, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The seeded initial score head (base-model names, fp32, on CPU): normal(0, initializer_range)
    for weights, zeros for a bias, drawn from ``seed`` in name order."""
    std = float(getattr(model.config.get_text_config(), "initializer_range", 0.02))
    generator = torch.Generator().manual_seed(seed)
    for name, shape in sorted(head_keys(model).items()):
        if name.endswith("bias"):
            yield name, torch.zeros(shape)
        else:
            yield name, torch.empty(shape).normal_(0.0, std, generator=generator)


def init_head(model: torch.nn.Module, seed: int, missing: list[str]) -> None:
    """Give the score head weights the checkpoint did not hold (``missing``) their seeded init."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in initial_head_weights(model, seed):
            if name in missing:
                params[name].copy_(value.to(params[name].dtype))
