"""Run observability: ``metrics.jsonl``, TensorBoard, optional wandb, trajectories, plot, table.

A run folder looks like::

    out_dir/
      config.yaml            resolved configuration (written before anything heavy loads)
      metrics.jsonl          one JSON object per step (and one per evaluation), append-only
      trajectories.jsonl     a few sample trajectories per step (decoded text, tool calls with
                             their windows and sub-agent summaries, frame times, reward breakdown)
      thumbs/                small JPEGs of those trajectories' overview frames (ThumbnailStore)
      tb/                    TensorBoard event files (every scalar of metrics.jsonl)
      summary.png            the main curves (reward, format, tool-call rate, accuracy, KL, ...)
      checkpoints/step_N/    see paravt.checkpoint

Why this matters for PARA-GRPO: under vanilla GRPO, format compliance and the tool-call rate
collapse within a few steps; the curves in ``metrics.jsonl`` / ``summary.png`` are how a user
sees that happen (and sees PARA-GRPO's anchoring and gating prevent it).

Only rank 0 writes (``enabled=False`` on other ranks makes every method a no-op).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from paravt.files import (
    DISK_FULL,
    append_text,
    jsonl_lines,
    read_regular,
    write_atomic,
    write_failure,
)
from paravt.log import get_logger
from paravt.rewards.format import analyse_turn

log = get_logger(__name__)

# Metrics every RL step must log (the smoke test asserts each is present). Per-K metrics
# (``acc/K{k}``, ``tool_rate/K{k}``) are added for each K drawn in the step.
STEP_METRICS: tuple[str, ...] = (
    "reward/total",
    "reward/acc",
    "reward/fmt",
    "reward/anchor",
    "reward/tool",
    "reward/std",
    "format_compliance",
    "think_closure_rate",
    "tool_calls_per_rollout",
    "tool_call_rate",
    "parse_error_rate",
    "accuracy",
    "loss",
    "kl",
    "clip_frac",
    "entropy",
    "grad_norm",
    "lr",
    "response_tokens",
    "tokens_per_s",
    "packed_tokens",
    "backbone_rows",
    "tokens/main_prompt",
    "tokens/main_suffix",
    "time/rollout",
    "time/overview",
    "time/main_gen",
    "time/crops",
    "time/sub_gen",
    "time/reward",
    "time/logprobs",
    "time/update",
    "time/sync",
    "time/step",
)

# The curves of summary.png (key, title), in panel order.
PLOT_PANELS: tuple[tuple[str, str], ...] = (
    ("reward/total", "reward"),
    ("reward/fmt", "format reward"),
    ("format_compliance", "format compliance"),
    ("tool_call_rate", "tool-call rate"),
    ("accuracy", "accuracy"),
    ("kl", "KL to reference"),
    ("entropy", "entropy"),
    ("grad_norm", "grad norm"),
)

# The rows of the final before/after table.
TABLE_ROWS: tuple[tuple[str, str], ...] = (
    ("reward/total", "reward"),
    ("reward/fmt", "format reward"),
    ("format_compliance", "format compliance"),
    ("think_closure_rate", "</think> closure"),
    ("tool_call_rate", "tool-call rate"),
    ("tool_calls_per_rollout", "tool calls / rollout"),
    ("parse_error_rate", "parse-error rate"),
    ("accuracy", "accuracy"),
)


def _clean(v: Any) -> Any:
    """JSON-safe scalar: tensors → float, NaN/inf → None (strict JSON has no NaN)."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def json_safe(v: Any) -> Any:
    """``_clean`` applied through dicts and lists (trajectory records nest their rewards;
    ``paravt.experiments`` writes its ablation.json with it)."""
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return _clean(v)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a JSONL file written a line at a time (``metrics.jsonl``, the evaluation's
    ``results.jsonl``); skips a torn line left by a killed process, also one cut inside a
    multi-byte UTF-8 character (``paravt.view`` and the evaluation's resume read through
    here)."""
    rows: list[dict[str, Any]] = []
    blob = read_regular(path)  # a FIFO (or a directory) in its place is no file: no rows
    if blob is None:
        return rows
    # paravt.files.jsonl_lines: split on b"\n" only, then each line decoded on its own (a kill
    # mid-write can cut the last line inside a multi-byte character: results.jsonl is written
    # with ensure_ascii=False; that costs the line only).
    for _, raw in jsonl_lines(blob):
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue  # a line cut short by a kill mid-write
        if isinstance(row, dict):  # every reader takes rows as objects: a [..] or "..." line
            rows.append(row)  # (hand-edited, another tool's) is no row
    return rows


def _step_at_most(row: dict[str, Any], step: int) -> bool:
    """Whether ``row`` belongs to step ``step`` or before (a row without a step does, as an
    alarm may; a step that is no number cannot be placed and does not)."""
    v = row.get("step", -1)
    try:
        return not isinstance(v, bool) and float(v) <= step
    except (TypeError, ValueError):
        return False


class DiskFullError(RuntimeError):
    """A write found the disk full: a run-folder write other than a checkpoint (a metrics row,
    TensorBoard, trajectories, thumbnails, the summary plot) under
    ``train.on_save_error=fail``, or an evaluation's ``results.jsonl`` / ``run.json`` /
    ``summary.json`` (``paravt.eval.runner``). ``paravt.train.main`` and ``paravt.eval`` exit 1
    with its one-line message (``paravt.files.write_failure`` + the fix), as for a checkpoint
    that cannot fit."""


def _quiet_tensorboard_thread() -> None:
    """Keep TensorBoard's writer thread from printing a traceback of its own for a full disk:
    the thread keeps the error and the main thread gets it at the next add/flush, where
    ``RunFolderWrites`` turns it into the run's one-line message. Installed once
    (``threading.excepthook``, chained to the one before it)."""
    import threading

    before = threading.excepthook
    if getattr(before, "_paravt_tb", False):
        return

    def hook(args: Any) -> None:
        tb_thread = type(args.thread).__name__ == "_AsyncWriterThread"
        e = args.exc_value
        if tb_thread and isinstance(e, OSError) and e.errno in DISK_FULL:
            return
        before(args)

    hook._paravt_tb = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class RunFolderWrites:
    """How a run's folder writes meet a full disk, by ``train.on_save_error`` (``policy``),
    as checkpoints do (``paravt.checkpoint.Checkpointer.save``): ``fail`` raises ``DiskFullError``
    naming the file, the free space and the ways out; ``continue`` prints that once per kind
    of write (``what``), skips the write and trains on (a later write is tried again: the
    disk may have room by then). Any other ``OSError`` is raised as it is.

    Used by ``MetricsLogger`` (metrics rows, TensorBoard, trajectories), ``ThumbnailStore`` and
    ``paravt.train`` (config.yaml, summary.png)."""

    def __init__(self, policy: str = "fail", out_dir: str | Path = ".") -> None:
        self.policy, self.out_dir = policy, Path(out_dir)
        self.warned: set[str] = set()
        self.skipped: dict[str, int] = {}  # writes skipped per kind (``continue``)

    @contextlib.contextmanager
    def guard(self, what: str, path: str | Path) -> Iterator[None]:
        """Run the write of ``what`` (e.g. "metrics row") to ``path``; a full disk is handled
        by the policy, so under ``continue`` the block's remaining statements are skipped."""
        try:
            yield
        except OSError as e:
            self.failed(what, path, e)

    def failed(self, what: str, path: str | Path, e: OSError) -> None:
        """Handle ``e`` raised by the write of ``what`` to ``path`` (see the class)."""
        if e.errno not in DISK_FULL:
            raise e
        problem = write_failure(what, path, e, self.out_dir)
        if self.policy != "continue":
            raise DiskFullError(
                f"{problem} The newest checkpoint is intact and is what --resume loads. Fix: "
                "free space there (or lower train.keep_last, or point train.out_dir at a larger "
                "disk) and rerun with --resume; or set train.on_save_error=continue to train "
                "on, skipping the writes that do not fit."
            ) from e
        self.skipped[what] = self.skipped.get(what, 0) + 1
        if what not in self.warned:
            self.warned.add(what)
            log.warning(
                f"[train] warning: {problem} Training goes on without it "
                f"(train.on_save_error=continue); later {what} writes are tried again and "
                "skipped silently while the disk is full."
            )


