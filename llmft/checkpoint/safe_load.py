"""Loading checkpoint files without running code from them (docs/design.md G7).

Every file llmft reads back from a checkpoint is safetensors, JSON, or a pickle read under a
restriction:

- ``torch_load``: ``torch.load(weights_only=True)`` (tensors, containers and plain values);
  a file that needs more is refused with a ``UserError`` naming it (torch's own message
  suggests ``weights_only=False``, which is exactly what must not be done with a file one did
  not write).
- DCP metadata (``llmft.engines.safe_dcp``): an unpickler that allows only the classes DCP
  metadata is made of.
- DeepSpeed's pickles (``llmft.engines.safe_deepspeed``): scanned, without being executed,
  against the globals real DeepSpeed checkpoints hold, before DeepSpeed opens them.
"""

from __future__ import annotations

import os
import pickle
from typing import IO, Any

from llmft.errors import Problem, UserError

FIX = (
    "It was not written by llmft for this kind of checkpoint, or it was changed since: do not load it. "
    "Use a checkpoint from a run you trust, or train again."
)


def refused(path: str | os.PathLike, what: str) -> UserError:
    """The error for a checkpoint file that would run code (or is not what it should be)."""
    return UserError(Problem(str(path), f"refused: {what}", FIX))


def torch_load(source: str | os.PathLike | IO[bytes], *, name: str | os.PathLike | None = None, **kwargs: Any) -> Any:
    """``torch.load(weights_only=True)``; a file that holds anything else is refused by name."""
    import torch

    try:
        return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        raise refused(
            name if name is not None else source,
            f"it holds Python objects that a tensor file does not ({_unpickler_reason(e)}); loading it could run code",
        ) from None
    except OSError as e:
        raise UserError(
            Problem(
                str(name if name is not None else source),
                f"cannot be read ({e.strerror or e})",
                "Restore the file, resume from an earlier checkpoint, or (for a missing optimizer.pt) resume without "
                "optimizer state: checkpoint.save_optimizer=false.",
            )
        ) from None
    except (
        RuntimeError,
        ValueError,
        IndexError,
        KeyError,
        EOFError,
        OverflowError,
        MemoryError,
        AssertionError,  # torch's weights_only unpickler asserts on a malformed persistent id
        TypeError,
    ) as e:
        # a damaged file that passed the structural checks (a byte changed inside an entry)
        where = name if name is not None else source
        raise UserError(
            Problem(
                str(where),
                f"is damaged: torch.load cannot read it ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
                "Resume from an earlier checkpoint, or restore the file.",
            )
        ) from None


def _unpickler_reason(e: Exception) -> str:
    """The one sentence of torch's weights_only error that says what was found (its advice,
    ``weights_only=False``, is left out on purpose)."""
    text = str(e)
    _, marker, rest = text.partition("WeightsUnpickler error: ")
    reason = (rest if marker else text).split(". ")[0].split("\n")[0].strip().rstrip(".")
    return reason or "not a plain tensor file"


def without_remote_code(recipe: Any, source: str | os.PathLike, *, trust_remote_code: bool) -> Any:
    """A checkpoint's recipe with ``model.trust_remote_code`` taken from the command line, never
    from the checkpoint (docs/design.md G7: a checkpoint must not switch remote code on for itself)."""
    import logging

    if recipe.model.trust_remote_code and not trust_remote_code:
        logging.getLogger("llmft").warning(
            "%s asks for model.trust_remote_code=true; ignored (a checkpoint cannot turn remote code on). "
            "Pass --trust-remote-code if you have read that model code and trust it.",
            source,
        )
    recipe.model.trust_remote_code = trust_remote_code
    return recipe
