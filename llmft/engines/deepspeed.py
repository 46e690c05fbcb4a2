"""DeepSpeed ZeRO 0-3 with the ds_config compiled from the recipe.

The loop's loss is already normalised by the global token count, so DeepSpeed is
told not to divide by accumulation steps (``scale_wrt_gas=False``) and ``backward``
undoes its mean over ranks. Clipping happens inside DeepSpeed's step
(``gradient_clipping`` in the config, written from the plan's ``max_grad_norm`` as the
other engines' clipping is). Under ZeRO-3 no rank materialises the whole model: a
pretrained one (LoRA and 4-bit QLoRA bases included) is built on the meta device and each rank
reads only its partitions of the weights (``llmft.model.zero3``); a fresh one too big to
build whole is built under ``zero.Init`` (via ``HfDeepSpeedConfig``).

The checkpoint format is DeepSpeed's own (``deepspeed/state/``). A ZeRO 1-3 checkpoint
resumed on another world size is converted once to DeepSpeed's universal format
(``deepspeed_universal/``; also ``python -m llmft.checkpoint universal CKPT``).

DeepSpeed's ``*_model_states.pt`` and ``*_optim_states.pt`` files are Python pickles that
DeepSpeed's own code reads with ``torch.load(weights_only=False)`` (the engine's
``load_checkpoint`` on resume, ``ds_to_universal`` for an elastic resume, ``zero_to_fp32`` for
export). Before any of those runs, ``check_deepspeed_files`` (``llmft.engines.safe_deepspeed``)
scans every one of them without executing it and refuses a global outside the short list real
DeepSpeed checkpoints hold (docs/design.md G7).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, ContextManager

import torch

from llmft.checkpoint.layout import DS_DIR, UNIVERSAL_DIR, fsync_dir, resolve_checkpoint
from llmft.checkpoint.layout import DS_TAG as TAG
from llmft.checkpoint.safe_load import torch_load
from llmft.engines import OptimizerFactory
from llmft.engines.base import check_loaded_keys, freeze, trainable_names
from llmft.engines.safe_deepspeed import check_deepspeed_files
from llmft.errors import Problem, UserError
from llmft.job.dist import DistEnv, broadcast_object, sequence_group, timeout_s
from llmft.model import ulysses, zero3
from llmft.model.adapters import is_peft
from llmft.model.build import prepare_model
from llmft.model.meta import build_on_meta
from llmft.plan.deepspeed import deepspeed_config
from llmft.plan.layout import RunPlan

log = logging.getLogger("llmft")

# The ops DeepSpeed JIT-builds and loads in every process on a CPU machine (its shared-memory
# collectives, loaded when its communication backend starts), through torch's cpp_extension.
CPU_JIT_OPS = ("deepspeed_shm_comm",)


def averaged_over(plan: RunPlan) -> int:
    """The number DeepSpeed divides the summed gradients by: the data-parallel ranks. Under
    sequence parallelism every rank's gradient is a share of the sum, and DeepSpeed 0.19 reduces
    over the whole world: ZeRO-1/2 divide the result by ``world / N`` (``stage_1_and_2.py``), but
    ZeRO-3's reduce-scatter (``stage3.py``, ``reduce_scatter_coalesced``) averages over the whole
    world. ``tests/distributed/test_sequence_parallel.py`` holds both to the one-process gradient."""
    layout = plan.layout
    return layout.world_size if layout.sp > 1 and plan.zero_stage == 3 else layout.dp_size


class DeepSpeedEngineAdapter:
    def __init__(self, plan: RunPlan, env: DistEnv, tokenizer: Any, make_optimizer: OptimizerFactory) -> None:
        import deepspeed

        self.name = plan.engine
        self.env = env
        self.plan, self.tokenizer = plan, tokenizer  # what ``frozen_model`` builds from
        warn_stale_build_locks()
        # DeepSpeed 0.19 calls torch's all_gather_into_tensor / reduce_scatter_tensor, which torch
        # 2.13 deprecates with a FutureWarning that libraries' catch_warnings blocks re-arm: a
        # ZeRO-3 run printed it at every gather (pages per step) about code the user cannot change.
        warnings.filterwarnings(
            "ignore",
            r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
            FutureWarning,
        )
        # DeepSpeed's comm layer wraps the process group train.py created; its config checks
        # (batch x world size, also inside zero.Init) read the world size from there.
        deepspeed.init_distributed(
            dist_backend="nccl" if torch.cuda.is_available() else "gloo",
            auto_mpi_discovery=False,
            timeout=datetime.timedelta(seconds=timeout_s(plan.recipe.distributed)),
        )
        # On a CPU the gathered weights are host RAM: ZeRO-3 keeps about one layer of them
        # (plan.deepspeed.host_live_window), not HF's 1e9 parameters.
        self.config = deepspeed_config(plan, device_is_host=env.device.type == "cpu")
        self._hf_ds = None
        model = self._build(plan, tokenizer)
        if plan.zero_stage == 3:  # gathered weights are released after use, not kept by autograd
            zero3.linears_save_their_weights(model)
            zero3.moe_blocks_as_leaves(model)  # routing changes which experts run: one fetch per block
        # Ulysses: DeepSpeed's sequence groups are the mpu; ZeRO then reduces gradients over the whole
        # world and divides them by world / N = the data-parallel ranks (docs/long-context.md).
        self._mpu = None
        if plan.sequence_parallel > 1:
            group = sequence_group(plan.layout.mesh)
            ulysses.install(model, group)
            self._mpu = ulysses.deepspeed_mpu(group)
        self.peft = is_peft(model)
        self.optimizer = make_optimizer(model)
        self.model, _, _, _ = deepspeed.initialize(
            model=model, optimizer=self.optimizer, config=self.config, mpu=self._mpu
        )
        # DeepSpeed averages gradients over data-parallel ranks; backward undoes it.
        self._grad_scale = float(averaged_over(plan))

    def _build(self, plan: RunPlan, tokenizer: Any) -> torch.nn.Module:
        """The plan's model, built as this ZeRO stage needs it (partitioned for ZeRO-3 where it must be)."""
        env = self.env
        if plan.meta_init:
            # A pretrained model: built on the meta device, each rank reads only its partitions.

            model, slots, weights = build_on_meta(plan, tokenizer)
            zero3.materialize(model, slots, weights, self.config, seed=plan.recipe.run.seed, device=env.device)
        else:
            if plan.zero_init:  # a fresh model too big to build whole: transformers' zero.Init
                from transformers.integrations import HfDeepSpeedConfig

                self._hf_ds = HfDeepSpeedConfig(self.config)  # must stay alive while the model is built
            model = prepare_model(plan, tokenizer, env.device)
        return model

    def frozen_model(self, plan: RunPlan | None = None) -> torch.nn.Module:
        """A frozen model (``Engine.frozen_model``), built like the policy and put under the same
        ZeRO stage by ``deepspeed.initialize`` without an optimizer: ZeRO-3 partitions its weights
        over the ranks and gathers them layer by layer in its forward, as for the policy; below
        stage 3 the weights are whole on every rank, as the policy's are (nothing else is kept for
        a model without gradients). TRL prepares its DeepSpeed reference model the same way."""
        return self.place_frozen(self._build(plan or self.plan, self.tokenizer))

    def place_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model (``frozen_model``'s, or one its caller built whole: a reward model,
        ``objectives.rewards``) under the policy's ZeRO stage, without an optimizer: ZeRO-3
        partitions it over the ranks; below stage 3 it is whole on every rank."""
        import deepspeed

        model = freeze(model)
        config = copy.deepcopy(self.config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        if self.plan.zero_stage != 3:
            config.setdefault("zero_optimization", {})["stage"] = 0
        else:
            zero3.moe_blocks_as_leaves(model)
        reference, _, _, _ = deepspeed.initialize(model=model, config=config, mpu=self._mpu)
        reference.eval()  # DeepSpeedEngine.eval() returns None
        return reference

    def micro_step(self, boundary: bool) -> ContextManager:
        self.model.set_gradient_accumulation_boundary(boundary)
        return contextlib.nullcontext()

    def autocast(self) -> ContextManager:
        return contextlib.nullcontext()  # DeepSpeed runs the module in its bf16/fp16 dtype

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss * self._grad_scale, scale_wrt_gas=False)

    def step(self) -> float:
        # The boundary was set on the last micro-step: clip (gradient_clipping) + optimizer step + zero grad.
        self.model.step()
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def unwrap(self) -> torch.nn.Module:
        return self.model.module

    def save(self, directory: Path, *, save_optimizer: bool) -> None:
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

        # UNIVERSAL_CHECKPOINT_INFO in client_state is what lets ds_to_universal convert this
        # checkpoint later for a resume on another world size.
        self.model.save_checkpoint(
            str(directory / DS_DIR),
            tag=TAG,
            client_state={UNIVERSAL_CHECKPOINT_INFO: {}},
            save_latest=False,
            exclude_frozen_parameters=self.peft,
        )

    def load(self, directory: Path, *, load_optimizer: bool) -> None:
        # ZeRO 1-3 state is partitioned per data-parallel rank; on another world size DeepSpeed
        # only loads its universal format, converted here on first use (rank 0, others wait).
        check_deepspeed_files(directory)  # G7 (docs/design.md): before DeepSpeed unpickles anything
        saved_dp = deepspeed_dp_size(directory)
        elastic = saved_dp is not None and saved_dp != self.env.world_size
        load_dir = universal_for_resume(directory, self.env) if elastic else directory / DS_DIR
        # The same switch as `"checkpoint": {"load_universal": true}` in the config: the engine
        # reads it at load time (DeepSpeedEngine.load_universal_checkpoint()), and only this load
        # needs it, so it is set here rather than in the config every run starts with.
        self.model._config.load_universal_checkpoint = elastic
        repair = elastic and load_optimizer and self.model.zero_optimization_stage() == 3
        if repair:
            optimizer = self.model.optimizer.optimizer  # the torch optimizer inside ZeRO-3's wrapper
            groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        try:
            path, _ = self.model.load_checkpoint(
                str(load_dir),
                tag=TAG,
                load_module_strict=not self.peft,
                load_optimizer_states=load_optimizer,
                load_lr_scheduler_states=False,
            )
        finally:
            self.model._config.load_universal_checkpoint = False
        assert path is not None, f"DeepSpeed found no checkpoint in {load_dir}"
        if repair:
            _repair_zero3_universal_load(optimizer, groups)
        if self.model.zero_optimization_stage() == 3:
            # The load leaves ZeRO-3's persistent parameters gathered (checkpoint_event_epilogue), a
            # state a fresh run's first pass never sees: released, so the pass that records
            # DeepSpeed's fetch trace sees what a fresh run's does (see release_after_load).
            release_after_load(self.model)


def _repair_zero3_universal_load(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal load (0.19, ``stage3.py``
    ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``; stages 1-2 load per group).

    - Every param group gets the same ``step`` tensor, which each group's Adam update then
      advances in place: with decay and no-decay groups the bias correction counts two
      steps per step from the first step after the resume.
    - Every param group gets group 0's hyperparameters: the decay group's weight decay
      lands on norms and biases.

    ``groups`` are the hyperparameters the recipe built the optimizer with; the learning
    rate is the one loaded (one schedule drives every group).
    """
    for group, built in zip(optimizer.param_groups, groups, strict=True):
        group.update({k: v for k, v in built.items() if k != "lr"})
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