class MetricsLogger:
    """Writes the run folder's metrics (jsonl + TensorBoard + optional wandb).

    ``log(step, metrics, kind='train')`` appends ``{"step": step, "kind": kind, **metrics}``.
    ``truncate_after(step)`` drops rows past ``step`` (used on ``--resume`` so that a run killed
    after writing step 5's metrics but before its checkpoint does not log step 5 twice).
    ``on_disk_full``: ``train.on_save_error``, what a full disk does to these writes
    (``RunFolderWrites``, shared as ``self.disk`` with the run's ``ThumbnailStore``).
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        enabled: bool = True,
        tensorboard: bool = True,
        wandb: bool = False,
        run_name: str = "",
        config: dict[str, Any] | None = None,
        on_disk_full: str = "fail",
    ) -> None:
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self.disk = RunFolderWrites(on_disk_full, self.out_dir)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.traj_path = self.out_dir / "trajectories.jsonl"
        self.heldout_path = self.out_dir / "heldout.jsonl"
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_thread()
            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tb"))
        if wandb:
            try:
                import wandb as _wandb
            except ImportError as e:
                raise RuntimeError(
                    "train.wandb=true but wandb is not installed; `pip install wandb` "
                    "or set train.wandb=false"
                ) from e
            self._wandb = _wandb.init(
                project="paravt", name=run_name or self.out_dir.name, config=config or {}
            )

    def truncate_after(self, step: int) -> None:
        """Keep only rows with ``step <= step`` (atomic rewrite)."""
        if not self.enabled or not self.metrics_path.is_file():
            return
        for path in (self.metrics_path, self.traj_path, self.heldout_path):
            rows = [r for r in read_metrics(path) if _step_at_most(r, step)]
            with self.disk.guard(f"{path.name} rewrite", path):
                write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))

    def log(self, step: int, metrics: dict[str, Any], *, kind: str = "train") -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "kind": kind, **{k: _clean(v) for k, v in metrics.items()}}
        with self.disk.guard("metrics row", self.metrics_path):
            append_text(self.metrics_path, json.dumps(row) + "\n")
        prefix = "" if kind == "train" else f"{kind}/"
        if self._tb is not None:
            # TensorBoard writes from a thread of its own and reports its error at the next
            # add/flush (again at each one after): the scalars of that step are lost.
            with self.disk.guard("TensorBoard event", self.out_dir / "tb"):
                for k, v in row.items():
                    if k in ("step", "kind") or not isinstance(v, (int, float)):
                        continue
                    self._tb.add_scalar(prefix + k, v, step)
                self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({prefix + k: v for k, v in row.items() if k != "kind"}, step=step)

    def log_trajectories(self, step: int, records: Iterable[dict[str, Any]]) -> None:
        if not self.enabled:
            return
        text = "".join(json.dumps(json_safe({"step": int(step), **r})) + "\n" for r in records)
        with self.disk.guard("trajectories", self.traj_path):
            append_text(self.traj_path, text)

    def log_heldout(self, step: int, kind: str, rows: Iterable[dict[str, Any]]) -> None:
        """``heldout.jsonl``: one row per held-out prompt and condition of an evaluation
        (``paravt.eval.heldout.evaluate``'s ``per_prompt``), as ``{"step", "kind", ...}``."""
        if not self.enabled:
            return
        text = "".join(
            json.dumps(json_safe({"step": int(step), "kind": kind, **r})) + "\n" for r in rows
        )
        with self.disk.guard("held-out records", self.heldout_path):
            append_text(self.heldout_path, text)

    def close(self) -> None:
        if self._tb is not None:
            tb, self._tb = self._tb, None
            with self.disk.guard("TensorBoard event", self.out_dir / "tb"):
                tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class ThumbnailStore:
    """Small JPEGs of the overview frames a logged trajectory's model saw, for ``paravt.view``.

    Files go to ``out_dir/thumbs/`` named by sample, K and frame index, so the trajectories of
    one group (and a prompt drawn again later at the same K) share them. The total size is
    capped at ``max_bytes``: the store counts the bytes already under ``thumbs/`` (a resumed
    run included) and, once the next frame would pass the cap, writes nothing more; those
    trajectories keep their frame times and are shown without pictures. A 96 px JPEG is
    ~1-3 KB, so the default 18 MB holds ~10k frames.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        max_bytes: int,
        max_px: int = 96,
        disk: RunFolderWrites | None = None,
    ) -> None:
        self.dir = Path(out_dir) / "thumbs"
        # A full disk: the run's policy (train.on_save_error); under ``continue`` the
        # trajectory is logged without pictures, as past the cap.
        self.disk = disk if disk is not None else RunFolderWrites("fail", out_dir)
        self.max_bytes = int(max_bytes)
        self.max_px = int(max_px)
        self.used = (
            sum(f.stat().st_size for f in self.dir.glob("*.jpg")) if self.dir.is_dir() else 0
        )
        self.full = False

    def save(self, key: str, frames: Any) -> list[str] | None:
        """Write ``frames`` (uint8 ``(T, H, W, 3)``) as ``thumbs/{key}_{i}.jpg``; returns their
        paths relative to ``out_dir``, or None when the cap is reached (nothing partial kept)."""
        import io

        from PIL import Image

        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in key)[:100]
        # + a hash of the whole key: "a/b" and "a_b" (or two long ids) never share thumbnails.
        safe += "-" + hashlib.sha1(key.encode()).hexdigest()[:8]
        names = [f"thumbs/{safe}_{i:03d}.jpg" for i in range(len(frames))]
        if all((self.dir.parent / n).is_file() for n in names):
            return names
        if self.full:
            return None
        blobs = []
        for f in frames:
            img = Image.fromarray(f.cpu().numpy() if hasattr(f, "cpu") else f)
            img.thumbnail((self.max_px, self.max_px))
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=70)
            blobs.append(buf.getvalue())
        size = sum(len(b) for b in blobs)
        if self.used + size > self.max_bytes:
            self.full = True
            return None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for n, b in zip(names, blobs):
                write_atomic(self.dir.parent / n, b, fsync=False)
        except OSError as e:
            for n in names:  # nothing partial kept: a torn JPEG would pass the is_file check
                with contextlib.suppress(OSError):
                    (self.dir.parent / n).unlink(missing_ok=True)
            self.disk.failed("thumbnails", self.dir, e)
            return None
        self.used += size
        return names


def plot_summary(
    metrics_path: str | Path,
    out_png: str | Path,
    panels: Sequence[tuple[str, str]] = PLOT_PANELS,
) -> Path:
    """Plot the main curves of a ``metrics.jsonl`` (train rows vs step) into one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if r.get("kind", "train") == "train"]
    cols = 4
    nrows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3 * nrows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def format_table(
    columns: dict[str, dict[str, Any]],
    rows: Sequence[tuple[str, str]] = TABLE_ROWS,
) -> str:
    """A fixed-width text table: one row per metric, one column per named metrics dict.

    ``columns`` maps a column title (e.g. 'before RL', 'after RL') to a metrics dict.
    """
    names = list(columns)
    w0 = max(len(label) for _, label in rows) + 2
    widths = [max(10, len(n) + 2) for n in names]
    header = "metric".ljust(w0) + "".join(n.rjust(w) for n, w in zip(names, widths))
    lines = [header, "-" * len(header)]
    for key, label in rows:
        cells = []
        for n, w in zip(names, widths):
            v = columns[n].get(key)
            cells.append(("n/a" if v is None else f"{float(v):.3f}").rjust(w))
        lines.append(label.ljust(w0) + "".join(cells))
    return "\n".join(lines)


