"""The arms of the PARA-GRPO experiments, shared by the ablation
(``paravt.experiments.ablation``) and the collapse experiment (``paravt.experiments.collapse``),
the one arms × seeds driver both run them with (:func:`run_arms`), the test that says a run of
one is done, and the shared SFT checkpoint every arm starts from (made once, reused by a rerun).

Both experiments run every arm × seed as its own ``python -m paravt.train`` run (the one
training loop: periodic held-out evaluation, ``train.eval_every``, and the tool-vs-no-tool
advantage are ``paravt.train``'s own); an arm is PARA-GRPO (the config as given) with some of
its parts switched off by ``key=value`` overrides:

- ``vanilla``: no anchoring, no gating (every prompt sees the largest budget);
- ``vanilla_ref``: the reference implementation's vanilla GRPO (``vanilla_grpo_8b.yaml`` of
  EvolvingLMMs-Lab/ParaVT, :data:`REFERENCE_VANILLA`): as ``vanilla``, and no pinned
  ``<think>`` (``agent.think_prefix=``), its closure-blind base format reward, its answer
  fallbacks and its text-read R_tool (``paravt.rewards.reference``);
- ``anchoring``: anchoring only (no gating);
- ``gating``: gating only (no anchoring);
- ``paragrpo``: both (the config as given);
- ``paragrpo_no_rtool``: both, without the tool reward R_tool (``reward.tool_bonus=0``).

Also the drivers' shared machinery: the stamp that says what an arm run was made with (a
rerun with other settings redoes it, the earlier run moved to ``superseded/``, never
deleted), the folder lock (a rerun never wipes a folder a live run writes into) and the
arm-run launcher that forwards the driver's signals to the run.

This module sits below both experiment modules (it imports only ``paravt.config``,
``paravt.checkpoint`` and ``paravt.metrics``, and ``paravt.sft`` for the cold start), so
neither has to import the other for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from paravt.assets import prepare_assets
from paravt.checkpoint import latest_checkpoint
from paravt.config import Config, ConfigError, load_config
from paravt.distributed import DistContext
from paravt.files import FolderClaim, FolderError, write_atomic
from paravt.log import get_logger
from paravt.metrics import read_metrics
from paravt.sft import run_sft

log = get_logger(__name__)

#: Arm name -> one-line description (``ablation.json`` carries it).
ARMS: dict[str, str] = {
    "vanilla": "GRPO: no anchoring, no gating",
    "vanilla_ref": "the reference's vanilla GRPO (no pinned <think>, its format/answer/R_tool)",
    "anchoring": "anchoring only",
    "gating": "gating only",
    "paragrpo": "PARA-GRPO (anchoring + gating)",
    "paragrpo_no_rtool": "PARA-GRPO without R_tool",
}


#: The ablation's default arms (``--arms``): the paper's ablation rows; ``vanilla_ref`` is
#: asked for by name there (the collapse experiment runs every arm by default).
ABLATION_ARMS = ("vanilla", "anchoring", "gating", "paragrpo", "paragrpo_no_rtool")

#: What ``vanilla_ref`` sets besides ``vanilla``'s overrides: the reference's vanilla GRPO
#: recipe, read from EvolvingLMMs-Lab/ParaVT (commit cf55249): ``paravt/rl/configs/
#: vanilla_grpo_8b.yaml`` (``constrained.think_prefix: false``, ``answer_suffix: false``,
#: ``anchoring.weight: 0.0``, ``gating.nframes_gating: false``, ``reward.format_weight: 1.0``),
#: ``paravt/rl/workflow.py`` (``<think>\n`` is appended to the prompt only under
#: THINK_PREFIX or ANSWER_SUFFIX), ``paravt/rl/rewards/compose.py`` (acc + format_weight ·
#: format + tool), ``format.py``, ``tool.py`` and ``utils.py`` (``extract_answer``);
#: ``paravt.rewards.reference`` is paravt's reading of the last four.
REFERENCE_VANILLA = (
    "agent.think_prefix=",
    "reward.base_format=reference",
    "reward.answer_extraction=reference",
    "reward.tool_mode=reference",
    "reward.w_fmt=1.0",
)


def arm_overrides(arm: str, cfg: Config) -> list[str]:
    """The ``key=value`` overrides that turn ``cfg`` (PARA-GRPO) into ``arm``."""
    k_max = max(cfg.video.frame_budgets)
    no_anchor = ["reward.lambda_anchor=0.0"]
    no_gating = ["video.gating=false", f"video.fixed_frames={k_max}"]
    table = {
        "vanilla": no_anchor + no_gating,
        "vanilla_ref": no_anchor + no_gating + list(REFERENCE_VANILLA),
        "anchoring": no_gating,
        "gating": no_anchor,
        "paragrpo": [],
        "paragrpo_no_rtool": ["reward.tool_bonus=0.0"],
    }
    if arm not in table:
        raise ConfigError(f"--arms: unknown arm {arm!r} (known: {', '.join(ARMS)})")
    return table[arm]


def run_finished(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` got to its final evaluation (resumed experiments skip it)."""
    return any(r.get("kind") == "eval_after" for r in read_metrics(run_dir / "metrics.jsonl"))