def release_after_load(engine: Any) -> None:
    """Partition every parameter of a ZeRO-3 engine that has just loaded a checkpoint, the
    persistent ones (``stage3_param_persistence_threshold``: LoRA's small matrices) included, as
    they are when a fresh run starts.

    DeepSpeed's ``load_checkpoint`` ends by gathering the persistent parameters
    (``checkpoint_event_epilogue``). PEFT's LoRA layer reads ``lora_A.weight.dtype`` in its own
    forward, before ``lora_A`` runs; DeepSpeed registers a parameter read that way while it is
    partitioned as an *external* parameter of the reading module (``ZeROOrderedDict.__getitem__``),
    for good. A fresh run registers it in its first pass, the one that records DeepSpeed's fetch
    trace. A resumed run read it gathered in that pass, registered it in the next one (the
    optimizer step partitions every parameter) and then fetched for the LoRA layer a parameter its
    recorded trace does not have there: "tracing error" as soon as the live window is bounded
    (with 1e9 the prefetcher had already taken those entries off the queue)."""
    engine.empty_partition_cache()


# --- DeepSpeed universal checkpoints: ZeRO 1-3 state resharded for any data-parallel size ----------


def deepspeed_dp_size(step_dir: Path) -> int | None:
    """The data-parallel size a ZeRO 1-3 checkpoint is partitioned for (None: ZeRO-0 or no DeepSpeed state)."""
    pattern = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
    ranks = {
        m.group(1) for f in (Path(step_dir) / DS_DIR / TAG).glob("*_optim_states.pt") if (m := pattern.search(f.name))
    }
    return len(ranks) or None


