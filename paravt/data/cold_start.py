"""The collapse experiment's cold-start SFT records (``python -m paravt.experiments collapse``,
``docs/DESIGN.md``, "The collapse experiment, protocol 3"), written from a synthetic spot task
folder (``paravt.data.synth``):

- stage 1, :func:`base_records`: the task's own oracle records with the ``<think>`` tags
  removed (a format prior of its own);
- stage 2, :func:`all_tool_records`: every training row and overview budget K calls
  ``crop_video`` on ``n`` equal windows of the whole video, a share of the tool turns never
  closing ``<think>``; plus :func:`replay_records`, stage 1's direct answers replayed.

The driver (``paravt.experiments.collapse``: ``base_sft``, ``cold_start``) writes them with
``paravt.data.sft_records.write_sft_records`` and trains on them. Everything here is a pure
function of the task folder, the run config and the knobs: the same inputs give the same
records (stable hashes, never ``hash()``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from pathlib import Path

from paravt.config import Config, ConfigError
from paravt.data.sft_records import SFTRecord, read_sft_records
from paravt.data.synth import (
    SPOT_PLAN_TEXT,
    Seen,
    oracle_settings,
    plan_meta,
    read_plans,
    tool_record,
    whole_video_crops,
)
from paravt.files import read_jsonl
from paravt.video import overview_timestamps

#: The tasks the cold start is written for (``data.synth_task``): "spot_late" is protocol 3's,
#: whose need for the tool the K = 32 overview cannot show; "spot" is protocols 1 and 2's.
TASKS = ("spot", "spot_late", "spot_decoy")


def _windows_for(key: str, choices: Sequence[int]) -> int:
    """``choices[h % len]`` for a stable hash of ``key`` (``hash()`` is salted per process)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return int(choices[h % len(choices)])


def _hash_share(key: str) -> float:
    """A stable uniform draw in [0, 1) for ``key``."""
    return _windows_for(key, range(1000)) / 1000


def check_task(cfg: Config) -> None:
    """Raise ``ConfigError`` unless ``cfg``'s task (``data.synth_task``) is one of ``TASKS``:
    checked by :func:`all_tool_records` and, before anything runs, by the collapse driver."""
    if cfg.data.synth_task not in TASKS:
        raise ConfigError(
            f"data.synth_task={cfg.data.synth_task!r}: the collapse cold start is written for "
            "the 'spot_late' task (protocol 3) and the 'spot' task (protocols 1 and 2); set "
            "data.synth_task=spot_late"
        )


def all_tool_records(
    data_dir: str | Path, cfg: Config, windows: Sequence[int], unclosed_think: float = 0.0
) -> list[SFTRecord]:
    """The collapse cold start's SFT records for the "spot"/"spot_late" task in ``data_dir``:
    for every training row and every overview budget K of the run (``oracle_settings``), one
    trajectory that calls ``crop_video`` on ``n`` equal windows of the whole video (``n`` from
    ``windows``, per (row, K) by a stable hash), whether or not the overview shows the square;
    the sub-agents' summaries are the oracle's (only what the crop's frames show,
    ``paravt.data.synth.square_summary``) and the final thought repeats the summary that names
    the square asked about (``square_found``).

    ``unclosed_think``: the share of records (by a stable hash) whose tool-call turn never
    closes its ``<think>`` (the calls follow the thought directly; they still parse and run):
    the fragile format, one that breaks exactly the turns that call the tool, as the paper's
    8B does (0: off).

    Raises ``ConfigError`` for another task or a window count outside
    ``1..agent.max_parallel``."""

    check_task(cfg)
    if not 0.0 <= unclosed_think <= 1.0:
        raise ConfigError(f"--unclosed-think {unclosed_think} must be in [0, 1]")
    bad = [n for n in windows if not 1 <= n <= cfg.agent.max_parallel]
    if not windows or bad:
        raise ConfigError(
            f"--windows {list(windows)}: each count must be in 1..agent.max_parallel "
            f"({cfg.agent.max_parallel})"
        )
    d = Path(data_dir)
    fps, plans = read_plans(d)
    st = oracle_settings(cfg)
    out: list[SFTRecord] = []
    for _, row in read_jsonl(d / "train.jsonl"):
        plan = plans[Path(row["video"]).stem]
        meta = plan_meta(plan, fps)
        squares = sorted([plan.target, *plan.distractors], key=lambda e: e.start)
        for k in st.budgets:
            n = _windows_for(f"{row['id']}:{k}", windows)
            over = Seen(plan, fps, overview_timestamps(meta, k), st.temporal_patch)
            shown = [e.name for e in squares if over.event(e)]
            if over.decoyed():  # "spot_decoy": the overview shows the wrong colour
                shown.append(f"{plan.decoy} {plan.target.shape}")
            plan_text = (
                f"The overview shows a {shown[-1]}; I will check the whole video."
                if shown
                else SPOT_PLAN_TEXT
            )
            wins, summaries, found = whole_video_crops(plan, meta, n, st)
            rec = tool_record(row, k, plan_text, wins, summaries, found, row["answer"])
            if _hash_share(f"unclosed:{row['id']}:{k}") < unclosed_think:
                first = rec.turns[0]
                first.content = first.content.replace("\n</think>\n", "\n", 1)
            out.append(rec)
    return out