def progress_bar(total: int, *, initial: int = 0, enabled: bool = True, desc: str = "PARA-GRPO"):
    """A tqdm bar over RL steps; ``set_postfix`` shows reward, fmt, tool rate and accuracy."""
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True)


def postfix(metrics: dict[str, Any]) -> dict[str, str]:
    """The progress-bar summary of one step's metrics."""
    keys = (
        ("reward/total", "R"),
        ("reward/fmt", "fmt"),
        ("tool_call_rate", "tool"),
        ("accuracy", "acc"),
        ("kl", "kl"),
    )
    return {short: f"{metrics[k]:.3f}" for k, short in keys if metrics.get(k) is not None}


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def call_record(c: Any) -> dict[str, Any]:
    """One tool call as the run's ``trajectories.jsonl`` and the evaluation's ``results.jsonl``
    keep it (and ``paravt.view`` reads it): the tool it names (as the model wrote it; '' for a
    call that names none, e.g. bad JSON), status, window, sub-agent summary, error, and the
    first 500 characters of the raw call text."""
    return {
        "tool": c.name,
        "status": c.status,
        "start": c.start,
        "end": c.end,
        "response": c.response,
        "error": c.error,
        "raw": c.raw[:500],
    }


#: Call statuses that name no tool of the run (not JSON with a name, or a name no tool has):
#: counted in ``parse_error_rate``, never under ``tool_calls/<name>`` (whose names would
#: otherwise be whatever the model wrote).
_NO_TOOL = ("bad_json", "unknown_tool")