def deepspeed_universal(step_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Convert a ZeRO 1-3 checkpoint into DeepSpeed's universal format, in this process.

    ZeRO partitions optimizer state (and, at stage 3, weights) by data-parallel rank, so
    DeepSpeed refuses to load it on another world size. Its ``ds_to_universal`` rewrites the
    partitions as one folder per parameter (fp32 weight, Adam moments), which an engine of any
    size loads with ``"checkpoint": {"load_universal": true}``. Written to
    ``step-N/deepspeed_universal/`` (or ``out``) by default, staged under a temporary name and
    renamed, so a crash mid-conversion leaves nothing half-made; an existing conversion is
    reused. The result is load_dir for ``engine.load_checkpoint(load_dir, tag="state")``.

    On demand: ``python -m llmft.checkpoint universal CHECKPOINT``. A resume on another world
    size calls it on rank 0 by itself (``DeepSpeedEngineAdapter.load``).
    """
    import argparse
    import io

    step_dir = resolve_checkpoint(step_dir)
    out = Path(out) if out is not None else step_dir / UNIVERSAL_DIR
    if (out / TAG / "zero").is_dir():
        return out
    if deepspeed_dp_size(step_dir) is None:
        raise UserError(
            Problem(
                str(step_dir),
                "holds no DeepSpeed ZeRO 1-3 optimizer partitions, so there is nothing to convert "
                "(ZeRO-0, FSDP and single-process checkpoints load on any world size as they are)",
                "Pass a checkpoint written with distributed.engine=deepspeed and zero_stage 1-3.",
            )
        )
    from deepspeed.checkpoint import ds_to_universal

    check_deepspeed_files(step_dir)  # G7 (docs/design.md): before ds_to_universal unpickles the partitions
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed conversion
    tmp.mkdir(parents=True)
    args = argparse.Namespace(
        input_folder=str(step_dir / DS_DIR / TAG),
        output_folder=str(tmp / TAG),  # ds_to_universal also writes latest_universal beside it, inside tmp
        num_extract_workers=1,  # in this process: no worker pool to fork from a training process
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # checkpoints saved without UNIVERSAL_CHECKPOINT_INFO (older llmft)
    )
    chatter = io.StringIO()  # its prints and progress bars
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():  # converted meanwhile by someone else: theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return out


def universal_for_resume(step_dir: Path, env: DistEnv) -> Path:
    """Rank 0 converts (or reuses) ``step-N/deepspeed_universal``; every rank waits and gets its path."""
    error = None
    if env.is_main:
        try:
            deepspeed_universal(step_dir)
        except Exception as e:  # every rank must learn of it, not wait in a barrier forever
            error = f"{type(e).__name__}: {e}"
    error = broadcast_object(error)
    if error is not None:
        raise UserError(
            Problem(
                str(step_dir),
                f"was written on another world size and could not be converted to DeepSpeed's universal "
                f"checkpoint ({error})",
                "Resume on the world size that wrote it, or convert it by hand with "
                f"`python -m llmft.checkpoint universal {step_dir}` to see the full error.",
            )
        )
    return step_dir / UNIVERSAL_DIR


def _module_state(step_dir: Path, *, exclude_frozen: bool = False, lazy: bool = False) -> dict[str, Any]:
    """The model state of a DeepSpeed checkpoint, in one process, after its files are scanned:
    ZeRO 1-3 partitions merged to fp32 by DeepSpeed's own ``zero_to_fp32`` (``lazy``: each
    parameter gathered only when read); ZeRO-0's whole module state (tensors and plain values
    only) read with ``weights_only`` (``lazy``: memory mapped)."""
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    check_deepspeed_files(step_dir)  # before zero_to_fp32 unpickles anything (docs/design.md G7)
    if deepspeed_dp_size(step_dir) is None:
        model_states = Path(step_dir) / DS_DIR / TAG / "mp_rank_00_model_states.pt"
        return torch_load(model_states, map_location="cpu", mmap=lazy)["module"]
    # DeepSpeed unpickles its own files here (see the module docstring); its progress prints are muted.
    with contextlib.redirect_stdout(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(
            str(Path(step_dir) / DS_DIR), tag=TAG, exclude_frozen_parameters=exclude_frozen, lazy_mode=lazy
        )


def read_deepspeed(model: torch.nn.Module, step_dir: Path) -> None:
    """The model part of a DeepSpeed checkpoint into an unsharded model, in one process."""
    peft = is_peft(model)
    missing, unexpected = model.load_state_dict(_module_state(step_dir, exclude_frozen=peft), strict=False)
    if peft:  # only the adapter was saved: the frozen base is the rebuilt one
        assert not unexpected, unexpected[:5]
        unloaded = sorted(trainable_names(model) & set(missing))
        assert not unloaded, f"{step_dir} lacks adapter weights {unloaded[:5]}"
    else:
        check_loaded_keys(model, missing, unexpected)


def deepspeed_reader(step_dir: Path):
    """A function ``{name: empty tensor} -> the same dict filled`` from a DeepSpeed checkpoint's
    model part, one process, each parameter read only when asked for (``_module_state(lazy=True)``).
    Export streams a full fine-tune this way, never the whole model in fp32."""
    state = _module_state(step_dir, lazy=True)

    def read(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for name, t in tensors.items():
                t.copy_(state[name].contiguous())
        return tensors

    return read


def warn_stale_build_locks() -> list[Path]:
    """Warn about a JIT build lock no process on this machine holds; returns those locks.

    torch's ``cpp_extension.load`` takes ``<build dir>/lock`` (a ``FileBaton``) before it loads or
    builds an op, and a process that finds the file waits, without a timeout, until it is gone. A
    process killed while holding it (a timeout during the build) leaves it behind, and every later
    DeepSpeed process then waits forever before llmft can say anything (docs/preference.md,
    "Status"). The holder keeps the file open, so a lock no process has open is stale, unless a
    process on another machine sharing this directory holds it: warned about, never removed."""
    if torch.cuda.is_available():
        return []
    from torch.utils.cpp_extension import _get_build_directory

    stale = []
    for name in CPU_JIT_OPS:
        lock = Path(_get_build_directory(name, False)) / "lock"
        if lock.exists() and not held_open(lock):
            stale.append(lock)
            log.warning(
                "%s exists but no process on this machine has it open: a JIT build of %s was killed while "
                "holding it, and DeepSpeed waits for it forever; if no other machine builds into this "
                "directory, remove it (rm %s)",
                lock,
                name,
                lock,
            )
    return stale


def held_open(path: Path) -> bool:
    """Whether a process on this machine has ``path`` open (Linux ``/proc``; True where that cannot be read)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return True
    target = str(path.resolve())
    for fds in proc.glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fds.iterdir()):
                return True
        except OSError:  # gone, or another user's
            continue
    return False
