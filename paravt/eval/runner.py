"""The evaluation loop behind ``python -m paravt.eval``: the training agent loop, greedy, on a
benchmark's samples, one result line per sample, resumable, split across ``torchrun`` ranks.

Per batch of ``batch_size`` samples: ONE ``AgentRunner.rollout`` (G = 1) at the overview budget
K = ``frames`` — overview, parallel ``crop_video`` calls (at most ``agent.max_parallel`` per
turn, ``agent.max_turns`` tool rounds, then the forced answer), each crop examined by a
sub-agent with the same weights (``agent.crop_mode=subagent``) or shown to the main agent as
frames (``frames``, the reference evaluation's protocol) — then ``paravt.eval.scoring``.

Files in ``out``:

* ``results.jsonl`` — one line per sample (:func:`result_row`): id, question, the video's
  duration, prediction (the main
  agent's full text), parsed answer, correct / IoU / score, turns, calls, timings, error, and
  the trace (each turn's text and its calls' windows and responses) that the viewer renders.
  Written as each batch finishes (``results.rank{r}.jsonl`` per rank under ``torchrun``, merged
  into ``results.jsonl`` in dataset order at the end).
* ``run.json`` — what the numbers depend on (:class:`EvalSettings`): benchmark, data, model
  path and a fingerprint of its files (``paravt.checkpoint.weights_fingerprint``), frames, the preset and the
  whole resolved configuration (prompts, crop sizes, dtype, sampling, … :func:`eval_config`).
  A rerun with the same settings skips every id already in the results (a killed run loses at
  most the batch in flight); a rerun that differs in any of them is refused before the model
  loads, naming each key that differs (saved → now), rather than averaging two protocols in
  one summary.
* ``summary.json`` — :func:`paravt.eval.scoring.summarize` of all rows; the markdown table
  (:func:`paravt.eval.scoring.markdown_table`) is printed at the end.

Errors never stop a run: a sample whose video is missing (``error_kind="missing"``) or
unreadable (``"video"``) becomes an error row (counted in the summary, scored wrong / IoU 0); a
batch whose engine call raises becomes error rows with ``error_kind="engine"``; a sample whose
prompt alone (overview + question) passes the engine's context is an error row of kind
``"context"`` (not retried: the same settings cannot fit it). A rerun retries
every row of these kinds (:data:`RETRYABLE`: a restored video, a fixed engine), so a stale
error never stays in the score; the merged ``results.jsonl`` keeps one row per sample.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paravt.agent.loop import PROMPT_TOO_LONG, UNSUPPORTED, stable_seed
from paravt.config import to_dict
from paravt.data.readers import NOT_FOUND, video_path_problem
from paravt.distributed import DistContext, barrier, broadcast_object
from paravt.eval.benchmarks import BENCHMARK_SPECS
from paravt.eval.scoring import call_fields, markdown_table, score_answer, summarize
from paravt.files import DISK_FULL, append_text, write_atomic, write_failure
from paravt.metrics import DiskFullError, call_record, progress_bar, read_metrics
from paravt.rewards.compose import full_text
from paravt.runfolder import training_run_in
from paravt.types import Sample, Trajectory

log = logging.getLogger("paravt.eval")

RESULTS = "results.jsonl"
SUMMARY = "summary.json"
RUN_FILE = "run.json"
# Error kinds a rerun redoes: the cause is outside the sample (a video not yet downloaded or
# half-copied, a lost device), so the next run may well succeed.
RETRYABLE = frozenset({"missing", "video", "engine"})
# Config keys that cannot change a result row, left out of the fingerprint: where the model is
# looked up (the model itself is fingerprinted: ``model``, ``weights``) and run logistics.
NOT_FINGERPRINTED = (
    "model.path",
    "train.out_dir",
    "train.resume",
    "train.progress",
    "train.wandb",
    "train.dump_batches",
)


@dataclass(frozen=True)
class EvalSettings:
    """What a result depends on (``run.json``); a resumed run must match it exactly. The
    sampling and budget fields repeat values of ``config`` so that ``summary.json`` reads
    without it."""

    benchmark: str
    data_root: str
    model: str
    engine: str
    frames: int
    crop_mode: str
    temperature: float
    top_p: float
    sub_temperature: float
    max_turns: int
    max_parallel: int
    max_new_tokens: int
    sub_max_new_tokens: int = 0
    max_tool_response_tokens: int = 0
    overview_max_pixels: int = 0
    crop_max_pixels: int = 0
    crop_max_frames: int = 0
    crop_fps: float = 0.0
    seed: int = 0
    # ``--preset`` (the config's base layer).
    preset: str = ""
    # ``paravt.checkpoint.weights_fingerprint`` of the model folder.
    weights: str = ""
    # :func:`eval_config`: the whole resolved configuration, as nested dicts.
    config: dict[str, Any] = field(default_factory=dict)


class EvalError(RuntimeError):
    """An evaluation cannot start (bad settings, mismatched resume); the message says why."""


# ------------------------------------------------------------------------------ results
def result_files(out: Path) -> list[Path]:
    """``results.jsonl`` and any per-rank parts of an unfinished distributed run."""
    return [out / RESULTS, *sorted(out.glob("results.rank*.jsonl"))]


def load_results(out: Path, samples: Sequence[Sample] = ()) -> dict[str, dict[str, Any]]:
    """Every row in ``out`` by id. A finished row is never replaced by a retryable failure of
    the same id (the files are not in time order: a stale failure in a rank's part must not
    undo its successful retry); otherwise a later line wins. A row of one of ``samples``
    scored against another annotation of it (:func:`is_current`) is left out."""
    rows: dict[str, dict[str, Any]] = {}
    now = {s.id: s for s in samples}
    for f in result_files(out):
        for r in read_metrics(f):  # any JSONL written line by line; skips a torn line
            i = str(r["id"])
            if i in now and not is_current(r, now[i]):
                continue
            if i not in rows or is_done(r) or not is_done(rows[i]):
                rows[i] = r
    return rows


def is_done(row: dict[str, Any]) -> bool:
    """A row a rerun keeps: everything except the :data:`RETRYABLE` errors (retried)."""
    return row.get("error_kind") not in RETRYABLE


def sample_fingerprint(sample: Sample) -> str:
    """Identity of what a row was scored against: sha256 of the sample's annotation (video,
    question, gold answer, type, options, event window). Each ``results.jsonl`` row keeps it
    (``sample_fp``), so a rerun after the benchmark's annotation file changed redoes the rows
    it changed (:func:`is_current`) and keeps the others."""
    ann = [sample.video, sample.question, sample.answer, sample.question_type,
           list(sample.options), sample.event_start, sample.event_end]  # fmt: skip
    return hashlib.sha256(json.dumps(ann).encode()).hexdigest()[:16]


def is_current(row: dict[str, Any], sample: Sample) -> bool:
    """Whether ``row`` was scored against ``sample``'s annotation as it is now (a row of an
    older paravt, without ``sample_fp``: the question and gold answer it holds are compared)."""
    if "sample_fp" in row:
        return row["sample_fp"] == sample_fingerprint(sample)
    said = (("question", sample.question), ("answer", sample.answer))
    return all(row[k] == v for k, v in said if k in row)


def result_row(
    sample: Sample, traj: Trajectory | None, *, frames: int, error: str = "", kind: str = ""
) -> dict[str, Any]:
    """The ``results.jsonl`` line of one sample (scored; an error row when ``traj`` is None)."""

    extra = sample.extra or {}
    row: dict[str, Any] = {
        "id": sample.id,
        "benchmark": extra.get("benchmark", ""),
        "question_type": sample.question_type,
        "categories": extra.get("categories", {}),
        "question": sample.question,
        "answer": sample.answer,
        "frames": frames,
        "sample_fp": sample_fingerprint(sample),
    }
    if traj is None:
        row.update(
            prediction="",
            parsed=None,
            source="none",
            correct=False if sample.question_type != "tvg" else None,
            iou=0.0 if sample.question_type == "tvg" else None,
            score=0.0,
            unparseable=False,
            turns=0,
            calls=0,
            calls_ok=0,
            call_format_errors=0,
            timings={},
            error=error,
            error_kind=kind,
            trace=[],
        )
        return row
    text = full_text(traj)  # forced text included: a forced answer's "<answer>" is forced
    row.update(
        prediction=text,
        **score_answer(sample, text),
        **call_fields(traj),
        timings={k: round(v, 4) for k, v in traj.timings.items()},
        error=None,
        error_kind="",
        trace=[
            {
                "text": t.prefix + t.text,
                "finish_reason": t.finish_reason,
                "forced_answer": t.forced_answer,
                "calls": [call_record(c) for c in t.calls],
            }
            for t in traj.turns
        ],
    )
    return row


# --------------------------------------------------------------------------------- loop
def _video_problem(sample: Sample) -> tuple[str, str] | None:
    """``(error_kind, message)`` of a sample whose video cannot be read as a file: "missing"
    ("video not found: PATH") or "video" naming what the path is instead (a directory, a FIFO,
    a symlink loop: ``paravt.data.readers.video_path_problem``); None when it is a file."""

    problem = video_path_problem(sample.video)
    if not problem and (sample.extra or {}).get("video_missing"):
        problem = NOT_FOUND
    if not problem:
        return None
    return ("missing" if problem == NOT_FOUND else "video"), f"video {problem}: {sample.video}"


def evaluate_samples(
    samples: Sequence[Sample],
    runner: Any,
    *,
    frames: int,
    batch_size: int,
    seed: int,
    write: Callable[[dict[str, Any]], None],
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Run ``samples`` through ``runner`` (an ``AgentRunner``) in batches; ``write`` each row
    as soon as its batch finishes; returns the rows in sample order."""

    rows: list[dict[str, Any]] = []
    todo: list[Sample] = []

    def emit(row: dict[str, Any]) -> None:
        write(row)
        rows.append(row)
        if progress is not None:
            progress(row)

    def flush() -> None:
        if not todo:
            return
        batch = list(todo)
        todo.clear()
        t0 = time.perf_counter()
        try:
            done = runner.rollout(
                batch, [frames] * len(batch), group_size=1, seed=stable_seed("eval", seed)
            )
        except Exception as e:  # noqa: BLE001 - recorded per sample, retried on resume
            if len(batch) > 1:  # find the sample that fails: the others must not pay for it
                log.warning("engine failure on a batch of %d (%s); one by one", len(batch), e)
                for s in batch:
                    todo.append(s)
                    flush()
                return
            log.warning("engine failure on sample %s: %s", batch[0].id, e)
            err = f"{type(e).__name__}: {e}"
            emit(result_row(batch[0], None, frames=frames, error=err, kind="engine"))
            return
        dt = time.perf_counter() - t0
        by_id = {g.sample.id: g for g in done.groups}
        for s in batch:
            g = by_id.get(s.id)
            if g is None or not g.trajectories:
                said = [m for m in done.errors if m.startswith(f"sample {s.id}: ")]
                msg = said[0] if said else f"sample {s.id}: no rollout came back"
                # A video the model cannot take (aspect ratio ...) is no transient failure.
                kind = "unsupported" if UNSUPPORTED in msg else "video"
                emit(result_row(s, None, frames=frames, error=msg, kind=kind))
                continue
            t = g.trajectories[0]
            if not t.turns and any(PROMPT_TOO_LONG in x for x in t.errors):
                # Its question does not fit the context: an error of its own kind, not an
                # unparseable answer (a rerun with the same settings cannot do better).
                msg = next(x for x in t.errors if PROMPT_TOO_LONG in x)
                emit(result_row(s, None, frames=frames, error=f"sample {s.id}: {msg}",
                                kind="context"))  # fmt: skip
                continue
            row = result_row(s, t, frames=frames)
            row["duration"] = float(runner.meta(s.video).duration)  # the viewer's time axis
            row["timings"]["batch_s"] = round(dt, 4)
            row["timings"]["batch_size"] = len(batch)
            emit(row)

    for s in samples:
        if (bad := _video_problem(s)) is not None:
            emit(result_row(s, None, frames=frames, error=bad[1], kind=bad[0]))
            continue
        todo.append(s)
        if len(todo) >= batch_size:
            flush()
    flush()
    return rows