def trajectory_record(traj: Any, num_frames: int, advantage: float | None = None) -> dict[str, Any]:
    """A light, picklable summary of one scored main trajectory (gathered across ranks);
    ``advantage``: its group advantage (a training step's; ``rollout_metrics``' ``adv/*``)."""

    ok = bool(traj.turns)
    closed: list[float] = []
    closed_tool: list[float] = []  # the turns that call a tool: the collapse's tool-turn closure
    for i, turn in enumerate(traj.turns):
        if turn.forced_answer:
            ok = False
            continue
        a = analyse_turn(turn.prefix + turn.text)
        closed.append(float(a["closed"]))
        if turn.calls:
            closed_tool.append(float(a["closed"]))
        ok = ok and a["well_formed"] and (i < len(traj.turns) - 1 or a["answer"])
    calls = [c for turn in traj.turns for c in turn.calls]
    by_tool: dict[str, int] = {}
    tool_errors: dict[str, int] = {}  # calls a plug-in's own bug failed (paravt.agent.tools)
    for c in calls:
        if c.status not in _NO_TOOL:
            by_tool[c.name] = by_tool.get(c.name, 0) + 1
        if c.status == "tool_error":
            tool_errors[c.name] = tool_errors.get(c.name, 0) + 1
    return {
        "K": int(num_frames),
        # The prompt (group) it was rolled out for: prompt-level statistics (paravt.alarms).
        "prompt": f"{traj.sample_id}:{traj.group_id}",
        "reward": float(traj.reward),
        "breakdown": {k: float(v) for k, v in traj.reward_breakdown.items()},
        "compliant": float(ok),
        "closed": closed,
        "closed_tool": closed_tool,
        "n_calls": len(calls),
        # Calls per tool of the run (``agent.tools``), whatever their status.
        "tool_calls": by_tool,
        "tool_errors": tool_errors,
        "bad_calls": sum(c.status != "ok" for c in calls),
        "used_tool": float(any(c.status == "ok" for c in calls)),
        "response_tokens": int(sum(traj.loss_mask)),
        **({} if advantage is None else {"advantage": float(advantage)}),
    }


