"""Records that cross module boundaries. Typed dataclasses, never bare dicts.

Shapes are written ``(dim, ...)``. Tensors are CPU tensors unless a field says otherwise.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch

QuestionType = Literal["mcq", "oe", "tvg"]


# ------------------------------------------------------------------------------------- video
@dataclass(frozen=True)
class VideoMeta:
    """What ``paravt.video.probe`` learns about a file without decoding it fully."""

    path: str
    # Seconds from the file's 0:00 (the container's start, what a player shows) to the end of
    # the last frame: ``start_time`` + the frames' span + one frame interval.
    duration: float
    fps: float  # average frame rate: (frames - 1) / their span, or the declared rate if equal
    num_frames: int
    # Displayed size: the stored size with the pixel aspect applied (width scaled) and turned
    # by ``rotation``; decoded frames come back at this size.
    width: int
    height: int
    codec: str  # the codec's name ('h264', 'hevc', 'vp9', 'av1'), never the decoder's
    # Frame indices (display order) of keyframes, ascending; frame i is shown at
    # ``start_time + i / fps`` for constant-frame-rate streams.
    keyframes: tuple[int, ...] = ()
    # Seconds from the file's 0:00 to the first frame: 0 unless the video stream starts after
    # the audio (times before it show the first frame).
    start_time: float = 0.0
    # Counter-clockwise degrees (0/90/180/270) the display matrix turns the stored frames
    # (phones: 270 = the iPhone's portrait "-90"); applied to every decoded frame.
    rotation: int = 0
    sample_aspect: float = 1.0  # pixel aspect (SAR) of the stored frames; 1 = square pixels


@dataclass
class FrameBatch:
    """Decoded frames of one request, in request order."""

    frames: torch.Tensor  # (T, H, W, 3) uint8, RGB
    timestamps: torch.Tensor  # (T,) float64 seconds, the requested sample times
    indices: torch.Tensor  # (T,) int64 display-order frame index actually returned
    video: str = ""


@dataclass(frozen=True)
class FrameRequest:
    """Frames wanted from one file at given times (the decode planner's unit of work)."""

    video: str
    timestamps: tuple[float, ...]
    # Optional resize target (height, width); None keeps the decoded size.
    size: tuple[int, int] | None = None
    tag: str = ""  # free-form, for logging (e.g. 'overview', 'crop:3')


@dataclass(frozen=True)
class CropRequest:
    """A crop window on a sample's own video, already validated and clamped."""

    video: str
    start: float
    end: float
    fps: float = 1.0
    max_frames: int = 16
    min_frames: int = 2
    max_pixels: int = 64 * 64
    min_pixels: int = 32 * 32


# -------------------------------------------------------------------------------------- data
@dataclass
class Sample:
    """One dataset row: a question about a video."""

    id: str
    video: str  # absolute or dataset-relative path, resolved by the reader
    question: str
    answer: str
    question_type: QuestionType = "mcq"
    # Ground-truth event window (seconds) when known (synthetic task, tvg questions).
    event_start: float | None = None
    event_end: float | None = None
    options: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def own_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, on the CPU, in storage of its own (never a view of a larger tensor)."""
    return t.detach().to("cpu", copy=True).contiguous()


# ---------------------------------------------------------------------------------- visuals
@dataclass
class VisualInputs:
    """Everything the vision encoder needs for the visual placeholders of one sequence.

    ``pixel_values`` rows are patches in the model's spatial-merge order; ``grid_thw`` has one
    row per video/image segment, in the order the placeholders appear in the token ids.
    """

    pixel_values: torch.Tensor  # (sum_i t_i*h_i*w_i, C*tp*p*p) float32
    grid_thw: torch.Tensor  # (n_segments, 3) int64
    kind: Literal["video", "image"] = "video"
    # Qwen2.5-VL videos only: seconds per temporal patch, one per segment (its M-RoPE spaces
    # temporal positions by this); None for Qwen3-VL, whose timestamps are text tokens.
    second_per_grid_ts: torch.Tensor | None = None  # (n_segments,) float32
    # The source of each segment, for engines that run their own preprocessing (vLLM expands
    # one collapsed placeholder per segment from these): uint8 ``(T, H, W, 3)`` frames at the
    # size they were patchified at, and their ``T`` sample times in seconds. Set by
    # ``paravt.vision.preprocess.encode_clip(s)``; None where a producer only had pixels.
    frames: list[torch.Tensor] | None = None
    timestamps: list[list[float]] | None = None
    # Where each segment's frames came from, when they are exactly what a decode planner
    # returned for that request (the overview; a tool's view that did not change its frames):
    # an asynchronous run's workers send these instead of the pixels and the trainer ranks
    # decode them again (``paravt.workers.pixels``). None where a segment has no such source.
    requests: list[FrameRequest] | None = None

    @property
    def num_segments(self) -> int:
        return int(self.grid_thw.shape[0])

    def compact(self) -> VisualInputs:
        """A copy whose tensors are on the CPU, each with its own storage. A clip encoded in a
        batch holds a VIEW of the batch's packed pixels, and pickling a view sends the whole
        storage: ``paravt.distributed.balance_buckets`` compacts what it moves between ranks."""
        frames = None if self.frames is None else [own_tensor(f) for f in self.frames]
        spg = None if self.second_per_grid_ts is None else own_tensor(self.second_per_grid_ts)
        return replace(
            self,
            pixel_values=own_tensor(self.pixel_values),
            grid_thw=own_tensor(self.grid_thw),
            second_per_grid_ts=spg,
            frames=frames,
        )

    @staticmethod
    def concat(parts: list[VisualInputs]) -> VisualInputs | None:
        parts = [p for p in parts if p is not None and p.num_segments]
        if not parts:
            return None
        kinds = {p.kind for p in parts}
        if len(kinds) != 1:
            raise ValueError(f"cannot concatenate visual inputs of kinds {sorted(kinds)}")
        spg = [p.second_per_grid_ts for p in parts]
        has_src = all(p.frames is not None and p.timestamps is not None for p in parts)
        has_req = all(p.requests is not None for p in parts)
        return VisualInputs(
            torch.cat([p.pixel_values for p in parts]),
            torch.cat([p.grid_thw for p in parts]),
            parts[0].kind,
            None if any(s is None for s in spg) else torch.cat(spg),  # type: ignore[arg-type]
            [f for p in parts for f in p.frames] if has_src else None,  # type: ignore[union-attr]
            [t for p in parts for t in p.timestamps] if has_src else None,  # type: ignore[union-attr]
            [r for p in parts for r in p.requests] if has_req else None,  # type: ignore[union-attr]
        )


@dataclass(frozen=True)
class VisualSource:
    """A trajectory's visuals without their pixels, as an asynchronous run's worker sends them
    (``paravt.workers.pixels``). ``rollout.async_pixels=decode``: per segment, the frame
    request the trainer rank that trains the row decodes again and a digest of the uint8 frames
    the worker encoded (what the decoded frames must equal); ``frames``: the uint8 frames
    themselves and their sample times (the trainer re-encodes them, no decode; ``requests``
    and ``digests`` may then be empty). Either way each segment's ``(t, h, w)`` grid."""

    requests: tuple[FrameRequest, ...]
    digests: tuple[str, ...]
    grids: tuple[tuple[int, int, int], ...]
    kind: Literal["video", "image"] = "video"
    frames: tuple[torch.Tensor, ...] | None = None  # (T, H, W, 3) uint8, one per segment
    timestamps: tuple[tuple[float, ...], ...] | None = None


# ------------------------------------------------------------------------------------ agent
ToolCallStatus = Literal[
    "ok",
    "bad_json",
    "unknown_tool",
    "bad_arguments",
    "bad_range",
    "outside_video",
    "over_parallel_limit",
    "unclosed",
    "decode_error",
    "sub_agent_error",
    "tool_error",  # a plug-in tool's method raised or returned garbage (paravt.agent.tools)
]


@dataclass
class ToolCall:
    """One parsed ``<tool_call>`` block. ``status != 'ok'`` calls become error tool responses."""

    raw: str
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    status: ToolCallStatus = "ok"
    error: str = ""
    # Filled for executed calls: the clamped window actually cropped.
    start: float | None = None
    end: float | None = None
    response: str = ""


@dataclass
class Turn:
    """One main-agent generation and what the tools returned for it."""

    text: str  # decoded generated text (forced prefix excluded)
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str = ""
    # Forced text the engine was given right before ``text`` in this turn (the think prefix,
    # plus ``agent.force_answer_text`` on a forced-answer turn); loss mask 0.
    prefix: str = ""
    forced_answer: bool = False  # True when the answer was forced after max_turns


@dataclass
class Trajectory:
    """Token-exact record of one agent (main or sub) for training.

    ``tokens`` is the full context the engine conditioned on, prompt included; ``loss_mask`` is
    1 exactly on tokens the policy generated; ``logprobs`` holds the behaviour log-prob of each
    generated token (0 elsewhere). ``visuals`` matches the visual placeholders in ``tokens``.
    """

    uid: str
    role: Literal["main", "sub"]
    sample_id: str
    group_id: int
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_len: int
    visuals: VisualInputs | None = None
    parent: str | None = None  # uid of the main trajectory for sub-agents
    num_frames: int = 0  # overview budget K (main) or crop frames (sub)
    turns: list[Turn] = field(default_factory=list)
    answer_text: str = ""  # the full generated text of the main agent (all turns, for rewards)
    reward: float = 0.0
    reward_breakdown: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    # Extra model inputs aligned with tokens (e.g. mm_token_type_ids), filled by the builder.
    extras: dict[str, Any] = field(default_factory=dict)
    # Sampling parameters the generated tokens were drawn with (``logprobs`` are of
    # ``softmax(top_p(logits / temperature))``). Every trainer log-prob pass (policy, proximal,
    # reference) re-scores the row under these, so a sub-agent sampled cooler than the main
    # agent keeps a PPO ratio of 1 before the update. 1.0 / 1.0 (plain softmax) for rows that
    # were not sampled (SFT oracle trajectories).
    temperature: float = 1.0
    top_p: float = 1.0
    # The policy version that sampled each token (-1 on tokens it did not sample; empty:
    # not recorded). A synchronous run samples every token with the policy being updated and
    # records 0 throughout (its runner's version never advances); an asynchronous run's worker
    # (``paravt.workers``) records the step each version follows, may swap weights between
    # turns, so one episode can span versions, and a step trains only rows whose oldest
    # sampled token is at most ``rollout.max_staleness`` versions behind.
    versions: list[int] = field(default_factory=list)
    # Set, with ``visuals`` None, only while the row travels from an asynchronous run's worker
    # to the trainer rank that trains it (``paravt.workers.pixels``: that rank decodes the
    # frames again and restores ``visuals``).
    visual_source: VisualSource | None = None

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.loss_mask) == len(self.logprobs)):
            raise ValueError(
                f"trajectory {self.uid}: tokens ({len(self.tokens)}), loss_mask "
                f"({len(self.loss_mask)}) and logprobs ({len(self.logprobs)}) differ in length"
            )
        if self.versions and len(self.versions) != len(self.tokens):
            raise ValueError(
                f"trajectory {self.uid}: versions ({len(self.versions)}) and tokens "
                f"({len(self.tokens)}) differ in length"
            )

    def oldest_version(self) -> int | None:
        """The oldest policy version among the sampled tokens (None: none recorded)."""
        sampled = [v for v in self.versions if v >= 0]
        return min(sampled) if sampled else None


