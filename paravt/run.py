"""The run of ``python -m paravt.train``: the loop over the steps, its one stop path, its result.

``paravt.train`` keeps what one step is (``build_trainer``, ``train_step``) and hands both to
:func:`run`, which holds ``train.out_dir``, starts the ranks (or a rollout worker), evaluates
before and after, drives the steps (alarms, periodic evaluations, checkpoints) and returns a
:class:`RunResult`. :func:`command` is the command line's exit codes around it
(``paravt.train.main``). This module imports nothing of ``paravt.train``: the step arrives
as arguments, so the two never import each other.

A run that stops before its last step stops in one place, :func:`_stop`, whatever stopped it
(:class:`StopReason`): a SIGTERM/SIGUSR1/SIGINT at a step boundary (``paravt.preempt``), a
step abandoned after such a signal (``StepAbandoned``: finishing it would pass the grace), or
a lost rollout worker (``WorkerFailed``, asynchronous runs). Every rank checkpoints the last
completed step unless the newest checkpoint holds it, rank 0 says so in one line, and the
stop is a :class:`RunStopped`: in the result (``RunResult.stopped``) after a signal, or logged
before the ``WorkerFailed`` is raised on (``main`` exits 1 with its message).
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paravt.alarms import CollapseDetector, EmptySteps, EmptyStepsError
from paravt.checkpoint import (
    CheckpointLoadError,
    CheckpointSaveError,
    latest_checkpoint,
    rng_state,
    run_id,
    step_dirname,
)
from paravt.config import Config, ConfigError, config_summary, to_yaml
from paravt.data.readers import DatasetError
from paravt.distributed import (
    DistContext,
    cleanup,
    init_distributed,
    peer_lost,
    release_single_rank_group,
    world_size_from_env,
)
from paravt.eval.conditions import eval_conditions
from paravt.eval.heldout import before_after_table, evaluate, table_rows
from paravt.files import FolderError, NotRegularFile, claim_folder, write_atomic
from paravt.log import get_logger
from paravt.metrics import (
    DiskFullError,
    RunFolderWrites,
    format_table,
    plot_summary,
    postfix,
    progress_bar,
    read_metrics,
)
from paravt.plan import check_device_memory
from paravt.preempt import Preemption, SFTPreempted, StepAbandoned
from paravt.runfolder import check_run_folder, logged_eval, record_run
from paravt.step_stats import StepResult
from paravt.trainer import Trainer
from paravt.validate import validate_run
from paravt.workers import TrainerGone, WorkerFailed, init_async, run_worker
from paravt.workers.roles import AsyncRoles, pin_worker_gpu

log = get_logger(__name__)

#: ``paravt.train.build_trainer``: everything a step touches, once (``roles``: an
#: asynchronous run's trainer rank; None: this rank rolls out).
BuildTrainer = Callable[[Config, DistContext, AsyncRoles | None], Trainer]
#: ``paravt.train.train_step``: one step; its metrics (global over ranks, on every rank).
TrainStep = Callable[[Trainer, int], StepResult]


class StopReason(enum.Enum):
    """What stopped a run before its last step."""

    SIGNAL = "a signal"  # SIGTERM/SIGUSR1/SIGINT, seen at a step boundary (or the SFT's)
    ABANDONED = "an abandoned step"  # a signal, and finishing the step would pass the grace
    WORKER_LOST = "a lost worker"  # an asynchronous run's rollout worker died or raised


@dataclass(frozen=True)
class RunStopped:
    """A run stopped early, after every rank saved what it could (:func:`_stop`).

    ``step``: the last completed step, the one the checkpoint holds (0: none completed);
    ``checkpoint``: its folder ('' when no step completed; the cold-start SFT's state folder
    when the SFT stopped); ``ok``: False when it could not be written
    (``train.on_save_error=continue``; ``main`` exits 1); ``message``: the line rank 0 logged
    (``[preempt] ...`` or ``[async] a rollout worker is gone ...``); ``outcome``: where the
    run stopped ("finished step 3", "abandoned step 4 ...", "no step in progress", ...).
    After a signal (not a lost worker): its name, the step and phase it came in on the
    earliest rank (``signal_step``, ``phase``), the ranks it reached, and the seconds from it
    to the end of the save."""

    reason: StopReason
    step: int
    checkpoint: str
    ok: bool
    message: str
    outcome: str
    signal: str = ""
    signal_step: int = 0
    phase: str = ""
    ranks: tuple[int, ...] = ()
    seconds: float = 0.0

    @classmethod
    def sft(cls, info: dict[str, Any]) -> RunStopped:
        """The cold-start SFT's stop after a signal (``SFTPreempted.info``,
        ``Preemption.exit_line``'s record): no RL step completed."""
        return cls(
            StopReason.SIGNAL, 0, info["checkpoint"], info["ok"], info["message"],
            info["outcome"], info["signal"], info["step"], info["phase"], tuple(info["ranks"]),
            info["seconds"],
        )  # fmt: skip