def trajectory_samples(
    groups: Sequence[Any],
    n: int,
    *,
    video_meta: Callable[[str], Any],
    store: ThumbnailStore | None,
) -> list[dict[str, Any]]:
    """A few decoded trajectories for ``trajectories.jsonl``: what the model saw and wrote.

    Per trajectory of the scored ``groups``: question, gold answer, K, the video's duration
    (``video_meta``: a video path's ``VideoMeta``, the agent runner's cached ``meta``), the
    overview frames' times and thumbnails (``thumbs``: paths relative to the run folder written
    by ``store``; None past its ``train.viewer_max_mb`` cap, or without a store), each turn's
    text and its calls (status, clamped window, the sub-agent's summary, the parse error, the
    raw call text), reward and breakdown. This is what ``python -m paravt.view`` renders."""
    # lazy: PyAV, for a training run's thumbnails only (the viewer imports metrics)
    from paravt.video import overview_timestamps

    out = []
    for g in groups:
        for t in g.trajectories:
            if len(out) >= n:
                return out
            vis = t.visuals
            meta = video_meta(g.sample.video)
            if vis is not None and vis.timestamps:
                times = [float(x) for x in vis.timestamps[0]]
            else:  # visuals without their source frames: the times the loop sampled
                times = overview_timestamps(meta, g.num_frames)
            thumbs = None
            if vis is not None and vis.frames and store is not None:
                thumbs = store.save(f"{g.sample.id}_K{g.num_frames}", vis.frames[0])
            out.append(
                {
                    "uid": t.uid,
                    "sample_id": t.sample_id,
                    "K": g.num_frames,
                    "question": g.sample.question,
                    "task": g.sample.question_type,
                    "answer": g.sample.answer,
                    "duration": float(meta.duration),
                    "frame_times": times,
                    "thumbs": thumbs,
                    "turns": [
                        {
                            "prefix": x.prefix,
                            "text": x.text,
                            "forced_answer": x.forced_answer,
                            "calls": [call_record(c) for c in x.calls],
                        }
                        for x in t.turns
                    ],
                    "reward": t.reward,
                    "breakdown": t.reward_breakdown,
                    "num_sub_agents": sum(s.parent == t.uid for s in g.sub_trajectories),
                }
            )
    return out