def task_stamp(cfg: Config) -> dict[str, Any]:
    """What shapes an experiment's SFT records, for its cold starts' stamps: the task (not its
    folder), and the oracle's budgets, crops and window cap
    (``paravt.data.synth.oracle_settings``)."""
    data = dataclasses.asdict(cfg.data)
    data.pop("synth_dir")  # where the task lies, not what it is (its seed and settings are)
    return {
        "data": data,
        "video": dataclasses.asdict(cfg.video),
        "max_parallel": cfg.agent.max_parallel,
    }


def sft_stamp(sft: Any) -> dict[str, Any]:
    """An SFT's settings (``cfg.sft``) as its checkpoint's stamp records them: all but how
    often its state is saved (``sft.save_every``: the same weights either way)."""
    out = dataclasses.asdict(sft)
    out.pop("save_every", None)
    return out


@functools.cache
def code_stamp(root: Path | None = None) -> dict[str, str]:
    """The code a cold start or an arm run is made by, for their stamps: ``{"paravt": SHA-256
    over the relative path and bytes of every ``.py`` and ``.json`` file of the package}``
    (``paravt/models/arch/*.json`` shape the tiny model; ``root``: another copy of the
    package, for tests). Computed once per process, at its
    first stamp: the code it runs, not what an edit under a running driver makes of the tree.

    An edit anywhere in the package changes it, so a rerun after one retrains (or, for a
    cold start, refuses to reuse) rather than mixing two codes' results into one experiment:
    protocol 4's seed 600 cold start was reused from a run made from a tree being edited,
    and its stamp compared settings only (issue 62)."""
    root = Path(__file__).resolve().parents[1] if root is None else root
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".json") and "__pycache__" not in f.parts and f.is_file():
            h.update(f.relative_to(root).as_posix().encode() + b"\0")
            h.update(f.read_bytes() + b"\0")
    return {"paravt": h.hexdigest()}