@dataclass
class Group:
    """The G main trajectories of one prompt (plus their sub-agents), sharing frame budget K."""

    sample: Sample
    group_id: int
    num_frames: int
    trajectories: list[Trajectory]  # main agents
    sub_trajectories: list[Trajectory] = field(default_factory=list)


@dataclass
class RolloutStats:
    """The agent loop's counters of one ``AgentRunner.rollout`` call (``RolloutResult.stats``),
    named: a misspelt counter is an ``AttributeError``, not a metric that stays 0. Several
    runners' counters (an asynchronous step's workers) add up with ``+``."""

    episodes: int = 0
    main_engine_calls: int = 0
    sub_engine_calls: int = 0
    planner_runs: int = 0  # decode-planner runs (the overviews, each turn's crops)
    crops: int = 0  # tool views decoded (crop_video crops and any plug-in tool's views)
    forced_answers: int = 0
    visual_token_stops: int = 0  # generations stopped at a visual token
    truncated_responses: int = 0  # tool responses cut to agent.max_tool_response_tokens
    context_forced_answers: int = 0  # the engine's context forced the answer turn
    context_cut_answers: int = 0  # ... and cut that answer short
    context_ended: int = 0  # ... and left no room for an answer: the episode ended
    rollout_s: float = 0.0
    overview_s: float = 0.0  # overview decode + pixel pack
    main_gen_s: float = 0.0
    crop_s: float = 0.0  # tool views: plan + decode + encode
    sub_gen_s: float = 0.0
    # Tool calls by ``ToolCall.status`` (ok, decode_error, sub_agent_error, ...).
    calls: Counter[str] = field(default_factory=Counter)

    def __add__(self, other: RolloutStats) -> RolloutStats:
        out = RolloutStats(
            **{
                f.name: getattr(self, f.name) + getattr(other, f.name)
                for f in fields(self)
                if f.name != "calls"
            }
        )
        out.calls.update(self.calls)  # update, not Counter +: a count of 0 stays a key
        out.calls.update(other.calls)
        return out


