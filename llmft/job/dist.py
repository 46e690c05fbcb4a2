"""Where this process sits in the job: ranks from torchrun, the deepspeed launcher or srun.

Also the few collectives the loop needs, written so they cost nothing in a
single process, and the run's one world mesh, of which every group an engine or a
collective uses is a view (``world_mesh``, ``mesh_view``).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from llmft import stop
from llmft.errors import Problem, UserError
from llmft.job import watchdog

if TYPE_CHECKING:
    from llmft.plan.layout import ParallelLayout

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"  # torchrun, deepspeed (its launcher), srun, env (WORLD_SIZE/RANK of another), none
    local_known: bool = True  # False: the launcher did not say how many processes run per node

    @property
    def launched_per_node(self) -> int | None:
        """Processes per node as the launcher said (None where it did not): ``plan.resolve``'s world."""
        return self.local_world_size if self.local_known else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def device(self) -> torch.device:
        if torch.cuda.is_available():
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")


def _int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def _tasks_per_node() -> int | None:
    """SLURM_TASKS_PER_NODE looks like "8(x2)" or "4,3": the first node's count."""
    value = os.environ.get("SLURM_TASKS_PER_NODE", "")
    head = value.split(",")[0].split("(")[0]
    return int(head) if head.isdigit() else None


def read_env() -> DistEnv:
    """The world the launcher started: torchrun and the deepspeed launcher set RANK/WORLD_SIZE/
    LOCAL_RANK, and the processes per node as LOCAL_WORLD_SIZE (torchrun) or LOCAL_SIZE (the
    deepspeed launcher); srun sets SLURM_* (SLURM_NTASKS_PER_NODE, or SLURM_TASKS_PER_NODE)."""
    if _int("WORLD_SIZE") is not None and _int("RANK") is not None:
        world = _int("WORLD_SIZE") or 1
        if "TORCHELASTIC_RUN_ID" in os.environ:
            launcher, local = "torchrun", _int("LOCAL_WORLD_SIZE")
        elif _int("LOCAL_SIZE") is not None:
            launcher, local = "deepspeed", _int("LOCAL_SIZE")
        else:
            launcher, local = "env", _int("LOCAL_WORLD_SIZE")
        return DistEnv(
            rank=_int("RANK") or 0,
            world_size=world,
            local_rank=_int("LOCAL_RANK") or 0,
            local_world_size=local or world,
            launcher=launcher,
            local_known=bool(local),
        )
    if _int("SLURM_NTASKS") and _int("SLURM_PROCID") is not None and "SLURM_STEP_ID" in os.environ:
        world = _int("SLURM_NTASKS") or 1
        if world > 1:
            local = _int("SLURM_NTASKS_PER_NODE") or _tasks_per_node()
            env = DistEnv(
                rank=_int("SLURM_PROCID") or 0,
                world_size=world,
                local_rank=_int("SLURM_LOCALID") or 0,
                local_world_size=local or world,
                launcher="srun",
                local_known=bool(local),
            )
            # torch.distributed's env:// rendezvous reads these names.
            os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(world), LOCAL_RANK=str(env.local_rank))
            if "MASTER_ADDR" not in os.environ:
                raise UserError(
                    Problem(
                        "MASTER_ADDR",
                        "srun started several tasks but MASTER_ADDR is not set",
                        "Launch with the launch/slurm.sbatch that `llmft compile` writes, or export MASTER_ADDR "
                        "(the first host of $SLURM_JOB_NODELIST) and MASTER_PORT before srun.",
                    )
                )
            return env
    return DistEnv()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_process_env() -> None:
    """What ``env://`` rendezvous reads, for a process that is the whole job (no launcher set it):
    rank 0 of 1, on loopback at a free port (an address or port already set is kept)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def timeout_s(distributed) -> float:
    """``distributed.timeout_s``, or the older ``distributed.timeout_minutes`` where a recipe sets it."""
    if distributed.timeout_minutes is not None:
        return 60.0 * distributed.timeout_minutes
    return float(distributed.timeout_s)


def init_distributed(env: DistEnv, backend: str = "auto", timeout_s: float = 600, *, force: bool = False) -> None:
    """Create the process group. ``force``: also for one process (DDP, FSDP2 and DeepSpeed need a group).

    ``timeout_s`` bounds every collective: on gloo a collective that waits longer raises (the
    caller hands the error to ``llmft.job.watchdog.give_up``); NCCL's own watchdog aborts the rank."""
    if dist.is_initialized() or not (env.distributed or force):
        return
    if not env.distributed:
        one_process_env()
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo" and os.environ.get("MASTER_ADDR", "127.0.0.1") in LOOPBACK:
        # A local multi-process run: keep gloo off the machine's other interfaces.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """One all-reduce for a few scalars (token counts, loss sums, stop flags)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    with watchdog.collective("all_reduce"):
        dist.all_reduce(t)
        return t.tolist()


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Each scalar's largest value over the ranks (a minimum: the max of its negation)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    with watchdog.collective("all_reduce"):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()


def all_gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's ``rows`` (the same shape on each), stacked in rank order: ``[world * n, ...]``."""
    if not (dist.is_available() and dist.is_initialized()):
        return rows
    out = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
    with watchdog.collective("all_gather"):
        dist.all_gather(out, rows.contiguous())
    return torch.cat(out)


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (picklable) in ``group`` (the world by default), in rank order."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    with watchdog.collective("all_gather_object"):
        dist.all_gather_object(out, obj, group=group)
    return out