def _prompt_stats(out: dict[str, float], key: str, records: Sequence[dict[str, Any]]) -> None:
    """``prompts/key`` and ``prompt_sq/key`` of the records' per-prompt tool-call rates (a
    record without ``prompt`` counts with the others as one prompt: fewer, never more)."""
    by: dict[Any, list[float]] = {}
    for r in records:
        by.setdefault(r.get("prompt"), []).append(r["used_tool"])
    rates = [_mean(v) for v in by.values()]
    out[f"prompts/{key}"] = float(len(rates))
    out[f"prompt_sq/{key}"] = _mean([x * x for x in rates])


def clustered_mean_ci95(values: Sequence[float], clusters: Sequence[Any]) -> tuple[float, float]:
    """Mean of ``values`` and the half-width of its 95% interval, with the samples of one
    cluster (the rollouts of one prompt) averaged first: they are not independent, so the
    interval is ``1.96 * sd(cluster means) / sqrt(n_clusters)`` (nan with < 2 clusters)."""
    groups: dict[Any, list[float]] = {}
    for v, c in zip(values, clusters):
        groups.setdefault(c, []).append(float(v))
    means = [_mean(g) for g in groups.values()]
    if not means:
        return float("nan"), float("nan")
    mu = _mean(means)
    if len(means) < 2:
        return mu, float("nan")
    sd = math.sqrt(sum((m - mu) ** 2 for m in means) / (len(means) - 1))
    return mu, 1.96 * sd / math.sqrt(len(means))


