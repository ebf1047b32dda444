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

Special tokens come only from templates. Text is tokenised in one of three ways
(:class:`TextCache`): the project's own markup (``<|im_start|>user\\n``, the think prefix,
``<tool_response>``) with every added token parsed; text from the model or from data (a tool's
error message quoting the model's call, a sub-agent's summary, a question) with NONE parsed, so
a summary that says ``<|video_pad|>`` or ``</tool_response>`` becomes ordinary text tokens and
can never forge protocol structure; and SFT targets, where the tags the model generates as
single tokens (``<tool_call>``, ``</think>``) are parsed but Qwen's special tokens are not. A
:class:`Context` records where its templates put added tokens and
:meth:`Context.check_special_tokens` asserts that no other forced position holds one (the
agent loop checks every trajectory it returns).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paravt.agent import prompts
from paravt.engines import ENGINES
from paravt.engines.engine import GenerationRequest, SamplingParams
from paravt.types import FrameRequest, Trajectory, VisualInputs
from paravt.vision.preprocess import encode_clips


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


def encode_frames_batch(
    bundle: Any,
    clips: list[tuple[torch.Tensor, list[float]]],
    sources: list[FrameRequest | None] | None = None,
) -> list[Clip]:
    """:func:`encode_frames` for many clips (a turn's overviews, or all its crops), with their
    pixels packed in ONE native call (``paravt.vision.preprocess.encode_clips``).
    ``sources``: per clip, the decode request its frames are exactly the result of (kept as
    ``VisualInputs.requests``: an asynchronous run sends these instead of the pixels), or
    None."""
    out = []
    for i, enc in enumerate(encode_clips(clips, bundle.vision, bundle.tokenizer)):
        src = sources[i] if sources is not None else None
        if src is not None:
            enc.visuals.requests = [src]
        out.append(
            Clip(
                token_ids=[int(t) for t in enc.token_ids],
                mm_token_type_ids=[int(t) for t in enc.mm_token_type_ids],
                visuals=enc.visuals,
            )
        )
    return out


class TextCache:
    """Tokenises forced text (no BOS/EOS added), with special-token parsing decided by where
    the text came from; memoises the project's repeated markup.

    - :meth:`markup` — the project's own template text: every added token (Qwen's special
      tokens and the structural tags) is parsed. Only constants of ``paravt.agent.prompts`` and
      the config's ``think_prefix`` / ``force_answer_text`` go through here.
    - :meth:`plain` — text from the model or from data: no added token is parsed, whatever the
      text spells; the ids never contain an id of ``control_ids``.
    - :meth:`target` — SFT targets (what the model should generate): the structural tags
      (non-special added tokens such as ``<tool_call>``) are parsed, Qwen's special tokens
      (``special=True``: ``<|im_end|>``, ``<|video_pad|>`` …) are not.
    """

    def __init__(self, tokenizer: Any, max_entries: int = 4096) -> None:
        self.tokenizer = tokenizer
        self._memo: dict[str, list[int]] = {}
        self._max = max_entries
        added = dict(tokenizer.get_added_vocab())
        #: ids of every added token (special tokens and structural tags).
        self.control_ids: frozenset[int] = frozenset(int(i) for i in added.values())
        spellings = sorted(added, key=len, reverse=True)  # longest first: the regex prefers it
        self._control_re = re.compile("|".join(re.escape(t) for t in spellings)) if added else None

    def _encode(self, text: str, split_special: bool) -> list[int]:
        return list(
            self.tokenizer.encode(
                text, add_special_tokens=False, split_special_tokens=split_special
            )
        )

    def markup(self, text: str) -> list[int]:
        """The project's template text, every added token parsed (memoised)."""
        ids = self._memo.get(text)
        if ids is None:
            ids = self._encode(text, False)
            if len(self._memo) < self._max:
                self._memo[text] = ids
        return list(ids)

    def target(self, text: str) -> list[int]:
        """An SFT target: structural tags parsed, Qwen's special tokens not."""
        return self._encode(text, True)

    def plain(self, text: str) -> list[int]:
        """Untrusted text (model output, data): no added token is ever produced.

        Where the text spells an added token, the spelling is split after its first character
        so that the tokenizer cannot match it; what remains is tokenised the same way (it may
        spell another one). The result is checked; a tokenizer that still yields an added
        token (e.g. through normalisation) falls back to one character at a time.
        """
        if not text:
            return []
        if self._control_re is None:
            return self._encode(text, True)
        ids: list[int] = []
        pos = 0
        for m in self._control_re.finditer(text):
            if m.start() > pos:
                ids += self._encode(text[pos : m.start()], True)
            ids += self._encode(m.group()[0], True) + self.plain(m.group()[1:])
            pos = m.end()
        if pos < len(text):
            ids += self._encode(text[pos:], True)
        if any(i in self.control_ids for i in ids):  # pragma: no cover - normalising tokenizers
            ids = [i for ch in text for i in self._encode(ch, True)]
            if any(i in self.control_ids for i in ids):
                raise RuntimeError(
                    f"the tokenizer maps plain text {text[:80]!r} to an added token even one "
                    "character at a time; paravt cannot keep model text out of its markup"
                )
        return ids