@dataclass(frozen=True)
class RunResult:
    """What :func:`run` returns. ``before`` / ``after``: the held-out evaluations before and
    after RL ({} when not run: ``train.eval_prompts=0``, ``eval_before`` off, or a stopped
    run's ``after``); ``last``: the last completed step's metrics ({} when none ran);
    ``stopped``: how a signal stopped the run early (None: it ran to ``train.steps``).
    A rollout worker's process (asynchronous runs) trains nothing: ``worker`` is its rank and
    ``worker_totals`` its counters (steps, groups, busy and idle seconds)."""

    out_dir: str
    before: dict[str, float] = field(default_factory=dict)
    after: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    stopped: RunStopped | None = None
    worker: int | None = None
    worker_totals: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """False when a stop's checkpoint could not be written (``main`` exits 1)."""
        return self.stopped is None or self.stopped.ok


def run(
    cfg: Config, build: BuildTrainer, step: TrainStep, *, keep_handlers: bool = False
) -> RunResult:
    """``paravt.train.run``: train with a validated config, ``build`` making the trainer and
    ``step`` running each step. A SIGTERM/SIGUSR1 stops it early (``RunResult.stopped``,
    ``after`` then empty): the run, not the caller, handles those signals while it runs
    (``paravt.preempt``; ``keep_handlers``: until the process exits, as ``main`` does). A
    folder another live process holds (``paravt.files.FolderClaim``: rank 0 holds
    ``train.out_dir`` for the run's life), a folder that holds another run, or a ``--resume``
    with other settings, is refused first (``paravt.runfolder``)."""
    pin_worker_gpu(cfg.rollout.workers, cfg.model.device)  # before anything starts CUDA
    validate_run(cfg, world_size_from_env())  # before anything heavy loads
    check_device_memory(cfg, world_size_from_env())  # CUDA: the memory plan fits the device
    try:  # rank 0 holds the folder for the run's life; a second run into it is refused
        claim = claim_folder(cfg.train.out_dir, "a paravt.train run", _BUSY_FIX)
    except FolderError as e:
        raise ConfigError(str(e)) from None
    try:
        return _claimed_run(cfg, build, step, keep_handlers)
    finally:
        if claim is not None:
            claim.release()


#: What a run refused by another live run's claim on ``train.out_dir`` may do.
_BUSY_FIX = (
    "wait for that run to end (or stop it: kill -TERM saves it), or pass another train.out_dir"
)


def _claimed_run(
    cfg: Config, build: BuildTrainer, step: TrainStep, keep_handlers: bool
) -> RunResult:
    """:func:`run` once rank 0 holds ``train.out_dir``: the folder check, then the run."""
    check_run_folder(cfg)  # every rank (workers too), before any of them writes there
    roles = None
    if cfg.rollout.workers > 0:  # asynchronous: this process trains or rolls out
        ctx, roles = init_async(cfg.model.device, cfg.rollout.workers, cfg.rollout.weight_sync)
        if roles.is_worker:
            totals = run_worker(cfg, ctx, roles)
            cleanup(ctx)
            return RunResult(cfg.train.out_dir, worker=roles.rank, worker_totals=totals)
    else:
        ctx = init_distributed(cfg.model.device, hsdp=cfg.train.hsdp)
    with Preemption(cfg.train.preempt_grace_s, ctx, keep=keep_handlers) as pre:
        try:
            return _run(cfg, ctx, pre, build, step, roles)
        finally:  # a run that raised: no live group of one at exit or for the next run
            release_single_rank_group()