_THINK = re.compile(r"^<think>\n(.*?)\n</think>\n", re.S)


def base_records(data_dir: str | Path) -> list[SFTRecord]:
    """Stage 1's records: the task's own oracle records (``sft.jsonl``: direct answers where
    the overview shows the square, crops of the whole video where it does not) with the
    ``<think>``/``</think>`` tags removed and the thought kept as plain text (``The overview
    shows a red square.\\n<answer>A</answer>``), so that stage 1 learns the task, reading the
    colour before the letter, in a format without the tags: the format prior the tags of stage
    2 are laid over (stage 1 trains with ``agent.think_prefix`` empty). Forced-answer records
    are left out (their prefix is the agent's, with ``</think>``).

    Measured (seed 0): with the thought removed too, the cold start answered one letter
    whatever the colour (held-out accuracy 0.14-0.29 at K = 32 after stage 2)."""

    out = []
    for rec in read_sft_records(Path(data_dir) / "sft.jsonl"):
        if rec.forced:
            continue
        for t in rec.turns:
            if t.role == "assistant":
                t.content = _THINK.sub(r"\1\n", t.content, count=1)
        out.append(rec)
    return out


def replay_records(data_dir: str | Path, n_tool: int, share: float) -> list[SFTRecord]:
    """Stage 1's direct answers, replayed in stage 2 of the cold start: ``share`` of stage 2's
    records are the task's own oracle records (``sft.jsonl``, the embedded default's data,
    with their closed ``<think>``) that answer from the overview in one unforced turn, picked
    by a stable hash (with repeats when more are asked for than exist).

    Why (``docs/collapse_notes.md``, protocol 2): a 200-step all-tool SFT erases the base
    model's direct answer (tool-call rate 1.00 at every K), so a rollout without a crop is a
    failed call, never a clean direct answer, and GRPO has nothing safer to drift to. The
    paper's SFT starts from a pretrained VLM that keeps answering from frames underneath;
    replaying a share of stage 1's direct answers keeps that habit here. Every replayed record
    is a direct answer; every other record of stage 2 calls the tool."""
    if not 0.0 <= share < 1.0:
        raise ConfigError(f"--replay {share} must be in [0, 1)")
    n = round(n_tool * share / (1.0 - share))
    if n == 0:
        return []

    direct = [
        rec
        for rec in read_sft_records(Path(data_dir) / "sft.jsonl")
        if len(turns := rec.turns) == 1 and not turns[0].forced and "<answer>" in turns[0].content
    ]
    if not direct:
        raise ConfigError(f"--replay {share}: {data_dir}/sft.jsonl has no direct-answer records")
    ranked = sorted(
        direct,
        key=lambda r: hashlib.sha256(f"{r.sample_id}:{r.num_frames}".encode()).digest(),
    )
    return [ranked[i % len(ranked)] for i in range(n)]
