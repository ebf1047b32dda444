"""The agent's encoder: samples, tool views and oracle records -> token-exact contexts.

One :class:`AgentEncoder` per runner holds what encoding needs and nothing that generates: the
tokenizer's :class:`~paravt.agent.context.TextCache`, the stop and visual token ids, the decode
planner, the probed videos' metadata and the run's tools (``agent.tools``). Used by

* the agent loop (``paravt.agent.loop.AgentRunner``, so RL, evaluation and the rollout
  workers): the overviews, the sub-agents' prompts, the generated text;
* cold-start SFT (``paravt.sft.encode_records``, ``paravt.eval.copy_probe``):
  :func:`encode_oracle_trajectory` and :func:`encode_oracle_sub_trajectories` build an oracle
  record's rows with the SAME context code as RL rollouts, with no engine at all.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from paravt.agent import prompts
from paravt.agent.context import (
    Clip,
    Context,
    TextCache,
    add_tool_turn,
    encode_frames_batch,
    main_prompt,
    markup_fits,
    sub_prompt,
)
from paravt.agent.parser import parse_tool_calls
from paravt.agent.tools import (
    ToolBox,
    ToolFailure,
    load_tools,
    plan_problem,
    tool_failure,
    view_problem,
)
from paravt.config import Config
from paravt.engines.engine import SamplingParams
from paravt.types import FrameRequest, Sample, ToolCall, Trajectory, Turn, VideoMeta
from paravt.video import (
    DecodePlanner,
    VideoError,
    frame_size_for_budget,
    overview_timestamps,
    probe,
)

log = logging.getLogger(__name__)

END_TOKENS = ("<|im_end|>", "<|endoftext|>")
# Placeholder tokens a generated turn must never contain: they would claim visual features the
# sequence does not have and break every later forward pass over the context.
VISUAL_TOKENS = ("<|video_pad|>", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>")


def _tool_bug(name: str, where: str, e: Exception) -> ToolFailure:
    """A tool's ``plan`` / ``view`` raised: that call fails (``tool_error``, logged)."""
    msg = f"raised {type(e).__name__}: {e}" if str(e) else f"raised {type(e).__name__}"
    return tool_failure(name, where, msg)


def frame_times(fb: Any) -> list[float]:
    """A FrameBatch's sample times as Python floats (the clip's timestamp text)."""
    return [float(t) for t in fb.timestamps]


