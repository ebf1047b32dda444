"""A rollout worker of an asynchronous run: its own engine, fed prompts and weights by the
trainer, returning scored-later ``Group`` s (``paravt.workers.pipeline`` is the other end).

Three threads:

* the control thread reads the trainer's ordered stream on ``roles.ctrl``: ``hello`` (the
  model folder), ``assign`` (one step's prompts with their K and seed), ``weights`` (a header;
  ``rollout.weight_sync=host``: then one broadcast per tensor into a staging copy, received
  here; ``bucketed``: handed to the weight thread), ``stop``;
* the weight thread receives each bucketed version over ``roles.weights`` into buffers on the
  worker's device (``paravt.weight_sync.receive``), so the control stream is never held
  up by a push. Either way a version is staged only once it is whole and its tensors match the
  trainer's checksums; the engine is never touched from these threads;
* the main thread rolls out the assigned steps in order. Before every turn
  (``AgentRunner.before_turn``) it swaps in the newest staged weights, so a multi-turn episode
  may span versions but no generation does, and every member of a group samples a turn with
  the same version; each sampled token records its version (``Trajectory.versions``). A step
  ``b`` starts only once the worker holds version ``>= b - 1 - η`` (the trainer sends that
  version's weights before the assignment, so the wait is the stream's order).

After a swap the engine's own copy is checked against the trainer's checksums where it can be
read back (the HF engine; ``weight_sync.verify_engine``). A checksum mismatch, on receipt or
after loading, is a ``WeightSyncError`` naming the tensor and the version: the worker sends it
to the trainer (which raises ``WorkerFailed``) and exits 1.

The result of a step goes to trainer rank 0 on the worker's own ``roles.results`` channel, with
the runner's errors and counters and the worker's busy / idle seconds. A rollout that raises
sends its traceback and the worker exits 1; a trainer that disappears fails the control
thread's receive, and the worker exits 1 naming it. SIGTERM / SIGUSR1 (a cluster preempting
the job) and SIGINT (a Ctrl-C, which torchrun forwards to every process) are left to the
trainer, which checkpoints and then sends ``stop``.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import traceback
from typing import Any

import torch

from paravt.agent.loop import AgentRunner
from paravt.config import Config
from paravt.distributed import DistContext
from paravt.engines import engine_spec, make_engine
from paravt.log import ALL_RANKS, get_logger
from paravt.models import load_model_from_config
from paravt.weight_sync import Staged, WeightSyncError, receive, verify_engine
from paravt.workers.roles import AsyncRoles

log = get_logger(__name__)

#: Test hook: seconds a worker sleeps before every turn (``PARAVT_WORKER_TURN_PAUSE_S``), so
#: that a test sees weights arrive in the middle of an episode.
TURN_PAUSE_ENV = "PARAVT_WORKER_TURN_PAUSE_S"


class WorkerStopped(Exception):
    """The trainer said stop (or vanished) while this worker was rolling out."""


class _Weights:
    """Staged weights from the control or weight thread, swapped into the engine by the main
    thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending: Staged | None = None  # whole and verified (weight_sync.receive)
        self.staged_version = -1  # the newest version received (staged or loaded)
        self.arrived = threading.Condition(self.lock)
        self.gone = ""  # why the control stream failed (the trainer is gone), if it did
        self.failed: WeightSyncError | None = None  # a received version failed its checksums

    def stage(self, staged: Staged) -> None:
        with self.arrived:
            self.pending = staged
            self.staged_version = staged.version
            self.arrived.notify_all()

    def fail(self, e: WeightSyncError, jobs: queue.Queue[Any]) -> None:
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
    hello = roles.ctrl.bcast()
    if hello.get("kind") != "hello":
        raise RuntimeError(f"rollout worker rank {roles.rank}: expected hello, got {hello}")
    tag = f"[worker {roles.rank}]"
    # The control thread first: the trainer's first weight push and prompts are staged while
    # the model loads and the engine starts (minutes for vLLM), so the trainer never waits.
    weights = _Weights()
    jobs: queue.Queue[Any] = queue.Queue()
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
        f"{tag} pid {os.getpid()}: loading {hello['init_dir']} ({cfg.rollout.engine} engine)",
        extra=ALL_RANKS,
    )
    try:
        # An engine that loads its own copy (vLLM) only reads the HF model's config and dtype:
        # that model stays in host memory (at 8B, 16 GiB of the worker's device saved).
        own = engine_spec(cfg.rollout.engine).own_weights
        where = "cpu" if own else str(ctx.device)
        bundle = load_model_from_config(hello["init_dir"], cfg.model, device=where)
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
            verify_engine(engine, staged)  # the HF engine's copy, read back (not vLLM's)
            version = staged.version
        if pause:  # test hook: slow turns, so that weights arrive mid-episode
            time.sleep(pause)
        return version

    share = cfg.train.prompts_per_step // len(roles.workers)
    first = roles.worker_index * share
    totals = {"steps": 0, "busy_s": 0.0, "idle_s": 0.0}
    idle = 0.0
    try:
        while True:
            t0 = time.perf_counter()
            job = jobs.get()
            if isinstance(job, BaseException):
                raise job
            if job is None:
                break
            # The assignment follows the weights it needs in the stream: wait for the control
            # thread to have staged them (it has, unless the stream is still being read).
            need = int(job["min_version"])
            with weights.arrived:
                weights.arrived.wait_for(
                    lambda need=need: (
                        weights.staged_version >= need
                        or stop.is_set()
                        or weights.failed is not None
                    )
                )
            idle += time.perf_counter() - t0
            runner.before_turn = swap
            mine = job["prompts"][first : first + share]
            t1 = time.perf_counter()
            try:
                groups = runner.rollout(
                    [s for s, _ in mine],
                    [k for _, k in mine],
                    group_size=cfg.rollout.group_size,
                    seed=job["seed"],
                    first_group=first,
                )
            except WorkerStopped:
                if weights.failed is not None:  # failed weights stopped the control thread
                    raise weights.failed from None
                break  # the trainer said stop (or is gone: raised below)
            busy = time.perf_counter() - t1  # (the engine owns its device: it never sleeps)
            _send_or_gone(
                results,
                roles.rank,
                {
                    "kind": "batch",
                    "step": job["step"],
                    "worker": roles.rank,
                    "groups": groups,
                    "errors": list(runner.errors),
                    "stats": runner.stats,  # a new RolloutStats per rollout
                    "busy_s": busy,
                    "idle_s": idle,
                },
            )
            totals["steps"] += 1
            totals["busy_s"] += busy
            totals["idle_s"] += idle
            idle = 0.0
    except BaseException as e:  # tell the trainer which worker failed and why, then exit 1
        if not isinstance(e, TrainerGone):
            _report(results, roles.rank, e)
        raise
    if weights.gone:
        raise TrainerGone(weights.gone)
    try:
        results.send({"kind": "bye", "worker": roles.rank}, 0)
    except Exception:  # the trainer stopped us and has exited already: nothing left to say
        if not stop.is_set():
            raise
    ctrl.join(timeout=30)
    receiver.join(timeout=30)
    getattr(engine, "close", lambda: None)()
    log.info(
        f"{tag} stopped after {totals['steps']} step(s): busy {totals['busy_s']:.1f} s, "
        f"idle {totals['idle_s']:.1f} s",
        extra=ALL_RANKS,
    )
    return totals


