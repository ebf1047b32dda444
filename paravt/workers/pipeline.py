"""The trainer's end of an asynchronous run: prompts and weights out, rollouts in, staleness
bounded (``paravt.workers.worker`` is the other end).

Versions: the policy the trainer holds after step ``s`` is version ``s`` (the run's start,
SFT or a resumed checkpoint, is version ``start_step``). Step ``b`` trains the policy of
version ``b - 1``; a token sampled by version ``v`` is then ``b - 1 - v`` versions stale.

Dispatch (``rollout.dispatch``):

* **group** (the default; AReaL's). The unit is a group, one prompt's G samples. Rank 0 draws
  prompts a slot at a time (slot ``k`` = ``plan_prompts(sampler, cfg, k)``: the prompts, K
  and seed of step ``k`` under static dispatch, so group ``(k, i)`` samples the same whichever
  worker runs it) and issues groups with tickets, broadcast to every worker; a free worker
  claims the next unclaimed tickets on the rendezvous store (``CLAIM_KEY``, one
  compare-and-set: no ticket twice), at most ``rollout.dispatch_groups`` consecutive groups of
  one slot (0: ``prompts_per_step / W``). Step ``b`` trains the first ``prompts_per_step``
  finished groups within η (the lowest tickets among those finished), renumbered 0.. in the
  step. A slow worker holds only its claim: the step does not wait for it. A worker answers
  each claimed ticket (``worker.ticket_entries``): with its group, or "skipped" and why (its
  sample's video could not be read or decoded in time); a skipped ticket is closed at once
  (counted, ``async/skipped_groups``; its prompt is not issued again, on ``--resume`` either)
  and replaced by the capacity rule, so the step's count is still met. ``ClaimWatchdog``
  names a worker holding a claim far longer than its peers.
* **static** (the reference). Every worker rolls out a fixed 1/W slice of each step's prompts;
  step ``b`` trains step ``b``'s prompts and waits for every slice.

* **Admission (AReaL's rule).** A group goes out only with the trainer's newest version
  loaded first, and at most ``(η + 1) · prompts_per_step`` groups are open (issued, neither
  trained nor dropped): at the start those of steps ``start+1 .. start+1+η``, then one step's
  worth after every update, and a dropped group is replaced at once (static: step ``b``'s
  prompts go out once the trainer holds version ``>= b - 1 - η``). Workers swap in newer
  weights between turns. η = 0 is the synchronous schedule: step ``b``'s groups are sampled
  with version ``b - 1`` exactly while the trainer waits (group dispatch with one worker
  reproduces the synchronous run bitwise).
* **Filter.** ``collect`` drops (and counts, ``async/dropped_groups``) any group whose oldest
  sampled token is more than η versions behind, so every trained token's version is
  ``>= b - 1 - η``. Under static dispatch the admission rule makes this a guard that never
  fires; under group dispatch a group finished late (a slow worker) can be older, and is
  dropped, never trained (the prompt is not issued again; up to ``η · prompts_per_step``
  groups rolled out at the run's end are not trained either).
* **Groups stay whole.** A prompt's G samples are one batched rollout on one worker, turn by
  turn: each turn of all G is sampled with the same version, so the group baseline compares
  rollouts drawn from the same policies.
* **Weights.** ``publish`` streams the full weights after every update (``full_weights``: one
  tensor at a time, all-gathered from the FSDP2 shards when there are several trainer ranks)
  from trainer rank 0 to the workers as the version ``step`` (``paravt.weight_sync``):
  by default packed into buckets, one broadcast each over the weights group (NCCL on GPUs),
  sent by a background thread while the trainer goes on with the next step (the snapshot is
  taken inside ``publish``; the next ``publish`` and ``close`` wait for the push to end);
  ``rollout.weight_sync=host``: one broadcast per tensor on the control stream, inline. Every
  push carries per-tensor checksums, which the workers verify on receipt and, for the HF
  engine, after loading. Workers stage a version only whole and verified, and swap between
  turns; the assignments that follow a push in the stream wait for it on the worker.
* **Data position.** Rank 0's prompt sampler runs ahead of training. static: the position
  checkpointed with step ``s`` is the one before step ``s + 1``'s prompts were drawn. group:
  groups finish out of order, so what is not trained is a set: the checkpoint of step ``s``
  records (``GroupLedger.state``, as it was when step ``s`` took its groups) the sampler's
  position before the oldest slot with a group neither trained nor dropped and which groups
  of that slot and after were; ``--resume`` re-draws those slots and issues exactly the
  others, with their slot's seed. Either way ``--resume`` re-issues exactly the prompts not
  yet trained on.

Faults: each worker has a receiving thread on its own group; a worker that dies (SIGKILL, OOM,
its node lost) closes its sockets and the thread's receive fails at once, and a worker whose
rollout raises sends its traceback. The failure is raised by ``collect`` only, on every trainer
rank (rank 0 posts it on the rendezvous store where the others wait), as ``WorkerFailed``
naming the worker's rank: the policy is then exactly the last completed step's, which the
training loop checkpoints before it stops (``paravt.run``). A failure noticed while pushing
weights (the step's update is done; a background push's error is noticed when the next
``publish`` or ``close`` waits for it) skips the rest of the push and is raised by the next
``collect``, so that step is logged and saved too. A worker whose received or loaded weights
fail their checksum sends that error (``WeightSyncError``, naming the tensor and the version)
like any other. A trainer that dies fails the workers'
control stream and they exit (``paravt.workers.worker``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from paravt.config import Config
from paravt.data.sampler import PromptSampler
from paravt.distributed import DistContext, Precision, full_weights
from paravt.engines.engine import Engine
from paravt.log import get_logger
from paravt.preempt import Preemption
from paravt.rollout_source import plan_prompts, push_weights
from paravt.types import Group, RolloutBatch, RolloutStats
from paravt.video.planner import DecodePlanner
from paravt.weight_sync import PushStalled, PushWatch, Spec, WeightPublisher
from paravt.workers.messages import (
    AssignGroups,
    AssignStep,
    Bye,
    Claimed,
    ClaimRollouts,
    FromWorker,
    Hello,
    IssuedGroup,
    PlannedGroup,
    StepRollouts,
    Stop,
    TicketGroup,
    WorkerError,
    WorkerLost,
    describe,
    expect,
)
from paravt.workers.pixels import restore_pixels
from paravt.workers.roles import CTRL_TIMEOUT, AsyncRoles, Channel

if TYPE_CHECKING:
    from paravt.models import ModelBundle

log = get_logger(__name__)


class WorkerFailed(RuntimeError):
    """A rollout worker died or its rollout raised; the message names its rank."""


#: How rank 0 posts a worker failure on the rendezvous store for the other trainer ranks.
_FAILED = "failed:"


class RolloutPipeline:
    """Trainer-side state of the asynchronous schedule (every trainer rank holds one; only
    rank 0 talks to the workers): the asynchronous ``paravt.rollout_source.RolloutSource``.
    ``sampler``: the run's ``PromptSampler`` (rank 0's draws are the run's prompts);
    ``engine``: the trainer's own engine, which only evaluates (None: no evaluation);
    ``bundle``: the policy's ``ModelBundle`` (its vision spec and tokenizer re-encode the clips
    that arrive without their pixels, ``rollout.async_pixels=frames|decode``)."""

    abandon_when = "while waiting for its rollouts"

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        roles: AsyncRoles,
        sampler: PromptSampler,
        engine: Engine | None = None,
        bundle: ModelBundle | None = None,
    ) -> None:
        self.cfg, self.ctx, self.roles = cfg, ctx, roles
        self.bundle = bundle
        self._planner: DecodePlanner | None = None  # restores this rank's clips (lazily)
        self.ledger = GroupLedger(sampler, cfg)  # holds the sampler (``sampler``)
        self.engine = engine
        self._engine_version = 0  # the policy version the evaluation engine holds
        self.eta = int(cfg.rollout.max_staleness)
        self.assigned = 0  # the last step whose prompts went out
        self._data_before: dict[int, dict[str, int]] = {}
        #: rollout.dispatch=group: any free worker claims the next groups (``GroupLedger``);
        #: static: every worker rolls out its 1/W slice of each step.
        self.group = cfg.rollout.dispatch == "group"
        self._after: dict[int, dict[str, Any]] = {}  # group: the data state after step b
        self._ready: dict[int, tuple[Group, int]] = {}  # group: finished, by ticket
        self._pool = _Pool()  # group: what the claims received since the last step add up to
        #: group: tickets closed as skipped (a video that could not be read) and not yet
        #: replaced by an admission; the claims in progress, by worker (the watchdog).
        self._unreplaced = 0
        self.watchdog = ClaimWatchdog(
            cfg.rollout.claim_watchdog_factor, cfg.rollout.claim_watchdog_min_s
        )
        self._results: queue.Queue[FromWorker] = queue.Queue()
        self._buffer: dict[int, dict[int, StepRollouts]] = {}  # static: by step, by worker
        self._threads: list[threading.Thread] = []
        self._closing = False
        self.failed = False
        #: The failure noticed outside ``collect`` (while pushing weights), raised by the next
        #: ``collect`` (the step in progress then finishes: its update is done).
        self._failure: WorkerFailed | None = None
        #: Rank 0's sending end of the weight pushes (``paravt.weight_sync``).
        self.publisher: WeightPublisher | None = None
        if ctx.is_main:
            r = cfg.rollout
            self.publisher = WeightPublisher(
                roles.ctrl,
                roles.weights,
                mode=r.weight_sync,
                bucket_bytes=int(r.weight_bucket_mb) << 20,
                overlap=r.weight_sync_overlap,
                device=roles.weights.device if roles.weights is not None else "cpu",
                # The push's deadline: a worker that does not hold it in time fails like a
                # dead one (its failure queued here: the wait for rollouts raises it).
                watch=PushWatch(roles.store, roles.workers, r.weight_push_timeout_s,
                                on_stall=self._stalled) if roles.store is not None else None,
            )  # fmt: skip
            for w in roles.workers:
                th = threading.Thread(
                    target=self._receive, args=(w,), name=f"paravt-recv-{w}", daemon=True
                )
                th.start()
                self._threads.append(th)

    def _stalled(self, worker: int, e: BaseException) -> None:
        """A weight push passed its deadline (``paravt.weight_sync.PushWatch``): worker
        ``worker`` fails like a dead one (``WorkerFailed`` where the trainer next waits)."""
        self._results.put(WorkerLost(worker, f"{type(e).__name__}: {e}"))

    @property
    def sampler(self) -> PromptSampler:
        """The run's ``PromptSampler`` (``Trainer.sampler`` reads and replaces it here)."""
        return self.ledger.sampler

    @sampler.setter
    def sampler(self, sampler: PromptSampler) -> None:
        self.ledger.sampler = sampler

    # ------------------------------------------------------------------------ outbound
    def start(self, policy: torch.nn.Module, init_dir: str, start_step: int) -> None:
        """Tell the workers where the model is, send them version ``start_step``'s weights
        and the first η + 1 steps' prompts (every trainer rank calls it)."""
        self.assigned = self._engine_version = start_step
        if self.ctx.is_main:
            if self.group:  # the workers' claims start at ticket 0 (a resumed job's too)
                self._store.set(CLAIM_KEY, "0")
                self._after[start_step] = self.ledger.state()
            self._ctrl.bcast(Hello(str(init_dir)))
        self.publish(policy, start_step)

    @property
    def _ctrl(self) -> Channel:
        """The control channel to the workers (trainer rank 0 holds it: ``AsyncRoles``)."""
        if self.roles.ctrl is None:
            raise RuntimeError(f"trainer rank {self.ctx.rank} has no control channel (rank 0's)")
        return self.roles.ctrl

    @property
    def _store(self) -> dist.Store:
        """The job's rendezvous store (every role holds it: ``AsyncRoles``)."""
        if self.roles.store is None:
            raise RuntimeError(f"trainer rank {self.ctx.rank} has no rendezvous store")
        return self.roles.store

    def publish(self, policy: torch.nn.Module, version: int) -> None:
        """Stream ``policy``'s weights to the workers as ``version`` (after an update; every
        trainer rank calls it: under FSDP2 each entry is an all-gather), then admit the steps
        that version allows (``version + 1 + η`` at most)."""
        if version >= self.cfg.train.steps:
            return  # the run's last update: no worker will generate again
        main = self.ctx.is_main
        when = f"while pushing version {version}"
        # The workers' engines hold the compute dtype: float32 masters go out cast to it.
        dtype = Precision.from_config(self.cfg).compute
        # The previous version's background push ends first (one push in flight at a time).
        # A worker that died meanwhile is named before the push, not by a broadcast error; a
        # failure stops rank 0's sends, while every trainer rank still walks ``full_weights``
        # (under FSDP2 each entry is a collective among the trainers).
        before = f"before pushing version {version}"
        send = main and self._noticed(lambda: self._await_push(before), before)
        send = send and self._noticed(lambda: self._drain(before))
        stream = full_weights(policy, dtype)
        if send and self.publisher is not None:
            specs = [
                Spec(n, tuple(t.shape), dtype if t.is_floating_point() else t.dtype)
                for n, t in policy.state_dict().items()
            ]
            pub = self.publisher
            send = self._noticed(lambda: pub.push(version, specs, stream), when)
        for _ in stream:  # the trainer ranks > 0 (or rank 0 after a failure): the collectives
            pass
        if send:
            self._noticed(lambda: self._admit(version), when)

    def _await_push(self, when: str) -> None:
        """Rank 0: wait for the background weight push to end, noticing a worker failure
        meanwhile (``WorkerFailed``: under NCCL a dead peer would leave the push hanging)."""
        if self.publisher is None:
            return
        while not self.publisher.wait(timeout=0.2):
            self._drain(when)

    def _noticed(self, op: Callable[[], object], when: str = "") -> bool:
        """Run ``op`` (rank 0, outside ``collect``); False, with the failure kept for the next
        ``collect``, when a worker is gone or failed (``WorkerFailed``) or a send to the
        workers fails (a peer's sockets closed: its receiving thread names it)."""
        if self._failure is not None:
            return False
        try:
            op()
            return True
        except WorkerFailed as e:
            self._failure = e
        except PushStalled as e:  # a worker did not take the push by its deadline: named
            self._failure = WorkerFailed(f"{e} (noticed {when})")
        except Exception as e:  # noqa: BLE001 - a send failed: a worker died mid-send
            self.failed = True
            time.sleep(0.5)  # its receiving thread's error names the worker
            try:
                self._drain(when)
                self._failure = WorkerFailed(
                    f"a rollout worker is gone ({type(e).__name__}: {e}), noticed {when}; the "
                    "run stops (--resume continues from the last checkpoint)"
                )
            except WorkerFailed as w:
                self._failure = w
        return False

    def _admit(self, version: int) -> None:
        """Send the workers what holding ``version`` admits (rank 0, after its weights).

        static: the steps up to ``version + 1 + η``, each step's prompts in one message. group:
        new groups while fewer than ``(η + 1) · prompts_per_step`` are issued and neither
        trained nor dropped, so a dropped group is replaced at once (AReaL's capacity rule).
        Not capped by what the run still trains: a slow worker's claims would then gate the
        last steps; up to ``η · prompts_per_step`` groups rolled out at the end go untrained."""
        steps = self.cfg.train.steps
        if not self.group:
            last = min(steps, version + 1 + self.eta)
            while self.assigned < last:
                self._assign(self.assigned + 1)
            return
        per = self.cfg.train.prompts_per_step
        room = (self.eta + 1) * per - self.ledger.outstanding
        if room > 0:
            self._ctrl.bcast(AssignGroups(tuple(self.ledger.issue(room, version))))

    def _assign(self, step: int) -> None:
        """Draw step ``step``'s prompts with their K and send them to the workers (static)."""
        self._data_before[step] = self.sampler.state()
        plan = plan_prompts(self.sampler, self.cfg, step)
        msg = AssignStep(
            step, tuple(zip(plan.samples, plan.budgets)), plan.seed, max(step - 1 - self.eta, 0)
        )
        self._ctrl.bcast(msg)
        self.assigned = step

    def data_state(self, done: int) -> dict[str, Any]:
        """What a checkpoint of step ``done`` records of the prompts. static: the sampler's
        position before step ``done + 1``'s draw. group: ``GroupLedger.state`` as it was when
        step ``done`` took its groups (the prompts drawn but not trained then are re-issued on
        ``--resume``)."""
        if not self.ctx.is_main:
            return self.sampler.state()
        if self.group:
            return dict(self._after.get(done) or self.ledger.state())
        return dict(self._data_before.get(done + 1, self.sampler.state()))

    def load_data_state(self, state: dict[str, Any], start_step: int) -> None:
        """``--resume`` (every trainer rank): the sampler's position and, under
        dispatch=group, the groups of the open slots already trained (not issued again)."""
        self.ledger.load(state, start_step)
        if not self.group and state.get("done"):
            log.warning(
                "[async] the checkpoint was written under rollout.dispatch=group with groups "
                f"trained out of order ({len(state['done'])}); rollout.dispatch=static "
                "re-draws whole steps from the oldest open one and trains those again"
            )

    @contextmanager
    def evaluating(self, policy: torch.nn.Module, step: int) -> Iterator[None]:
        """Around an evaluation after step ``step`` with the trainer's own engine: the policy's
        weights pushed into it first when it holds another version (every trainer rank: under
        FSDP2 the push is a collective), and the engine put to sleep after (vLLM on a GPU: it
        idles until the next evaluation) unless this is the run's last."""
        if self.engine is not None and self._engine_version != step:
            push_weights(self.engine, policy, self.cfg)
            self._engine_version = step
        try:
            yield
        finally:
            if self.engine is not None and step < self.cfg.train.steps:
                self.engine.sleep()

    def push_metrics(self) -> dict[str, float] | None:
        """Rank 0: its ``WeightPublisher``'s metrics (``async/push_s``, each worker's wait for
        weights); None on the other trainer ranks."""
        return self.publisher.metrics() if self.publisher is not None else None

    def close(self) -> None:
        """Stop the workers (each says bye; its receiving thread ends). Not after a failure:
        a dead worker cannot take part in the broadcast."""
        if not self.ctx.is_main or self.failed or self._closing:
            return
        try:
            self._await_push("while stopping the workers")
            self._drain("while stopping the workers")
            self._closing = True
            self._ctrl.bcast(Stop())
        except WorkerFailed as e:  # e.g. a preemption that came because a worker died
            log.info(f"error: {e}")
            return
        except Exception as e:  # a worker died meanwhile: name it if its thread saw it
            self.failed = True
            time.sleep(0.5)
            self._closing = False
            try:
                self._drain("while stopping the workers")
            except WorkerFailed as w:
                log.info(f"error: {w}")
                return
            log.info(f"[async] could not tell the workers to stop ({type(e).__name__}: {e})")
            return
        for th in self._threads:
            th.join(timeout=60)

    # ------------------------------------------------------------------------- inbound
    def _receive(self, worker: int) -> None:
        channel = self.roles.results[worker]
        where = f"trainer rank 0, from rollout worker rank {worker}"
        kinds = (Claimed, ClaimRollouts, StepRollouts, WorkerError, Bye)
        try:
            while True:
                msg = cast("FromWorker", expect(channel.recv(1), kinds, where))
                if msg.worker != worker:
                    raise RuntimeError(f"{where}: a message signed by worker {msg.worker}")
                if isinstance(msg, (ClaimRollouts, StepRollouts)):
                    msg = replace(msg, rx_bytes=channel.last_bytes)
                self._results.put(msg)
                if isinstance(msg, (Bye, WorkerError)):
                    return
        except Exception as e:  # the worker's sockets closed (it died), or it sent nonsense
            if not self._closing:
                self._results.put(WorkerLost(worker, f"{type(e).__name__}: {e}"))

    def _take(self, msg: FromWorker, when: str) -> None:
        w = msg.worker
        if isinstance(msg, StepRollouts):
            self._buffer.setdefault(msg.step, {})[w] = msg
            return
        if isinstance(msg, Claimed):
            self.watchdog.claimed(w, list(msg.tickets))
            return
        if isinstance(msg, ClaimRollouts):
            self.watchdog.finished(w)
            for e in msg.entries:  # one per claimed ticket
                if isinstance(e, TicketGroup):
                    self._ready[e.ticket] = (e.group, w)
                else:  # skipped (its video could not be read): closed, replaced at once
                    self.ledger.close(e.ticket)
                    self._unreplaced += 1
            self._pool.add(msg)
            return
        self.failed = True
        if isinstance(msg, WorkerError):
            raise WorkerFailed(
                f"rollout worker rank {w} failed (noticed {when}); the run stops (--resume "
                f"continues from the last checkpoint). Its error:\n{msg.message}"
            )
        if isinstance(msg, Bye):
            why = "it said bye before the trainer's stop"
        elif isinstance(msg, WorkerLost):
            why = msg.message
        else:  # (a message type added without its case here)
            why = f"unexpected message {describe(msg)}"
        raise WorkerFailed(
            f"rollout worker rank {w} is gone ({why}), noticed {when}; the run stops (--resume "
            "continues from the last checkpoint)"
        )

    def _drain(self, when: str) -> None:
        """Take every message already received, without waiting (``WorkerFailed`` for a dead
        or failed worker; finished rollouts are kept for their step)."""
        while True:
            try:
                msg = self._results.get_nowait()
            except queue.Empty:
                return
            self._take(msg, when)

    def collect(self, step: int, preempt: Preemption | None = None) -> RolloutBatch | None:
        """Step ``step``'s rollouts, filtered by staleness, with the ``async/*`` metrics;
        under several trainer ranks each gets its share (by prompt position), whose clips that
        arrived as decode requests it decodes (``paravt.workers.pixels.restore_pixels``). None
        when a preemption signal reached rank 0 while it waited: the step is then abandoned at
        once, whatever ``train.preempt_grace_s`` (nothing of it has started on the trainer)."""
        batch = self._share(step, preempt)
        if batch is None:
            return None
        if self._planner is None:
            self._planner = DecodePlanner.from_config(self.cfg.video, self.restore_deadline_s)
        done = restore_pixels(
            batch.groups, self._planner, self.bundle, f"trainer rank {self.ctx.rank}"
        )
        batch.groups = done.groups
        batch.errors = [*batch.errors, *done.errors]
        if self.ctx.is_main:
            batch.metrics.update(done.metrics)
        return batch

    @property
    def restore_deadline_s(self) -> float:
        """The deadline of one file's decode on a trainer rank (``async_pixels=decode``): the
        worker decoded a group's clips of a file in up to ``1 + agent.max_turns`` planner runs
        (the overview, then each turn's crops), each under ``video.decode_timeout_s``; the
        trainer decodes them all in ONE pass, cold, so it gets their sum. A trainer deadline
        at the worker's would drop groups the worker decoded in time."""
        return (1 + self.cfg.agent.max_turns) * self.cfg.video.decode_timeout_s

    def _share(self, step: int, preempt: Preemption | None) -> RolloutBatch | None:
        """This rank's share of step ``step``'s rollouts as they arrived (see ``collect``)."""
        if not self.ctx.distributed:
            return self._collect_main(step, preempt)
        # Trainer ranks > 0 wait on the rendezvous store (CTRL_TIMEOUT), not inside the scatter
        # (a collective, under NCCL's 10-minute watchdog), while rank 0 waits for the workers.
        # A worker failure is posted there too, so every trainer rank raises it at this step
        # (and the loop's checkpoint of the last step, a collective, runs on all of them).
        key = f"paravt/async/ready/{step}"
        batch = None
        if self.ctx.is_main:
            try:
                batch = self._collect_main(step, preempt)
            except WorkerFailed as e:
                self._store.set(key, _FAILED + str(e))
                raise
            self._store.set(key, "1")
        else:
            self._store.wait([key], CTRL_TIMEOUT)
            posted = self._store.get(key).decode()
            if posted.startswith(_FAILED):
                self.failed = True
                raise WorkerFailed(posted[len(_FAILED) :])
        shares: list[RolloutBatch | None] = [None]
        out = self._split(batch) if batch is not None else [None] * self.ctx.world_size
        dist.scatter_object_list(shares, out if self.ctx.is_main else None, src=0)
        return shares[0]

    def _split(self, batch: RolloutBatch) -> list[RolloutBatch]:
        n = self.ctx.world_size
        per = self.cfg.train.prompts_per_step // n
        out = [RolloutBatch([]) for _ in range(n)]
        for g in batch.groups:
            out[min(g.group_id // per, n - 1)].groups.append(g)
        out[0].errors, out[0].stats, out[0].metrics = batch.errors, batch.stats, batch.metrics
        return out

    def _collect_main(self, step: int, preempt: Preemption | None) -> RolloutBatch | None:
        if self._failure is not None:  # noticed while pushing the last weights
            raise self._failure
        if self.group:
            return self._collect_groups(step, preempt)
        t0 = time.perf_counter()
        workers = self.roles.workers
        while len(self._buffer.get(step, {})) < len(workers):
            if not self._take_next(step, preempt):
                return None
        wait = time.perf_counter() - t0
        parts = self._buffer.pop(step)
        groups: list[Group] = [g for w in workers for g in parts[w].groups]
        errors = [e for w in workers for e in parts[w].errors]
        stats = sum((parts[w].stats for w in workers), RolloutStats())
        now = step - 1  # the version this step trains
        kept = [g for g in groups if not _too_stale(g, now, self.eta)]
        dropped = len(groups) - len(kept)
        busy = sum(parts[w].busy_s for w in workers)
        idle = sum(parts[w].idle_s for w in workers)
        rx = sum(parts[w].rx_bytes for w in workers)
        metrics = staleness_metrics(kept, now)
        metrics.update(_by_worker(w for w in workers for _ in parts[w].groups))
        metrics.update(
            {
                "async/dropped_groups": float(dropped),
                "async/queue_depth": float(
                    sum(len(v) for v in self._buffer.values()) + self._results.qsize()
                ),
                "async/in_flight_steps": float(self.assigned - step),
                "async/trainer_wait_s": wait,
                "async/worker_busy_s": busy,
                "async/worker_idle_s": idle,
                "async/worker_idle_frac": idle / (busy + idle) if busy + idle > 0 else 0.0,
                "async/version": float(now),
                "async/received_mb": rx / 1e6,
            }
        )
        return RolloutBatch(kept, errors, stats, metrics)

    def _take_next(self, step: int, preempt: Preemption | None) -> bool:
        """Take the next message from the workers (waiting 0.2 s at most); False when a
        preemption signal reached this rank meanwhile (both dispatches' wait for a step).
        dispatch=group: names a worker holding a claim far longer than its peers meanwhile
        (``ClaimWatchdog``)."""
        try:
            msg = self._results.get(timeout=0.2)
        except queue.Empty:
            self._watch(step)
            return preempt is None or not preempt.signalled
        self._take(msg, f"while waiting for step {step}'s rollouts")
        return True

    def _watch(self, step: int) -> None:
        """Log the claims newly overdue (``ClaimWatchdog``): while collecting step ``step``."""
        for line in self.watchdog.overdue():
            log.warning(f"[async] step {step}: {line}")

    def _collect_groups(self, step: int, preempt: Preemption | None) -> RolloutBatch | None:
        """dispatch=group: the first ``prompts_per_step`` finished groups within η (the
        lowest tickets among those finished: the oldest issued, nearest to going stale);
        older ones are dropped, counted and replaced at once."""
        t0 = time.perf_counter()
        per, now = self.cfg.train.prompts_per_step, step - 1
        dropped = 0
        self._watch(step)
        while True:
            stale = [t for t, (g, _) in self._ready.items() if _too_stale(g, now, self.eta)]
            for t in stale:
                del self._ready[t]
                self.ledger.close(t)
            dropped += len(stale)
            if stale or self._unreplaced:  # replaced at once (the capacity rule)
                self._unreplaced = 0
                why = "while replacing stale or skipped groups"
                if not self._noticed(lambda: self._admit(now), why):
                    assert self._failure is not None
                    raise self._failure
            if len(self._ready) >= per:
                break
            if not self._take_next(step, preempt):
                return None
        wait = time.perf_counter() - t0
        taken = sorted(self._ready)[:per]
        groups, workers = [], []
        for pos, t in enumerate(taken):
            g, w = self._ready.pop(t)
            self.ledger.close(t)
            groups.append(renumber(g, pos))  # unique ids in the step: its position
            workers.append(w)
        self._after[step] = self.ledger.state()
        for old in [s for s in self._after if s < step - 1]:
            del self._after[old]
        pool, self._pool = self._pool, _Pool()
        metrics = staleness_metrics(groups, now)
        metrics.update(_by_worker(workers))
        metrics.update(
            {
                "async/dropped_groups": float(dropped),
                "async/skipped_groups": float(pool.skipped),
                "async/longest_claim_s": self.watchdog.longest(),
                "async/queue_depth": float(len(self._ready) + self._results.qsize()),
                "async/in_flight_steps": self.ledger.outstanding / per,
                "async/trainer_wait_s": wait,
                "async/worker_busy_s": pool.busy,
                "async/worker_idle_s": pool.idle,
                "async/worker_idle_frac": (
                    pool.idle / (pool.busy + pool.idle) if pool.busy + pool.idle > 0 else 0.0
                ),
                "async/version": float(now),
                "async/received_mb": pool.rx_bytes / 1e6,
            }
        )
        return RolloutBatch(groups, pool.errors, pool.stats, metrics)


#: dispatch=group: the rendezvous-store key of the next unclaimed ticket. Its value is
#: ``"<next ticket>"`` or, after a claim, ``"<next ticket>/<worker rank>/<claim number>"``, so
#: that a worker's compare-and-set sees whether it, and not another worker, moved it.
CLAIM_KEY = "paravt/async/claimed"


@dataclass
class _Pool:
    """dispatch=group: the runner errors, counters and busy / idle seconds of the claims
    received since the last step (they are the next step's)."""

    errors: list[str] = field(default_factory=list)
    stats: RolloutStats = field(default_factory=RolloutStats)
    busy: float = 0.0
    idle: float = 0.0
    rx_bytes: int = 0  # what the channels carried (pickled)
    skipped: int = 0  # tickets answered without a group (their video could not be read)

    def add(self, msg: ClaimRollouts) -> None:
        self.rx_bytes += msg.rx_bytes
        self.skipped += msg.skipped
        self.errors += msg.errors
        self.stats = self.stats + msg.stats
        self.busy += msg.busy_s
        self.idle += msg.idle_s


class ClaimWatchdog:
    """dispatch=group, trainer rank 0: names a worker that has held its claim far longer than
    its peers (``rollout.claim_watchdog_factor`` times the median of the claims finished so
    far, and at least ``claim_watchdog_min_s`` seconds): a hung worker (a decode stuck on a
    network filesystem, a wedged GPU) is otherwise silent, since a group-dispatch step never
    waits for one claim. Each claim is named once; the run goes on (a worker that dies is
    ``WorkerFailed`` as before). Fed by the workers' ``claimed`` messages and their replies
    (``RolloutPipeline._take``); asked while the trainer waits (``_take_next``)."""

    def __init__(
        self, factor: float, min_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.factor, self.min_s, self.clock = float(factor), float(min_s), clock
        self.held: dict[int, tuple[list[int], float]] = {}  # worker -> (tickets, since)
        self.durations: list[float] = []  # finished claims' seconds
        self.named: set[tuple[int, int]] = set()  # (worker, first ticket) already named

    def claimed(self, worker: int, tickets: list[int]) -> None:
        self.held[worker] = (tickets, self.clock())

    def finished(self, worker: int) -> None:
        got = self.held.pop(worker, None)
        if got is not None:
            self.durations.append(self.clock() - got[1])

    def longest(self) -> float:
        """Seconds the longest claim in progress has been held (0: none)."""
        now = self.clock()
        return max((now - t0 for _, t0 in self.held.values()), default=0.0)

    def overdue(self) -> list[str]:
        """One line per claim newly overdue (empty while off). Before any claim has finished
        (the first claims carry the engines' warm-up) the limit is ``factor * min_s``, so a
        worker hung from its first claim is named too."""
        if self.factor <= 0:
            return []
        med = float(sorted(self.durations)[len(self.durations) // 2]) if self.durations else 0.0
        limit = max(self.factor * med, self.min_s) if med else self.factor * self.min_s
        now, out = self.clock(), []
        for w, (tickets, t0) in sorted(self.held.items()):
            held = now - t0
            if held <= limit or (w, tickets[0]) in self.named:
                continue
            self.named.add((w, tickets[0]))
            than = (
                f"{held / med:.1f}x the median claim ({med:.1f} s over {len(self.durations)})"
                if med
                else f"and no claim has finished yet (limit {limit:.0f} s)"
            )
            out.append(
                f"rollout worker rank {w} has held its claim of tickets {tickets[0]}.."
                f"{tickets[-1]} for {held:.0f} s, {than}: it may be hung (a stuck decode or "
                "engine). Other workers claim the tickets left; a step that needs this "
                "claim's groups waits for them. Check that rank's log and stack (py-spy "
                "dump); the watchdog is rollout.claim_watchdog_factor / claim_watchdog_min_s"
            )
        return out


class GroupLedger:
    """Rank 0's account of the prompts under ``rollout.dispatch=group`` (``RolloutPipeline``).

    Prompts are drawn a slot at a time: slot ``k`` is ``plan_prompts(sampler, cfg, k)``
    (``prompts_per_step`` prompts, their K, the seed ``stable_seed(train.seed, k)``), so group
    ``(k, i)`` is the same prompt with the same seeds and group index whichever worker rolls it
    out, and with nothing dropped slot ``k`` is what step ``k`` trains under dispatch=static.
    ``issue`` hands groups out in order, each with a ticket (the workers claim tickets);
    ``close`` marks one trained or dropped. ``state`` is what a checkpoint records: the
    sampler's position before the oldest slot with a group neither trained nor dropped
    (``slot``), and which groups of that slot and after are (``done``); ``load`` restores it,
    so ``--resume`` re-draws those slots and issues exactly the other groups."""

    def __init__(self, sampler: PromptSampler, cfg: Config) -> None:
        self.sampler, self.cfg = sampler, cfg
        self.slot = 0  # the last slot drawn
        self.tickets = 0  # tickets issued
        self.planned: deque[PlannedGroup] = deque()  # drawn, not issued
        self.open: dict[int, IssuedGroup] = {}  # issued, neither trained nor dropped
        self.done: set[tuple[int, int]] = set()  # (slot, index) trained or dropped
        self._before: dict[int, dict[str, int]] = {}  # the sampler's position before slot k

    @property
    def outstanding(self) -> int:
        """Groups issued and neither trained nor dropped (running, or finished and waiting)."""
        return len(self.open)

    def load(self, state: dict[str, Any], start_step: int) -> None:
        """A checkpoint's ``state`` (one without ``slot``: slots follow steps from
        ``start_step + 1``, nothing of them trained)."""
        self.sampler.load(state)
        self.slot = int(state.get("slot", start_step + 1)) - 1
        self.done = {(int(k), int(i)) for k, i in state.get("done", [])}

    def issue(self, n: int, version: int) -> list[IssuedGroup]:
        """The next ``n`` groups (drawing slots as needed), ticketed; ``min_version``: the
        version a worker must hold to start one (the trainer's, ``version``, sent before)."""
        out: list[IssuedGroup] = []
        while len(out) < n:
            if not self.planned:
                self._draw()
                continue
            e = self.planned.popleft().issued(self.tickets, version)
            self.open[self.tickets] = e
            self.tickets += 1
            out.append(e)
        return out

    def _draw(self) -> None:
        self.slot += 1
        self._before[self.slot] = self.sampler.state()
        plan = plan_prompts(self.sampler, self.cfg, self.slot)
        for i, (sample, k) in enumerate(zip(plan.samples, plan.budgets)):
            if (self.slot, i) not in self.done:  # trained before the checkpoint resumed from
                self.planned.append(PlannedGroup(self.slot, i, sample, k, plan.seed))

    def close(self, ticket: int) -> None:
        """Group ``ticket`` was trained or dropped."""
        e = self.open.pop(ticket)
        self.done.add((e.slot, e.index))

    def state(self) -> dict[str, Any]:
        """``{"epoch", "pos", "slot", "done"}`` now (see the class docstring)."""
        oldest = min((e.slot for e in (*self.open.values(), *self.planned)), default=None)
        k = self.slot + 1 if oldest is None else oldest
        self.done = {d for d in self.done if d[0] >= k}
        for old in [j for j in self._before if j < k]:
            del self._before[old]
        pos = self._before.get(k) or self.sampler.state()
        return {**pos, "slot": k, "done": sorted([j, i] for j, i in self.done)}


def _too_stale(g: Group, version: int, eta: int) -> bool:
    """Whether group ``g``'s oldest sampled token is more than ``eta`` versions behind."""
    olds = [t.oldest_version() for t in (*g.trajectories, *g.sub_trajectories)]
    known = [v for v in olds if v is not None]
    return bool(known) and version - min(known) > eta


def _by_worker(workers: Iterable[int]) -> dict[str, float]:
    """``async/groups_worker_<rank>``: a step's groups by the worker that rolled out each
    (dispatch=group: those trained; static: before the staleness filter, which never fires)."""
    return {f"async/groups_worker_{w}": float(n) for w, n in sorted(Counter(workers).items())}


def renumber(g: Group, gid: int) -> Group:
    """``g`` as group ``gid`` of its step (dispatch=group: groups of different slots share a
    step): its ``group_id`` and its trajectories' (``"<group>:..."`` uids, sub-agents'
    parents), which the advantages, rewards and packing key on. Already ``gid``: unchanged."""
    old = str(g.group_id)
    if old == str(gid):
        return g

    def uid(u: str) -> str:
        head, sep, rest = u.partition(":")
        return f"{gid}{sep}{rest}" if head == old else u

    for t in (*g.trajectories, *g.sub_trajectories):
        t.uid, t.group_id = uid(t.uid), gid
        if t.parent is not None:
            t.parent = uid(t.parent)
    g.group_id = gid
    return g


def staleness_metrics(groups: list[Group], version: int) -> dict[str, float]:
    """Staleness per trained token of ``groups`` trained by ``version``: its maximum, mean,
    the share of tokens at each staleness observed (``async/staleness_<d>``, the histogram; a
    value no token had is absent) and how many versions sampled them
    (``async/versions_in_batch``). Called by ``RolloutPipeline.collect``."""
    hist: Counter[int] = Counter()
    for g in groups:
        for t in (*g.trajectories, *g.sub_trajectories):
            for m, v in zip(t.loss_mask, t.versions):
                if m and v >= 0:
                    hist[version - v] += 1
    n = sum(hist.values())
    out = {
        "async/staleness_max": float(max(hist, default=0)),
        "async/staleness_mean": sum(d * c for d, c in hist.items()) / n if n else 0.0,
        "async/versions_in_batch": float(len(hist)),
    }
    # Observed values only: a key per value 0 .. η made every row (and the viewer page) grow
    # with η, 30 MB a row at η = 1e6. An absent key reads as a share of 0.
    for d in sorted(hist):
        out[f"async/staleness_{d}"] = hist[d] / n
    return out