class AgentEncoder:
    """Everything the agent encodes, for a model ``bundle`` (a ``paravt.models.ModelBundle``:
    its ``tokenizer`` and ``vision`` spec) under ``cfg``.

    ``planner`` defaults to one over ``cfg.video`` (backend, cache, deadline); ``tools`` to
    the tools ``cfg.agent.tools`` names (``paravt.agent.tools.load_tools``). Raises
    ``ValueError`` when the tokenizer spells the tool-turn markup over its budget.
    """

    def __init__(
        self,
        bundle: Any,
        cfg: Config,
        *,
        planner: DecodePlanner | None = None,
        tools: ToolBox | None = None,
    ) -> None:
        self.bundle = bundle
        self.cfg = cfg
        self.tokenizer = bundle.tokenizer
        self.factor = int(bundle.vision.factor)
        self.planner = planner or DecodePlanner.from_config(cfg.video)
        self.tools = tools if tools is not None else load_tools(list(cfg.agent.tools))
        self.text = TextCache(self.tokenizer)
        why = markup_fits(self.text)
        if why:
            raise ValueError(f"AgentRunner: {why}")
        conv = self.tokenizer.convert_tokens_to_ids
        self.stop_ids = tuple(
            i for i in (conv(t) for t in END_TOKENS) if isinstance(i, int) and i >= 0
        )
        self.im_end = conv("<|im_end|>")
        unk = getattr(self.tokenizer, "unk_token_id", None)
        self.visual_ids = {
            i for i in (conv(t) for t in VISUAL_TOKENS) if isinstance(i, int) and i != unk
        }
        self._metas: dict[str, VideoMeta] = {}

    # ------------------------------------------------------------------------------ helpers
    def meta(self, video: str) -> VideoMeta:
        """Probe a video once per encoder (metadata never changes during a run)."""
        m = self._metas.get(video)
        if m is None:
            m = probe(video, timeout_s=self.cfg.video.decode_timeout_s)
            self._metas[video] = m
        return m

    def sampling(self, seed: int, *, sub: bool = False) -> SamplingParams:
        """A main agent's (``rollout.temperature``, ``rollout.max_new_tokens``) or, with
        ``sub``, a sub-agent's (``rollout.sub_temperature``, ``rollout.sub_max_new_tokens``)
        sampling; both share ``rollout.top_p`` and the end-of-turn stop tokens."""
        r = self.cfg.rollout
        return SamplingParams(
            temperature=r.sub_temperature if sub else r.temperature,
            top_p=r.top_p,
            max_new_tokens=r.sub_max_new_tokens if sub else r.max_new_tokens,
            stop_token_ids=self.stop_ids,
            seed=seed,
        )

    def decode_text(self, ids: list[int]) -> str:
        """Generated ids -> text, tags kept, trailing end-of-turn markers dropped."""
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        changed = True
        while changed:
            changed = False
            for m in END_TOKENS:
                if text.endswith(m):
                    text, changed = text[: -len(m)], True
        return text

    def cut_visual(self, ids: list[int], lps: list[float]) -> tuple[list[int], list[float], bool]:
        """Drop a generation from its first visual placeholder token on.

        A sampled ``<|video_pad|>`` (likely from an untrained model) would claim visual
        features the sequence does not have and break every later forward pass over it. The
        kept part is still exactly what was sampled, with its behaviour log-probs.
        """
        for i, t in enumerate(ids):
            if t in self.visual_ids:
                return ids[:i], lps[:i], True
        return ids, lps, False

    def parse(self, text: str, duration: float) -> list[ToolCall]:
        """A main turn's tool calls, each judged on its own by the run's tools."""
        acfg = self.cfg.agent
        return parse_tool_calls(
            text,
            duration=duration,
            max_parallel=acfg.max_parallel,
            allow_unclosed_final=acfg.allow_unclosed_final_call,
            tools=self.tools,
        )

    def tool_texts(self, calls: list[ToolCall]) -> list[str]:
        """The contents of a tool turn (``prompts.tool_turn_texts`` with the tools' labels)."""
        return prompts.tool_turn_texts(calls, self.cfg.agent.max_parallel, self.tools.label)

    # ------------------------------------------------------------------------------ prompts
    def encode_overviews(
        self, samples: list[Sample], frame_budgets: list[int]
    ) -> list[Context | VideoError]:
        """Prompt context of each sample (one planner pass for all overviews)."""
        vcfg = self.cfg.video
        reqs: list[FrameRequest] = []
        where: list[int] = []
        out: list[Context | VideoError] = [VideoError("", "not planned")] * len(samples)
        for i, (s, k) in enumerate(zip(samples, frame_budgets)):
            try:
                m = self.meta(s.video)
                size = frame_size_for_budget(
                    m, vcfg.overview_min_pixels, vcfg.overview_max_pixels, self.factor
                )
                ts = overview_timestamps(m, int(k))
            except VideoError as e:
                out[i] = e
                continue
            reqs.append(FrameRequest(s.video, tuple(ts), size, tag=f"overview:{s.id}"))
            where.append(i)
        done = []
        for i, req, fb in zip(where, reqs, self.planner.run(reqs)):
            if isinstance(fb, VideoError):
                out[i] = fb
            else:
                done.append((i, req, fb))
        clips = encode_frames_batch(
            self.bundle,
            [(fb.frames, frame_times(fb)) for _, _, fb in done],
            [req for _, req, _ in done],  # the overview is the decoded request
        )
        schemas = self.tools.schemas
        for (i, _, _), clip in zip(done, clips):
            s = samples[i]
            question = prompts.question_text(s, self.meta(s.video).duration)
            out[i] = main_prompt(self.text, clip, question, self.cfg.agent.max_parallel, schemas)
        return out

    def sub_context(self, sample: Sample, call: ToolCall, clip: Clip) -> Context | ToolFailure:
        """A sub-agent's prompt for the view ``clip`` of a valid ``call``: its tool's
        instruction, with the question when ``agent.sub_agent_include_question``; or the
        call's ``tool_error`` when the tool's instruction raises or is no bounded text
        (``ToolBox.instruction``)."""
        q = sample.question if self.cfg.agent.sub_agent_include_question else None
        instruction = self.tools.instruction(call, q)
        if isinstance(instruction, ToolFailure):
            return instruction
        return sub_prompt(self.text, clip, instruction)

    def decode_views(
        self, jobs: list[tuple[ToolCall, str, VideoMeta]]
    ) -> tuple[
        list[tuple[torch.Tensor, list[float]] | ToolFailure], int, list[FrameRequest | None]
    ]:
        """The view of each valid ``(call, video, meta)``: the frames its tool planned,
        decoded in ONE planner run for all of them, then cut by the tool
        (:meth:`~paravt.agent.tools.Tool.view`); or why there is none (never raises: a tool
        whose ``plan`` or ``view`` raises, or returns what ``paravt.agent.tools.plan_problem``
        / ``view_problem`` refuse, fails that call as a ``tool_error``, logged). Also
        returns the planner runs made (0 when nothing was left to decode, else 1) and, per
        view, its source: the request when the view is exactly the decoded frames at the
        requested times (``crop_video``'s), else None (``encode_frames_batch``'s
        ``sources``)."""
        out: list[tuple[torch.Tensor, list[float]] | ToolFailure] = []
        sources: list[FrameRequest | None] = []
        plans: list[FrameRequest | ToolFailure] = []
        for i, (call, video, meta) in enumerate(jobs):
            tool = self.tools.tools[call.name]
            try:
                p = tool.plan(call, video, meta, self.cfg.video, self.factor)
            except Exception as e:  # noqa: BLE001 — a tool's bug fails its call, not the run
                p = _tool_bug(tool.name, "plan", e)
            if why := plan_problem(p, video, self.cfg.video):
                p = tool_failure(tool.name, "plan", why)
            if isinstance(p, FrameRequest):
                p = FrameRequest(p.video, p.timestamps, p.size, tag=f"crop:{i}")
            plans.append(p)
        live = [i for i, p in enumerate(plans) if isinstance(p, FrameRequest)]
        decoded: dict[int, Any] = (
            dict(zip(live, self.planner.run([plans[i] for i in live]))) if live else {}
        )
        for i, (call, _, _) in enumerate(jobs):
            fb = decoded.get(i, plans[i])
            sources.append(None)
            if isinstance(fb, ToolFailure):
                out.append(fb)
            elif isinstance(fb, VideoError):
                out.append(
                    ToolFailure(
                        "decode_error", f"the crop could not be decoded ({fb.problem})", str(fb)
                    )
                )
            else:
                tool = self.tools.tools[call.name]
                try:
                    view = tool.view(call, fb, self.cfg.video, self.factor)
                except Exception as e:  # noqa: BLE001 — a tool's bug fails its call, not the run
                    out.append(_tool_bug(tool.name, "view", e))
                    continue
                if why := view_problem(view, self.cfg.video, self.factor):
                    out.append(tool_failure(tool.name, "view", why))
                    continue
                view = (view[0], [float(x) for x in view[1]])
                out.append(view)
                if view[0] is fb.frames and list(view[1]) == frame_times(fb):
                    sources[-1] = plans[i]  # type: ignore[assignment]
        return out, 1 if live else 0, sources

    # ---------------------------------------------------------------------------------- SFT
    def oracle_trajectory(self, sample: Sample, record: dict[str, Any]) -> Trajectory:
        """:func:`encode_oracle_trajectory` with this encoder."""
        acfg = self.cfg.agent
        sid = record.get("sample_id", sample.id)
        k = int(record.get("num_frames", self.cfg.video.fixed_frames))
        ctx = self.encode_overviews([sample], [k])[0]
        if isinstance(ctx, VideoError):
            raise ctx
        prompt_len = len(ctx.tokens)
        meta = self.meta(sample.video)
        turns: list[Turn] = []
        for j, msg in enumerate(record.get("turns", [])):
            role, content = msg.get("role"), msg.get("content")
            if role == "assistant":
                if not isinstance(content, str):
                    raise ValueError(
                        f"SFT record {sid} turn {j}: assistant content must be a string"
                    )
                forced = bool(msg.get("forced"))
                prefix = acfg.think_prefix + (acfg.force_answer_text if forced else "")
                gen = content[len(prefix) :] if content.startswith(prefix) else content
                ctx.add_markup(self.text.markup(prefix))
                if not turns:
                    prompt_len = len(ctx.tokens)
                ids = self.text.target(gen) + [self.im_end]
                ctx.add_generated(ids, [0.0] * len(ids))
                t = Turn(text=gen, finish_reason="stop", prefix=prefix, forced_answer=forced)
                t.calls = self.parse(gen, meta.duration)
                turns.append(t)
            elif role == "tool":
                if not turns or not turns[-1].calls:
                    raise ValueError(
                        f"SFT record {sid} turn {j}: a tool turn must follow an assistant turn "
                        "with tool calls"
                    )
                summaries = [content] if isinstance(content, str) else list(content or [])
                ok = [c for c in turns[-1].calls if c.status == "ok"]
                if len(summaries) != len(ok):
                    raise ValueError(
                        f"SFT record {sid} turn {j}: {len(summaries)} tool summaries for "
                        f"{len(ok)} valid calls in the previous assistant turn; give one summary "
                        "per valid call"
                    )
                for c, s in zip(ok, summaries):
                    c.response = str(s).strip()
                add_tool_turn(
                    ctx, self.text, self.tool_texts(turns[-1].calls), acfg.max_tool_response_tokens
                )
            else:
                raise ValueError(
                    f"SFT record {sid} turn {j}: role {role!r} is not 'assistant' or 'tool'"
                )
        if not turns:
            raise ValueError(f"SFT record {sid} has no assistant turns")
        return ctx.to_trajectory(
            uid=f"sft:{sid}:K{k}",  # one sample may have a record per budget
            role="main",
            sample_id=sample.id,
            group_id=0,
            prompt_len=prompt_len,
            num_frames=k,
            turns=turns,
            answer_text="".join(t.text for t in turns),
        )

    def oracle_sub_trajectories(self, sample: Sample, main: Trajectory) -> list[Trajectory]:
        """:func:`encode_oracle_sub_trajectories` with this encoder."""
        meta = self.meta(sample.video)
        jobs = [
            (ti, k, c)
            for ti, t in enumerate(main.turns)
            for k, c in enumerate(t.calls)
            if c.status == "ok" and c.response
        ]
        views, _, sources = self.decode_views([(c, sample.video, meta) for _, _, c in jobs])
        ok = [(i, v) for i, v in enumerate(views) if not isinstance(v, ToolFailure)]
        clips = encode_frames_batch(
            self.bundle,
            [v for _, v in ok],  # type: ignore[misc]
            [sources[i] for i, _ in ok],
        )
        out: list[Trajectory] = []
        for (i, v), clip in zip(ok, clips):
            ti, k, c = jobs[i]
            ctx = self.sub_context(sample, c, clip)
            if isinstance(ctx, ToolFailure):
                raise ValueError(
                    f"SFT record of sample {sample.id}, turn {ti} call {k}: {ctx.error}; fix the "
                    "tool or drop the record"
                )
            prompt_len = len(ctx.tokens)
            ids = self.text.target(c.response) + [self.im_end]
            ctx.add_generated(ids, [0.0] * len(ids))
            out.append(
                ctx.to_trajectory(
                    uid=f"{main.uid}:t{ti}:c{k}",
                    role="sub",
                    sample_id=sample.id,
                    group_id=main.group_id,
                    prompt_len=prompt_len,
                    parent=main.uid,
                    num_frames=int(v[0].shape[0]),  # type: ignore[index]
                    turns=[Turn(c.response, finish_reason="stop")],
                    answer_text=c.response,
                )
            )
        return out


