"""Preemption: on SIGTERM / SIGUSR1 / SIGINT, finish or abandon the step, checkpoint, exit 0.

A user's Ctrl-C (SIGINT) is a preemption too: one line says it was received (as for every
signal, at once, whatever the run is doing), the run saves and exits 0 as below; a second
Ctrl-C exits at once with 130, no traceback, nothing saved since the last checkpoint and no
file torn (every file is written whole through a temporary, or a line at a time).

Schedulers announce a kill: SLURM ``--signal=TERM@60`` (or ``USR1@60``) signals the job 60 s
before its time limit; Kubernetes sends SIGTERM and kills ``terminationGracePeriodSeconds``
later. ``Preemption`` installs handlers for SIGTERM and SIGUSR1 that only record the first
signal (its name, when it came, the step and phase the run was in); the trainer
(``paravt.train``) asks it at two kinds of points, every rank at the same points:

* each step boundary (``start_step``): if any rank got a signal, every rank stops there, the
  last completed step is checkpointed (unless its checkpoint exists) and the run exits 0;
* once per step, after the rollout and before anything the step changes is saved state
  (``should_abandon``): if any rank got a signal and finishing the step would end more than
  ``grace_s`` after it (the previous step's time after its rollout plus the last checkpoint's
  write time, as the estimate), every rank abandons the step: the checkpoint then holds the
  previous step, with the prompt position and RNG states the abandoned step started from.
  Otherwise the step is finished and the next boundary stops the run.

Both combine the ranks' records with one ``all_reduce(MAX)`` and decide from the reduced values
only, so the decision is the same on every rank even when only one rank was signalled.

Two more checks outside the steps: the cold-start SFT (``paravt.sft.run_sft``, which finds the
run's handler through :func:`active`) checks before each of its steps, saves its state and
stops the run (:class:`SFTPreempted`; ``--resume`` continues the SFT where it stopped), and the
trainer checks before each evaluation (a signal during the SFT or the model loads skips the
evaluation before RL; one after the last step skips the one after it).

A second signal changes nothing (SLURM signals again at the time limit), also during the
teardown after the ``[preempt]`` line: the command line (``python -m paravt.train``) keeps the
handlers installed to the end of the run and then ignores the signals until the process exits
(``keep=True``), so a repeated SIGTERM cannot turn "exiting 0" into exit 143. Whatever the run is doing when the signal comes (a step, an
evaluation) goes on to the next check; a run that overruns the grace is SIGKILLed by the
scheduler, which is the kill -9 case: the newest checkpoint stays loadable
(``paravt.checkpoint``) and ``--resume`` continues from it.

Test hook: ``PARAVT_PREEMPT_TEST_SIGNAL=SIGNAL:STEP:PHASE[:RANK]`` (e.g. ``SIGTERM:3:update``)
makes the run send itself that signal (``os.kill``: the real signal, through the handler
above) when it enters PHASE of STEP (on RANK only, if given), printing the wall time it sent it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from types import FrameType, TracebackType
from typing import Any

from paravt.distributed import DistContext, all_gather_objects, all_reduce_max
from paravt.log import ALL_RANKS, get_logger

log = get_logger(__name__)

#: The signals that request a checkpoint and a clean exit: a scheduler's SIGTERM / SIGUSR1 and
#: a user's Ctrl-C (SIGINT; a second Ctrl-C stops at once, see ``Preemption._handle``).
SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
#: Test hook (see the module docstring).
TEST_SIGNAL_ENV = "PARAVT_PREEMPT_TEST_SIGNAL"


SIGINT = signal.SIGINT


def _say(line: str) -> None:
    """One line to stderr from a signal handler (``os.write``: no buffered stream re-entered)."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


class StepAbandoned(Exception):
    """Raised by ``train_step`` when a preemption abandons the step (nothing of it is kept)."""


class SFTPreempted(Exception):
    """Raised by ``paravt.sft.run_sft`` when a preemption stops the cold-start SFT (its state
    saved for ``--resume``); ``paravt.run`` returns ``info`` as the run's ``RunStopped``."""

    def __init__(self, info: dict[str, Any]) -> None:
        super().__init__(info.get("outcome", "SFT preempted"))
        self.info = info


# The Preemption whose handlers are installed (None: none): the cold-start SFT, called from
# inside the trainer's build, checks it without the trainer passing it down.
_ACTIVE: Preemption | None = None