def _run(
    cfg: Config,
    ctx: DistContext,
    pre: Preemption,
    build: BuildTrainer,
    train_step: TrainStep,
    roles: AsyncRoles | None = None,
) -> RunResult:
    out = Path(cfg.train.out_dir)
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        with RunFolderWrites(cfg.train.on_save_error, out).guard("config", out / "config.yaml"):
            write_atomic(out / "config.yaml", to_yaml(cfg))
            if not cfg.train.resume:  # a new run: its identity, which its checkpoints carry
                run_id(out, create=True)
            record_run(cfg)  # run.json: what a --resume must match (paravt.runfolder)
        log.info(config_summary(cfg))
        log.debug(to_yaml(cfg))
    t_run = time.perf_counter()
    try:
        tr = build(cfg, ctx, roles)
    except SFTPreempted as e:  # its state is saved: --resume continues the SFT
        cleanup(ctx)
        return RunResult(str(out), stopped=RunStopped.sft(e.info))
    if ctx.is_main:  # now with the fingerprint of a tiny model built by this run
        with tr.logger.disk.guard("config", out / "run.json"):
            record_run(cfg)
    tr.preempt = pre
    t = cfg.train
    tr.source.start(tr.policy, tr.init_dir, tr.start_step)  # async: workers start rolling out

    before: dict[str, float] = {}
    pre.enter(tr.start_step, "eval")
    # After a signal the evaluation is skipped (the loop's first boundary then stops the run).
    if t.eval_prompts and t.eval_before and not pre.requested():
        # Logged already (the rows kept are the start's: truncated above): not twice.
        before = logged_eval(out, "eval_before", ctx=ctx)
        if not before:
            before = _evaluate(tr, tr.start_step, "eval_before")

    bar = progress_bar(
        t.steps, initial=tr.start_step, enabled=ctx.is_main and t.progress, desc="PARA-GRPO"
    )
    # Collapse alarms; on --resume the kept rows restore starting levels and armed states.
    alarms = CollapseDetector.from_config(t)
    empty = EmptySteps(t.max_empty_steps)
    if tr.start_step > 0:
        alarms.replay(read_metrics(out / "metrics.jsonl"))
        _periodic_eval(tr, tr.start_step, pre, resumed=True)  # one a preemption skipped
    last: dict[str, float] = {}
    # A stop (_stop): the last completed step, the step the newest checkpoint holds, and
    # what the step in progress started from (what an abandoned or failed step leaves).
    done = saved = tr.start_step
    begin: tuple[dict[str, int], Any] | None = None
    stop: StopReason | None = None
    failure: WorkerFailed | None = None
    for step in range(tr.start_step + 1, t.steps + 1):
        if pre.start_step(step):  # any rank, during the previous step or before the first
            stop = StopReason.SIGNAL
            break
        begin = (tr.source.data_state(step - 1), rng_state())
        try:
            res = train_step(tr, step)
        except StepAbandoned:
            stop = StopReason.ABANDONED
            break
        except WorkerFailed as e:  # raised by collect: the policy is still step `done`'s
            stop, failure = StopReason.WORKER_LOST, e
            break
        done, last = step, res.metrics
        pre.rest_s = last["time/step"] - last["time/rollout"]  # for should_abandon
        tr.logger.log(step, last)
        fired = alarms.update(step, last)
        if (a := empty.update(step, last, res.errors)) is not None:
            fired.append(a)
        for a in fired:
            tr.logger.log(step, a.row(), kind="alarm")
            if ctx.is_main:
                bar.write(f"[alarm] step {step}: {a.message}")
        empty.check(step)  # train.max_empty_steps empty steps in a row: EmptyStepsError
        bar.set_postfix(postfix(last))
        bar.update(1)
        _periodic_eval(tr, step, pre)  # before the checkpoint: a resume from it has the row
        if (t.save_every and step % t.save_every == 0) or step == t.steps:
            # train.async_save: written in the background while the next steps run, committed
            # at the next save (or the end); the last step's in the foreground (nothing after).
            with tr.phase(step, "checkpoint"):
                back = t.async_save and step < t.steps
                if tr.checkpoint(step, background=back):
                    saved = step
            # What a preemption's save would take: the whole write, not the blocking part.
            pre.save_s = max(tr.times["time/checkpoint"], tr.times.get("time/checkpoint_write", 0))
    bar.close()
    if stop is None and pre.requested():  # a signal during the last step or an evaluation
        stop = StopReason.SIGNAL
    if stop is not None:  # the one stop path: save, say so, close
        stopped = _stop(tr, stop, done, saved, None if stop is StopReason.SIGNAL else begin)
        if failure is None:  # a lost worker's pipeline is not closed: its peers are gone
            tr.source.close()
        tr.logger.close()
        cleanup(ctx, *([tr.engine.close] if tr.engine is not None else []))
        if failure is not None:
            raise failure
        return RunResult(str(out), before=before, last=last, stopped=stopped)
    tr.finish_checkpoint()  # none in flight (the last step's is foreground): for certain
    pre.enter(t.steps, "eval")
    tr.source.close()  # async: the workers are done; the evaluation runs here

    # A resumed finished run has its evaluation logged already: reused, not logged twice.
    after = logged_eval(out, "eval_after", t.steps, ctx) if t.eval_prompts else {}
    if t.eval_prompts and not after:
        after = _evaluate(tr, t.steps, "eval_after")
    if ctx.is_main:
        if t.summary_plot:
            with tr.logger.disk.guard("summary plot", out / "summary.png"):
                plot_summary(out / "metrics.jsonl", out / "summary.png")
        table = {"before RL": before, "after RL": after, "last step": last}
        log.info("\n" + format_table(table, table_rows(cfg)))
        if before and after:
            log.info("\n" + paired_table(tr))
        log.info(
            f"\n[train] {t.steps} steps in {time.perf_counter() - t_run:.0f} s; run folder: "
            f"{out} (metrics.jsonl, tb/, trajectories.jsonl, summary.png, checkpoints/)"
        )
    tr.logger.close()
    cleanup(ctx, *([tr.engine.close] if tr.engine is not None else []))
    return RunResult(str(out), before=before, after=after, last=last)


