"""Where a weight of a transformers 5 model lives in its safetensors files, for a reader that loads
shard by shard (``llmft.model.meta.SafetensorsWeights``) instead of through ``from_pretrained``.

transformers 5 holds a mixture of experts' routed experts fused (``mlp.experts.gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``), but the checkpoints on the Hub, and the ones its own
``save_pretrained`` writes, keep one tensor per expert (``mlp.experts.7.gate_proj.weight``) and
sometimes older module names (mixtral's ``block_sparse_moe``). ``from_pretrained`` converts them
with the family's conversion mapping (``transformers.conversion_mapping``); this module reads the
same mapping backwards: a model key becomes the checkpoint key it is renamed from, or a ``Fused``
record (per expert, the checkpoint keys concatenated into that expert's slice). Renamings, and
converters that stack experts (``MergeModulelist(dim=0)``), optionally after concatenating their
sources (``Concatenate``), are read; a family whose mapping needs anything else is left to
``from_pretrained`` (the caller reports the weight missing).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from llmft.errors import UserError
from llmft.plan.moe import moe_family


@dataclass(frozen=True)
class Fused:
    """A fused ``[E, ...]`` weight the checkpoint stores per expert: ``parts[e]`` are the checkpoint
    keys whose tensors, concatenated along ``dim``, are expert ``e``'s slice."""

    parts: tuple[tuple[str, ...], ...]
    dim: int

    def read(self, get: Any, index: tuple[slice, ...]) -> torch.Tensor:
        """Rows ``index`` (experts first) of the fused weight; ``get(key)`` reads one checkpoint tensor."""
        experts = range(len(self.parts))[index[0]] if index else range(len(self.parts))
        rows = []
        for e in experts:
            whole = torch.cat([get(key) for key in self.parts[e]], dim=self.dim)
            rows.append(whole[index[1:]] if len(index) > 1 else whole)
        return torch.stack(rows)

    def shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The fused weight's shape, from its parts' (``shapes``: checkpoint key -> shape)."""
        first = [list(shapes[k]) for k in self.parts[0]]
        whole = first[0]
        whole[self.dim] = sum(s[self.dim] for s in first)
        return (len(self.parts), *whole)


def checkpoint_key(
    key: str, files: dict[str, str], model_type: str | None, num_experts: int | None
) -> str | Fused | None:
    """Where model ``key`` is in a checkpoint whose keys are ``files``: the checkpoint key, a
    ``Fused`` record, or None."""
    mapping = _mapping(model_type)
    renames = [(s, t) for w in mapping if type(w).__name__ == "WeightRenaming" for s, t in _pairs(w)]
    found = _renamed(key, files, renames)
    if found is not None:
        return found
    for w in mapping:
        if type(w).__name__ != "WeightConverter" or not num_experts:
            continue
        concat = _stacking(w)
        if concat is None:
            continue
        for target in w.target_patterns:
            if not key.endswith(target):
                continue
            prefix = key[: len(key) - len(target)]
            parts = []
            for e in range(num_experts):
                keys = [_renamed(prefix + s.replace("*", str(e)), files, renames) for s in w.source_patterns]
                if any(k is None or isinstance(k, Fused) for k in keys):
                    break
                parts.append(tuple(keys))
            else:
                return Fused(tuple(parts), concat)
    return None


def _mapping(model_type: str | None) -> list[Any]:
    if not model_type:
        return []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without conversion mappings holds its checkpoints' names
        return []
    return list(get_checkpoint_conversion_mapping(model_type) or [])


def _pairs(w: Any) -> list[tuple[str, str]]:
    """A renaming's (checkpoint text, model text) pairs, the checkpoint side unescaped."""
    return [(re.sub(r"\\(.)", r"\1", s), t) for s, t in zip(w.source_patterns, w.target_patterns, strict=False)]


def _renamed(key: str, files: dict[str, str], renames: list[tuple[str, str]]) -> str | None:
    """``key`` itself or a name the renamings map to it, whichever the checkpoint holds."""
    candidates = [key]
    for source, target in reversed(renames):
        candidates += [c.replace(target, source) for c in candidates if target in c]
    return next((c for c in candidates if c in files), None)


def _stacking(w: Any) -> int | None:
    """For a converter that stacks per-expert tensors (``MergeModulelist(dim=0)``, then optionally
    ``Concatenate(dim=d)`` of its sources): the dimension of one expert's tensor its sources are
    concatenated along (d - 1; 0 with a single source). None for any other converter."""
    ops = [(type(o).__name__, getattr(o, "dim", None)) for o in getattr(w, "operations", [])]
    if ops == [("MergeModulelist", 0)] and len(w.source_patterns) == 1:
        return 0
    if len(ops) == 2 and ops[0] == ("MergeModulelist", 0) and ops[1][0] == "Concatenate" and (ops[1][1] or 0) >= 1:
        return ops[1][1] - 1
    return None


def to_model_keys(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict as ``save_pretrained`` wrote it (fused experts per expert, older module names)
    under ``model``'s own names, as ``from_pretrained`` would load it; keys it does not convert stay."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not _mapping(model_type):
        return state
    try:
        family = moe_family(config)
    except UserError:
        family = None
    num_experts = getattr(config, family.experts, None) if family is not None else None
    out = dict(state)
    for key in model.state_dict():
        if key in out:
            continue
        found = checkpoint_key(key, state, model_type, num_experts)
        if isinstance(found, Fused):
            out[key] = found.read(state.__getitem__, ())
            for part in found.parts:
                for k in part:
                    out.pop(k, None)
        elif found is not None:
            out[key] = out.pop(found)
    return out