@dataclass
class Context:
    """A growing token context with per-token mask, behaviour log-probs and mm token types.

    ``control_ids`` are the tokenizer's added-token ids (``TextCache.control_ids``);
    ``template_tokens`` lists ``(position, id)`` of every added token a template or a clip
    put there. Forced text from the model or from data (:meth:`add_text`) must not add any.
    """

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mm_types: list[int] = field(default_factory=list)
    clips: list[VisualInputs] = field(default_factory=list)
    control_ids: frozenset[int] = frozenset()
    template_tokens: list[tuple[int, int]] = field(default_factory=list)
    # The policy version that sampled each token (``add_generated``'s ``version``; -1 on
    # forced tokens): an asynchronous run's worker swaps weights between turns.
    versions: list[int] = field(default_factory=list)

    def _add_forced(
        self, ids: list[int], mm_types: list[int] | None = None, *, template: bool
    ) -> None:
        """Forced tokens (mask 0, log-prob 0); a ``template``'s added tokens are recorded."""
        if template:
            n = len(self.tokens)
            self.template_tokens += [(n + j, t) for j, t in enumerate(ids) if t in self.control_ids]
        self.tokens += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.mm_types += mm_types if mm_types is not None else [0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_markup(self, ids: list[int]) -> None:
        """Forced template tokens (``TextCache.markup``): mask 0, log-prob 0, text type 0."""
        self._add_forced(ids, template=True)

    def add_text(self, ids: list[int]) -> None:
        """Forced tokens of untrusted text (``TextCache.plain``): must hold no added token."""
        bad = [t for t in ids if t in self.control_ids]
        if bad:
            raise ValueError(
                f"add_text: untrusted text holds added token id(s) {sorted(set(bad))[:5]}; "
                "tokenise model or data text with TextCache.plain, never with markup"
            )
        self._add_forced(ids, template=False)

    def check_special_tokens(self, where: str = "") -> None:
        """Raise unless the added tokens at forced positions are exactly the templates' (same
        positions, same ids).

        Generated positions (mask 1) hold what the model sampled and are not restricted here.
        """
        control = self.control_ids
        forced = [
            (i, t)
            for i, (t, m) in enumerate(zip(self.tokens, self.loss_mask))
            if m == 0 and t in control
        ]
        if forced != self.template_tokens:
            extra = sorted(set(forced) - set(self.template_tokens))[:5]
            missing = sorted(set(self.template_tokens) - set(forced))[:5]
            raise RuntimeError(
                f"context {where}: special tokens at forced positions differ from the templates' "
                f"(unexpected (position, id) {extra}, missing {missing}); model or data text was "
                "tokenised with special-token parsing on"
            )

    def add_clip(self, clip: Clip) -> None:
        if len(clip.token_ids) != len(clip.mm_token_type_ids):
            raise ValueError(
                f"clip has {len(clip.token_ids)} token ids but {len(clip.mm_token_type_ids)} "
                "mm_token_type_ids; encode_clip must return aligned lists"
            )
        self._add_forced(list(clip.token_ids), list(clip.mm_token_type_ids), template=True)
        self.clips.append(clip.visuals)

    def add_generated(self, ids: list[int], logprobs: list[float], version: int = 0) -> None:
        """Sampled tokens: mask 1 and their behaviour log-probs (from the engine), drawn by
        policy ``version`` (``AgentRunner.version``)."""
        if len(ids) != len(logprobs):
            raise ValueError(
                f"engine returned {len(ids)} tokens but {len(logprobs)} log-probs; an Engine "
                "must return one behaviour log-prob per generated token"
            )
        self.tokens += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.mm_types += [0] * len(ids)
        self.versions += [int(version)] * len(ids)

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
            self.control_ids,
            list(self.template_tokens),
            list(self.versions),
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
            versions=list(self.versions),
            **kw,
        )


# ------------------------------------------------------------------------- prompt segments
def header(role: str) -> str:
    return f"{prompts.IM_START}{role}\n"


