"""Stop requests: SIGTERM, SLURM's warning signal (SIGUSR1/2) and Ctrl-C, honoured within seconds in every phase.

The handler only sets a flag (and logs one line); what happens next depends on what the process
is doing, which it names with ``StopRequest.during`` (the line says it):

- an optimizer step's forward and backward (``TRAINING``, the default): the loop all-reduces the
  flag with the step's loss, so every rank stops after the same step; it checkpoints and exits
  with ``STOPPED_EXIT_CODE``;
- a checkpoint being written: the save completes (it is the checkpoint the stop wants), then one
  vote (``llmft.job.dist.any_rank_stopping``) and the run exits 75 at once, not after another step;
- preparing data (``BUILDING``): the cache build calls ``check()`` every 0.2 s while its workers
  tokenize, and in one process before every tokenizer call, whose size keeps it under about half a
  second however slow a record is (``data.shards``), and before each eval prompt; ``check()``
  raises ``Stopped``; the tokenized shards it finished are kept for the next build, and the command
  exits ``STOPPED_EXIT_CODE`` with no checkpoint (nothing was trained yet);
- generating or scoring a step's completions (online RL, ``GENERATING``): generation stops at the
  next token (a stopping criterion reads the flag; with ``synced_gpus`` a rank that stopped keeps
  joining its peers' forwards until they stop too, so none waits for a peer), reward functions and
  models stop between calls; then every rank votes once (``llmft.job.dist.cut_short``) and, if any rank was asked
  to stop, all raise ``Abandoned`` together. The step is abandoned before anything was applied: the
  loop writes the checkpoint of the state before it (unless that step's checkpoint exists), with
  the random state as it was when the step began, and exits 75 saying which step it resumes from.
  The resumed run generates that step again with the same seeds (``rollout.generation_seed`` is a
  function of the seed, the generation batch and the rank), so it equals the run that never
  stopped. A step that finished generating and scoring is finished as in training;
- evaluating (``EVALUATING``): the eval stops between batches (its generation at the next token),
  every rank votes after each, and the eval row is left out; the run checkpoints the step it
  finished and exits 75 (after the last step: the run's final eval runs again on the rerun);
- exporting (``llmft export``, ``EXPORTING``): the export stops between tensors, removes its
  partial output (a temporary sibling of the output folder) and exits 75; the checkpoint is only
  read, and the same command starts it again.

A second Ctrl-C aborts at once. The handler is in the process that installed it only: worker
processes the build forks ignore these signals, so one stop is one log line.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator

log = logging.getLogger("llmft")

STOPPED_EXIT_CODE = 75  # "try again later" (EX_TEMPFAIL): stopped on request, checkpoint written

TRAINING = "finishing this optimizer step, then checkpointing and exiting"
BUILDING = "stopping the data build; its finished shards are kept, and the same command continues from them"
GENERATING = (
    "cutting this step's generation and scoring short: the step is abandoned (none of it is applied), "
    "the state before it is checkpointed, and the run exits"
)
EVALUATING = "cutting the eval short: the last finished step is checkpointed, and the run exits"
SAVING = "finishing the checkpoint being written, then exiting"
EXPORTING = "stopping the export; its partial output is removed, and the same command starts it again"

_active: StopRequest | None = None  # the installed request of this process, if any


class Stopped(Exception):
    """Raised where a stop request ends a command before training started (exit ``STOPPED_EXIT_CODE``).

    The handler already logged the one line a stop gets; the CLI prints nothing more."""

    exit_code = STOPPED_EXIT_CODE


class Abandoned(Exception):
    """Raised on every rank together (``cut_short``, after one vote) where a stop request cuts short
    the work before a step's update (generation, scoring) or an eval; ``what`` names that work."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class StopRequest:
    def __init__(self, extra_signal: str | tuple[str, ...] = "SIGUSR1") -> None:
        self.requested: str | None = None
        self.action = TRAINING  # what the one log line says happens next
        self.said: str | None = None  # the action the log line said, once a stop arrived
        self._sigint_count = 0
        self._previous: dict[int, object] = {}
        extra = (extra_signal,) if isinstance(extra_signal, str) else extra_signal
        self._signals = [signal.SIGTERM, signal.SIGINT, *(getattr(signal, name) for name in extra)]

    def install(self) -> StopRequest:
        global _active
        for sig in self._signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some test runners)
                pass
        _active = self
        return self

    def uninstall(self) -> None:
        global _active
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
        if _active is self:
            _active = None

    @contextlib.contextmanager
    def during(self, action: str) -> Iterator[StopRequest]:
        """Say ``action`` (instead of the training one) for a stop that arrives inside the block."""
        before, self.action = self.action, action
        try:
            yield self
        finally:
            self.action = before

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self._sigint_count += 1
            if self._sigint_count > 1:
                raise KeyboardInterrupt  # the second Ctrl-C aborts without a checkpoint
        if self.requested is None:
            log.warning("%s received: %s", name, self.action)
            self.said = self.action
        self.requested = self.requested or name


def active() -> StopRequest | None:
    """The stop request installed in this process (``llmft train``, ``llmft prepare``), if any."""
    return _active


def requested() -> str | None:
    """The signal that asked this process to stop, if one did (and a request is installed)."""
    return _active.requested if _active is not None else None


def check(action: str = BUILDING) -> None:
    """Raise ``Stopped`` if a stop was requested. A request that came before ``action`` began (its
    log line promised a checkpoint after a step) gets one more line, saying what happens instead."""
    r = _active
    if r is None or r.requested is None:
        return
    said(action)
    raise Stopped


@contextlib.contextmanager
def during(action: str) -> Iterator[None]:
    """``StopRequest.during`` on the installed request; nothing when none is installed. Inside an
    eval the eval's line stands: a stop there cuts the whole eval short, whatever part of it runs."""
    if _active is None or (_active.action == EVALUATING and action != EVALUATING):
        yield
        return
    with _active.during(action):
        yield


def said(action: str) -> None:
    """Log, once, what happens to a stop request that came before ``action`` began (its line said
    what the phase it arrived in does)."""
    r = _active
    if r is not None and r.requested is not None and r.said != action:
        log.warning("%s received earlier: %s", r.requested, action)
        r.said = action


@contextlib.contextmanager
def installed(extra_signal: str | tuple[str, ...], action: str) -> Iterator[StopRequest | None]:
    """A stop request for a command that is not ``llmft train`` (``llmft export``): installed for the
    block with ``action`` as what a stop does, unless one is installed already (then that one)."""
    if _active is not None:
        with _active.during(action):
            yield _active
        return
    request = StopRequest(extra_signal).install()
    try:
        with request.during(action):
            yield request
    finally:
        request.uninstall()