def _send_or_gone(results: Any, rank: int, msg: dict[str, Any]) -> None:
    """Send a finished batch to trainer rank 0; a transport error means the trainer is gone
    (killed or exited): :class:`TrainerGone`, one line at ``paravt.train.main``."""
    try:
        results.send(msg, 0)
    except RuntimeError as e:
        raise TrainerGone(
            f"rollout worker rank {rank}: the trainer (rank 0) is gone, sending step "
            f"{msg.get('step')}'s rollouts failed ({str(e).splitlines()[0][:200]}); stopping"
        ) from None


def _report(results: Any, rank: int, e: BaseException) -> None:
    """Send the trainer this worker's error (best effort: the trainer may be gone)."""
    try:
        msg = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        results.send({"kind": "error", "worker": rank, "message": msg}, 0)
    except Exception:
        pass


class TrainerGone(RuntimeError):
    """The control stream failed: trainer rank 0 exited or was killed. ``paravt.train.main``
    prints its message as one ``error:`` line (no traceback) and exits 1."""


def _control_loop(
    roles: AsyncRoles,
    weights: _Weights,
    jobs: queue.Queue[Any],
    stop: threading.Event,
    headers: queue.Queue[Any],
) -> None:
    """Read the trainer's stream until ``stop`` (see the module docstring)."""
    try:
        while True:
            msg = roles.ctrl.bcast()
            kind = msg["kind"]
            if kind == "assign":
                jobs.put(msg)
            elif kind == "weights":
                if msg.get("sync", "host") == "host":  # through ctrl, here, into host memory
                    weights.stage(receive(msg, roles.ctrl, None))
                else:
                    headers.put(msg)  # the weight thread receives the buckets
            elif kind == "stop":
                break
            else:
                raise RuntimeError(f"unexpected control message {kind!r}")
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
    jobs: queue.Queue[Any],
    stop: threading.Event,
    headers: queue.Queue[Any],
) -> None:
    """Receive each bucketed version the control thread announces (``headers``; None: the
    stream ended) over ``roles.weights``, verify and stage it."""
    device = roles.weights.device if roles.weights is not None else torch.device("cpu")
    while (msg := headers.get()) is not None:
        try:
            weights.stage(receive(msg, None, roles.weights, device))
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