def made_by() -> dict[str, Any]:
    """Where a cold start's code came from, recorded beside its stamp for the reader and
    never compared (:func:`code_stamp` is): the checkout's commit and whether its tree
    differed from it, and the torch and transformers versions."""
    import torch
    import transformers

    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            r = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no", "--", "paravt")
    return {
        "commit": git("rev-parse", "HEAD"),
        "paravt_edited": None if status is None else bool(status),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


#: The key of a cold start's stamp that records where its code came from (never compared).
MADE_BY = "made_by"


def reused_checkpoint(
    dst: Path, tag: str, stamp: Path | None = None, made: dict[str, Any] | None = None
) -> bool:
    """Whether ``dst`` already holds the experiment's SFT checkpoint (a rerun reuses it).

    With ``stamp``: the settings ``made`` it was trained with and the code that trained it
    (:func:`code_stamp`) are recorded there (:func:`train_checkpoint`); a checkpoint made with
    other settings or by other code (a stamp from before the code was recorded included)
    raises ``ConfigError`` naming what differs, rather than being mixed into a new
    experiment."""
    if not (dst / "config.json").is_file():
        return False
    unchecked = ""
    if stamp is not None:
        old = json.loads(stamp.read_text()) if stamp.is_file() else None
        if old is not None:
            old.pop(MADE_BY, None)
            if isinstance(old.get("sft"), dict):
                old["sft"].pop("save_every", None)  # stamps written before sft_stamp dropped it
            want = json.loads(json.dumps({**(made or {}), "code": code_stamp()}))
            if diff := stamp_diff(old, want):
                shown = "; ".join(diff[:6]) + (
                    f"; ... {len(diff) - 6} more" if len(diff) > 6 else ""
                )
                raise ConfigError(
                    f"{dst} was trained with other cold-start settings or code ({stamp} "
                    f"differs: {shown}); use another --out or delete {dst} to train the new one"
                )
        else:
            unchecked = f" (no {stamp.name}: its settings and code are unchecked)"
    log.info(f"[{tag}] SFT checkpoint {dst} exists: reused{unchecked}")
    return True


def train_checkpoint(
    cfg: Config,
    dst: Path,
    tag: str,
    what: str,
    *,
    dirs: tuple[str, str] | None = None,
    stamp: Path | None = None,
    made: dict[str, Any] | None = None,
) -> Path:
    """``paravt.sft.run_sft`` of ``cfg`` into ``dst``, one line of its loss printed as
    ``[tag] what: nll/token ...``; ``dirs``: the (data, model) directories when the caller
    prepared them already (else ``paravt.assets.prepare_assets``). ``made`` is recorded in
    ``stamp`` once the checkpoint is written, with the code that made it (:func:`code_stamp`,
    compared by :func:`reused_checkpoint`) and :func:`made_by` (recorded, never compared)."""

    ctx = DistContext()
    data_dir, model_dir = dirs if dirs is not None else prepare_assets(cfg, ctx)
    res = run_sft(cfg, model_dir=model_dir, data_dir=data_dir, out_dir=dst, ctx=ctx)
    if stamp is not None:
        rec = {**(made or {}), "code": code_stamp(), MADE_BY: made_by()}
        write_atomic(stamp, json.dumps(rec, indent=1) + "\n")
    log.info(
        f"[{tag}] {what}: nll/token {res['sft/loss_first']:.3f} -> {res['sft/loss_last']:.3f} "
        f"({res['sft/seconds']:.0f} s) -> {dst}"
    )
    return dst


# ------------------------------------------------------------------ what a run was made with
#: The file in an arm run's folder that records what it was made with (:func:`run_stamp`).
STAMP = "stamp.json"


def run_stamp(cfg: Config, **extra: Any) -> dict[str, Any]:
    """What makes an arm run what it is: its resolved config (every key, RL settings included),
    the code that runs it (:func:`code_stamp`) and the driver's own settings that shape its
    rows (``extra``, e.g. ``eval_every``), as JSON values. The drivers write it into the run
    folder before starting the run and keep a finished run on a rerun only when it matches
    (:func:`kept_run`): a run made by other code is redone (the earlier one set aside), as a
    cold start evaluated by it is."""
    made = {"config": dataclasses.asdict(cfg), "code": code_stamp(), **extra}
    return json.loads(json.dumps(made))


def write_stamp(run_dir: Path, stamp: dict[str, Any]) -> None:
    write_atomic(run_dir / STAMP, json.dumps(stamp, indent=1) + "\n")


def _flat(d: Any, pre: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {pre: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flat(v, f"{pre}.{k}" if pre else str(k))
    return out


def stamp_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``["algo.lr: 2e-06 -> 0.001", ...]``: the keys whose values differ (``config.`` cut)."""
    a, b = _flat(old), _flat(new)
    return [
        f"{k.removeprefix('config.')}: {a.get(k, '(absent)')} -> {b.get(k, '(absent)')}"
        for k in sorted(set(a) | set(b))
        if a.get(k, "(absent)") != b.get(k, "(absent)")
    ]


def arm_action(run_dir: Path, stamp: dict[str, Any], label: str) -> str:
    """What the driver does with the arm run in ``run_dir`` for job ``label`` (``[ablation]
    3/10 gating seed 1``), saying it: ``"keep"`` (finished and made with ``stamp``:
    :func:`kept_run`), ``"resume"`` (cut short, made with ``stamp``, and holding a checkpoint:
    a SIGTERM to the driver reaches the run, which checkpoints its last step as any training
    run does; ``python -m paravt.train --resume`` continues it) or ``"start"`` (anything else:
    the folder is wiped and the run starts over; a finished run made with other settings says
    ``<why>: redone``; :func:`run_arms` first moves such a run, or one holding a checkpoint,
    to ``superseded/`` with :func:`set_aside`). :func:`run_arms` uses it for every job."""

    keep, why = kept_run(run_dir, stamp)
    if keep:
        log.info(f"{label}: finished before, kept")
        return "keep"
    if why != NOT_FINISHED:
        log.info(f"{label}: {why}: redone")
        return "start"
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None and _stamped_with(run_dir, stamp):
        log.info(f"{label}: cut short, resumed from {ckpt}")
        return "resume"
    return "start"


def _stamped_with(run_dir: Path, stamp: dict[str, Any]) -> bool:
    try:
        return not stamp_diff(json.loads((run_dir / STAMP).read_text()), stamp)
    except (OSError, json.JSONDecodeError):
        return False


def run_arms(
    out: Path,
    jobs: Sequence[tuple[str, int]],
    args_of: Callable[[str, int], list[str]],
    base_args: Sequence[str],
    tag: str,
    lock: FolderLock | None,
    **stamp_extra: Any,
) -> dict[tuple[str, int], Path]:
    """The one arms × seeds driver of both experiments: every ``(arm, seed)`` of ``jobs`` is
    one ``python -m paravt.train`` run (the one training loop) of ``base_args`` (``--preset``,
    ``--config``, overrides) + ``args_of(arm, seed)`` into ``out/ARM/seedN`` (its log in
    ``train.log``), kept, resumed or started over by :func:`arm_action` (its ``stamp.json``:
    the resolved config and ``stamp_extra``). A failed run stops the driver with its log's tail
    (``RuntimeError``); a signal to the driver reaches the run (:func:`run_child`). Returns
    ``(arm, seed) -> run folder``. Callers: ``paravt.experiments.ablation.ablation`` and
    ``paravt.experiments.collapse.collapse``."""
    t0 = time.perf_counter()
    dirs: dict[tuple[str, int], Path] = {}
    for i, (arm, seed) in enumerate(jobs, 1):
        run_dir = out / arm / f"seed{seed}"
        dirs[(arm, seed)] = run_dir
        args = [*args_of(arm, seed), f"train.out_dir={run_dir}"]
        stamp = run_stamp(load_args(base_args, args), **stamp_extra)  # what the run resolves
        what = f"{tag} run {arm} seed {seed}"
        action = arm_action(run_dir, stamp, f"[{tag}] {i}/{len(jobs)} {arm} seed {seed}")
        if action == "keep":
            continue
        if action == "start":
            if run_finished(run_dir) or latest_checkpoint(run_dir) is not None:
                kept = set_aside(run_dir)  # a run made with other settings: never deleted
                log.info(
                    f"[{tag}] {i}/{len(jobs)} {arm} seed {seed}: its earlier run is kept in "
                    f"{kept} (delete it when you no longer need it)"
                )
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            write_stamp(run_dir, stamp)
        cmd = [sys.executable, "-m", "paravt.train", *base_args, *args]
        if action == "resume":
            cmd.append("--resume")
        t = time.perf_counter()
        rc = run_child(cmd, run_dir / "train.log", what, lock, append=action == "resume")
        if rc != 0:
            tail = (run_dir / "train.log").read_text().splitlines()[-25:]
            raise RuntimeError(
                f"{what} failed (exit {rc}); log {run_dir}/train.log:\n" + "\n".join(tail)
            )
        log.info(
            f"[{tag}] {i}/{len(jobs)} {arm} seed {seed}: {time.perf_counter() - t:.0f} s "
            f"(elapsed {(time.perf_counter() - t0) / 60:.1f} min)"
        )
    return dirs


NOT_FINISHED = "not finished"

#: Where a rerun with other settings moves an arm run that finished or holds a checkpoint
#: (``OUT/ARM/superseded/seedN.K``): out of the ``OUT/ARM/seedN`` pattern the drivers and
#: reports read, and never deleted.
SUPERSEDED = "superseded"


def set_aside(run_dir: Path) -> Path:
    """Move ``run_dir`` (``OUT/ARM/seedN``) to the first free ``OUT/ARM/superseded/seedN.K``
    (K = 1, 2, ...) and return it: a rerun with one flag changed used to delete a finished
    arm run (hours of training) before redoing it under the new settings."""
    parent = run_dir.parent / SUPERSEDED
    parent.mkdir(parents=True, exist_ok=True)
    k = 1
    while True:
        dst = parent / f"{run_dir.name}.{k}"
        try:
            dst.mkdir()  # claims the name: two drivers cannot pick the same one
        except FileExistsError:
            k += 1
            continue
        os.replace(run_dir, dst)  # an empty directory is replaced by the rename
        return dst


def kept_run(run_dir: Path, stamp: dict[str, Any]) -> tuple[bool, str]:
    """Whether a rerun keeps the arm run in ``run_dir``: finished (:func:`run_finished`) and
    made with ``stamp`` (:data:`STAMP`). Returns ``(keep, why not)``; ``why`` names the keys
    that differ. A run made before stamps is checked by its ``config.yaml`` (the resolved
    config it wrote; the stamp's extra keys cannot be checked for it)."""
    if not run_finished(run_dir):
        return False, NOT_FINISHED
    p = run_dir / STAMP
    if p.is_file():
        try:
            old = json.loads(p.read_text())
        except json.JSONDecodeError:
            return False, f"{p} is unreadable"
        diff = stamp_diff(old, stamp)
        shown = "; ".join(diff[:6]) + (f"; ... ({len(diff) - 6} more)" if len(diff) > 6 else "")
        return not diff, f"made with other settings ({shown})"
    from omegaconf import OmegaConf

    yml = run_dir / "config.yaml"
    if yml.is_file():  # the driver's extra settings are unknown for such a run: not compared
        old = OmegaConf.to_container(OmegaConf.load(yml))
        diff = stamp_diff({"config": old}, {"config": stamp["config"]})
        return not diff, f"made with other settings ({'; '.join(diff[:6])})"
    return False, f"no {STAMP}: its settings are unknown"


# ------------------------------------------------------------------- the drivers' folder lock
LOCK = FolderClaim.NAME


def _start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot; None: no such process or no
    /proc): with the pid it names one process, not a later one that reuses the number."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _alive(pid: int | None, start: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    now = _start_ticks(pid)
    return start is None or now is None or now == start


class FolderLock:
    """The drivers' claim on their ``--out`` folder: ``OUT/.lock`` records the driver's pid
    (and the arm run it is waiting for, :meth:`child`), each with its start time. A driver
    refuses a folder whose lock names a live process (``ConfigError``): a rerun would wipe a
    run folder while that run still writes into it. A lock whose processes are all gone (a
    driver killed with SIGKILL) is stale and taken over. The claim itself is a
    ``paravt.files.FolderClaim`` (``flock``): two drivers started at the same moment cannot
    both pass the check. Used by ``paravt.experiments.ablation``
    and ``paravt.experiments.collapse``."""

    def __init__(self, out: Path, tag: str) -> None:
        self.path, self.tag = Path(out) / LOCK, tag
        self.state: dict[str, Any] = {}

    def __enter__(self) -> FolderLock:
        # No mkdir here: FolderClaim makes the folder, and a read-only one is its one line.
        if self.path.is_file():
            try:
                old = json.loads(self.path.read_text())
            except (json.JSONDecodeError, OSError):
                old = {}
            for who in ("pid", "child"):
                if isinstance(old, dict) and _alive(old.get(who), old.get(f"{who}_start")):
                    what = "its driver" if who == "pid" else "an arm run it started"
                    raise ConfigError(
                        f"{self.path.parent} is held by a live run ({what}: pid {old[who]}, "
                        f"{self.path}); wait for it to end or stop it (kill -TERM "
                        f"{old.get('pid')}: the driver stops its arm run too), or pass another "
                        "--out"
                    )
        try:  # atomic: of two drivers started at the same moment, one holds the folder
            self.claim = FolderClaim(self.path.parent, f"a {self.tag} driver").acquire()
        except FolderError as e:
            raise ConfigError(f"{e} (or pass another --out)") from None
        me = os.getpid()
        self.state = {"tag": self.tag, "pid": me, "pid_start": _start_ticks(me)}
        self._write()
        return self

    def child(self, pid: int | None) -> None:
        """Record (``None``: clear) the arm run the driver now waits for."""
        self.state["child"] = pid
        self.state["child_start"] = _start_ticks(pid) if pid else None
        self._write()

    def _write(self) -> None:
        self.claim.record({**self.state, "what": f"a {self.tag} driver", "argv": sys.argv})

    def __exit__(self, *exc: Any) -> None:
        self.claim.release()


# ------------------------------------------------------------------------- the arm runs
class DriverInterrupted(RuntimeError):
    """The driver got SIGTERM/SIGINT/SIGUSR1 while an arm run was going: the signal went to
    the run's process group, the run stopped, and the driver stops (its ``main`` exits
    128 + the signal number). A rerun redoes the unfinished run."""

    def __init__(self, signum: int, what: str, rc: int) -> None:
        self.signum = signum
        super().__init__(
            f"{signal.Signals(signum).name}: forwarded to {what}, which exited {rc}; the driver "
            "stops. Rerun the same command to continue: finished runs are kept, this one is "
            "redone."
        )


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def run_child(
    cmd: Sequence[str], log_path: Path, what: str, lock: FolderLock | None, *, append: bool = False
) -> int:
    """Run an arm's process ``cmd`` (stdout and stderr to ``log_path``) in a process group of
    its own, and forward SIGTERM / SIGINT / SIGUSR1 sent to the driver to that group (a
    scheduler's preemption reaches the run; it checkpoints or stops, and no orphan keeps
    writing into the folder). Returns its exit code; raises ``DriverInterrupted`` after a
    forwarded signal, once the run has exited. ``append``: a resumed run's log continues the
    first part's."""
    got: list[int] = []
    with open(log_path, "a" if append else "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def forward(signum: int, _frame: Any) -> None:
            got.append(signum)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)

        old = {s: signal.signal(s, forward) for s in FORWARDED}
        try:
            if lock is not None:
                lock.child(proc.pid)
            rc = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if lock is not None:
                lock.child(None)
    if got:
        raise DriverInterrupted(got[0], what, rc)
    return rc


def parse_arms(raw: str, known: Sequence[str]) -> list[str]:
    """``--arms`` as a list: each name known, at least one (an empty list would run nothing and
    report an empty table as a result)."""
    arms = [x.strip() for x in raw.split(",") if x.strip()]
    if not arms:
        raise ConfigError(f"--arms {raw!r} names no arm; give a comma list of {', '.join(known)}")
    for a in arms:
        if a not in known:
            raise ConfigError(f"--arms: unknown arm {a!r} (known: {', '.join(known)})")
    return arms


def load_args(base_args: Sequence[str], extra: Sequence[str]) -> Config:
    """The config of ``base_args`` (``--preset P --config F ... key=value ...``, what the
    drivers pass every arm run) + ``extra``: what the run resolves (its stamp's config)."""

    args = list(base_args)
    preset, configs, kv = "tiny_cpu", [], []
    while args:
        a = args.pop(0)
        if a == "--preset":
            preset = args.pop(0)
        elif a == "--config":
            configs.append(args.pop(0))
        else:
            kv.append(a)
    return load_config(preset, configs, [*kv, *extra])


def run_driver(name: str, body: Callable[[], dict[str, Any]], out: str | Path) -> int:
    """The exit of ``python -m paravt.experiments NAME``: run ``body`` (parse, run the arms,
    aggregate: returns the result with its ``table``) and map its failures to exit codes: a
    bad configuration 2, a forwarded SIGTERM/SIGINT/SIGUSR1 128 + the signal, another
    failure 1; on success print the table and the files written under ``out`` (none when the
    result is None)."""

    try:
        res = body()
    except ConfigError as e:
        log.error(f"error: {e}")
        return 2
    except DriverInterrupted as e:  # SIGTERM/SIGINT/SIGUSR1, forwarded to the arm run
        log.error(f"[{name}] {e}")
        return 128 + e.signum
    except RuntimeError as e:
        log.error(f"error: {e}")
        return 1
    print(res["table"])  # the command's result (stdout)
    if res.get("result") is not None:  # None: nothing aggregated (collapse --cold-only)
        log.info(f"[{name}] {out}/{name}.md, {name}.json, {name}.png")
    return 0


def save_panels(fig: Any, axes: Any, out_png: Path) -> Path:
    """Write an experiment's figure of step panels (``ablation.png``, ``collapse.png``): the
    arms' legend on the first panel, tight layout, 80 dpi; the figure is closed."""
    import matplotlib.pyplot as plt

    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return out_png