class _Appender:
    """Appends JSON lines, each on disk before the next batch (a kill loses at most one line);
    a write cut short by a full disk is cut back (``paravt.files.append_text``), so the file
    holds whole rows only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.is_file() and path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n"):
            append_text(path, "\n")  # a killed run's half-written last line: never glue onto it

    def __call__(self, row: dict[str, Any]) -> None:
        append_text(self.path, json.dumps(row, ensure_ascii=False) + "\n", fsync=True)

    def close(self) -> None:
        pass  # each row is written whole and closed


@contextlib.contextmanager
def disk_full(what: str, out: Path) -> Iterator[None]:
    """Turn a full disk (``ENOSPC``, quota) met by a write of ``what`` into ``out`` into the
    one-line :class:`paravt.metrics.DiskFullError` (path, free bytes, how to go on); any other
    ``OSError`` passes as it is."""

    try:
        yield
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        raise DiskFullError(
            f"{write_failure(what, e.filename or out, e, out)} Every finished row is kept in "
            f"{out} ({RESULTS} and its per-rank parts, whole rows only). Fix: free space there "
            "(or pass another --out on a larger disk) and rerun the same command: it resumes."
        ) from e


def eval_config(cfg: Any) -> dict[str, Any]:
    """The resolved ``Config`` as nested dicts, minus :data:`NOT_FINGERPRINTED`: the part of
    ``run.json`` that catches a resume with another prompt, crop size, dtype, sampling, …"""

    d = json.loads(json.dumps(to_dict(cfg)))
    for key in NOT_FINGERPRINTED:
        section, name = key.split(".")
        d.get(section, {}).pop(name, None)
    return d


_UNRECORDED = object()


def _flat(settings: dict[str, Any]) -> dict[str, Any]:
    """``run.json`` as ``{key: value}``: the settings by name, the config by dotted key
    (``agent.think_prefix``: what a ``key=value`` override names)."""

    def walk(d: dict[str, Any], prefix: str) -> Iterable[tuple[str, Any]]:
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from walk(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    out = {k: v for k, v in settings.items() if k != "config"}
    if isinstance(settings.get("config"), dict):
        out.update(walk(settings["config"], ""))
    return out


def training_refusal(out: Path) -> str:
    """Why ``out`` cannot take an evaluation's files: it holds a training run
    (``paravt.runfolder.training_run_in``); "" when it does not."""

    if run := training_run_in(out):
        return (
            f"{out} holds a training run ({run}): the evaluation's run.json would replace the "
            "run's, and the run could no longer be resumed; pass another --out (e.g. "
            f"--out {out / 'eval'}, a folder of its own)"
        )
    return ""


def settings_refusal(out: Path, settings: EvalSettings) -> str:
    """Why a run into ``out`` with ``settings`` must not resume the results there ("" when it
    may: no results yet, or the same settings). Reads only; each differing key is named with
    its saved and new values."""
    if refused := training_refusal(out):
        return refused
    f = out / RUN_FILE
    if not f.is_file() or not any(p.is_file() and p.stat().st_size for p in result_files(out)):
        return ""
    try:
        saved = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        return (
            f"{f} is not valid JSON ({e}), so its results' settings are unknown; pass another "
            "--out, or delete that folder to start over"
        )
    new = json.loads(json.dumps(asdict(settings)))
    old_flat, new_flat = _flat(saved), _flat(new)
    lines: list[str] = []
    if "config" not in saved:
        lines.append("  config: not recorded (run.json written by an older paravt)")
        new_flat = {k: v for k, v in new_flat.items() if k in asdict(settings)}
    for k in dict.fromkeys([*old_flat, *new_flat]):
        a, b = old_flat.get(k, _UNRECORDED), new_flat.get(k, _UNRECORDED)
        if a == b:
            continue
        said = lambda v: "(not recorded)" if v is _UNRECORDED else repr(v)  # noqa: E731
        note = " (the model's files changed: other weights, or a copy)" if k == "weights" else ""
        lines.append(f"  {k}: saved {said(a)}, now {said(b)}{note}")
    if not lines:
        return ""
    shown = lines[:20] + ([f"  … and {len(lines) - 20} more"] if len(lines) > 20 else [])
    return (
        f"{out} holds results of a run with other settings, and resuming would average both "
        "in one score:\n" + "\n".join(shown) + "\nrerun with the same settings (the saved "
        "values above), or pass another --out (or delete that folder to start over)"
    )


def check_settings(out: Path, settings: EvalSettings, *, has_results: bool) -> str:
    """Write ``run.json``; or, for a resume whose settings differ from the saved ones, write
    nothing and return the message that refuses it ("" when fine)."""
    refused = settings_refusal(out, settings) if has_results else training_refusal(out)
    if not refused:
        write_atomic(out / RUN_FILE, json.dumps(asdict(settings), indent=2) + "\n")
    return refused


def failed_run(out: Path, samples: Sequence[Sample]) -> str:
    """Why the evaluation of ``samples`` in ``out`` is no result: every row is an error
    (engine failures, missing videos …). "" when at least one sample was evaluated."""
    rows = load_results(out)
    mine = [rows[s.id] for s in samples if s.id in rows]
    if not mine or any(not r.get("error") for r in mine):
        return ""
    kinds = Counter(str(r.get("error_kind") or "other") for r in mine)
    first = next(r for r in mine if r.get("error"))
    return (
        f"all {len(mine)} samples failed ("
        + ", ".join(f"{k}: {n}" for k, n in kinds.most_common())
        + f"; first: {first['error']} (sample {first['id']})), so {out / SUMMARY} scores "
        "nothing. Fix the cause (the errors are in results.jsonl) and rerun the same command: "
        "error rows are retried, finished ones kept"
    )


def merge_results(out: Path, samples: Sequence[Sample]) -> list[dict[str, Any]]:
    """Rewrite ``results.jsonl`` (atomically) with one row per id: this run's samples in
    dataset order, then the rows of samples outside it (an earlier run without ``--limit``:
    kept, not deleted); per-rank parts and retried rows are folded in. Returns this run's rows
    and raises if one of its samples has none."""
    done = load_results(out, samples)
    mine = {s.id for s in samples}
    rows = [done[s.id] for s in samples if s.id in done]
    lost = [s.id for s in samples if s.id not in done]
    kept = rows + [r for i, r in done.items() if i not in mine]
    write_atomic(out / RESULTS, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    for part in out.glob("results.rank*.jsonl"):
        part.unlink()
    if lost:
        raise EvalError(
            f"{len(lost)} sample(s) have no result in {out} (first: {lost[:3]}); run the same "
            "command again to complete them"
        )
    return rows


class RunningScore:
    """The progress bar's running metric over every finished row (resumed ones included)."""

    def __init__(self, rows: Iterable[dict[str, Any]]) -> None:
        self.n, self.total = 0, 0.0
        for r in rows:
            self.add(r)

    def add(self, row: dict[str, Any]) -> None:
        self.n += 1
        self.total += float(row.get("score") or 0.0)

    @property
    def value(self) -> float:
        return self.total / self.n if self.n else 0.0


