"""The trainer's end of an asynchronous run: prompts and weights out, rollouts in, staleness
bounded (``paravt.workers.worker`` is the other end).

Versions: the policy the trainer holds after step ``s`` is version ``s`` (the run's start,
SFT or a resumed checkpoint, is version ``start_step``). Step ``b`` trains the policy of
version ``b - 1`` on the rollouts of step ``b``; a token sampled by version ``v`` is then
``b - 1 - v`` versions stale.

* **Admission (AReaL's rule).** Step ``b``'s prompts go out only once the trainer holds
  version ``>= b - 1 - η`` (``rollout.max_staleness``): at the start steps ``start+1 ..
  start+1+η``, then one more after every update. A worker starts step ``b`` only with a
  version ``>= b - 1 - η`` loaded, and swaps in newer weights between turns, so no token of
  step ``b`` is older than ``b - 1 - η``. η = 0 is the synchronous schedule: the worker
  generates step ``b`` with version ``b - 1`` exactly while the trainer waits.
* **Filter.** ``collect`` drops (and counts, ``async/dropped_groups``) any group whose oldest
  sampled token is more than η versions behind. The admission rule makes this a guard that
  should never fire.
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
* **Data position.** Rank 0's prompt sampler runs ahead of training (up to η + 1 steps); the
  position checkpointed with step ``s`` is the one before step ``s + 1``'s prompts were drawn
  (``data_state``), so ``--resume`` re-issues exactly the prompts not yet trained on.

Faults: each worker has a receiving thread on its own group; a worker that dies (SIGKILL, OOM,
its node lost) closes its sockets and the thread's receive fails at once, and a worker whose
rollout raises sends its traceback. The failure is raised by ``collect`` only, on every trainer
rank (rank 0 posts it on the rendezvous store where the others wait), as ``WorkerFailed``
naming the worker's rank: the policy is then exactly the last completed step's, which the
training loop checkpoints before it stops (``paravt.train``). A failure noticed while pushing
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
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from paravt.config import Config
from paravt.distributed import DistContext, Precision, full_weights
from paravt.engines.engine import Engine
from paravt.log import get_logger
from paravt.rollout_source import plan_prompts, push_weights
from paravt.types import Group, RolloutBatch, RolloutStats
from paravt.weight_sync import Spec, WeightPublisher
from paravt.workers.roles import CTRL_TIMEOUT, AsyncRoles

log = get_logger(__name__)


class WorkerFailed(RuntimeError):
    """A rollout worker died or its rollout raised; the message names its rank."""


#: How rank 0 posts a worker failure on the rendezvous store for the other trainer ranks.
_FAILED = "failed:"


class RolloutPipeline:
    """Trainer-side state of the asynchronous schedule (every trainer rank holds one; only
    rank 0 talks to the workers): the asynchronous ``paravt.rollout_source.RolloutSource``.
    ``sampler``: the run's ``PromptSampler`` (rank 0's draws are the run's prompts);
    ``engine``: the trainer's own engine, which only evaluates (None: no evaluation)."""

    abandon_when = "while waiting for its rollouts"

    def __init__(
        self,
        cfg: Config,
        ctx: DistContext,
        roles: AsyncRoles,
        sampler: Any,
        engine: Engine | None = None,
    ) -> None:
        self.cfg, self.ctx, self.roles, self.sampler = cfg, ctx, roles, sampler
        self.engine = engine
        self._engine_version = 0  # the policy version the evaluation engine holds
        self.eta = int(cfg.rollout.max_staleness)
        self.assigned = 0  # the last step whose prompts went out
        self._data_before: dict[int, dict[str, int]] = {}
        self._results: queue.Queue[dict[str, Any]] = queue.Queue()
        self._buffer: dict[int, dict[int, dict[str, Any]]] = {}
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
            )
            for w in roles.workers:
                th = threading.Thread(
                    target=self._receive, args=(w,), name=f"paravt-recv-{w}", daemon=True
                )
                th.start()
                self._threads.append(th)

    # ------------------------------------------------------------------------ outbound
    def start(self, policy: torch.nn.Module, init_dir: str, start_step: int) -> None:
        """Tell the workers where the model is, send them version ``start_step``'s weights
        and the first η + 1 steps' prompts (every trainer rank calls it)."""
        self.assigned = self._engine_version = start_step
        if self.ctx.is_main:
            self.roles.ctrl.bcast({"kind": "hello", "init_dir": str(init_dir)})
        self.publish(policy, start_step)

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
            last = min(self.cfg.train.steps, version + 1 + self.eta)
            while send and self.assigned < last:
                send = self._noticed(lambda: self._assign(self.assigned + 1), when)

    def _await_push(self, when: str) -> None:
        """Rank 0: wait for the background weight push to end, noticing a worker failure
        meanwhile (``WorkerFailed``: under NCCL a dead peer would leave the push hanging)."""
        if self.publisher is None:
            return
        while not self.publisher.wait(timeout=0.2):
            self._drain(when)

    def _noticed(self, op: Any, when: str = "") -> bool:
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

    def _assign(self, step: int) -> None:
        """Draw step ``step``'s prompts with their K and send them to the workers."""
        self._data_before[step] = self.sampler.state()
        plan = plan_prompts(self.sampler, self.cfg, step)
        msg = {
            "kind": "assign",
            "step": step,
            "prompts": list(zip(plan.samples, plan.budgets)),
            "seed": plan.seed,
            "min_version": max(step - 1 - self.eta, 0),
        }
        self.roles.ctrl.bcast(msg)
        self.assigned = step

    def data_state(self, done: int) -> dict[str, int]:
        """The prompt sampler's position after step ``done``'s prompts (what a checkpoint of
        step ``done`` records): before step ``done + 1``'s draw if it happened already."""
        if not self.ctx.is_main:
            return self.sampler.state()
        return dict(self._data_before.get(done + 1, self.sampler.state()))

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
                getattr(self.engine, "sleep", lambda: None)()

    def close(self) -> None:
        """Stop the workers (each says bye; its receiving thread ends). Not after a failure:
        a dead worker cannot take part in the broadcast."""
        if not self.ctx.is_main or self.failed or self._closing:
            return
        try:
            self._await_push("while stopping the workers")
            self._drain("while stopping the workers")
            self._closing = True
            self.roles.ctrl.bcast({"kind": "stop"})
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
        try:
            while True:
                msg = channel.recv(1)
                self._results.put(msg)
                if msg.get("kind") in ("bye", "error"):
                    return
        except Exception as e:  # the worker's sockets closed: it died
            if not self._closing:
                self._results.put(
                    {"kind": "failed", "worker": worker, "message": f"{type(e).__name__}: {e}"}
                )

    def _take(self, msg: dict[str, Any], when: str) -> None:
        kind, w = msg.get("kind"), msg.get("worker")
        if kind == "batch":
            self._buffer.setdefault(int(msg["step"]), {})[int(w)] = msg
            return
        self.failed = True
        if kind == "error":
            raise WorkerFailed(
                f"rollout worker rank {w} failed (noticed {when}); the run stops (--resume "
                f"continues from the last checkpoint). Its error:\n{msg['message']}"
            )
        why = msg.get("message", "it said bye before the trainer's stop")
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

    def collect(self, step: int, preempt: Any = None) -> RolloutBatch | None:
        """Step ``step``'s rollouts, filtered by staleness, with the ``async/*`` metrics;
        under several trainer ranks each gets its share (by prompt position). None when a
        preemption signal reached rank 0 while it waited: the step is then abandoned at once,
        whatever ``train.preempt_grace_s`` (nothing of it has started on the trainer)."""
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
                self.roles.store.set(key, _FAILED + str(e))
                raise
            self.roles.store.set(key, "1")
        else:
            self.roles.store.wait([key], CTRL_TIMEOUT)
            posted = self.roles.store.get(key).decode()
            if posted.startswith(_FAILED):
                self.failed = True
                raise WorkerFailed(posted[len(_FAILED) :])
        shares: list[Any] = [None]
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

    def _collect_main(self, step: int, preempt: Any) -> RolloutBatch | None:
        if self._failure is not None:  # noticed while pushing the last weights
            raise self._failure
        t0 = time.perf_counter()
        workers = self.roles.workers
        while len(self._buffer.get(step, {})) < len(workers):
            try:
                msg = self._results.get(timeout=0.2)
            except queue.Empty:
                if preempt is not None and preempt.signalled:
                    return None
                continue
            self._take(msg, f"while waiting for step {step}'s rollouts")
        wait = time.perf_counter() - t0
        parts = self._buffer.pop(step)
        groups: list[Group] = [g for w in workers for g in parts[w]["groups"]]
        errors = [e for w in workers for e in parts[w]["errors"]]
        stats = sum((parts[w]["stats"] for w in workers), RolloutStats())
        now = step - 1  # the version this step trains
        kept, dropped = [], 0
        for g in groups:
            olds = [t.oldest_version() for t in (*g.trajectories, *g.sub_trajectories)]
            olds = [v for v in olds if v is not None]
            if olds and now - min(olds) > self.eta:
                dropped += 1
            else:
                kept.append(g)
        busy = sum(parts[w]["busy_s"] for w in workers)
        idle = sum(parts[w]["idle_s"] for w in workers)
        metrics = staleness_metrics(kept, now)
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
            }
        )
        return RolloutBatch(kept, errors, stats, metrics)


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