def _prompt(text: TextCache, system: str, clip: Clip, user_text: str) -> Context:
    """``system`` as the system turn, then a user turn of ``clip`` and ``user_text`` (plain
    text), up to and including ``<|im_start|>assistant\\n``: the layout both roles share."""
    ctx = Context(control_ids=text.control_ids)
    ctx.add_markup(
        text.markup(header("system") + system + prompts.IM_END + "\n") + text.markup(header("user"))
    )
    ctx.add_clip(clip)
    ctx.add_markup(text.markup("\n"))
    ctx.add_text(text.plain(user_text))
    ctx.add_markup(text.markup(prompts.IM_END + "\n" + header("assistant")))
    return ctx


def main_prompt(
    text: TextCache,
    overview: Clip,
    question: str,
    max_parallel: int,
    schemas: list[dict[str, Any]] | None = None,
) -> Context:
    """The main agent's prompt up to and including ``<|im_start|>assistant\\n``.

    ``question`` (``prompts.question_text``: data) is tokenised as plain text; ``schemas``:
    the run's tools (``prompts.system_prompt``; default ``crop_video`` alone)."""
    return _prompt(text, prompts.system_prompt(max_parallel, schemas), overview, question)


def sub_prompt(text: TextCache, crop: Clip, instruction: str) -> Context:
    """A sub-agent's prompt up to and including ``<|im_start|>assistant\\n``.

    ``instruction`` (``prompts.sub_user_text``: may quote the question) is plain text."""
    return _prompt(text, prompts.sub_system_prompt(), crop, instruction)


TRUNCATED = " [truncated]"

# Markup tokens around one tool response's content (the "\n" between responses,
# "<tool_response>\n", "\n</tool_response>"), and around a tool turn's responses (a forced
# <|im_end|> closing a turn the length cap cut, "\n<|im_start|>user\n",
# "<|im_end|>\n<|im_start|>assistant\n"). Qwen's tokenizer and the tiny one need 5 and 10;
# the margins let any tokenizer that spells the tags as added tokens fit, and
# ``AgentRunner`` checks its own tokenizer against them at start-up.
RESPONSE_MARKUP_TOKENS = 16
TURN_MARKUP_TOKENS = 32


def tool_turn_max_tokens(max_parallel: int, max_tool_response_tokens: int) -> int:
    """The most tokens one tool turn appends to a main context (``agent.crop_mode=summary``).

    A turn shows at most ``max_parallel`` responses for its allowed calls plus ONE shared error
    for every call past the limit (``paravt.agent.prompts.tool_turn_texts``), each content cut
    to ``max_tool_response_tokens``::

        (max_parallel + 1) · (max_tool_response_tokens + RESPONSE_MARKUP_TOKENS)
            + TURN_MARKUP_TOKENS

    This is the tool term of the pre-run context check (:func:`context_budget_errors`); the
    agent loop enforces it on every turn. With ``agent.crop_mode=frames`` each response also
    holds its crop's visual tokens, which this bound does not count.
    """
    return (max_parallel + 1) * (
        max_tool_response_tokens + RESPONSE_MARKUP_TOKENS
    ) + TURN_MARKUP_TOKENS


def context_budget_errors(cfg: Any, model_dir: Path) -> list[str]:
    """K (frames) × visual tokens per frame + generation must fit the context: the model's
    max_position_embeddings, or with an engine that caps its own context
    (``paravt.engines.EngineSpec.max_model_len_key``; ``rollout.engine=vllm``) that cap
    (``rollout.vllm_max_model_len``, 0: the model's capped at ``VLLM_DEFAULT_MAX_MODEL_LEN``),
    which vLLM would otherwise enforce by failing every over-long request mid-run.

    Reads only ``config.json`` (no weights). Visual tokens per frame pair (temporal patch 2)
    are at most ``overview_max_pixels / (patch · merge)^2``. Checked before anything loads by
    ``paravt.validate.validate_run`` and, at K = ``--frames``, by ``python -m paravt.eval``.
    """
    c = json.loads((model_dir / "config.json").read_text())
    text = c.get("text_config", c)
    vis = c.get("vision_config", {})
    max_pos = int(text.get("max_position_embeddings", 0) or 0)
    if not max_pos:
        return []
    patch = int(vis.get("patch_size", 16))
    merge = int(vis.get("spatial_merge_size", 2))
    tpatch = int(vis.get("temporal_patch_size", 2))
    k_max = max(cfg.video.frame_budgets) if cfg.video.gating else cfg.video.fixed_frames
    per_frame = cfg.video.overview_max_pixels / float((patch * merge) ** 2) / tpatch
    visual = int(k_max * per_frame) + 8 * k_max  # + timestamp text per frame
    # Each turn generates at most max_new_tokens (+ its forced prefix, in the 512 margin); each
    # tool turn appends at most tool_turn_max_tokens, however many calls the model writes.
    gen = (cfg.agent.max_turns + 1) * cfg.rollout.max_new_tokens + cfg.agent.max_turns * (
        tool_turn_max_tokens(cfg.agent.max_parallel, cfg.agent.max_tool_response_tokens)
    )
    limit, what = max_pos, f"the model's max_position_embeddings={max_pos}"
    engine = ENGINES.get(cfg.rollout.engine)
    if engine is not None and engine.max_model_len_key:
        key = engine.max_model_len_key
        limit = getattr(cfg.rollout, key) or min(max_pos, engine.default_max_model_len)
        what = f"{engine.label}'s context (rollout.{key} -> {limit})"
    if visual + gen + 512 > limit:
        return [
            f"frame budget K={k_max} needs about {visual} visual tokens plus up to {gen} "
            f"generated/tool tokens, over {what}; lower video.frame_budgets / "
            "video.overview_max_pixels or agent.max_turns"
        ]
    return []