def run_eval(
    samples: Sequence[Sample],
    runner: Any,
    out: str | Path,
    settings: EvalSettings,
    *,
    batch_size: int = 8,
    seed: int = 0,
    ctx: Any = None,
    show_progress: bool = True,
    stream: Any = None,
) -> dict[str, Any]:
    """Evaluate ``samples`` with ``runner`` into ``out``; returns the summary.

    ``ctx`` (``paravt.distributed.DistContext``): rank ``r`` of ``W`` runs the pending samples
    ``r, r+W, …`` and writes ``results.rank{r}.jsonl``; after a barrier rank 0 merges, writes
    ``summary.json`` and prints the table (the other ranks return the same summary).
    """

    ctx = ctx or DistContext()
    out = Path(out)
    ids = [s.id for s in samples]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise EvalError(f"sample ids are not unique ({dup}); results are keyed by id")
    # Rank 0 alone reads the folder and decides; every rank gets the same refusal or the same
    # pending list (ranks reading on their own could see another rank's first rows).
    plan: tuple[str, list[str]] = ("", [])
    prev: dict[str, dict[str, Any]] = {}
    stale: list[str] = []
    if ctx.is_main:
        out.mkdir(parents=True, exist_ok=True)
        prev = load_results(out)
        with disk_full("evaluation record", out):
            refused = check_settings(out, settings, has_results=bool(prev))
        # A finished row scored against annotations that have changed since is redone.
        stale = [s.id for s in samples
                 if s.id in prev and is_done(prev[s.id]) and not is_current(prev[s.id], s)]  # fmt: skip
        plan = (refused, [i for i in ids if i not in prev or not is_done(prev[i]) or i in stale])
    refused, pending_ids = broadcast_object(plan, ctx)
    if refused:
        raise EvalError(refused)
    todo_ids = set(pending_ids)
    pending = [s for s in samples if s.id in todo_ids]
    mine = pending[ctx.rank :: ctx.world_size]
    done = set(ids) - todo_ids
    if ctx.is_main and stale:
        print(
            f"[eval] {len(stale)} of {sum(i in prev and is_done(prev[i]) for i in ids)} finished "
            f"rows were scored against other annotations (the benchmark's question, answer or "
            f"options changed since; first: {stale[0]}): redone",
            file=stream or sys.stdout,
            flush=True,
        )
    if ctx.is_main and done:
        print(
            f"[eval] resuming in {out}: {len(done)} of {len(ids)} samples already "
            f"done, {len(pending)} to run",
            file=stream or sys.stdout,
            flush=True,
        )
    path = out / (RESULTS if not ctx.distributed else f"results.rank{ctx.rank}.jsonl")
    score = RunningScore(prev[i] for i in done if i in prev)
    bar = progress_bar(
        len(ids),
        initial=score.n,
        enabled=show_progress and ctx.is_main,
        desc=f"eval {settings.benchmark}",
    )

    def tick(row: dict[str, Any]) -> None:
        score.add(row)
        bar.set_postfix({settings_metric(settings.benchmark): f"{score.value:.3f}"})
        bar.update(ctx.world_size)

    writer = _Appender(path)

    def write(row: dict[str, Any]) -> None:
        row["rank"] = ctx.rank
        with disk_full("result row", out):
            writer(row)

    try:
        evaluate_samples(
            mine,
            runner,
            frames=settings.frames,
            batch_size=batch_size,
            seed=seed,
            write=write,
            progress=tick,
        )
    finally:
        writer.close()
        bar.close()
    barrier(ctx)
    summary: dict[str, Any] = {}
    lost = ""
    if ctx.is_main:
        try:
            with disk_full("merged results", out):
                rows = merge_results(out, samples)
        except EvalError as e:
            lost = str(e)
        else:
            summary = summarize(settings.benchmark, rows)
            # The settings without the whole config (run.json, beside it, has that).
            summary["settings"] = {k: v for k, v in asdict(settings).items() if k != "config"}
            with disk_full("summary", out):
                write_atomic(out / SUMMARY, json.dumps(summary, indent=2) + "\n")
            print(markdown_table(summary), file=stream or sys.stdout, flush=True)
    summary, lost = broadcast_object((summary, lost), ctx)
    if lost:
        raise EvalError(lost)
    return summary


def settings_metric(benchmark: str) -> str:
    """The progress bar's label for the running mean score: ``mIoU`` for a benchmark registered
    with that headline (``paravt.eval.benchmarks.BENCHMARK_SPECS``), else ``acc``."""

    spec = BENCHMARK_SPECS.get(benchmark)
    return "mIoU" if spec is not None and spec.headline == "mIoU" else "acc"
