"""A rollout worker of an asynchronous run: its own engine, fed prompts and weights by the
trainer, returning scored-later ``Group`` s (``paravt.workers.pipeline`` is the other end).

Three threads:

* the control thread reads the trainer's ordered stream on ``roles.ctrl`` (the messages are
  ``paravt.workers.messages``'): ``Hello`` (the model folder), ``AssignGroups``
  (dispatch=group: ticketed groups, each with its prompt, K, seed and index) or
  ``AssignStep`` (static: one step's prompts with their K and seed), a weight push's header
  (``rollout.weight_sync=host``: then one broadcast per tensor into a staging copy, received
  here; ``bucketed``: handed to the weight thread), ``Stop``; anything else is this worker's
  failure (``UnexpectedMessage``, reported to the trainer);
* the weight thread receives each bucketed version over ``roles.weights`` into buffers on the
  worker's device (``paravt.weight_sync.receive``), so the control stream is never held
  up by a push. Either way a version is staged only once it is whole and its tensors match the
  trainer's checksums; the engine is never touched from these threads;
* the main thread rolls out its work in order: under dispatch=group the groups it claims
  (``GroupClaims``: the next unclaimed tickets, claimed on the rendezvous store as soon as it
  is free), under static its fixed slice of each step (``prompts_per_step / W`` prompts at its
  index). Before every turn (``AgentRunner.before_turn``) it swaps in the newest staged
  weights, so a multi-turn episode may span versions but no generation does, and every member
  of a group samples a turn with the same version; each sampled token records its version
  (``Trajectory.versions``). Work starts only once the worker holds the version it names
  (the trainer sends those weights before the assignment, so the wait is the stream's order).

After a swap the engine's own copy is read back and checked (``weight_sync.verify_engine``:
the HF engine's tensors by checksum, vLLM's parameters by element sum). A checksum mismatch, on receipt or
after loading, is a ``WeightSyncError`` naming the tensor and the version: the worker sends it
to the trainer (which raises ``WorkerFailed``) and exits 1.

Each result (a claim's groups, or a step's slice) goes to trainer rank 0 on the worker's own
``roles.results`` channel (``ClaimRollouts`` or ``StepRollouts``); a claim's reply has one
entry per ticket (``ticket_entries``: its ``TicketGroup``, or ``TicketSkipped`` with the
runner's reason when the video could not be read), and each claim is announced first
(``Claimed``, for the trainer's ``ClaimWatchdog``), with the runner's errors and counters and
the worker's busy / idle seconds; under ``rollout.async_pixels=frames`` (the default) its rows carry their clips' uint8
frames instead of their pixels, under ``decode`` their decode requests
(``paravt.workers.pixels.strip_pixels``; ``ship``: each clip's pixels compacted once,
``compact_pixels``). A rollout that raises sends its traceback and the worker
exits 1; a trainer that disappears fails the control thread's receive, and the worker exits 1 naming it. SIGTERM /
SIGUSR1 (a cluster preempting the job) and SIGINT (a Ctrl-C, which torchrun forwards to every
process) are left to the trainer, which checkpoints and then sends ``stop``.

Test hooks (environment, never set by a run): ``PARAVT_WORKER_TURN_PAUSE_S`` (every worker
sleeps before each turn) and ``PARAVT_TEST_SLOW_WORKER`` (one deliberately slow worker:
``_slow_hook``).
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paravt.agent.loop import AgentRunner
from paravt.config import Config
from paravt.distributed import DistContext
from paravt.engines import engine_spec, make_engine
from paravt.log import ALL_RANKS, get_logger
from paravt.models import load_model_from_config
from paravt.types import Group, Sample
from paravt.weight_sync import Heartbeat, Staged, WeightSyncError, receive, verify_engine
from paravt.workers.messages import (
    AssignGroups,
    AssignStep,
    Bye,
    Claimed,
    ClaimRollouts,
    Hello,
    IssuedGroup,
    StepRollouts,
    Stop,
    TicketEntry,
    TicketGroup,
    TicketSkipped,
    UnexpectedMessage,
    WorkerError,
    expect,
    is_weights_header,
)
from paravt.workers.pipeline import CLAIM_KEY
from paravt.workers.pixels import compact_pixels, strip_pixels
from paravt.workers.roles import AsyncRoles, Channel

log = get_logger(__name__)

#: Test hook: seconds a worker sleeps before every turn (``PARAVT_WORKER_TURN_PAUSE_S``), so
#: that a test sees weights arrive in the middle of an episode.
TURN_PAUSE_ENV = "PARAVT_WORKER_TURN_PAUSE_S"
#: Test hook: one deliberately slow worker (``_slow_hook``), e.g. ``"2:s=3"``.
SLOW_WORKER_ENV = "PARAVT_TEST_SLOW_WORKER"


class WorkerStopped(Exception):
    """The trainer said stop (or vanished) while this worker was rolling out."""


#: What the control thread hands the main thread: an assignment, the error that ends the
#: worker (a failed weight check, the trainer gone), or None (stop).
Job = AssignGroups | AssignStep | BaseException | None


@dataclass(frozen=True)
class Work:
    """One rollout of this worker: its prompts with their K, the seed, the first group's
    index, the version it needs loaded first, and what its reply answers: the claimed
    ``tickets`` (dispatch=group) or the ``step`` (static)."""

    samples: list[Sample]
    budgets: list[int]
    seed: int
    first_group: int
    min_version: int
    tickets: tuple[int, ...] = ()
    step: int = 0


class _Weights:
    """Staged weights from the control or weight thread, swapped into the engine by the main
    thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: Staged | None = None  # whole and verified (weight_sync.receive)
        self.staged_version = -1  # the newest version received (staged or loaded)
        self.arrived = threading.Condition(self.lock)
        self.gone = ""  # why the control stream failed (the trainer is gone), if it did
        #: A received version failed its checksums, or the control stream sent a message this
        #: worker does not handle (``UnexpectedMessage``).
        self.failed: WeightSyncError | UnexpectedMessage | None = None
        #: This worker's heartbeat on the store (``paravt.weight_sync.Heartbeat``): the
        #: versions it holds (the trainer's push deadline) and its wait for weights.
        self.heartbeat: Heartbeat | None = None

    def stage(self, staged: Staged) -> None:
        with self.arrived:
            self.pending = staged
            self.staged_version = staged.version
            self.arrived.notify_all()

    def fail(self, e: WeightSyncError | UnexpectedMessage, jobs: queue.Queue[Job]) -> None:
        """A received version failed its checksums: the main thread raises ``e`` at its next
        swap or job (whichever comes first) and reports it to the trainer."""
        with self.arrived:
            self.failed = e
            self.arrived.notify_all()
        jobs.put(e)


