"""SFT records: one oracle (or hand-written) tool-use trajectory per ``sft.jsonl`` line.

Written by ``paravt.data.synth`` (the synthetic task's oracle, ``DIR/sft.jsonl``) and
``paravt.data.cold_start`` (the collapse experiment's cold-start data); read by
``paravt.sft`` (``run_sft``: ``read_sft_records`` → ``encode_records``), the collapse cold
start and the tests. On disk a record is the JSON object::

    {"sample_id", "num_frames": K, "turns": [{"role": "assistant", "content": str},
                                             {"role": "tool", "content": [summary, ...]}, ...],
     "main_only": true}

(``num_frames`` absent in a ParaVT ``messages`` row without one; ``"forced": true`` on a
forced answer turn; ``main_only`` only when set). :class:`SFTRecord` is that object, typed;
``from_dict`` / ``to_dict`` convert at the JSONL boundary and give back the same JSON line
(keys in the same order; keys this module does not know are kept in ``extra`` and written
after the known ones).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paravt.files import read_jsonl, write_atomic


@dataclass
class SFTTurn:
    """One turn of an SFT record: an assistant turn (``content`` a string; ``forced``: a
    forced answer, its prefix ``agent.force_answer_text``) or a tool turn (``content`` the
    sub-agents' summaries, one per valid call of the assistant turn before it; a foreign file
    may hold one string)."""

    role: str
    content: Any
    forced: bool | None = None  # None: the key is absent on disk
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SFTTurn:
        """A turn from its JSON object (``role`` and ``content`` may be missing in a foreign
        file: ``encode_oracle_trajectory`` names the record then)."""
        extra = {k: v for k, v in d.items() if k not in ("role", "content", "forced")}
        forced = d["forced"] if "forced" in d else None
        return cls(d.get("role"), d.get("content"), forced, extra)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (``forced`` only when it was given)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.forced is not None:
            out["forced"] = self.forced
        return {**out, **self.extra}


@dataclass
class SFTRecord:
    """One ``sft.jsonl`` line (module docstring). ``num_frames`` None: the run's
    ``video.fixed_frames`` (a ParaVT row without one); ``main_only``: the record trains the
    main agent only (a colour-swapped copy, ``paravt.data.synth.colour_swaps``: its summaries
    are not what its crops show)."""

    sample_id: str
    num_frames: int | None
    turns: list[SFTTurn]
    main_only: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SFTRecord:
        """A record from a paravt ``turns`` row."""
        known = ("sample_id", "num_frames", "turns", "main_only")
        return cls(
            sample_id=d.get("sample_id"),  # type: ignore[arg-type]
            num_frames=d.get("num_frames"),
            turns=[SFTTurn.from_dict(t) for t in d.get("turns") or []],
            main_only=bool(d.get("main_only", False)),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of the line (what ``paravt.agent.loop.encode_oracle_trajectory``
        reads too)."""
        out: dict[str, Any] = {"sample_id": self.sample_id}
        if self.num_frames is not None:
            out["num_frames"] = self.num_frames
        out["turns"] = [t.to_dict() for t in self.turns]
        if self.main_only:
            out["main_only"] = True
        return {**out, **self.extra}

    @property
    def forced(self) -> bool:
        """Whether a turn is a forced answer."""
        return any(t.forced for t in self.turns)


def _record_from_messages(row: dict[str, Any], where: str) -> SFTRecord:
    """ParaVT ``messages`` → an :class:`SFTRecord` (system and user messages dropped: the
    prompt is rebuilt by the agent's own code; consecutive tool messages form one tool turn)."""
    turns: list[SFTTurn] = []
    for j, m in enumerate(row["messages"]):
        role, content = m.get("role"), m.get("content")
        if isinstance(content, list):  # multimodal content parts: keep the text parts
            content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
        if role in ("system", "user"):
            continue
        if role == "assistant":
            turns.append(SFTTurn("assistant", str(content)))
        elif role == "tool":
            if turns and turns[-1].role == "tool":
                turns[-1].content.append(str(content))
            else:
                turns.append(SFTTurn("tool", [str(content)]))
        else:
            raise ValueError(f"{where} message {j}: unknown role {role!r}")
    num_frames = int(row["num_frames"]) if "num_frames" in row else None
    return SFTRecord(str(row.get("sample_id", row.get("id", ""))), num_frames, turns)


def read_sft_records(path: str | Path) -> list[SFTRecord]:
    """SFT records from a JSONL file in either supported format: paravt's ``turns`` rows or
    ParaVT's ``messages`` rows (``paravt.sft`` documents both). Used by ``paravt.sft.run_sft``
    and the collapse cold start (``paravt.data.cold_start``)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"SFT data '{path}' does not exist; set sft.data to a JSONL of trajectories or "
            "leave it empty to use the synthetic task's sft.jsonl"
        )
    out = []
    for n, row in read_jsonl(p):  # split on "\n" only: a string may hold U+2028
        where = f"{p}:{n}"
        if "messages" in row:
            out.append(_record_from_messages(row, where))
        elif "turns" in row:
            out.append(SFTRecord.from_dict(row))
        else:
            raise ValueError(f"{where}: an SFT row needs 'turns' (paravt) or 'messages' (ParaVT)")
    return out


def sft_jsonl(records: Iterable[SFTRecord]) -> str:
    """The JSONL text of ``records`` (one ``json.dumps`` line each)."""
    return "".join(json.dumps(r.to_dict()) + "\n" for r in records)


def write_sft_records(path: str | Path, records: Iterable[SFTRecord]) -> None:
    """Write ``records`` to ``path`` as JSONL (atomically): the synthetic task's ``sft.jsonl``
    and the collapse cold start's ``base_data.jsonl`` / ``sft_data.jsonl``."""
    write_atomic(path, sft_jsonl(records))