def rollout_metrics(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Behaviour metrics of one step's main-agent rollouts (``trajectory_record`` rows).

    * ``reward/*``: mean of each ``reward_breakdown`` entry (total, acc, fmt, anchor, tool, …);
    * ``format_compliance``: fraction of rollouts whose every turn is well-formed and that end
      in a non-forced ``</think>`` → ``<answer>`` (``paravt.rewards.format``'s analysis);
    * ``think_closure_rate``: fraction of non-forced turns that close ``<think>``;
    * ``tool_calls_per_rollout``: ``<tool_call>`` blocks attempted per rollout (valid or not);
    * ``tool_calls/<name>``: the calls naming tool ``<name>`` of the run per rollout, whatever
      their status (absent for a tool no rollout of the records named; a call naming no tool
      of the run counts in ``tool_calls_per_rollout`` and ``parse_error_rate`` only);
    * ``tool_errors/<name>``: the calls per rollout that tool ``<name>``'s own bug failed
      (``tool_error``: a plug-in method raised or returned garbage, ``paravt.agent.tools``;
      absent when none did);
    * ``tool_call_rate``: fraction of rollouts that executed at least one valid crop;
    * ``parse_error_rate``: fraction of attempted calls that failed to parse/validate;
    * ``accuracy``: mean ``acc`` reward (1/0 for mcq);
    * ``acc/K{k}``, ``tool_rate/K{k}``, ``count/K{k}``: the same per frame-budget bucket;
    * none of these for no records (an empty step: ``paravt.alarms.EmptySteps``);
    * ``adv/nonzero_groups`` (records with an ``advantage``: a training step's): the share of
      groups (prompts) with a non-zero group advantage; a group whose G rollouts earn the same
      reward teaches nothing, so a step whose share is 0 changes nothing but by the KL;
    * ``adv/mixed_groups``, ``adv/tool``, ``adv/no_tool`` (the same records): the share of
      groups holding rollouts that executed a crop and rollouts that did not, and over those
      mixed groups the mean group advantage of each side (absent when no group is mixed). ``adv/tool`` < 0 < ``adv/no_tool`` pushes the
      policy away from the tool: the measured reason for a collapse (the collapse
      experiment, ``paravt.experiments.collapse``, reads them from ``metrics.jsonl``);
    * ``prompts/X``, ``prompt_sq/X`` for ``X`` = ``tool_call_rate`` and each ``tool_rate/K{k}``:
      the number of prompts and the mean of their squared per-prompt tool-call rates, which
      with ``X`` (every prompt has G rollouts, so ``X`` is also the mean of the per-prompt
      rates) let ``paravt.alarms`` test a fall with the prompt as the unit.
    """
    if not records:
        # A step with no rollout (every video read failed) has no rate or reward to log:
        # 0.0 would read as a collapse (and feed the collapse alarms a false fall).
        return {}
    out: dict[str, float] = {}
    for k in sorted({k for r in records for k in r["breakdown"]}):
        out[f"reward/{k}"] = _mean([r["breakdown"].get(k, 0.0) for r in records])
    rewards = [r["reward"] for r in records]
    out["reward/total"] = mu = _mean(rewards)
    out["reward/std"] = math.sqrt(_mean([(x - mu) ** 2 for x in rewards]))
    out["format_compliance"] = _mean([r["compliant"] for r in records])
    out["think_closure_rate"] = _mean([c for r in records for c in r["closed"]])
    total_calls = sum(r["n_calls"] for r in records)
    out["tool_calls_per_rollout"] = total_calls / len(records) if records else 0.0
    for name in sorted({n for r in records for n in r.get("tool_calls", {})}):
        n_calls = sum(r.get("tool_calls", {}).get(name, 0) for r in records)
        out[f"tool_calls/{name}"] = n_calls / len(records)
    for name in sorted({n for r in records for n in r.get("tool_errors", {})}):
        n_err = sum(r.get("tool_errors", {}).get(name, 0) for r in records)
        out[f"tool_errors/{name}"] = n_err / len(records)
    out["tool_call_rate"] = _mean([r["used_tool"] for r in records])
    _prompt_stats(out, "tool_call_rate", records)
    out["parse_error_rate"] = (
        sum(r["bad_calls"] for r in records) / total_calls if total_calls else 0.0
    )
    out["accuracy"] = _mean([r["breakdown"].get("acc", 0.0) for r in records])
    out["response_tokens"] = _mean([r["response_tokens"] for r in records])
    for k in sorted({r["K"] for r in records}):
        rs = [r for r in records if r["K"] == k]
        out[f"acc/K{k}"] = _mean([r["breakdown"].get("acc", 0.0) for r in rs])
        out[f"tool_rate/K{k}"] = _mean([r["used_tool"] for r in rs])
        _prompt_stats(out, f"tool_rate/K{k}", rs)
        out[f"count/K{k}"] = float(len(rs))
    out.update(_tool_advantage(records))
    return out


#: An advantage at most this large in magnitude counts as zero in ``adv/nonzero_groups``: a
#: group whose G rewards are equal gets 0 up to rounding (its std is 0 and algo.adv_eps 1e-6).
NONZERO_ADVANTAGE = 1e-6


def _tool_advantage(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """``adv/*`` of :func:`rollout_metrics` (none without advantages)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if "advantage" in r:
            groups.setdefault(r["prompt"], []).append(r)
    if not groups:
        return {}
    tool: list[float] = []
    no_tool: list[float] = []
    mixed = nonzero = 0
    for rs in groups.values():
        nonzero += any(abs(r["advantage"]) > NONZERO_ADVANTAGE for r in rs)
        used = [r["used_tool"] > 0 for r in rs]
        if any(used) and not all(used):
            mixed += 1
            tool += [r["advantage"] for r, u in zip(rs, used) if u]
            no_tool += [r["advantage"] for r, u in zip(rs, used) if not u]
    out = {"adv/mixed_groups": mixed / len(groups), "adv/nonzero_groups": nonzero / len(groups)}
    if mixed:
        out["adv/tool"] = _mean(tool)
        out["adv/no_tool"] = _mean(no_tool)
    return out


def mean_or_nan(xs: Sequence[float]) -> float:
    """Mean of ``xs``; NaN for none (the experiments' tables over seeds)."""
    return sum(xs) / len(xs) if xs else float("nan")


def sample_std(xs: Sequence[float]) -> float:
    """Sample standard deviation (ddof 1); 0 for one value."""
    if len(xs) < 2:
        return 0.0 if xs else float("nan")
    m = mean_or_nan(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