def run_worker(cfg: Config, ctx: DistContext, roles: AsyncRoles) -> dict[str, Any]:
    """Serve the trainer until it says stop; returns this worker's totals."""
    # The trainer decides (see the docstring). SIGINT too: torchrun forwards a Ctrl-C to every
    # process of the job, and a worker that died of it would fail the trainer's checkpoint.
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, lambda *_: None)
    hello = expect(roles.ctrl.bcast(), Hello, f"rollout worker rank {roles.rank}'s first")
    tag = f"[worker {roles.rank}]"
    # The control thread first: the trainer's first weight push and prompts are staged while
    # the model loads and the engine starts (minutes for vLLM), so the trainer never waits.
    weights = _Weights()
    if roles.store is not None:
        weights.heartbeat = Heartbeat(
            roles.store, roles.rank, cfg.rollout.worker_heartbeat_s
        ).start()
    jobs: queue.Queue[Job] = queue.Queue()
    headers: queue.Queue[Any] = queue.Queue()  # bucketed weight headers, for the weight thread
    stop = threading.Event()
    ctrl = threading.Thread(
        target=_control_loop,
        args=(roles, weights, jobs, stop, headers),
        name=f"paravt-worker-ctrl-{roles.rank}",
        daemon=True,
    )
    ctrl.start()
    receiver = threading.Thread(
        target=_weight_loop,
        args=(roles, weights, jobs, stop, headers),
        name=f"paravt-worker-weights-{roles.rank}",
        daemon=True,
    )
    receiver.start()
    results = roles.results[roles.rank]
    log.info(
        f"{tag} pid {os.getpid()}: loading {hello.init_dir} ({cfg.rollout.engine} engine)",
        extra=ALL_RANKS,
    )
    try:
        # An engine that loads its own copy (vLLM) only reads the HF model's config and dtype:
        # that model stays in host memory (at 8B, 16 GiB of the worker's device saved).
        own = engine_spec(cfg.rollout.engine).own_weights
        where = "cpu" if own else str(ctx.device)
        bundle = load_model_from_config(hello.init_dir, cfg.model, device=where)
        bundle.model.eval()
        engine = make_engine(cfg, bundle)
        runner = AgentRunner(engine, bundle, cfg)
    except BaseException as e:
        _report(results, roles.rank, e)
        raise
    version = -1

    pause = float(os.environ.get(TURN_PAUSE_ENV, "0") or 0)

    def swap() -> int:
        """Load the newest staged weights (between turns); the version now loaded."""
        nonlocal version
        if weights.failed is not None:
            raise weights.failed
        if stop.is_set():
            raise WorkerStopped()
        with weights.lock:
            staged, weights.pending = weights.pending, None
        if staged is not None:
            engine.sync_weights(staged.named())
            verify_engine(engine, staged)  # the engine's own copy, read back
            version = staged.version
        if pause:  # test hook: slow turns, so that weights arrive mid-episode
            time.sleep(pause)
        return version

    group = cfg.rollout.dispatch == "group"
    work = (GroupClaims(cfg, roles, jobs) if group else _StaticSlices(cfg, roles, jobs)).next_work
    slow = _slow_hook(roles.rank)
    totals = {"steps": 0, "groups": 0, "busy_s": 0.0, "idle_s": 0.0}
    idle = 0.0
    try:
        while True:
            t0 = time.perf_counter()
            job = work()
            if job is None:
                break
            if group:  # the trainer's watchdog times each claim (``RolloutPipeline``)
                _send_or_gone(results, roles.rank, Claimed(roles.rank, job.tickets))
            # The work follows the weights it needs in the stream: wait for the control thread
            # to have staged them (it has, unless the stream is still being read).
            need = job.min_version
            t_wait = time.perf_counter()
            with weights.arrived:
                weights.arrived.wait_for(
                    lambda need=need: (
                        weights.staged_version >= need
                        or stop.is_set()
                        or weights.failed is not None
                    )
                )
            if weights.heartbeat is not None:  # the wait for weights (async/* metrics)
                weights.heartbeat.waited(time.perf_counter() - t_wait)
            idle += time.perf_counter() - t0
            runner.before_turn = swap
            t1 = time.perf_counter()
            try:
                done = runner.rollout(
                    job.samples,
                    job.budgets,
                    group_size=cfg.rollout.group_size,
                    seed=job.seed,
                    first_group=job.first_group,
                )
                groups = done.groups
                if slow is not None:  # test hook: a deliberately slow worker
                    _be_slow(slow, groups, weights, stop)
            except WorkerStopped:
                if weights.failed is not None:  # failed weights stopped the control thread
                    raise weights.failed from None
                break  # the trainer said stop (or is gone: raised below)
            busy = time.perf_counter() - t1  # (the engine owns its device: it never sleeps)
            if cfg.rollout.async_pixels in ("decode", "frames"):  # restored by the trainer
                groups = strip_pixels(groups, frames=cfg.rollout.async_pixels == "frames")
            else:  # each clip once, in storage of its own (not its turn's packed tensor)
                groups = compact_pixels(groups)
            report = {
                "worker": roles.rank,
                "errors": tuple(done.errors),
                "stats": done.stats,
                "busy_s": busy,
                "idle_s": idle,
            }
            reply: ClaimRollouts | StepRollouts
            if group:  # one entry per claimed ticket: its group, or why it has none
                entries = ticket_entries(job.tickets, job.first_group, groups, done.skipped)
                reply = ClaimRollouts(tickets=job.tickets, entries=tuple(entries), **report)
            else:
                reply = StepRollouts(step=job.step, groups=tuple(groups), **report)
            _send_or_gone(results, roles.rank, reply)
            totals["steps"] += 1
            totals["groups"] += len(groups)
            totals["busy_s"] += busy
            totals["idle_s"] += idle
            idle = 0.0
    except BaseException as e:  # tell the trainer which worker failed and why, then exit 1
        if weights.heartbeat is not None:  # no beats from a failed worker
            weights.heartbeat.stop()
        if not isinstance(e, TrainerGone):
            _report(results, roles.rank, e)
        raise
    if weights.gone:
        raise TrainerGone(weights.gone)
    try:
        results.send(Bye(roles.rank), 0)
    except Exception:  # the trainer stopped us and has exited already: nothing left to say
        if not stop.is_set():
            raise
    ctrl.join(timeout=30)
    receiver.join(timeout=30)
    if weights.heartbeat is not None:
        weights.heartbeat.stop()
    engine.close()
    done = f"{totals['groups']} group(s)" if group else f"{totals['steps']} step(s)"
    log.info(
        f"{tag} stopped after {done}: busy {totals['busy_s']:.1f} s, idle {totals['idle_s']:.1f} s",
        extra=ALL_RANKS,
    )
    return totals


