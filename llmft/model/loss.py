"""Chunked cross-entropy: the LM head and the loss computed a few hundred tokens at a time.

The plain path (transformers' ``ForCausalLMLoss``) materialises the logits of the whole
micro-batch in the compute dtype, an fp32 copy, and the fp32 log-softmax cross-entropy saves
for backward: ``tokens x vocab x (a + 8)`` bytes at once, and its backward 12 (5.9 GiB for 4096 tokens at vocab
128k). Here the head's input is split into chunks of ``chunk_tokens`` rows; each chunk's
logits and loss run under non-reentrant activation checkpointing, so forward keeps only the
chunk's input (a view of the hidden states) and backward recomputes one chunk at a time. The
loss is the same sum of token losses divided by the same count, the gradients are the same
(summed in another order: equal to float rounding), and at most one chunk's logits exist.

How it plugs in: ``install`` replaces the ``forward`` of the model's output-embedding module
(``lm_head``) by a ``ChunkedHead``. Outside ``targets(...)`` it is the original forward (eval,
generation and export see the plain module). Inside, the model's forward hands it the final
hidden states and it returns the loss instead of logits; ``loop.micro_loss`` reads it from
``output.logits``. Inside ``token_logps(...)`` it returns instead the log-prob of given token ids at
every position (``[rows, tokens]``, chunk by chunk the same way): the per-sequence log-probs of the
preference objectives without the logits. The model calls the head once (its hooks run once: DeepSpeed ZeRO-3
gathers it there, and before backward); the chunks call its original forward. The parameter names and the module tree are unchanged (checkpoints,
FSDP2 sharding and PEFT see the same model).

Where a fused GPU kernel (e.g. Liger's fused linear cross-entropy) is available, it would
replace ``chunked_cross_entropy`` below: same inputs (hidden states, a callable head, shifted
labels, the divisor), same output (the divided loss).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from llmft.plan.memory import loss_chunk_tokens

IGNORE_INDEX = -100


def chunked_cross_entropy(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    num_items: torch.Tensor | None,
    chunk_tokens: int,
    shifted_labels: bool = False,
) -> torch.Tensor:
    """Causal-LM loss of ``head(hidden)`` against ``labels`` (unshifted, as transformers takes
    them; already shifted with ``shifted_labels``, as a sequence slice holds them):
    sum of token losses / ``num_items``, or the token mean when ``num_items`` is None."""
    # transformers' shift: position t predicts labels[t + 1]; the last position predicts nothing.
    shifted = (labels if shifted_labels else F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]).reshape(-1)
    flat = hidden.reshape(-1, hidden.shape[-1])
    total = None
    for start in range(0, flat.shape[0], chunk_tokens):
        end = start + chunk_tokens
        part = checkpoint(_chunk_loss, head, flat[start:end], shifted[start:end], use_reentrant=False)
        total = part if total is None else total + part
    assert total is not None
    if num_items is None:
        return total / (shifted != IGNORE_INDEX).sum()
    return total / num_items.to(total.device)


def _chunk_loss(head: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # As transformers: logits in the head's dtype, upcast to fp32 for the cross-entropy.
    return F.cross_entropy(head(x).float(), y, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_token_logps(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, token_ids: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """``log p(token_ids[..., t] | position t)`` under ``head(hidden)``, shaped like ``token_ids``,
    computed ``chunk_tokens`` rows at a time as the chunked loss is (the preference objectives sum
    them per sequence: llmft.objectives.preference)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    ids = token_ids.reshape(-1)
    parts = [
        checkpoint(
            _chunk_logps,
            head,
            flat[start : start + chunk_tokens],
            ids[start : start + chunk_tokens],
            use_reentrant=False,
        )
        for start in range(0, flat.shape[0], chunk_tokens)
    ]
    return torch.cat(parts).reshape(token_ids.shape)


def _chunk_logps(head: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -F.cross_entropy(head(x).float(), y, reduction="none")


class ChunkedHead:
    """The ``forward`` of an output-embedding module that turns into the chunked loss while
    ``targets`` are set (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, chunk_tokens: int) -> None:
        self.module = module
        self.original = module.forward
        self.chunk_tokens = chunk_tokens
        self.labels: torch.Tensor | None = None
        self.num_items: torch.Tensor | None = None
        self.token_ids: torch.Tensor | None = None  # set by ``token_logps``
        self.shifted = False  # labels already shifted (a sequence slice: llmft.data.sequence)

    def __call__(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.token_ids is not None:
            return chunked_token_logps(self.original, hidden, self.token_ids, self.chunk_tokens)
        if self.labels is None:
            return self.original(hidden, *args, **kwargs)
        # The chunks call the head's own forward: this call went through module(...), so hooks
        # on the head ran once, whatever the number of chunks (ZeRO-3 gathers the head here and
        # again, through the output's backward hook, before the chunks are recomputed). Ranks
        # with different token counts make the same collectives.
        return chunked_cross_entropy(
            self.original, hidden, self.labels, self.num_items, self.chunk_tokens, shifted_labels=self.shifted
        )


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DDP / DeepSpeed wrap the model in .module


def install(model: torch.nn.Module, chunk_tokens: int | None = None) -> ChunkedHead:
    """Make ``model``'s LM head compute the chunked loss inside ``targets``. ``chunk_tokens``:
    rows per chunk, by default from the vocabulary size (``plan.memory.loss_chunk_tokens``)."""
    head = _unwrap(model).get_output_embeddings()
    if isinstance(head.forward, ChunkedHead):
        return head.forward
    if chunk_tokens is None:
        chunk_tokens = loss_chunk_tokens(_unwrap(model).config.get_text_config().vocab_size)
    chunked = ChunkedHead(head, chunk_tokens)
    head.forward = chunked
    return chunked


def find(model: torch.nn.Module) -> ChunkedHead | None:
    """The installed chunked head of ``model``, if any."""
    model = _unwrap(model)
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    forward = getattr(head, "forward", None)
    return forward if isinstance(forward, ChunkedHead) else None


@contextlib.contextmanager
def targets(
    head: ChunkedHead, labels: torch.Tensor, num_items: torch.Tensor | None, *, shifted: bool = False
) -> Iterator[None]:
    """While inside, the model's forward returns the loss of ``labels`` in place of logits
    (``shifted``: the labels are already the targets of each position)."""
    head.labels, head.num_items, head.shifted = labels, num_items, shifted
    try:
        yield
    finally:
        head.labels, head.num_items, head.shifted = None, None, False


@contextlib.contextmanager
def token_logps(head: ChunkedHead, token_ids: torch.Tensor) -> Iterator[None]:
    """While inside, the model's forward returns, in place of logits, the log-prob of
    ``token_ids[r, t]`` at every position ``(r, t)`` (shape of ``token_ids``), one chunk at a time."""
    head.token_ids = token_ids
    try:
        yield
    finally:
        head.token_ids = None


def shifted_loss(logits: torch.Tensor, shift_labels: torch.Tensor, num_items: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss for targets already shifted (a sequence slice): the fp32
    cross-entropy sum of the target tokens / ``num_items``."""
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss / num_items.to(loss.device)