@dataclass
class RolloutBatch:
    """One step's rollouts as the trainer receives them: from its own ``AgentRunner``
    (synchronous, ``paravt.rollout_source.LocalRollout``) or from the rollout workers
    (``paravt.workers.pipeline``).

    ``errors`` / ``stats``: the runners' skipped prompts and counters (``RolloutResult.errors``,
    ``.stats``; an asynchronous run's are on trainer rank 0 only, so sums over ranks count
    each once); ``metrics``: the asynchronous run's ``async/*`` metrics of the step (staleness,
    queue depth, idle times; rank 0), empty when synchronous."""

    groups: list[Group]
    errors: list[str] = field(default_factory=list)
    stats: RolloutStats = field(default_factory=RolloutStats)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class SequenceUnit:
    """One main trajectory and the sub-agent trajectories it spawned (trained together).

    ``advantage`` is the main trajectory's group-relative advantage
    (``paravt.algo.advantages.build_units``); ``sub_weight`` the loss weight of each sub row
    (1/len(subs)). Minibatches are cut between units, never inside one, so a sub row always
    finds its parent in the same packed batch (``paravt.algo.packing.pack_units``).
    """

    main: Trajectory
    subs: list[Trajectory]
    advantage: float
    group_id: int

    @property
    def sub_weight(self) -> float:
        return 1.0 / len(self.subs) if self.subs else 0.0

    @property
    def sequences(self) -> list[Trajectory]:
        return [self.main, *self.subs]

    @property
    def num_tokens(self) -> int:
        """Tokens of all its rows (the cost ``paravt.distributed.balance_buckets`` evens out)."""
        return sum(len(t.tokens) for t in self.sequences)

    def portable(self) -> SequenceUnit:
        """A copy to send to another rank (``paravt.distributed.balance_buckets``): every tensor
        it carries (pixels, source frames, extras) on the CPU in storage of its own."""

        def own(t: Trajectory) -> Trajectory:
            extras = {k: own_tensor(v) if torch.is_tensor(v) else v for k, v in t.extras.items()}
            vis = None if t.visuals is None else t.visuals.compact()
            return replace(t, visuals=vis, extras=extras)

        return replace(self, main=own(self.main), subs=[own(s) for s in self.subs])


