"""Long-sequence memory switches on a built model: ``model.activation_offload`` and ``model.tiled_mlp``.

Both trade compute or host traffic for device memory, with the field's own mechanisms:

- **Activation offload** keeps the input each checkpointed decoder layer saves (the only activation
  a checkpointed layer keeps across forward and backward: ``L x tokens x hidden`` in the compute
  dtype) in host memory. Non-reentrant ``torch.utils.checkpoint`` saves those inputs as saved
  tensors, so torch's own ``torch.autograd.graph.save_on_cpu`` around the checkpoint call moves
  them to (pinned, on CUDA) host memory in forward and back, one layer at a time, in backward. The
  tensors saved inside the layer are the checkpoint's (recomputed), so nothing else moves.
- **Tiled MLP** computes each decoder layer's MLP in tiles of the sequence with DeepSpeed's
  ``TiledMLP`` (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``, from Arctic Long Sequence
  Training): forward runs the tiles without saving anything but the MLP's input, backward recomputes
  one tile at a time, so the ``tokens x intermediate_size`` gate/up/product tensors exist for one
  tile only. Tiles hold ``hidden_size`` tokens, as ALST sizes them (``tile_count``).
  ``TiledMLP``'s backward back-propagates each tile on its own, so a parameter's gradient arrives
  once per tile: DeepSpeed holds it until the last tile, but DDP's and FSDP2's hooks would reduce
  it after the first. Under those engines (``EngineSpec.tiled_mlp == "checkpoint"``) each tile is
  one non-reentrant ``torch.utils.checkpoint`` instead: the same memory (a tile saves only its
  input, a view of the MLP's; backward recomputes one tile at a time), and autograd sums the tiles'
  contributions before a parameter's gradient is ready, once. The checkpoint replays the tile's
  random state, so LoRA dropout on the MLP is allowed there.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from typing import TYPE_CHECKING, Any, Callable

import torch

from llmft.model.structure import decoder_layer_classes

if TYPE_CHECKING:
    from llmft.recipe.schema import ModelConfig


def apply(model: torch.nn.Module, m: ModelConfig, tiling: str = "TiledMLP") -> None:
    """Turn on ``m.activation_offload`` and ``m.tiled_mlp`` on a built model (PEFT-wrapped or not),
    after gradient checkpointing is enabled and before an engine wraps it; ``tiling``: the engine's
    ``EngineSpec.tiled_mlp``."""
    if m.activation_offload:
        offload_checkpointed_inputs(model)
    if m.tiled_mlp:
        tile_mlps(model, tiling)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    classes = decoder_layer_classes(model)
    return [mod for mod in model.modules() if classes and isinstance(mod, classes)]


# --- activation offload -------------------------------------------------------------------------


def offload_checkpointed_inputs(model: torch.nn.Module) -> None:
    """Every checkpointed decoder layer saves its input in host memory (``save_on_cpu``)."""
    layers = [layer for layer in decoder_layers(model) if getattr(layer, "gradient_checkpointing", False)]
    assert layers, "activation offload needs gradient checkpointing on the decoder layers (checked at resolve)"
    for layer in layers:
        layer._gradient_checkpointing_func = functools.partial(offloaded_checkpoint, layer._gradient_checkpointing_func)


def offloaded_checkpoint(checkpoint_fn: Callable[..., Any], function: Callable[..., Any], *args: Any) -> Any:
    """``checkpoint_fn(function, *args)`` with the tensors it saves (the layer's inputs) in host memory."""
    pin = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)  # pinned: full-bandwidth copies
    with torch.autograd.graph.save_on_cpu(pin_memory=pin):
        return checkpoint_fn(function, *args)


# --- tiled MLP ----------------------------------------------------------------------------------


def tile_count(tokens: int, hidden_size: int) -> int:
    """Tiles of about ``hidden_size`` tokens each (ALST's choice: a tile's gate/up outputs are then no
    bigger than an MLP weight); agreed across ranks by the caller where collectives run per tile."""
    return max(1, math.ceil(tokens / hidden_size))


def tile_mlps(model: torch.nn.Module, tiling: str = "TiledMLP") -> None:
    """Every decoder layer's ``mlp`` computes in sequence tiles: with DeepSpeed's ``TiledMLP``
    (``tiling`` "TiledMLP"), or one checkpoint per tile ("checkpoint"; module docstring)."""
    mlps = [layer.mlp for layer in decoder_layers(model) if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]
    assert mlps, "tiled MLP needs decoder layers with an .mlp module"
    tiled = {"TiledMLP": tiled_forward, "checkpoint": checkpointed_tiles_forward}[tiling]
    for mlp in mlps:
        mlp.forward = types.MethodType(functools.partial(tiled, mlp.forward), mlp)


def checkpointed_tiles_forward(
    untiled: Callable[[torch.Tensor], torch.Tensor], mlp: torch.nn.Module, x: torch.Tensor
) -> torch.Tensor:
    """The MLP of ``x`` (batch, tokens, hidden), each sequence tile under its own non-reentrant
    checkpoint: forward saves only the tiles' inputs, backward recomputes one tile at a time, and
    each parameter's gradient is ready once, summed over the tiles. Eval and no-grad run it whole."""
    if not torch.is_grad_enabled() or x.dim() < 2:
        return untiled(x)
    from torch.utils.checkpoint import checkpoint

    # No collective runs per tile here (unlike ZeRO-3's gathers under TiledMLP): each rank cuts its own rows.
    pieces = torch.tensor_split(x, tile_count(x.shape[-2], x.shape[-1]), dim=-2)
    return torch.cat([checkpoint(untiled, piece, use_reentrant=False) for piece in pieces], dim=-2)


def tiled_forward(
    untiled: Callable[[torch.Tensor], torch.Tensor], mlp: torch.nn.Module, x: torch.Tensor
) -> torch.Tensor:
    """The MLP of ``x`` (batch, tokens, hidden) computed tile by tile with DeepSpeed's ``TiledMLP``;
    eval and no-grad use the plain one."""
    if not torch.is_grad_enabled() or x.dim() < 2:
        return untiled(x)
    # Imported here: deepspeed's import takes seconds and only a tiled run needs it.
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    tiles = _agreed(tile_count(x.shape[-2], x.shape[-1]), x.device)
    # TiledMLP recomputes each tile in backward, outside the forward's autocast: replay it there so the
    # recomputed tile has the forward's dtypes (and so the same gradients).
    cast = _autocast_state(x.device.type)

    def run(module: torch.nn.Module, tile: torch.Tensor) -> torch.Tensor:
        with cast():
            return untiled(tile)

    params = [p for p in mlp.parameters() if p.requires_grad]  # ZeRO: hold their gradients until the last tile
    return TiledMLP.apply(run, mlp, x, tiles, params)


def _autocast_state(device_type: str) -> Callable[[], contextlib.AbstractContextManager]:
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext
    dtype = torch.get_autocast_dtype(device_type)
    return functools.partial(torch.autocast, device_type=device_type, dtype=dtype)


def _agreed(tiles: int, device: torch.device) -> int:
    """The most tiles any rank needs: under ZeRO-3 each tile gathers the MLP's weights, a collective
    every rank must make the same number of times (ranks hold rows of different lengths)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return tiles
    t = torch.tensor([tiles], device=device if dist.get_backend() != "gloo" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