class _StaticSlices:
    """rollout.dispatch=static: each assignment is a whole step; this worker rolls out its
    fixed slice (``prompts_per_step / W`` prompts at its index)."""

    def __init__(self, cfg: Config, roles: AsyncRoles, jobs: queue.Queue[Job]) -> None:
        self.jobs = jobs
        self.rank = roles.rank
        self.share = cfg.train.prompts_per_step // len(roles.workers)
        self.first = roles.worker_index * self.share

    def next_work(self) -> Work | None:
        """The next step's slice (blocks); None: stop."""
        job = self.jobs.get()
        if isinstance(job, BaseException):
            raise job
        if job is None:
            return None
        job = expect(job, AssignStep, f"rollout worker rank {self.rank} (dispatch=static)")
        mine = job.prompts[self.first : self.first + self.share]
        return Work(
            samples=[s for s, _ in mine],
            budgets=[k for _, k in mine],
            seed=job.seed,
            first_group=self.first,
            min_version=job.min_version,
            step=job.step,
        )


class GroupClaims:
    """rollout.dispatch=group: the trainer issues ticketed groups to every worker; a free
    worker claims the next unclaimed tickets on the rendezvous store (``CLAIM_KEY``: one
    compare-and-set, so no ticket is claimed twice), at most ``rollout.dispatch_groups`` of
    them (0: ``prompts_per_step / W``), consecutive groups of one slot (one seed, one batched
    rollout). A slow worker thus holds one claim, never a fixed share of every step."""

    def __init__(self, cfg: Config, roles: AsyncRoles, jobs: queue.Queue[Job]) -> None:
        self.jobs, self.store, self.rank = jobs, roles.store, roles.rank
        self.chunk = cfg.rollout.dispatch_groups or max(
            cfg.train.prompts_per_step // len(roles.workers), 1
        )
        self.issued: list[IssuedGroup] = []  # by ticket
        self.tries = itertools.count()

    def _take(self, job: Job) -> bool:
        """Add an assignment's groups; False: stop."""
        if isinstance(job, BaseException):
            raise job
        if job is None:
            return False
        job = expect(job, AssignGroups, f"rollout worker rank {self.rank} (dispatch=group)")
        for e in job.groups:
            if e.ticket != len(self.issued):
                raise RuntimeError(
                    f"rollout worker rank {self.rank}: ticket {e.ticket} arrived after "
                    f"{len(self.issued)} ticket(s); the trainer's stream is out of order"
                )
            self.issued.append(e)
        return True

    def next_work(self) -> Work | None:
        """The next claim (blocks until a ticket is free); None: stop."""
        while True:
            while not self.jobs.empty():  # every assignment received so far
                if not self._take(self.jobs.get()):
                    return None
            claim = self._claim()
            if claim is not None:
                break
            if not self._take(self.jobs.get()):  # wait for the next assignment
                return None
        es = [self.issued[t] for t in claim]
        return Work(
            samples=[e.sample for e in es],
            budgets=[e.budget for e in es],
            seed=es[0].seed,
            first_group=es[0].index,
            min_version=max(e.min_version for e in es),
            tickets=tuple(claim),
        )

    def _claim(self) -> range | None:
        """Claim the next free tickets among those issued; None: every one is claimed."""
        while True:
            raw = self.store.get(CLAIM_KEY)
            cur = int(raw.split(b"/")[0])
            if cur >= len(self.issued):
                return None
            end, limit = cur + 1, min(cur + self.chunk, len(self.issued))
            first = self.issued[cur]
            while (
                end < limit
                and self.issued[end].slot == first.slot
                and self.issued[end].index == self.issued[end - 1].index + 1
            ):
                end += 1
            want = f"{end}/{self.rank}/{next(self.tries)}"  # unique: the set value says who
            if self.store.compare_set(CLAIM_KEY, raw.decode(), want) == want.encode():
                return range(cur, end)


