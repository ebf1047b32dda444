"""The token-exact context builder shared by RL rollouts, SFT and eval.

A context is a growing list of token segments. Every segment is appended once, as ids, with
its loss mask, behaviour log-probs and ``mm_token_type_ids``; history is never re-templated
or re-tokenised. So the tokens a trajectory trains on are, by construction, exactly the tokens
the engine conditioned on plus the tokens it generated (the reference re-rendered the chat
after each tool result, so trained tokens drifted from sampled ones).

Main-agent layout (Qwen chat markup, written out in ``paravt.agent.prompts``)::

    <|im_start|>system\\n{system prompt with <tools>}<|im_end|>\\n
    <|im_start|>user\\n{overview clip: per temporal patch "<t seconds>" + vision block}\\n
    {duration, question, options}<|im_end|>\\n<|im_start|>assistant\\n
    ── per turn ─────────────────────────────────────────────────────────────────────────────
    {think prefix [+ force-answer text]}         forced,    mask 0
    {generated text ... <|im_end|>}              generated, mask 1, behaviour log-probs
    [<|im_end|>]                                 forced if generation stopped on length
    \\n<|im_start|>user\\n<tool_response>…</tool_response>…<|im_end|>\\n<|im_start|>assistant\\n
                                                 forced,    mask 0

Sub-agent layout: the same markup with the sub-agent system prompt, the crop clip, the
summary instruction, then the generated summary (mask 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from paravt.agent import prompts
from paravt.rollout.engine import GenerationRequest, SamplingParams
from paravt.types import Trajectory, VisualInputs


@dataclass
class Clip:
    """One encoded clip ready to splice into a context (from ``paravt.vision.preprocess``)."""

    token_ids: list[int]
    mm_token_type_ids: list[int]
    visuals: VisualInputs


def encode_frames(bundle: Any, frames: torch.Tensor, timestamps: list[float]) -> Clip:
    """Encode uint8 frames ``(T, H, W, 3)`` (already at the pixel budget) and their times into
    the model's video layout (one clip of :func:`encode_frames_batch`)."""
    return encode_frames_batch(bundle, [(frames, timestamps)])[0]


def encode_frames_batch(bundle: Any, clips: list[tuple[torch.Tensor, list[float]]]) -> list[Clip]:
    """:func:`encode_frames` for many clips (a turn's overviews, or all its crops), with their
    pixels packed in ONE native call (``paravt.vision.preprocess.encode_clips``)."""
    from paravt.vision.preprocess import encode_clips

    return [
        Clip(
            token_ids=[int(t) for t in enc.token_ids],
            mm_token_type_ids=[int(t) for t in enc.mm_token_type_ids],
            visuals=enc.visuals,
        )
        for enc in encode_clips(clips, bundle.vision, bundle.tokenizer)
    ]


class TextCache:
    """Tokenises forced text segments (no BOS/EOS added), memoising the repeated ones."""

    def __init__(self, tokenizer: Any, max_entries: int = 4096) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[str, list[int]] = {}
        self._max = max_entries

    def __call__(self, text: str) -> list[int]:
        ids = self._memo.get(text)
        if ids is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            if len(self._memo) < self._max:
                self._memo[text] = ids
        return ids


@dataclass
class Context:
    """A growing token context with per-token mask, behaviour log-probs and mm token types."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mm_types: list[int] = field(default_factory=list)
    clips: list[VisualInputs] = field(default_factory=list)

    def add_ids(self, ids: list[int]) -> None:
        """Forced (not generated) tokens: mask 0, log-prob 0, text type 0."""
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.mm_types += [0] * len(ids)

    def add_clip(self, clip: Clip) -> None:
        if len(clip.token_ids) != len(clip.mm_token_type_ids):
            raise ValueError(
                f"clip has {len(clip.token_ids)} token ids but {len(clip.mm_token_type_ids)} "
                "mm_token_type_ids; encode_clip must return aligned lists"
            )
        self.tokens += clip.token_ids
        self.loss_mask += [0] * len(clip.token_ids)
        self.logprobs += [0.0] * len(clip.token_ids)
        self.mm_types += clip.mm_token_type_ids
        self.clips.append(clip.visuals)

    def add_generated(self, ids: list[int], logprobs: list[float]) -> None:
        """Sampled tokens: mask 1 and their behaviour log-probs (from the engine)."""
        if len(ids) != len(logprobs):
            raise ValueError(
                f"engine returned {len(ids)} tokens but {len(logprobs)} log-probs; an Engine "
                "must return one behaviour log-prob per generated token"
            )
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.mm_types += [0] * len(ids)

    @property
    def visuals(self) -> VisualInputs | None:
        if len(self.clips) == 1:  # the common case (one overview / one crop): no copy
            return self.clips[0]
        return VisualInputs.concat(self.clips)

    def copy(self) -> Context:
        return Context(
            list(self.tokens),
            list(self.loss_mask),
            list(self.logprobs),
            list(self.mm_types),
            list(self.clips),
        )

    def request(self, sampling: SamplingParams, request_id: str) -> GenerationRequest:
        """A generation request conditioned on exactly the current tokens."""
        return GenerationRequest(
            prompt_ids=list(self.tokens),
            sampling=sampling,
            visuals=self.visuals,
            extras={"mm_token_type_ids": list(self.mm_types)},
            request_id=request_id,
        )

    def to_trajectory(self, **kw: Any) -> Trajectory:
        """Freeze into a ``Trajectory`` (``extras['mm_token_type_ids']`` aligned with tokens)."""
        extras = dict(kw.pop("extras", {}) or {})
        extras["mm_token_type_ids"] = list(self.mm_types)
        return Trajectory(
            tokens=list(self.tokens),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            visuals=self.visuals,
            extras=extras,
            **kw,
        )


# ------------------------------------------------------------------------- prompt segments
def header(role: str) -> str:
    return f"{prompts.IM_START}{role}\n"


def main_prompt(text: TextCache, overview: Clip, question: str, max_parallel: int) -> Context:
    """The main agent's prompt up to and including ``<|im_start|>assistant\\n``."""
    ctx = Context()
    ctx.add_ids(
        text(header("system") + prompts.system_prompt(max_parallel) + prompts.IM_END + "\n")
        + text(header("user"))
    )
    ctx.add_clip(overview)
    ctx.add_ids(text("\n" + question + prompts.IM_END + "\n" + header("assistant")))
    return ctx


def sub_prompt(text: TextCache, crop: Clip, instruction: str) -> Context:
    """A sub-agent's prompt up to and including ``<|im_start|>assistant\\n``."""
    ctx = Context()
    ctx.add_ids(
        text(header("system") + prompts.sub_system_prompt() + prompts.IM_END + "\n")
        + text(header("user"))
    )
    ctx.add_clip(crop)
    ctx.add_ids(text("\n" + instruction + prompts.IM_END + "\n" + header("assistant")))
    return ctx


def tool_turn_text(responses: str) -> str:
    """Forced text after a main turn that called tools, up to the next assistant header."""
    return "\n" + header("user") + responses + prompts.IM_END + "\n" + header("assistant")
