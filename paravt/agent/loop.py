"""The parallel agent loop: G rollouts per prompt, batched across all prompts of a step.

Per turn, for ALL active main agents of ALL groups::

    1. one engine.generate   — main agents continue after their forced "<think>\\n"
    2. parse                 — each <tool_call> judged on its own (paravt.agent.parser)
    3. one DecodePlanner.run — every crop window of every rollout, one pass per file
    4. one engine.generate   — every sub-agent summary (paravt.agent.subagent); with
                               ``agent.crop_mode=frames`` none: the crop's frames themselves
                               go into the tool response (the reference evaluation's protocol)
    5. append                — one <tool_response> per allowed call (errors too), ONE shared
                               error for all calls past ``agent.max_parallel``, next assistant
                               header: at most ``context.tool_turn_max_tokens`` tokens a turn

After ``agent.max_turns`` tool turns the answer is forced: ``think_prefix + force_answer_text``
is appended (mask 0) and the agent generates the answer. A main agent finishes when a turn has
no tool call (an answer, EOS or the length cap) or after the forced turn; a turn with tool
calls continues even if it also wrote an ``<answer>`` (accuracy reads the last complete one).
A turn cut by the length cap is closed with a forced ``<|im_end|>`` (mask 0) before the tool
responses, so the next turn starts from well-formed chat markup.

No request ever passes the engine's context (``paravt.rollout.engine.context_limit``; vLLM
fails the whole batch on one such request): a tool turn that would not fit forces the answer
early, an answer that would not fit is cut to what fits, and an episode with no room left ends
without an answer — each counted (``context_forced_answers``, ``context_cut_answers``,
``context_ended``) and noted in the trajectory's errors. Sub-agent summaries are cut to fit the
same way; a crop whose prompt alone does not fit becomes that call's error.

Overviews: one ``DecodePlanner.run`` for all prompts; each prompt is encoded once and its
context copied to its G rollouts (the frame budget K is per prompt, shared by the group).
A prompt whose video cannot be probed or decoded is skipped with a logged error
(``AgentRunner.errors``); the rest of the step proceeds.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

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
    tool_turn_max_tokens,
)
from paravt.agent.parser import parse_tool_calls
from paravt.agent.subagent import SubOutcome, run_sub_agents
from paravt.agent.tools import plan_crops
from paravt.config import Config
from paravt.rollout.engine import Engine, GenerationResult, SamplingParams, context_limit
from paravt.types import (
    FrameRequest,
    Group,
    RolloutStats,
    Sample,
    ToolCall,
    Trajectory,
    Turn,
    VideoMeta,
)
from paravt.video import (
    DecodePlanner,
    VideoError,
    VideoUnsupported,
    frame_size_for_budget,
    overview_timestamps,
    probe,
)

log = logging.getLogger(__name__)

# How a trajectory's ``errors`` say that its prompt alone passed the engine's context (nothing
# was generated): the evaluation makes such a sample an error row of kind "context"
# (``paravt.eval.runner.result_row``), not an unparseable answer.
PROMPT_TOO_LONG = "the prompt alone"
# How ``AgentRunner.errors`` says a sample was skipped for a ``VideoUnsupported`` video (one the
# model cannot take, whatever the retry): the evaluation's error kind "unsupported".
UNSUPPORTED = "cannot be used by the model"

END_TOKENS = ("<|im_end|>", "<|endoftext|>")
# Placeholder tokens a generated turn must never contain: they would claim visual features the
# sequence does not have and break every later forward pass over the context.
VISUAL_TOKENS = ("<|video_pad|>", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>")


def stable_seed(*parts: object) -> int:
    """A 31-bit seed from its parts, identical in every process (unlike salted ``hash``)."""
    h = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


@dataclass
class _Episode:
    """One main agent in flight."""

    uid: str
    group: int
    sample: Sample
    meta: VideoMeta
    ctx: Context
    prompt_len: int
    num_frames: int
    turns: list[Turn] = field(default_factory=list)
    subs: list[Trajectory] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    done: bool = False


def _add_time(e: _Episode, key: str, dt: float) -> None:
    e.timings[key] = e.timings.get(key, 0.0) + dt


class AgentRunner:
    """Runs the PARA-GRPO agent: ``rollout(samples, K per sample, G, seed) -> groups``.

    ``engine`` serves both the main agents and the sub-agents (same weights). ``bundle`` is a
    ``paravt.models.ModelBundle`` (its ``tokenizer`` and ``vision`` spec are used). ``stats``
    holds the last rollout's counters (``paravt.types.RolloutStats``: tool calls by final
    status, engine calls, crops, forced and context-cut answers, wall times), a new record per
    rollout.

    A failing *main-agent* engine call raises (nothing can continue without it); sub-agent
    failures, unreadable crops and malformed calls become error tool responses, and prompts
    whose video cannot be read are skipped (``errors``).
    """

    def __init__(
        self,
        engine: Engine,
        bundle: Any,
        cfg: Config,
        *,
        planner: DecodePlanner | None = None,
    ) -> None:
        self.engine = engine
        self.bundle = bundle
        self.cfg = cfg
        self.tokenizer = bundle.tokenizer
        self.factor = int(bundle.vision.factor)
        self.planner = planner or DecodePlanner(
            cfg.video.backend, cfg.video.cache_frames, timeout_s=cfg.video.decode_timeout_s
        )
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
        self.errors: list[str] = []
        self.stats = RolloutStats()
        # The policy version the engine's weights are (recorded on every sampled token), and
        # an optional hook called before every turn that may swap the engine's weights and
        # returns the version then loaded (``paravt.workers``: an asynchronous run's worker).
        self.version = 0
        self.before_turn: Callable[[], int] | None = None

    # ------------------------------------------------------------------------------ helpers
    def meta(self, video: str) -> VideoMeta:
        """Probe a video once per runner (metadata never changes during a run)."""
        m = self._metas.get(video)
        if m is None:
            m = probe(video, timeout_s=self.cfg.video.decode_timeout_s)
            self._metas[video] = m
        return m

    def _sampling(self, seed: int, *, sub: bool = False) -> SamplingParams:
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
        for i, fb in zip(where, self.planner.run(reqs)):
            if isinstance(fb, VideoError):
                out[i] = fb
            else:
                done.append((i, fb))
        clips = encode_frames_batch(self.bundle, [(fb.frames, _times(fb)) for _, fb in done])
        for (i, _), clip in zip(done, clips):
            s = samples[i]
            question = prompts.question_text(s, self.meta(s.video).duration)
            out[i] = main_prompt(self.text, clip, question, self.cfg.agent.max_parallel)
        return out

    def sub_context(self, sample: Sample, call: ToolCall, clip: Clip) -> Context:
        assert call.start is not None and call.end is not None
        q = sample.question if self.cfg.agent.sub_agent_include_question else None
        return sub_prompt(self.text, clip, prompts.sub_user_text(call.start, call.end, q))

    # ------------------------------------------------------------------------------ rollout
    def rollout(
        self,
        samples: list[Sample],
        frame_budgets: list[int],
        *,
        group_size: int,
        seed: int,
        first_group: int = 0,
    ) -> list[Group]:
        """Roll out ``group_size`` episodes for each sample; returns one ``Group`` per sample
        whose video could be read (``self.errors`` lists the skipped ones).

        Reproducible: every request carries a seed derived from ``(seed, uid, turn)``. Groups
        are numbered from ``first_group`` (their ``group_id`` and the uids' prefix): a rollout
        worker of an asynchronous run passes its share's offset in the step's prompts.
        """
        if len(samples) != len(frame_budgets):
            raise ValueError(
                f"rollout: {len(samples)} samples but {len(frame_budgets)} frame budgets; pass "
                "one K per sample (paravt.algo.gating.frame_budget)"
            )
        if group_size < 1:
            raise ValueError(f"rollout: group_size={group_size} must be >= 1")
        acfg = self.cfg.agent
        t_start = time.perf_counter()
        self.errors = []
        st = RolloutStats()
        t0 = time.perf_counter()
        contexts = self.encode_overviews(samples, frame_budgets)
        st.planner_runs += 1
        st.overview_s = time.perf_counter() - t0

        episodes: list[_Episode] = []
        groups: dict[int, Group] = {}
        for gi, (s, k, c) in enumerate(zip(samples, frame_budgets, contexts), first_group):
            if isinstance(c, VideoError):
                how = UNSUPPORTED if isinstance(c, VideoUnsupported) else "could not be read"
                msg = f"sample {s.id}: skipped, its video {how} ({c})"
                log.warning(msg)
                self.errors.append(msg)
                continue
            groups[gi] = Group(s, gi, int(k), [], [])
            for g in range(group_size):
                episodes.append(
                    _Episode(
                        uid=f"{gi}:{s.id}:r{g}",
                        group=gi,
                        sample=s,
                        meta=self.meta(s.video),
                        ctx=c.copy(),
                        prompt_len=len(c.tokens),
                        num_frames=int(k),
                    )
                )

        for turn in range(acfg.max_turns + 1):
            # An asynchronous run's worker swaps in newer weights here, between turns (never
            # inside a generation): every member of a group samples a turn with one version.
            if self.before_turn is not None:
                self.version = self.before_turn()
            reqs, active, how = [], [], []
            for e in episodes:
                if e.done:
                    continue
                plan = self._plan_turn(e, turn, seed, st)
                if plan is None:
                    continue  # the context is full: ended, counted
                prefix, forced, sampling = plan
                e.ctx.add_markup(self.text.markup(prefix))
                if turn == 0:  # the prompt is what the first generation conditioned on
                    e.prompt_len = len(e.ctx.tokens)
                reqs.append(e.ctx.request(sampling, e.uid))
                active.append(e)
                how.append((prefix, forced))
            if not active:
                break
            t0 = time.perf_counter()
            results = self.engine.generate(reqs)
            dt = time.perf_counter() - t0
            st.main_engine_calls += 1
            st.main_gen_s += dt
            if len(results) != len(reqs):
                raise RuntimeError(
                    f"engine returned {len(results)} results for {len(reqs)} main-agent requests"
                )
            calling: list[_Episode] = []
            for e, r, (prefix, forced) in zip(active, results, how):
                _add_time(e, "main_gen_s", dt)
                self._absorb_main(e, r, prefix, forced, turn, st)
                if not e.done:
                    calling.append(e)
            if calling:
                self._run_tools(calling, turn, seed, st)
        for e in episodes:
            if not e.done:  # cannot happen: the forced turn finishes everyone; keep invariant
                raise RuntimeError(f"episode {e.uid} did not finish after the forced answer")
            e.ctx.check_special_tokens(e.uid)
        out = self._collect(episodes, groups)
        st.episodes = len(episodes)
        st.rollout_s = time.perf_counter() - t_start
        self.stats = st
        return out

    def _plan_turn(
        self, e: _Episode, turn: int, seed: int, st: RolloutStats
    ) -> tuple[str, bool, SamplingParams] | None:
        """This turn's forced prefix, whether it forces the answer, and its sampling — within
        the engine's context (``paravt.rollout.engine.context_limit``); None when the episode
        ends here for want of room.

        A request must never pass the context: vLLM fails the whole call (and the training
        step) on one such request. So, with ``L`` the limit and ``n`` the context's tokens:

        * a tool turn whose prefix + ``max_new_tokens`` does not fit forces the answer now
          (``context_forced_answers``);
        * a forced answer that does not fit in full generates what fits
          (``context_cut_answers``);
        * when not one token fits after the forced prefix, the episode ends without an
          answer (``context_ended``; its last turn keeps its tool calls, so its format and
          accuracy rewards score it as unanswered).
        """
        acfg = self.cfg.agent
        sampling = self._sampling(stable_seed(seed, e.uid, turn))
        forced = turn == acfg.max_turns
        prefix = acfg.think_prefix + (acfg.force_answer_text if forced else "")
        limit = context_limit(self.engine)
        if not limit:
            return prefix, forced, sampling
        n = len(e.ctx.tokens)
        room = limit - n - len(self.text.markup(prefix))
        if room >= sampling.max_new_tokens:
            return prefix, forced, sampling
        if not forced:
            forced, prefix = True, acfg.think_prefix + acfg.force_answer_text
            room = limit - n - len(self.text.markup(prefix))
            st.context_forced_answers += 1
            e.errors.append(
                f"turn {turn}: a tool turn does not fit the engine's context ({n} of {limit} "
                "tokens used); the answer was forced"
            )
        if room < 1:
            st.context_ended += 1
            if not e.turns:  # nothing generated yet: the question itself does not fit
                e.errors.append(
                    f"turn {turn}: {PROMPT_TOO_LONG} ({n} tokens: the overview frames and the "
                    f"question) leaves no room in the engine's context ({limit} tokens); no "
                    "answer was generated (shorten the question or its subtitles, lower the "
                    "frame budget K, or raise the engine's max_model_len)"
                )
            else:
                e.errors.append(
                    f"turn {turn}: the context is full ({n} of {limit} tokens); the episode "
                    "ended without an answer (lower agent.max_turns, "
                    "agent.max_tool_response_tokens or the frame budget, or raise the engine's "
                    "max_model_len)"
                )
            e.done = True
            return None
        if room < sampling.max_new_tokens:
            st.context_cut_answers += 1
            sampling = replace(sampling, max_new_tokens=room)
        return prefix, forced, sampling

    def _absorb_main(
        self,
        e: _Episode,
        r: GenerationResult,
        prefix: str,
        forced: bool,
        turn: int,
        st: RolloutStats,
    ) -> None:
        """Append a main-agent generation; decide whether the episode continues with tools."""
        acfg = self.cfg.agent
        ids, lps, cut = self._cut_visual(list(r.token_ids), list(r.logprobs))
        e.ctx.add_generated(ids, lps, self.version)
        text = self.decode_text(ids)
        t = Turn(text=text, finish_reason=r.finish_reason, prefix=prefix, forced_answer=forced)
        e.turns.append(t)
        if cut:
            t.finish_reason = "visual_token"
            e.errors.append(f"turn {turn}: generated a visual placeholder token; episode ended")
            st.visual_token_stops += 1
            e.done = True
            return
        if forced:
            st.forced_answers += 1
            e.done = True
            return
        t.calls = parse_tool_calls(
            text,
            duration=e.meta.duration,
            max_parallel=acfg.max_parallel,
            allow_unclosed_final=acfg.allow_unclosed_final_call,
        )
        for k, c in enumerate(t.calls):
            st.calls[c.status] += 1
            if c.status != "ok":
                e.errors.append(f"turn {turn} call {k}: {c.status}: {c.error}")
        if not t.calls:
            e.done = True

    def _cut_visual(self, ids: list[int], lps: list[float]) -> tuple[list[int], list[float], bool]:
        """Drop a generation from its first visual placeholder token on.

        A sampled ``<|video_pad|>`` (likely from an untrained model) would claim visual
        features the sequence does not have and break every later forward pass over it. The
        kept part is still exactly what was sampled, with its behaviour log-probs.
        """
        for i, t in enumerate(ids):
            if t in self.visual_ids:
                return ids[:i], lps[:i], True
        return ids, lps, False

    def _run_tools(self, calling: list[_Episode], turn: int, seed: int, st: RolloutStats) -> None:
        """Crops (one planner run) and sub-agents (one engine call) for all calling episodes."""
        acfg = self.cfg.agent
        jobs: list[tuple[_Episode, int, ToolCall]] = [
            (e, k, c) for e in calling for k, c in enumerate(e.turns[-1].calls) if c.status == "ok"
        ]
        t0 = time.perf_counter()
        plans = plan_crops(
            [(c, e.sample.video, e.meta) for e, _, c in jobs], self.cfg.video, self.factor
        )
        live = [i for i, p in enumerate(plans) if isinstance(p, FrameRequest)]
        batches = self.planner.run([plans[i] for i in live]) if live else []
        st.planner_runs += 1 if live else 0
        decoded: dict[int, Any] = dict(zip(live, batches))
        ok: list[tuple[int, Any]] = []  # (job index, decoded frames)
        for i, (e, k, c) in enumerate(jobs):
            fb = decoded.get(i, plans[i])
            if isinstance(fb, VideoError):
                c.status, c.error = "decode_error", f"the crop could not be decoded ({fb.problem})"
                e.errors.append(f"turn {turn} call {k}: decode_error: {fb}")
                st.calls["ok"] -= 1
                st.calls["decode_error"] += 1
            else:
                ok.append((i, fb))
        # ONE pixel pack for every crop of every rollout in this turn.
        clips = encode_frames_batch(self.bundle, [(fb.frames, _times(fb)) for _, fb in ok])
        if acfg.crop_mode == "frames":  # the crop itself is the tool response: no sub-agent
            shown: dict[tuple[str, int], Clip] = {}
            for (i, fb), clip in zip(ok, clips):
                e, k, c = jobs[i]
                c.response = f"{int(fb.frames.shape[0])} frames of this window are shown above."
                shown[(e.uid, k)] = clip
            st.crops += len(ok)
            dt_tool = time.perf_counter() - t0
            st.crop_s += dt_tool
            for e in calling:
                _add_time(e, "tool_s", dt_tool)
                self._add_responses(
                    e, [shown.get((e.uid, k)) for k in range(len(e.turns[-1].calls))], st
                )
            return
        sub_ctx: list[tuple[int, Context, int]] = [  # (job index, context, frames)
            (i, self.sub_context(jobs[i][0].sample, jobs[i][2], clip), int(fb.frames.shape[0]))
            for (i, fb), clip in zip(ok, clips)
        ]
        st.crops += len(sub_ctx)
        dt_tool = time.perf_counter() - t0

        reqs = [
            ctx.request(
                self._sampling(
                    stable_seed(seed, jobs[i][0].uid, turn, jobs[i][1], "sub"), sub=True
                ),
                f"{jobs[i][0].uid}:t{turn}:c{jobs[i][1]}",
            )
            for i, ctx, _ in sub_ctx
        ]
        # A sub-agent request must fit the engine's context too (vLLM fails the whole call
        # otherwise): its summary is cut to what fits; a crop whose prompt leaves no room
        # becomes that call's error.
        limit = context_limit(self.engine)
        outcomes: list[SubOutcome | None] = [None] * len(reqs)
        for j, req in enumerate(reqs):
            room = limit - len(req.prompt_ids) if limit else req.sampling.max_new_tokens
            if room < 1:
                outcomes[j] = SubOutcome(
                    None,
                    "",
                    f"the crop's prompt ({len(req.prompt_ids)} tokens) does not fit the "
                    f"engine's context ({limit} tokens); lower video.crop_max_frames or "
                    "video.crop_max_pixels",
                )
            elif room < req.sampling.max_new_tokens:
                req.sampling = replace(req.sampling, max_new_tokens=room)
        send = [j for j, o in enumerate(outcomes) if o is None]
        t0 = time.perf_counter()
        for j, o in zip(
            send,
            run_sub_agents(
                self.engine,
                [reqs[j] for j in send],
                self.tokenizer,
                stop_ids=set(self.stop_ids),
            ),
        ):
            outcomes[j] = o
        dt_sub = time.perf_counter() - t0
        st.sub_engine_calls += 1 if send else 0
        st.crop_s += dt_tool  # plan + decode + encode of the crops
        st.sub_gen_s += dt_sub
        for (i, ctx, nframes), req, o in zip(sub_ctx, reqs, outcomes):
            assert o is not None
            e, k, c = jobs[i]
            if o.error:
                c.status, c.error = "sub_agent_error", o.error
                e.errors.append(f"turn {turn} call {k}: sub_agent_error: {o.error}")
                st.calls["ok"] -= 1
                st.calls["sub_agent_error"] += 1
            else:
                c.response = o.summary
            if o.result is None or o.error:
                continue  # nothing usable to train on
            ids, lps, _ = self._cut_visual(list(o.result.token_ids), list(o.result.logprobs))
            if ids:
                ctx.check_special_tokens(req.request_id)
                ctx.add_generated(ids, lps, self.version)
                e.subs.append(
                    ctx.to_trajectory(
                        uid=req.request_id,
                        role="sub",
                        sample_id=e.sample.id,
                        group_id=e.group,
                        prompt_len=len(req.prompt_ids),
                        parent=e.uid,
                        num_frames=nframes,
                        turns=[
                            Turn(
                                self.decode_text(ids),
                                finish_reason=o.result.finish_reason,
                            )
                        ],
                        answer_text=o.summary,
                        temperature=req.sampling.temperature,
                        top_p=req.sampling.top_p,
                    )
                )
        for e in calling:
            _add_time(e, "tool_s", dt_tool + dt_sub)
            self._add_responses(e, None, st)

    def _add_responses(
        self, e: _Episode, clips: list[Clip | None] | None, st: RolloutStats
    ) -> None:
        """Close the episode's last turn and append its tool responses (with the crop's
        frames in ``agent.crop_mode=frames``): one per allowed call, one shared error for the
        calls past ``agent.max_parallel`` (``prompts.tool_turn_texts``), so the turn appends
        at most ``context.tool_turn_max_tokens`` tokens besides the crops' frames."""
        acfg = self.cfg.agent
        t = e.turns[-1]
        n0 = len(e.ctx.tokens)
        if not (t.finish_reason == "stop" and e.ctx.tokens[-1] == self.im_end):
            e.ctx.add_markup([self.im_end])  # close the turn the length cap cut off
        contents = prompts.tool_turn_texts(t.calls, acfg.max_parallel)
        if clips is not None:  # the shared over-limit error has no frames
            clips = [cl for cl, c in zip(clips, t.calls) if c.status != "over_parallel_limit"]
            clips += [None] * (len(contents) - len(clips))
        cut = add_tool_turn(e.ctx, self.text, contents, acfg.max_tool_response_tokens, clips)
        st.truncated_responses += sum(cut)
        visual = sum(len(cl.token_ids) for cl in clips or [] if cl is not None)
        added = len(e.ctx.tokens) - n0 - visual
        bound = tool_turn_max_tokens(acfg.max_parallel, acfg.max_tool_response_tokens)
        if added > bound:  # cannot happen: markup_fits checked the tokenizer at start-up
            raise RuntimeError(
                f"episode {e.uid}: a tool turn appended {added} tokens, over its bound {bound} "
                "(paravt.agent.context.tool_turn_max_tokens); the markup budgets are too small"
            )

    def _collect(self, episodes: list[_Episode], groups: dict[int, Group]) -> list[Group]:
        for e in episodes:
            traj = e.ctx.to_trajectory(
                uid=e.uid,
                role="main",
                sample_id=e.sample.id,
                group_id=e.group,
                prompt_len=e.prompt_len,
                num_frames=e.num_frames,
                turns=e.turns,
                answer_text="".join(t.text for t in e.turns),
                errors=e.errors,
                timings=e.timings,
                temperature=self.cfg.rollout.temperature,
                top_p=self.cfg.rollout.top_p,
            )
            groups[e.group].trajectories.append(traj)
            groups[e.group].sub_trajectories.extend(e.subs)
        return [groups[k] for k in sorted(groups)]