def ticket_entries(
    tickets: Sequence[int], first_group: int, groups: list[Group], skipped: dict[int, str]
) -> list[TicketEntry]:
    """dispatch=group: a claim's reply, one entry per ticket in claim order: a
    ``TicketGroup`` or, for a sample the rollout skipped (its video could not be read or
    decoded in time: ``AgentRunner.skipped``), a ``TicketSkipped`` with why. Ticket ``j`` of a claim is
    group ``first_group + j`` of the rollout, whatever it returned: a reply paired by position
    (tickets zipped with the groups that came back) marked the wrong groups done after a skip
    and never closed the last ticket (the trainer waited for it forever)."""
    by_id = {int(g.group_id): g for g in groups}
    out: list[TicketEntry] = []
    for j, t in enumerate(tickets):
        gi = first_group + j
        if gi in by_id:
            out.append(TicketGroup(int(t), by_id.pop(gi)))
        else:
            why = skipped.get(gi, f"group {gi}: the rollout returned nothing for it")
            out.append(TicketSkipped(int(t), why))
    if by_id:  # cannot happen: a rollout numbers its groups from first_group
        raise RuntimeError(
            f"rollout returned groups {sorted(by_id)} outside its claim of tickets "
            f"{tickets[0]}..{tickets[-1]} (groups {first_group}..{first_group + len(tickets) - 1})"
        )
    return out