def _stop(
    tr: Trainer,
    reason: StopReason,
    done: int,
    saved: int,
    begin: tuple[dict[str, int], Any] | None,
) -> RunStopped:
    """The one stop path of a run that stops before its last step (every rank): checkpoint
    the last completed step ``done`` unless ``saved`` (the newest checkpoint's step) is it
    already, and say so on rank 0: after a signal the ``[preempt]`` line (where it came,
    where the run stopped, what was saved, how long after the signal), after a lost worker
    the ``[async]`` line (a node that dies takes its workers with it: the same path).

    ``begin``: when the step after ``done`` was abandoned (a signal, or ``WorkerFailed``
    raised by ``collect`` on every trainer rank before anything of that step ran), the
    sampler position and RNG states it started from, saved instead of the current ones so
    that ``--resume`` loses nothing."""
    path = str(Path(tr.cfg.train.out_dir) / "checkpoints" / step_dirname(done)) if done else ""
    if tr.checkpoint_pending:  # train.async_save: committed first
        with tr.phase(done, "checkpoint"):
            waited = tr.finish_checkpoint()
        if waited is not None and not waited[1]:  # it failed: the newest one is older
            saved = min(saved, waited[0] - 1)
    ok, wrote = True, " (already written)" if done else ""
    if done > saved:
        with tr.phase(done, "checkpoint"):
            ok = tr.checkpoint(done, begin=begin, background=False)
        wrote = f" written in {tr.times['time/checkpoint']:.1f} s"
    if not ok:
        what = f"checkpoint {path} NOT written (see the warning above)"
    elif path:
        what = f"checkpoint {path}{wrote}"
    else:
        what = "no step completed, nothing to checkpoint (--resume starts at step 0)"

    if reason is StopReason.WORKER_LOST:
        line = f"[async] a rollout worker is gone after step {done}: {what}"
        log.info(line)
        return RunStopped(
            reason, done, path, ok, line, f"a rollout worker is gone after step {done}"
        )

    t = tr.cfg.train
    assert tr.preempt is not None  # a signal came: the run's handler saw it
    arrivals = tr.preempt.arrivals()  # after the save: how long since the earliest signal
    first, seconds = arrivals[0]
    where = f"{first.signal} at step {first.step} ({first.phase})"
    if tr.ctx.world_size > 1:
        ranks = sorted(a[0].rank for a in arrivals)
        where += f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    if begin is not None:
        outcome = f"abandoned step {done + 1} {tr.source.abandon_when}"
    elif first.phase in ("startup", "eval"):
        outcome = "no step in progress"
    else:
        outcome = f"finished step {done}"
    late = f", past the grace of {t.preempt_grace_s:g} s" if seconds > t.preempt_grace_s else ""
    line = (
        f"[preempt] {where}: {outcome}, {what}; exiting {0 if ok else 1} {seconds:.1f} s after "
        f"the signal{late or f' (grace {t.preempt_grace_s:g} s)'}"
    )
    log.info(line)
    return RunStopped(
        reason, done, path, ok, line, outcome, first.signal, first.step, first.phase,
        tuple(a[0].rank for a in arrivals), seconds,
    )  # fmt: skip


def paired_table(tr: Trainer) -> str:
    """The before/after table paired by prompt (``paravt.eval.heldout.before_after_table``)
    from the run's ``heldout.jsonl``, with a uniform guess's accuracy on the held-out mcq
    prompts beside the no-tool conditions."""
    mcq = [1 / len(s.options) for s in tr.val_samples if s.options]
    guess = sum(mcq) / len(mcq) if mcq else None
    rows = read_metrics(tr.logger.heldout_path)
    return before_after_table(rows, eval_conditions(tr.cfg), guess)


