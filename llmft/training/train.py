"""``llmft train``: resolve the plan -> build the run -> restore -> fit -> finish.

Works as a plain process, under torchrun, the deepspeed launcher or srun: the
world comes from the environment and the batch equation is re-solved for it.
"""

from __future__ import annotations

import logging
import os
import sys

from llmft.job import watchdog
from llmft.job.dist import DistEnv, barrier, init_distributed, is_comm_failure, read_env, shutdown, timeout_s
from llmft.job.gpu import gpu_memory_gb
from llmft.metrics.trackers import check_available
from llmft.model import kernels
from llmft.plan.memory import check_fits
from llmft.plan.resolve import load_plan
from llmft.stop import STOPPED_EXIT_CODE, Abandoned, StopRequest
from llmft.training.run import Run, RunHooks

log = logging.getLogger("llmft")

# The runs of this process's multi-rank trainings, never freed: freeing one drops the last reference
# to its gloo process group (held by DDP's reducer, FSDP2's mesh) on the main thread, which holds the
# GIL, while a gloo worker thread may still be destroying the last collective's work and waits for
# the GIL to release its tensors: a deadlock (the rank never exits), or, during interpreter
# finalization, an abort. A rank leaves with os._exit instead (llmft.job.dist.leave_process).
_kept: list = []


def setup_logging(env: DistEnv) -> None:
    level = logging.INFO if env.is_main else logging.WARNING
    fmt = "[llmft] %(message)s" if not env.distributed else f"[llmft rank {env.rank}] %(message)s"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(fmt))
    log.handlers[:] = [handler]
    log.setLevel(level)
    log.propagate = False
    for noisy in ("transformers", "accelerate", "DeepSpeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def train(recipe_path: str, overrides: list[str], hooks: RunHooks | None = None) -> int:
    env = read_env()
    setup_logging(env)
    plan = load_plan(
        recipe_path,
        overrides,
        world_size=env.world_size,  # the launched world is the truth (llmft.plan.resolve)
        local_world_size=env.launched_per_node,
        launcher=env.launcher,
        measure_gpu=gpu_memory_gb,
    )
    # A missing tracker extra or kernel fails here, before any data or model is loaded.
    check_available(plan.recipe)
    kernels.check_available(plan.recipe.model)
    for note in plan.notes:
        log.warning("%s", note)
    check_fits(plan)  # before anything is loaded
    d = plan.recipe.distributed
    init_distributed(env, d.backend, timeout_s(d), force=plan.spec.multi_rank)
    # Installed before anything slow: a stop request during model loading is honoured after the
    # first step (checkpoint, exit 75) instead of killing the process with nothing to requeue.
    stop = StopRequest(d.stop_signal).install()
    run = Run(plan, env, stop, hooks)
    if env.distributed:
        _kept.append(run)
    watch = watchdog.start(timeout_s(d), env.rank) if env.distributed else None  # armed by the loop
    try:
        run.restore(run.setup())
        state = run.fit()
        with watchdog.idle("finishing the run"):
            try:
                code = run.finish(state)
            except Abandoned:  # every rank: a stop cut the final eval short; the last checkpoint is written
                log.warning(
                    "stopped by %s during the final eval, after step %d; checkpoint written. Run the same "
                    "command to run the final eval.",
                    stop.requested or "a signal on another rank",
                    state.step,
                )
                run.metrics.close(stopped=True)
                code = STOPPED_EXIT_CODE
            # Every rank leaves together: a rank that destroys its process group and exits (leave_process)
            # while another is still in the run's last collective would leave that one waiting.
            barrier()
        return code
    except Exception as e:
        if env.distributed and is_comm_failure(e):  # a timed-out collective, a peer that left: no teardown
            log.error("rank %d: a collective failed: %s", env.rank, e, exc_info=True)
            watchdog.give_up("a collective failed (above)")
        raise
    finally:
        if watch is not None:
            watch.stop()
        run.close()
        stop.uninstall()
        shutdown()