def active() -> Preemption | None:
    """The installed ``Preemption`` of this process (``paravt.sft.run_sft`` checks it), or
    None outside a training run (``python -m paravt.sft``, the experiments' SFT)."""
    return _ACTIVE


@dataclass
class Arrival:
    """The first preemption signal one rank got."""

    signal: str  # "SIGTERM"
    step: int  # the step the run was in (0: before the first step)
    phase: str  # "rollout", "update", ... (``Preemption.enter``)
    rank: int
    monotonic: float  # time.monotonic() when the handler ran


class Preemption:
    """Flag-only SIGTERM/SIGUSR1 handlers and the rank-consistent checks built on them.

    Use as a context manager (``with Preemption(grace_s, ctx) as pre:``): the handlers are
    installed on entry and the previous ones restored on exit, unless ``keep``: then the
    signals are ignored from the exit on until the process ends (the command line's run: a
    signal during its teardown changes nothing, where the default action would end it with exit
    143; ``ignore``). Signal
    handlers can only be set from the main thread; elsewhere nothing is installed
    (``installed`` is False) and the signals keep their previous disposition.
    """

    def __init__(
        self,
        grace_s: float,
        ctx: DistContext | None = None,
        signals: tuple[signal.Signals, ...] = SIGNALS,
        *,
        keep: bool = False,
    ) -> None:
        self.grace_s = float(grace_s)
        self.ctx = ctx or DistContext()
        self.signals = signals
        self.arrival: Arrival | None = None
        self.step, self.phase = 0, "startup"
        # Estimates of what finishing a step costs after its rollout (set by the trainer).
        self.rest_s = 0.0  # the previous step's seconds after its rollout
        self.save_s = 0.0  # the last checkpoint's write time
        self.installed = False
        self.keep = keep
        self._previous: dict[signal.Signals, Any] = {}
        self._test = _parse_test_signal(os.environ.get(TEST_SIGNAL_ENV, ""))

    # -- handlers

    def __enter__(self) -> Preemption:
        self.install()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        if self.keep:
            self.ignore()
        else:
            self.restore()

    def install(self) -> bool:
        """Set the handlers (main thread only); returns whether they were set."""
        global _ACTIVE
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self.installed = True
        _ACTIVE = self
        return True

    def restore(self) -> None:
        """Put the previous handlers back."""
        global _ACTIVE
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        self.installed = False
        if _ACTIVE is self:
            _ACTIVE = None

    def ignore(self) -> None:
        """The run is over: ignore the signals until the process exits (``keep``). SIG_IGN,
        not a Python handler: the interpreter's finalization puts Python handlers back to the
        default action (exit 143 on SIGTERM), and it can take a while after a large run."""
        if not self.installed:
            return
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        self._previous.clear()
        self.installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.arrival is None:  # a repeated SIGTERM / SIGUSR1 changes nothing
            self.arrival = Arrival(name, self.step, self.phase, self.ctx.rank, time.monotonic())
            # Said at once (a long rollout or evaluation would otherwise be silent until its
            # next check); os.write, not print: a handler may run inside a print.
            again = " (Ctrl-C again: stop at once, without saving)" if signum == SIGINT else ""
            _say(
                f"[signal] {name} received on rank {self.ctx.rank} at step {self.step} "
                f"({self.phase}): the run saves and exits 0 at its next check{again}"
            )
        elif signum == SIGINT and self.arrival.signal == "SIGINT":
            # A second Ctrl-C: the user wants out now. Every file the run writes is written
            # whole (a temporary renamed) or a line at a time (a torn line is skipped on read),
            # so stopping here tears none; what the last checkpoint holds is kept.
            _say(
                f"[signal] a second SIGINT on rank {self.ctx.rank}: exiting at once (130), "
                "nothing saved since the last checkpoint"
            )
            os._exit(130)

    # -- where the run is

    def enter(self, step: int, phase: str) -> None:
        """Record the run's position (named in the log line); fires the test hook."""
        self.step, self.phase = step, phase
        if self._test is not None and self._test[1:3] == (step, phase):
            sig, _, _, rank = self._test
            if rank is None or rank == self.ctx.rank:
                self._test = None
                log.info(
                    f"[preempt-test] rank {self.ctx.rank} sends itself {sig.name} at step {step} "
                    f"({phase}) at wall time {time.time():.6f}",
                    extra=ALL_RANKS,
                )
                os.kill(os.getpid(), sig)

    def start_step(self, step: int) -> bool:
        """The step boundary before ``step``: ``True`` when any rank got a signal (the run
        stops after the last completed step); otherwise record that ``step`` has started and
        return ``False``. Collective, like ``requested``.

        The check and the record are one atomic move: the handled signals are blocked between
        them (``pthread_sigmask``; main thread only, where the handlers are). A signal that
        comes in that window is delivered right after, naming the new step, which then runs
        and is finished or abandoned by its own checks. Without the block, a signal landing
        after the check but before the step named itself would be logged against the previous
        step while the next one ran to its end (seen in ``tests/test_train_preempt.py``:
        "SIGUSR1 at step 2 (metrics): finished step 3")."""
        block = self.installed and threading.current_thread() is threading.main_thread()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, self.signals) if block else None
        try:
            if self.requested():
                return True
            self.enter(step, "start")
            # The check saw no signal on any rank, so one recorded now came after it: the
            # mask above holds only this thread, and a process-directed signal can land on
            # another (torch's threads) and run the handler before ``enter``. Name it against
            # the step that now runs, as the mask would have.
            if self.arrival is not None and (self.arrival.step, self.arrival.phase) != (
                step,
                "start",
            ):
                self.arrival = replace(self.arrival, step=step, phase="start")
            return False
        finally:
            if old is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)

    # -- checks (collective: every rank calls them at the same points)

    @property
    def signalled(self) -> bool:
        """Whether this rank got a signal (local; decide with ``requested``)."""
        return self.arrival is not None

    def elapsed(self) -> float:
        """Seconds since this rank's signal (0 without one)."""
        return 0.0 if self.arrival is None else time.monotonic() - self.arrival.monotonic

    def requested(self) -> bool:
        """Whether any rank got a signal: the same answer on every rank."""
        return bool(all_reduce_max([float(self.signalled)], self.ctx)[0] > 0)

    def should_abandon(self) -> bool:
        """Whether any rank got a signal and finishing the step (``rest_s + save_s``) would end
        past ``grace_s`` after the earliest signal: the same answer on every rank."""
        got, elapsed, rest = (
            float(x)
            for x in all_reduce_max(
                [float(self.signalled), self.elapsed(), self.rest_s + self.save_s], self.ctx
            )
        )
        return got > 0 and elapsed + rest > self.grace_s

    def exit_line(self, outcome: str, what: str) -> tuple[str, dict[str, Any]]:
        """The ``[preempt]`` line of a run stopping after a signal (collective: every rank
        calls it) and the run's record of the stop (``"message"``: the line); ``outcome`` says
        where the run stopped, ``what`` what it saved (it ends in "exiting 0"). The cold-start
        SFT's stop writes it; ``paravt.run._stop`` writes the steps' own."""
        arrivals = self.arrivals()
        first, seconds = arrivals[0]
        where = f"{first.signal} at step {first.step} ({first.phase})"
        if self.ctx.world_size > 1:
            ranks = sorted(a[0].rank for a in arrivals)
            where += f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        late = f", past the grace of {self.grace_s:g} s" if seconds > self.grace_s else ""
        line = (
            f"[preempt] {where}: {outcome}, {what} {seconds:.1f} s after the signal"
            f"{late or f' (grace {self.grace_s:g} s)'}"
        )
        info = {
            "signal": first.signal,
            "step": first.step,
            "phase": first.phase,
            "ranks": [a[0].rank for a in arrivals],
            "outcome": outcome,
            "checkpoint": "",
            "ok": True,
            "seconds": seconds,
            "message": line,
        }
        return line, info

    def arrivals(self) -> list[tuple[Arrival, float]]:
        """Every signalled rank's ``(arrival, seconds since)``, earliest first (collective)."""
        mine = None if self.arrival is None else (self.arrival, self.elapsed())
        got = [a for a in all_gather_objects(mine, self.ctx) if a is not None]
        return sorted(got, key=lambda a: -a[1])


def _parse_test_signal(spec: str) -> tuple[signal.Signals, int, str, int | None] | None:
    """``SIGNAL:STEP:PHASE[:RANK]`` -> (signal, step, phase, rank or None); '' -> None."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) not in (3, 4):
        raise ValueError(f"{TEST_SIGNAL_ENV}='{spec}': expected SIGNAL:STEP:PHASE[:RANK]")
    return (
        signal.Signals[parts[0]],
        int(parts[1]),
        parts[2],
        int(parts[3]) if len(parts) == 4 else None,
    )