def _evaluate(tr: Trainer, step: int, kind: str) -> dict[str, float]:
    """The held-out evaluation (``paravt.eval.heldout.evaluate``) of the policy now, logged at
    ``step`` as a ``kind`` row (``eval_before``, ``eval_step``, ``eval_after``) of
    ``metrics.jsonl`` and one row per prompt and condition in ``heldout.jsonl``."""
    prompts: list[dict[str, Any]] = []
    t = tr.cfg.train
    label = {"eval_before": "before RL", "eval_after": "after RL"}.get(kind, f"step {step}")
    conds = list(t.eval_conditions) or [f"{t.eval_frames or tr.cfg.video.fixed_frames}:tools"]
    log.info(
        f"[eval] {label}: {len(tr.val_samples)} held-out prompt(s), "
        f"{len(conds)} condition(s): {', '.join(map(str, conds))}"
    )
    with tr.source.evaluating(tr.policy, step):  # async: the eval engine gets the weights
        m = evaluate(
            tr.cfg, tr.ctx, tr.policy, tr.runner, tr.val_samples,
            seed=t.seed, per_prompt=prompts, label=label,
        )  # fmt: skip
    tr.logger.log(step, m, kind=kind)
    tr.logger.log_heldout(step, kind, prompts)
    return m


def _periodic_eval(tr: Trainer, step: int, pre: Preemption, *, resumed: bool = False) -> None:
    """``train.eval_every``: after every that many steps (not the last: ``eval_after`` is
    its evaluation), an ``eval_step`` evaluation. Skipped after a SIGTERM/SIGUSR1 (the run
    stops at the next boundary); ``resumed``: at a resumed run's first step, the evaluation
    its checkpoint's step is owed when the preempted run skipped it."""
    t = tr.cfg.train
    if not (t.eval_every and t.eval_prompts) or step % t.eval_every or not 0 < step < t.steps:
        return
    if pre.requested() or (resumed and logged_eval(t.out_dir, "eval_step", step, tr.ctx)):
        return
    pre.enter(step, "eval")
    _evaluate(tr, step, "eval_step")


def _lost_peer(e: BaseException, cfg: Config | None) -> str:
    """The one line for a rank whose collective failed because another rank is gone: which
    rank saw it, the backend's words, and the checkpoint ``--resume`` continues from (the
    training state is sharded over the ranks, so the survivors cannot save it)."""
    rank = os.environ.get("RANK", "0")
    words = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    newest = latest_checkpoint(cfg.train.out_dir) if cfg is not None else None
    resume = (
        f"--resume continues from {newest}"
        if newest is not None
        else "no checkpoint was written yet: --resume starts at step 0"
    )
    return (
        f"rank {rank} lost a peer rank of the job (its process or node died): {words}. The "
        f"training state is sharded over the ranks, so the run stops without saving; {resume}"
    )


def command(parse: Callable[[], Config], run: Callable[[Config], RunResult]) -> int:
    """``paravt.train.main``'s exit code: ``parse`` the command line, ``run`` it; 0 done (or
    stopped by a signal, its checkpoint written), 1 a run that failed (a checkpoint or disk
    error, no data, a lost worker, trainer or peer rank), 2 a configuration refused before
    anything ran, 130 a Ctrl-C before the run's handlers were set. One line each, no
    traceback."""
    cfg = None
    try:
        cfg = parse()
        if not run(cfg).ok:
            return 1
    except ConfigError as e:
        log.error(f"error: {e}")
        return 2
    # A full disk; no data; a link or a FIFO planted where the run writes a file.
    except (
        CheckpointSaveError,
        CheckpointLoadError,
        DiskFullError,
        EmptyStepsError,
        NotRegularFile,
    ) as e:
        log.error(f"error: {e}")
        return 1
    # Asynchronous: a rollout worker died or raised (the trainer's view), or the trainer died
    # (a worker's view): one line each, no traceback.
    except (WorkerFailed, TrainerGone) as e:
        log.error(f"error: {e}")
        return 1
    except RuntimeError as e:  # another rank's process or node died mid-collective
        if not peer_lost(e):
            raise
        log.error(f"error: {_lost_peer(e, cfg)}")
        return 1
    except KeyboardInterrupt:  # Ctrl-C before the run's handlers (paravt.preempt) are set
        log.error("interrupted before the run started; nothing was written")
        return 130
    except DatasetError as e:  # raised before any model loads (read_datasets)
        log.error(
            f"error: {e}\n(the dataset is checked before any model loads: fix it, or point "
            "data.path at another dataset)",
        )
        return 2
    return 0
