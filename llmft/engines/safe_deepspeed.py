"""DeepSpeed's pickles checked before DeepSpeed opens them (docs/design.md G7).

DeepSpeed saves ``*_model_states.pt`` and ``*_optim_states.pt`` with ``torch.save`` and reads
them back with ``torch.load(weights_only=False)`` (resume, ``ds_to_universal``, ``zero_to_fp32``
for export): a crafted file would run code. llmft cannot change how DeepSpeed loads, so before
any of those runs, ``check_deepspeed_files`` scans every ``.pt`` file of the checkpoint's
``deepspeed/`` and ``deepspeed_universal/`` folders *without executing it*
(``torch.serialization.get_unsafe_globals_in_checkpoint`` reads the pickle's opcodes) and
refuses any global outside ``DEEPSPEED_GLOBALS``, naming the file and the global. A symbolic
link anywhere in the checkpoint is refused first: DeepSpeed would follow it to a file the scan
never saw (``Path.rglob`` does not descend into a linked folder).

``DEEPSPEED_GLOBALS`` holds what real llmft DeepSpeed checkpoints contain beyond what
``weights_only`` allows anyway (tensors, containers, plain values), found by scanning the
checkpoints of ZeRO 0-3, full and LoRA, fp32 and bf16, and their universal conversions
(DeepSpeed 0.19): the loss scaler and ZeRO stage enum DeepSpeed records in its client state,
and the fragment addresses ZeRO 1-2 store for the universal conversion. All three are plain
data classes; none runs code on unpickling. A DeepSpeed upgrade that stores another class is
refused with the class named: it is added here after reading what it is.
"""

from __future__ import annotations

from pathlib import Path

from llmft.checkpoint.layout import DS_DIR, UNIVERSAL_DIR
from llmft.checkpoint.safe_load import refused
from llmft.checkpoint.verify import check_confined

DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)


def unexpected_globals(path: Path) -> list[str]:
    """Globals the pickle in ``path`` would import that neither ``weights_only`` nor
    ``DEEPSPEED_GLOBALS`` allows (read from its opcodes, nothing is executed)."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        found = get_unsafe_globals_in_checkpoint(str(path))
    except Exception as e:  # not a torch zip file: DeepSpeed would still unpickle it
        raise refused(path, f"not a torch checkpoint file that can be checked ({type(e).__name__}: {e})") from None
    return sorted(g for g in found if g not in DEEPSPEED_GLOBALS)


def deepspeed_pickles(step_dir: str | Path) -> list[Path]:
    """The files DeepSpeed may unpickle from ``step_dir``: every ``.pt`` file under ``deepspeed/`` and
    ``deepspeed_universal/`` (its loaders glob ``*_model_states.pt``, ``*_optim_states.pt`` and the
    universal ``zero/<param>/<state>.pt``). The step dir is first checked to hold no link and
    nothing but files and folders (``check_confined``): ``Path.rglob`` does not descend into a
    linked folder, DeepSpeed's own ``open`` does, so a link would hide a file from this scan."""

    step_dir = Path(step_dir)
    folders = [step_dir / DS_DIR, step_dir / UNIVERSAL_DIR]
    return [p for p in check_confined(step_dir) if p.suffix == ".pt" and any(f in p.parents for f in folders)]


def check_deepspeed_files(step_dir: str | Path) -> None:
    """Refuse the checkpoint if any DeepSpeed pickle in it names a global outside the allowlist, or
    if anything in it leads outside it (``deepspeed_pickles``)."""
    for path in deepspeed_pickles(step_dir):
        bad = unexpected_globals(path)
        if bad:
            raise refused(
                path,
                f"this DeepSpeed file names the Python global(s) {', '.join(bad)}, which llmft's DeepSpeed "
                "checkpoints never hold; DeepSpeed unpickles it with weights_only=False, so loading it "
                "could run code",
            )