def markup_fits(text: TextCache) -> str:
    """'' when ``text``'s tokenizer spells the tool-turn markup within
    ``RESPONSE_MARKUP_TOKENS`` / ``TURN_MARKUP_TOKENS``, else what does not fit and the fix."""
    per_response = len(text.markup("\n" + prompts.TOOL_RESPONSE_OPEN)) + len(
        text.markup(prompts.TOOL_RESPONSE_CLOSE)
    )
    per_turn = (
        1
        + len(text.markup("\n" + header("user")))
        + len(text.markup(prompts.IM_END + "\n" + header("assistant")))
    )
    if per_response <= RESPONSE_MARKUP_TOKENS and per_turn <= TURN_MARKUP_TOKENS:
        return ""
    return (
        f"the tokenizer spells one tool response's markup in {per_response} tokens (budget "
        f"{RESPONSE_MARKUP_TOKENS}) and a tool turn's in {per_turn} (budget "
        f"{TURN_MARKUP_TOKENS}); add <tool_response>, </tool_response> and the chat markers as "
        "added tokens, or raise the budgets in paravt.agent.context"
    )


def response_ids(text: TextCache, content: str, max_tokens: int) -> tuple[list[int], bool]:
    """One tool response's content as plain-text ids, at most ``max_tokens`` of them.

    A longer content is cut at a token boundary and ends with the visible ``TRUNCATED``
    marker (counted in the budget). Returns ``(ids, truncated)``."""
    ids = text.plain(content)
    if len(ids) <= max_tokens:
        return ids, False
    mark = text.plain(TRUNCATED)
    return (ids[: max(max_tokens - len(mark), 0)] + mark)[:max_tokens], True


def add_tool_turn(
    ctx: Context,
    text: TextCache,
    contents: Iterable[str],
    max_tokens: int,
    clips: Iterable[Clip | None] | None = None,
) -> list[bool]:
    """Append the forced text after a main turn that called tools, up to the next assistant
    header: ``\\n<|im_start|>user\\n`` + one ``<tool_response>\\n{content}\\n</tool_response>``
    per call (joined by ``\\n``) + ``<|im_end|>\\n<|im_start|>assistant\\n``.

    The tags are markup; every content (a summary, an error quoting the model's call) is
    plain text cut to ``max_tokens`` (:func:`response_ids`). ``clips`` (``agent.crop_mode=
    frames``): per call, a crop clip spliced in right after ``<tool_response>\\n`` and
    followed by ``\\n`` (None for a call without frames). Returns which contents were cut."""
    cut: list[bool] = []
    contents = list(contents)
    per_call = list(clips) if clips is not None else [None] * len(contents)
    if len(per_call) != len(contents):
        raise ValueError(f"add_tool_turn: {len(contents)} contents but {len(per_call)} clips")
    ctx.add_markup(text.markup("\n" + header("user")))
    for j, (content, clip) in enumerate(zip(contents, per_call)):
        ctx.add_markup(text.markup(("\n" if j else "") + prompts.TOOL_RESPONSE_OPEN))
        if clip is not None:
            ctx.add_clip(clip)
            ctx.add_markup(text.markup("\n"))
        ids, was_cut = response_ids(text, content, max_tokens)
        ctx.add_text(ids)
        cut.append(was_cut)
        ctx.add_markup(text.markup(prompts.TOOL_RESPONSE_CLOSE))
    ctx.add_markup(text.markup(prompts.IM_END + "\n" + header("assistant")))
    return cut