def _slow_hook(rank: int) -> tuple[str, float] | None:
    """Test hook ``PARAVT_TEST_SLOW_WORKER`` (``SLOW_WORKER_ENV``): ``"RANK:s=SECONDS"`` (worker
    ``RANK`` sleeps that long after each rollout), ``"RANK:v=N"`` (it holds each rollout's
    result until it has received the version N above the oldest it sampled with, so the
    result arrives N versions stale) or ``"RANK:h=N"`` (it hangs, until stopped, after its
    N-th rollout: a worker that stops answering mid-run). None for the other workers, or
    when unset."""
    raw = os.environ.get(SLOW_WORKER_ENV, "")
    if not raw:
        return None
    try:
        r, spec = raw.split(":")
        kind, val = spec.split("=")
        if kind not in ("s", "v", "h"):
            raise ValueError(kind)
        target, value = int(r), float(val)
    except ValueError:
        raise RuntimeError(
            f"{SLOW_WORKER_ENV}={raw!r} (a test hook): expected 'RANK:s=SECONDS', "
            "'RANK:v=VERSIONS' or 'RANK:h=ROLLOUTS', e.g. '2:s=3'; unset it for a normal run"
        ) from None
    return (kind, value) if target == rank else None


_ROLLOUTS_DONE = [0]  # the ``h`` hook's count of this worker's rollouts


def _be_slow(
    slow: tuple[str, float], groups: list[Group], weights: _Weights, stop: threading.Event
) -> None:
    """Apply the ``_slow_hook`` (after a rollout, before its result is sent); a stop from the
    trainer ends the wait (``WorkerStopped``)."""
    kind, value = slow
    if kind == "s":
        stop.wait(value)
    elif kind == "h":
        _ROLLOUTS_DONE[0] += 1
        if _ROLLOUTS_DONE[0] >= value:
            stop.wait()
    else:
        olds = [t.oldest_version() for g in groups for t in g.trajectories]
        need = min((v for v in olds if v is not None), default=0) + int(value)
        with weights.arrived:
            weights.arrived.wait_for(lambda: weights.staged_version >= need or stop.is_set())
    if stop.is_set():
        raise WorkerStopped()