def encode_oracle_trajectory(
    bundle: Any,
    cfg: Config,
    sample: Sample,
    record: dict[str, Any],
    planner: DecodePlanner | None = None,
) -> Trajectory:
    """An SFT row (``sft.jsonl``) -> a token-exact main ``Trajectory`` built by the SAME
    context code as RL rollouts and eval (``paravt.sft.encode_records``).

    ``record = {"sample_id", "num_frames": K, "turns": [{"role": "assistant", "content": str},
    {"role": "tool", "content": [summary per call]}, ...]}``. Assistant contents start with
    ``agent.think_prefix`` (forced, mask 0; added if missing); the rest of each assistant turn
    plus its ``<|im_end|>`` is the target (mask 1, log-probs 0: there is no behaviour policy).
    An assistant turn with ``"forced": true`` is a forced answer, as the agent loop forces it
    after ``agent.max_turns`` (and as ``K:notools`` evaluation does at once): its prefix is
    ``think_prefix + force_answer_text`` (mask 0) and its content the rest, e.g. ``"B</answer>"``.
    Tool summaries are rendered through the same ``<tool_response>`` code as in RL (truncated
    to ``agent.max_tool_response_tokens``), paired in order with the calls of the preceding
    assistant turn that parse as valid. Raises ``ValueError`` (naming the sample) for a
    malformed record and ``VideoError`` for an unreadable video.
    """
    return AgentEncoder(bundle, cfg, planner=planner).oracle_trajectory(sample, record)


def encode_oracle_sub_trajectories(
    bundle: Any,
    cfg: Config,
    sample: Sample,
    main: Trajectory,
    planner: DecodePlanner | None = None,
) -> list[Trajectory]:
    """Sub-agent SFT targets of an oracle episode (``paravt.sft.encode_records``): for every
    valid call of ``main`` (from :func:`encode_oracle_trajectory`), the view the sub-agent
    would see — same tool, same frame sampling, same sub-agent prompt builder as RL — followed
    by the oracle summary (+ ``<|im_end|>``) as the target (mask 1, log-probs 0). Lets a cold
    start teach the sub-agents to describe crops, not only the main agent to request them.
    Calls whose view cannot be decoded are skipped.
    """
    return AgentEncoder(bundle, cfg, planner=planner).oracle_sub_trajectories(sample, main)