def rank_group(size: int) -> Any:
    """This rank's group of ``size`` consecutive ranks (``[g*size, (g+1)*size)``, as vLLM's
    ``external_launcher`` makes its tensor-parallel groups), or None for a size of 1. Every rank
    calls it together (each group is made by every rank)."""
    if size == 1:
        return None
    group, _ = dist.new_subgroups(group_size=size)
    return group


def any_rank_stopping(device: torch.device | None) -> bool:
    """Whether any rank was asked to stop (``llmft.stop``): one all-reduce, which every rank must
    reach; without a stop request installed (``llmft verify``, a library caller) no collective and False."""
    request = stop.active()
    if request is None:
        return False
    (votes,) = all_reduce_sum([1.0 if request.requested else 0.0], device)  # type: ignore[arg-type]
    return votes > 0


def cut_short(what: str, device: torch.device | None) -> None:
    """Raise ``stop.Abandoned(what)`` on every rank when any rank was asked to stop (``any_rank_stopping``)."""
    if any_rank_stopping(device):
        request = stop.active()
        assert request is not None
        stop.said(request.action)
        raise stop.Abandoned(what)


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        with watchdog.collective("barrier"):
            dist.barrier()


def broadcast_object(obj, src: int = 0):
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    with watchdog.collective("broadcast_object_list"):
        dist.broadcast_object_list(box, src=src)
    return box[0]


# What gloo's errors say when a collective timed out or a peer is gone (it raises a plain RuntimeError).
_COMM_FAILURES = ("Timed out waiting", "Connection closed by peer", "pair closure", "Connection reset by peer")


def is_comm_failure(e: BaseException) -> bool:
    """A collective that timed out or lost its peer (gloo's RuntimeError, NCCL's DistBackendError)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(s in str(e) for s in _COMM_FAILURES)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _WORLD_MESHES.clear()  # their groups are gone: a later process group builds its own
    _VIEWS.clear()


def leave_process(code: int) -> NoReturn:
    """End a rank of a finished multi-rank run without the interpreter's teardown.

    A thread that takes the GIL while CPython 3.11 finalizes is ended with ``pthread_exit``, which
    unwinds its C++ frames by force; inside a torch operator or a collective's Python callback
    (pybind11 takes the GIL back in a ``noexcept`` destructor) that aborts the process (SIGABRT,
    "terminate called without an active exception"), and the launcher reports a failed job for a
    run that succeeded (docs/reliability.md#what-hung-and-what-aborted). Everything llmft owns is
    finished by then (files closed, process group destroyed, the watchdog joined); the output
    streams and logging are flushed here, and DataLoader workers end on their own when their
    parent does.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code)


_WORLD_MESHES: dict[str, Any] = {}  # device type -> the world mesh, one per process
_VIEWS: dict[tuple[str, tuple[tuple[str, int], ...]], Any] = {}  # its views, built once (groups are collective)


def world_mesh(device_type: str):
    """Every rank of the run as one dimension, ``world``. Its group is the default process group,
    which the loop's collectives (``all_reduce_sum``, ``barrier``) and DDP use; every other group
    of the run is a dimension of one of its views (``mesh_view``), not a second mesh."""
    if device_type not in _WORLD_MESHES:
        _WORLD_MESHES[device_type] = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("world",))
    return _WORLD_MESHES[device_type]


def mesh_view(device_type: str, dims: tuple[tuple[str, int], ...]):
    """The world mesh seen as the named dimensions ``dims`` (outermost first; their product is the
    world), as torchtitan builds its meshes from one world mesh; each view is built once per process."""
    key = (device_type, dims)
    if key not in _VIEWS:
        world = world_mesh(device_type)
        sizes, names = tuple(n for _, n in dims), tuple(name for name, _ in dims)
        if hasattr(world, "_unflatten"):
            _VIEWS[key] = world._unflatten(0, sizes, names)
        else:  # torch < 2.9: the same ranks, laid out alike, as a mesh of their own
            _VIEWS[key] = DeviceMesh(device_type, world.mesh.reshape(sizes), mesh_dim_names=names)
    return _VIEWS[key]


def run_mesh(device_type: str, dims: tuple[tuple[str, int], ...]):
    """The run's processes as the layout names them (``ParallelLayout.mesh``: replicate, shard, sp),
    a view of the world mesh: the groups of a dimension (``mesh["sp"]``: a sequence group) come
    from it, not from a library's own bookkeeping."""
    return mesh_view(device_type, dims)


def param_mesh(device_type: str, layout: ParallelLayout):
    """FSDP2's mesh (``ParallelLayout.param_mesh``: ``shard``, or HSDP's ``replicate`` x ``shard``):
    those dimensions of the world mesh seen as ``layout.param_view``."""
    return mesh_view(device_type, layout.param_view)[tuple(name for name, _ in layout.param_mesh)]


def sequence_group(dims: tuple[tuple[str, int], ...]):
    """This rank's sequence group: the ``sp`` dimension of the run's mesh (``ParallelLayout.mesh``;
    ranks ``[g*N, (g+1)*N)``), on the device type a rank runs on (``DistEnv.device``)."""
    return run_mesh("cuda" if torch.cuda.is_available() else "cpu", dims)["sp"].get_group()
