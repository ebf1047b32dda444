"""``python -m paravt.data.make_sft DATA`` — cold-start (SFT) records for one's own rows.

A run on one's own videos (docs/own_data.md) starts from a model that must already write the
agent's syntax (``<think>``, parallel ``<tool_call>`` blocks, ``<answer>``) before RL can
reinforce anything; the embedded synthetic task ships such records (``paravt.data.synth``'s
oracle), one's own rows do not. This command writes them, as ``DATA/sft.jsonl`` by default:
the file ``python -m paravt.train data.path=DATA sft.steps=N`` trains on when ``sft.data`` is
empty (``paravt.sft.run_sft``). Two sources:

- **the whole-video oracle** (always): for every training row (``DATA/train.jsonl``, read by
  ``paravt.data.readers.load_samples``: the rows ``data.path`` trains on) and every overview
  budget K (``--frames``, default the preset's ``video.frame_budgets`` and
  ``video.fixed_frames``, as ``paravt.data.synth.oracle_settings`` gives them) one record of
  one tool round (``paravt.data.synth.tool_record``, the synthetic oracle's own writer): a
  thought, ``crop_video(0, duration)`` on the whole video (the duration as the prompt prints
  it), the sub-agent's summary, a thought that repeats the summary (the synthetic oracle's habit), and the row's answer.
  The summary is the row's own ``summary`` field when it has one (a description of what the
  video shows that answers the question; write it if you can), else one made from the answer
  (:func:`answer_summary`: the option's text, the open answer, or the event's window).
- **a stronger model's transcripts** (``--transcripts FILE``): episodes of another model on
  the same rows, in the OpenAI chat layout (``role``, ``content``, ``tool_calls``), turned into
  records of the same syntax (:func:`transcript_record`); their rows get no oracle record.

What the oracle records teach, honestly: the syntax, one whole-video call, and carrying a
summary's words into the answer. Their summaries state the answer whatever the crop shows, so
with ``sft.sub_agents`` (the default) the sub-agent learns to answer from the crop rather than
to describe it; descriptive ``summary`` fields or transcripts teach it better. Every record
is checked on the way out the way SFT reads it (``paravt.data.sft_records``), and an error
names the file, the row and the field.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paravt.config import load_config
from paravt.data.readers import DatasetError, load_samples
from paravt.data.sft_records import SFTRecord, SFTTurn, write_sft_records
from paravt.data.synth import SPOT_LOOK_TEXT, oracle_settings, tool_record
from paravt.files import read_jsonl
from paravt.log import get_logger
from paravt.types import Sample
from paravt.video import VideoError, probe

log = get_logger(__name__)


def answer_summary(sample: Sample) -> str:
    """The oracle's sub-agent summary of a row without a ``summary`` field: what the whole
    video shows, in the words of the row's answer. mcq: the text of the answer's option (the
    answer itself when it is not one of ``A``-``Z`` or has no option); tvg: ``It happens at
    <start>-<end> s.``; oe: the answer."""
    s = sample
    if s.question_type == "tvg" and s.event_start is not None and s.event_end is not None:
        return f"It happens at {s.event_start:.1f}-{s.event_end:.1f} s."
    text = s.answer.strip()
    if s.question_type == "mcq" and s.options and len(text) == 1 and text.isalpha():
        i = ord(text.upper()) - ord("A")
        if 0 <= i < len(s.options):
            text = s.options[i].strip()
    return f"The video shows: {text.rstrip('.')}."


def _answer(sample: Sample) -> str:
    """The text inside ``<answer>`` (a tvg row's window as ``start-end``)."""
    s = sample
    if s.question_type == "tvg" and s.event_start is not None and s.event_end is not None:
        return f"{s.event_start:.1f}-{s.event_end:.1f}"
    return s.answer


def oracle_records(
    samples: Sequence[Sample], durations: dict[str, float], budgets: Sequence[int]
) -> list[SFTRecord]:
    """The whole-video oracle's records (module docstring): one per sample and budget K, in
    sample order. ``durations``: each sample's video duration in seconds, by sample id."""
    out = []
    for s in samples:
        duration = round(durations[s.id], 1)  # as the prompt prints it
        summary = str(s.extra.get("summary") or "").strip() or answer_summary(s)
        row = {"id": s.id}
        for k in budgets:
            out.append(
                tool_record(
                    row, int(k), SPOT_LOOK_TEXT, [(0.0, duration)], [summary], summary, _answer(s)
                )
            )
    return out


def _call_text(call: Any, where: str) -> str:
    """One OpenAI ``tool_calls`` entry as the agent's ``<tool_call>`` block."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise DatasetError(f"{where}: a tool call needs 'function': {{'name', 'arguments'}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # OpenAI sends the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise DatasetError(
                f"{where}: the arguments of {fn['name']} are not JSON ({e})"
            ) from None
    body = json.dumps({"name": fn["name"], "arguments": args})
    return f"<tool_call>\n{body}\n</tool_call>"


def transcript_record(row: dict[str, Any], where: str, default_k: int) -> SFTRecord:
    """A transcript line (docs/own_data.md, "A stronger model's transcripts") as a record:
    ``{"id", "num_frames"?, "messages": [...]}``; each ``assistant`` message becomes a turn
    ``<think>\\n{content}\\n</think>\\n`` followed by one ``<tool_call>`` block per entry of its
    ``tool_calls``, and the ``tool`` messages after it, in order, one tool turn of summaries
    (as many as the calls). The last assistant message answers: its content is the answer
    (wrapped in ``<answer>`` unless it holds one already) and it may not call."""
    sid = row.get("id", row.get("sample_id"))
    msgs = row.get("messages")
    if sid is None or not isinstance(msgs, list):
        raise DatasetError(f"{where}: a transcript needs 'id' and a list 'messages'")
    msgs = [m for m in msgs if isinstance(m, dict) and m.get("role") not in ("system", "user")]
    turns: list[SFTTurn] = []
    pending = 0
    for j, m in enumerate(msgs):
        at, role = f"{where} message {j}", m.get("role")
        content = str(m.get("content") or "").strip()
        if role == "tool":
            if pending <= 0:
                raise DatasetError(f"{at}: a tool message with no call left to answer")
            if turns[-1].role != "tool":
                turns.append(SFTTurn("tool", []))
            turns[-1].content.append(content)
            pending -= 1
            continue
        if role != "assistant":
            raise DatasetError(
                f"{at}: role {role!r}; a transcript holds assistant and tool messages"
            )
        if pending:
            raise DatasetError(f"{at}: {pending} call(s) of the turn before have no tool message")
        calls = [_call_text(c, at) for c in m.get("tool_calls") or []]
        last = j == len(msgs) - 1
        if last and calls:
            raise DatasetError(
                f"{at}: the last assistant message calls a tool; end with the answer"
            )
        if last:
            answer = content if "<answer>" in content else f"<answer>{content}</answer>"
            turns.append(
                SFTTurn(
                    "assistant",
                    answer if "</think>" in answer else f"<think>\n\n</think>\n{answer}",
                )
            )
        else:
            if not calls:
                raise DatasetError(f"{at}: an assistant message before the last must call a tool")
            turns.append(SFTTurn("assistant", f"<think>\n{content}\n</think>\n" + "\n".join(calls)))
        pending = len(calls)
    if not turns or turns[-1].role != "assistant":
        raise DatasetError(f"{where}: the transcript must end with the assistant's answer")
    k = row.get("num_frames", default_k)
    return SFTRecord(str(sid), int(k), turns)


def transcript_records(path: str | Path, ids: set[str], default_k: int) -> list[SFTRecord]:
    """Every line of a transcripts JSONL (:func:`transcript_record`); an id that is no
    training row's is an error naming the line."""
    out = []
    for n, row in read_jsonl(Path(path)):
        where = f"{path}:{n}"
        rec = transcript_record(row, where, default_k)
        if rec.sample_id not in ids:
            raise DatasetError(
                f"{where}: id {rec.sample_id!r} is no row of the training data; use the row's id"
            )
        out.append(rec)
    return out


def make_records(
    data: str | Path,
    *,
    budgets: Sequence[int],
    transcripts: str | Path | None = None,
    video_root: str = "",
) -> list[SFTRecord]:
    """The records of ``data``'s training rows: the transcripts' (when given) and the
    whole-video oracle's for every other row. Raises ``DatasetError`` naming the file and row
    of a bad row, transcript or unreadable video."""
    samples = load_samples(data, video_root=video_root, split="train")
    if not samples:
        raise DatasetError(f"{data}: no training row with a readable video; nothing to write")
    told = (
        transcript_records(transcripts, {s.id for s in samples}, budgets[0]) if transcripts else []
    )
    done = {r.sample_id for r in told}
    rest = [s for s in samples if s.id not in done]
    durations = {}
    for s in rest:
        try:
            durations[s.id] = probe(s.video).duration
        except VideoError as e:
            raise DatasetError(f"row {s.id!r}: its video cannot be read ({e})") from None
    return [*told, *oracle_records(rest, durations, budgets)]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m paravt.data.make_sft",
        description="Write cold-start (SFT) records for a folder of one's own rows "
        "(docs/own_data.md).",
    )
    p.add_argument("data", help="the data folder (data.path): its train.jsonl and videos")
    p.add_argument("--out", default="", help="the records' file (default DATA/sft.jsonl)")
    p.add_argument("--preset", default="tiny_cpu", help="the run's preset: its overview budgets K")
    p.add_argument(
        "--frames", type=int, nargs="+", default=None,
        help="overview budgets K, one record each (default: the preset's)",
    )  # fmt: skip
    p.add_argument("--transcripts", default=None, help="a JSONL of a stronger model's episodes")
    p.add_argument("--video-root", default="", help="data.video_root, when the paths need one")
    a = p.parse_args(argv)
    budgets = a.frames or list(oracle_settings(load_config(a.preset, validate_=False)).budgets)
    if any(k < 1 for k in budgets):
        p.error(f"--frames {budgets}: every budget K must be a positive number of frames")
    try:
        records = make_records(
            a.data, budgets=budgets, transcripts=a.transcripts, video_root=a.video_root
        )
    except (DatasetError, OSError) as e:
        print(f"error: {e}")
        return 2
    out = Path(a.out or Path(a.data) / "sft.jsonl")
    write_sft_records(out, records)
    print(f"wrote {len(records)} SFT records to {out} (overview budgets K {budgets})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