# ----------------------------------------------------------------------------------- SFT
def encode_oracle_trajectory(
    bundle: Any,
    cfg: Config,
    sample: Sample,
    record: dict[str, Any],
    planner: DecodePlanner | None = None,
) -> Trajectory:
    """An SFT row (``sft.jsonl``) -> a token-exact main ``Trajectory`` built by the SAME
    context code as RL rollouts and eval.

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
    runner = AgentRunner(_NoEngine(), bundle, cfg, planner=planner)
    acfg = cfg.agent
    sid = record.get("sample_id", sample.id)
    k = int(record.get("num_frames", cfg.video.fixed_frames))
    ctx = runner.encode_overviews([sample], [k])[0]
    if isinstance(ctx, VideoError):
        raise ctx
    prompt_len = len(ctx.tokens)
    meta = runner.meta(sample.video)
    turns: list[Turn] = []
    for j, msg in enumerate(record.get("turns", [])):
        role, content = msg.get("role"), msg.get("content")
        if role == "assistant":
            if not isinstance(content, str):
                raise ValueError(f"SFT record {sid} turn {j}: assistant content must be a string")
            forced = bool(msg.get("forced"))
            prefix = acfg.think_prefix + (acfg.force_answer_text if forced else "")
            gen = content[len(prefix) :] if content.startswith(prefix) else content
            ctx.add_markup(runner.text.markup(prefix))
            if not turns:
                prompt_len = len(ctx.tokens)
            ids = runner.text.target(gen) + [runner.im_end]
            ctx.add_generated(ids, [0.0] * len(ids))
            t = Turn(text=gen, finish_reason="stop", prefix=prefix, forced_answer=forced)
            t.calls = parse_tool_calls(
                gen,
                duration=meta.duration,
                max_parallel=acfg.max_parallel,
                allow_unclosed_final=acfg.allow_unclosed_final_call,
            )
            turns.append(t)
        elif role == "tool":
            if not turns or not turns[-1].calls:
                raise ValueError(
                    f"SFT record {sid} turn {j}: a tool turn must follow an assistant turn with "
                    "tool calls"
                )
            summaries = [content] if isinstance(content, str) else list(content or [])
            ok = [c for c in turns[-1].calls if c.status == "ok"]
            if len(summaries) != len(ok):
                raise ValueError(
                    f"SFT record {sid} turn {j}: {len(summaries)} tool summaries for {len(ok)} "
                    "valid calls in the previous assistant turn; give one summary per valid call"
                )
            for c, s in zip(ok, summaries):
                c.response = str(s).strip()
            add_tool_turn(
                ctx,
                runner.text,
                prompts.tool_turn_texts(turns[-1].calls, acfg.max_parallel),
                acfg.max_tool_response_tokens,
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


def encode_oracle_sub_trajectories(
    bundle: Any,
    cfg: Config,
    sample: Sample,
    main: Trajectory,
    planner: DecodePlanner | None = None,
) -> list[Trajectory]:
    """Sub-agent SFT targets of an oracle episode: for every valid call of ``main`` (from
    :func:`encode_oracle_trajectory`), the crop the sub-agent would see — same crop sampling,
    same sub-agent prompt builder as RL — followed by the oracle summary (+ ``<|im_end|>``) as
    the target (mask 1, log-probs 0). Lets a cold start teach the sub-agents to describe crops,
    not only the main agent to request them. Calls whose crop cannot be decoded are skipped.
    """
    runner = AgentRunner(_NoEngine(), bundle, cfg, planner=planner)
    meta = runner.meta(sample.video)
    jobs = [
        (ti, k, c)
        for ti, t in enumerate(main.turns)
        for k, c in enumerate(t.calls)
        if c.status == "ok" and c.response
    ]
    plans = plan_crops([(c, sample.video, meta) for _, _, c in jobs], cfg.video, runner.factor)
    live = [i for i, p in enumerate(plans) if isinstance(p, FrameRequest)]
    decoded: dict[int, Any] = dict(zip(live, runner.planner.run([plans[i] for i in live])))
    ok = [(i, fb) for i, fb in decoded.items() if not isinstance(fb, VideoError)]
    clips = encode_frames_batch(bundle, [(fb.frames, _times(fb)) for _, fb in ok])
    out: list[Trajectory] = []
    for (i, fb), clip in zip(ok, clips):
        ti, k, c = jobs[i]
        ctx = runner.sub_context(sample, c, clip)
        prompt_len = len(ctx.tokens)
        ids = runner.text.target(c.response) + [runner.im_end]
        ctx.add_generated(ids, [0.0] * len(ids))
        out.append(
            ctx.to_trajectory(
                uid=f"{main.uid}:t{ti}:c{k}",
                role="sub",
                sample_id=sample.id,
                group_id=main.group_id,
                prompt_len=prompt_len,
                parent=main.uid,
                num_frames=int(fb.frames.shape[0]),
                turns=[Turn(c.response, finish_reason="stop")],
                answer_text=c.response,
            )
        )
    return out


def _times(fb: Any) -> list[float]:
    """A FrameBatch's sample times as Python floats (the clip's timestamp text)."""
    return [float(t) for t in fb.timestamps]


class _NoEngine:
    """Engine placeholder for encoding-only runners (SFT): generating is a bug."""

    def generate(self, requests: list[Any]) -> list[GenerationResult]:
        raise RuntimeError("encode_oracle_trajectory does not generate; no engine is attached")

    def sync_weights(self, model: object) -> None:
        return None