def _send_or_gone(results: Channel, rank: int, msg: Claimed | ClaimRollouts | StepRollouts) -> None:
    """Send a claim or a finished batch to trainer rank 0; a transport error means the
    trainer is gone (killed or exited): :class:`TrainerGone`, one line at
    ``paravt.train.main``."""
    try:
        results.send(msg, 0)
    except RuntimeError as e:
        what = (
            f"step {msg.step}'s rollouts"
            if isinstance(msg, StepRollouts)
            else f"tickets {list(msg.tickets)}"
        )
        raise TrainerGone(
            f"rollout worker rank {rank}: the trainer (rank 0) is gone, sending {what} "
            f"failed ({str(e).splitlines()[0][:200]}); stopping"
        ) from None


def _report(results: Channel, rank: int, e: BaseException) -> None:
    """Send the trainer this worker's error (best effort: the trainer may be gone)."""
    try:
        msg = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        results.send(WorkerError(rank, msg), 0)
    except Exception:
        pass


class TrainerGone(RuntimeError):
    """The control stream failed: trainer rank 0 exited or was killed. ``paravt.train.main``
    prints its message as one ``error:`` line (no traceback) and exits 1."""


def _control_loop(
    roles: AsyncRoles,
    weights: _Weights,
    jobs: queue.Queue[Job],
    stop: threading.Event,
    headers: queue.Queue[dict[str, Any] | None],
) -> None:
    """Read the trainer's stream until ``stop`` (see the module docstring)."""
    where = f"rollout worker rank {roles.rank}'s control stream"
    try:
        while True:
            msg = roles.ctrl.bcast()
            if is_weights_header(msg):
                if msg.get("sync", "host") == "host":  # through ctrl, here, into host memory
                    weights.stage(receive(msg, roles.ctrl, None, heartbeat=weights.heartbeat))
                else:
                    headers.put(msg)  # the weight thread receives the buckets
                continue
            msg = expect(msg, (AssignGroups, AssignStep, Stop), where)
            if isinstance(msg, Stop):
                break
            jobs.put(msg)
    except UnexpectedMessage as e:  # the two ends disagree: this worker's failure, reported
        weights.fail(e, jobs)
    except WeightSyncError as e:  # this worker's failure, not the trainer's: reported
        weights.fail(e, jobs)
    except Exception as e:
        weights.gone = (
            f"rollout worker rank {roles.rank}: the trainer (rank 0) is gone, its control "
            f"stream failed ({type(e).__name__}: {e}); stopping"
        )
        jobs.put(TrainerGone(weights.gone))
    finally:
        stop.set()
        headers.put(None)
        with weights.arrived:
            weights.arrived.notify_all()
        jobs.put(None)


def _weight_loop(
    roles: AsyncRoles,
    weights: _Weights,
    jobs: queue.Queue[Job],
    stop: threading.Event,
    headers: queue.Queue[dict[str, Any] | None],
) -> None:
    """Receive each bucketed version the control thread announces (``headers``; None: the
    stream ended) over ``roles.weights``, verify and stage it."""
    device = roles.weights.device if roles.weights is not None else torch.device("cpu")
    while (msg := headers.get()) is not None:
        try:
            weights.stage(receive(msg, None, roles.weights, device, weights.heartbeat))
        except WeightSyncError as e:
            weights.fail(e, jobs)
            return
        except Exception as e:  # the transport failed: the trainer is gone
            why = (
                f"rollout worker rank {roles.rank}: the trainer (rank 0) is gone, its weight "
                f"push failed ({type(e).__name__}: {e}); stopping"
            )
            with weights.arrived:
                weights.gone = weights.gone or why
                weights.arrived.notify_all()
            jobs.put(TrainerGone(why))
            stop.set()
            return