@dataclass
class PackedBatch:
    """A padding-free batch: sequences concatenated, boundaries in ``cu_seqlens``.

    Built by ``paravt.algo.packing.pack_units``; cut and joined by ``select_sequences``,
    ``trained_rows`` and ``concat_packed`` there, which carry every field below along.
    """

    input_ids: torch.Tensor  # (N,) int64
    cu_seqlens: torch.Tensor  # (B+1,) int32
    loss_mask: torch.Tensor  # (N,) float32, 1 on tokens to train (already shifted: see algo)
    old_logprobs: torch.Tensor  # (N,) float32 behaviour log-probs
    advantages: torch.Tensor  # (N,) float32 per-token advantages
    seq_weights: torch.Tensor  # (B,) float32 per-sequence loss weight (sub-agent 1/num_sub)
    # (B,) float32 sampling temperature / top-p of each sequence (``Trajectory.temperature``,
    # ``.top_p``): the distribution every log-prob pass scores that sequence under. None only
    # for hand-built batches; ``pack_units`` always fills them.
    temperatures: torch.Tensor | None = None
    top_ps: torch.Tensor | None = None
    uids: list[str] = field(default_factory=list)
    visuals: list[VisualInputs | None] = field(default_factory=list)
    # (N,) int64 ``MM_TEXT`` / ``MM_IMAGE`` / ``MM_VIDEO`` of each token (what the backbone's
    # ``get_rope_index`` and placeholder scatter read); ``pack_units`` always fills it, from
    # ``Trajectory.extras['mm_token_type_ids']``. None only for batches no model sees.
    mm_token_type_ids: torch.Tensor | None = None
    # (B,) int64: for a sub-agent row the index of its main row in this batch, -1 for a main
    # row (``pack_units``; its advantage is the parent's). Dropped by ``select_sequences`` /
    # ``trained_rows`` (a view need not hold the parents), re-based by ``concat_packed``.
    parent_index: torch.Tensor | None = None
    # (B,) ``Trajectory.role`` of each row ('main' / 'sub'); [] after ``trained_rows``.
    roles: list[str] = field(default_factory=list)
    # (N,) float32 log π_ref of every trained token (0 elsewhere): the frozen reference's
    # no-grad pass, filled by the trainer when ``algo.kl_coef != 0`` (the KL term or the
    # ``kl_mode=reward`` penalty); None otherwise.
    ref_logprobs: torch.Tensor | None = None
    # (N,) float32 log π_prox (the policy before this step's updates, one no-grad pass),
    # filled by the trainer for ``algo.loss=decoupled`` (``PolicyObjective.needs_prox``).
    prox_logprobs: torch.Tensor | None = None
    # (N,) int64 policy version that sampled each token (-1 where none did:
    # ``Trajectory.versions``); filled by ``pack_units`` when every row records them.
    versions: torch.Tensor | None = None
    # (B,) int64: the prompt group of each row (``Trajectory.group_id``; -1: shares with no
    # row), filled by ``pack_units`` under ``algo.share_prefix``; None: no sharing. What a
    # group really shares is checked from the tokens and pixels (``paravt.models.prefix``).
    group_ids: torch.Tensor | None = None

    def token_types(self) -> torch.Tensor:
        """``mm_token_type_ids`` ``(N,)``; ``ValueError`` when the batch has none (a forward
        cannot place visual features without them)."""
        if self.mm_token_type_ids is None:
            raise ValueError(
                "PackedBatch.mm_token_type_ids is None: a model forward needs each token's "
                "modality; build batches with pack_units (it copies "
                "Trajectory.extras['mm_token_type_ids']) or set the field"
            )
        return self.mm_token_type_ids
