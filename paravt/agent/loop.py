"""The parallel agent loop: G rollouts per prompt, batched across all prompts of a step.

Per turn, for ALL active main agents of ALL groups::

    1. one engine.generate   — main agents continue after their forced "<think>\\n"
    2. parse                 — each <tool_call> judged on its own (paravt.agent.parser) by
                               the run's tools (``agent.tools``; paravt.agent.tools)
    3. one DecodePlanner.run — every view of every call of every rollout, one pass per file
    4. one engine.generate   — every sub-agent summary (paravt.agent.subagent); with
                               ``agent.crop_mode=frames`` none: the views themselves go into
                               the tool responses (the reference evaluation's protocol)
                               (3 and 4: the tool step, paravt.agent.calls)
    5. append                — one <tool_response> per allowed call (errors too), ONE shared
                               error for all calls past ``agent.max_parallel``, next assistant
                               header: at most ``context.tool_turn_max_tokens`` tokens a turn

After ``agent.max_turns`` tool turns the answer is forced: ``think_prefix + force_answer_text``
is appended (mask 0) and the agent generates the answer. A main agent finishes when a turn has
no tool call (an answer, EOS or the length cap) or after the forced turn; a turn with tool
calls continues even if it also wrote an ``<answer>`` (accuracy reads the last complete one).
A turn cut by the length cap is closed with a forced ``<|im_end|>`` (mask 0) before the tool
responses, so the next turn starts from well-formed chat markup.

No request ever passes the engine's context (``paravt.engines.engine.context_limit``; vLLM
fails the whole batch on one such request): a tool turn that would not fit forces the answer
early, an answer that would not fit is cut to what fits, and an episode with no room left ends
without an answer — each counted (``context_forced_answers``, ``context_cut_answers``,
``context_ended``) and noted in the trajectory's errors. Sub-agent summaries are cut to fit the
same way; a crop whose prompt alone does not fit becomes that call's error.

Overviews: one ``DecodePlanner.run`` for all prompts; each prompt is encoded once and its
context copied to its G rollouts (the frame budget K is per prompt, shared by the group).
A prompt whose video cannot be probed or decoded is skipped with a logged error
(``RolloutResult.errors``); the rest of the step proceeds.

This module is the episode loop only: encoding (prompts, sub-agent prompts, generated text,
the SFT oracle rows) is ``paravt.agent.encoder``, the tool step ``paravt.agent.calls``, the
tools ``paravt.agent.tools`` (the protocol) and ``paravt.agent.crop`` (``crop_video``). Used by
training (``paravt.train``), the rollout workers (``paravt.workers``), evaluation
(``paravt.eval``) and ``python -m paravt.episodes``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from paravt.agent.calls import CallJob, run_calls
from paravt.agent.context import Clip, Context, TextCache, add_tool_turn, tool_turn_max_tokens
from paravt.agent.encoder import (  # noqa: F401  (re-exported: older import paths)
    END_TOKENS,
    VISUAL_TOKENS,
    AgentEncoder,
    encode_oracle_sub_trajectories,
    encode_oracle_trajectory,
)
from paravt.agent.encoder import frame_times as _times  # noqa: F401  (tests/test_view.py)
from paravt.agent.tools import ToolBox
from paravt.config import Config
from paravt.engines.engine import Engine, GenerationResult, SamplingParams, context_limit
from paravt.types import Group, RolloutStats, Sample, Trajectory, Turn, VideoMeta
from paravt.video import DecodePlanner, VideoError, VideoUnsupported

if TYPE_CHECKING:
    from paravt.models import ModelBundle

log = logging.getLogger(__name__)

# How a trajectory's ``errors`` say that its prompt alone passed the engine's context (nothing
# was generated): the evaluation makes such a sample an error row of kind "context"
# (``paravt.eval.runner.result_row``), not an unparseable answer.
PROMPT_TOO_LONG = "the prompt alone"
# How ``RolloutResult.errors`` says a sample was skipped for a ``VideoUnsupported`` video (one the
# model cannot take, whatever the retry): the evaluation's error kind "unsupported".
UNSUPPORTED = "cannot be used by the model"


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


@dataclass(frozen=True)
class RolloutResult:
    """What one ``AgentRunner.rollout`` returns: a ``Group`` per sample whose video could be
    read (numbered from the call's ``first_group``); ``errors``, one line per skipped sample;
    ``skipped``, the skipped samples' group index and why (their line in ``errors``; an
    asynchronous run's worker answers each claimed ticket with a group or this reason,
    ``paravt.workers.worker.ticket_entries``); ``stats``, the call's counters
    (``paravt.types.RolloutStats``: tool calls by final status, engine calls, crops, forced and
    context-cut answers, wall times)."""

    groups: list[Group]
    errors: list[str] = field(default_factory=list)
    skipped: dict[int, str] = field(default_factory=dict)
    stats: RolloutStats = field(default_factory=RolloutStats)


def _add_time(e: _Episode, key: str, dt: float) -> None:
    e.timings[key] = e.timings.get(key, 0.0) + dt


class AgentRunner:
    """Runs the PARA-GRPO agent: ``rollout(samples, K per sample, G, seed) ->
    RolloutResult`` (the groups, the skipped prompts and the call's counters).

    ``engine`` serves both the main agents and the sub-agents (same weights). ``bundle`` is a
    ``paravt.models.ModelBundle`` (its ``tokenizer`` and ``vision`` spec are used).

    A failing *main-agent* engine call raises (nothing can continue without it); sub-agent
    failures, unreadable crops and malformed calls become error tool responses, and prompts
    whose video cannot be read are skipped (``RolloutResult.errors``).
    """

    def __init__(
        self,
        engine: Engine,
        bundle: ModelBundle,
        cfg: Config,
        *,
        planner: DecodePlanner | None = None,
        tools: ToolBox | None = None,
    ) -> None:
        self.engine = engine
        self.bundle = bundle
        self.cfg = cfg
        # Prompts, tool views, generated text (``paravt.agent.encoder``); ``tools`` defaults
        # to ``agent.tools``.
        self.encoder = AgentEncoder(bundle, cfg, planner=planner, tools=tools)
        # The policy version the engine's weights are (recorded on every sampled token), and
        # an optional hook called before every turn that may swap the engine's weights and
        # returns the version then loaded (``paravt.workers``: an asynchronous run's worker).
        self.version = 0
        self.before_turn: Callable[[], int] | None = None

    # ------------------------------------------------------------------ the encoder's parts
    # (what callers of the runner read: evaluation, the trainer's video metadata, tests)
    @property
    def tokenizer(self) -> Any:
        return self.encoder.tokenizer

    @property
    def planner(self) -> DecodePlanner:
        return self.encoder.planner

    @property
    def text(self) -> TextCache:
        return self.encoder.text

    @property
    def im_end(self) -> int:
        return self.encoder.im_end

    @property
    def tools(self) -> ToolBox:
        return self.encoder.tools

    def meta(self, video: str) -> VideoMeta:
        """Probe a video once per runner (metadata never changes during a run)."""
        return self.encoder.meta(video)

    def encode_overviews(
        self, samples: list[Sample], frame_budgets: list[int]
    ) -> list[Context | VideoError]:
        """Prompt context of each sample (one planner pass for all overviews)."""
        return self.encoder.encode_overviews(samples, frame_budgets)

    # ------------------------------------------------------------------------------ rollout
    def rollout(
        self,
        samples: list[Sample],
        frame_budgets: list[int],
        *,
        group_size: int,
        seed: int,
        first_group: int = 0,
    ) -> RolloutResult:
        """Roll out ``group_size`` episodes for each sample; returns one ``Group`` per sample
        whose video could be read, the skipped ones' errors and reasons, and the counters
        (``RolloutResult``).

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
        errors: list[str] = []
        skipped: dict[int, str] = {}
        st = RolloutStats()
        t0 = time.perf_counter()
        contexts = self.encoder.encode_overviews(samples, frame_budgets)
        st.planner_runs += 1
        st.overview_s = time.perf_counter() - t0

        episodes: list[_Episode] = []
        groups: dict[int, Group] = {}
        for gi, (s, k, c) in enumerate(zip(samples, frame_budgets, contexts), first_group):
            if isinstance(c, VideoError):
                how = UNSUPPORTED if isinstance(c, VideoUnsupported) else "could not be read"
                msg = f"sample {s.id}: skipped, its video {how} ({c})"
                log.warning(msg)
                errors.append(msg)
                skipped[gi] = msg
                continue
            groups[gi] = Group(s, gi, int(k), [], [])
            for g in range(group_size):
                episodes.append(
                    _Episode(
                        uid=f"{gi}:{s.id}:r{g}",
                        group=gi,
                        sample=s,
                        meta=self.encoder.meta(s.video),
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
                e.ctx.add_markup(self.encoder.text.markup(prefix))
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
        return RolloutResult(out, errors, skipped, st)

    def _plan_turn(
        self, e: _Episode, turn: int, seed: int, st: RolloutStats
    ) -> tuple[str, bool, SamplingParams] | None:
        """This turn's forced prefix, whether it forces the answer, and its sampling — within
        the engine's context (``paravt.engines.engine.context_limit``); None when the episode
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
        sampling = self.encoder.sampling(stable_seed(seed, e.uid, turn))
        forced = turn == acfg.max_turns
        prefix = acfg.think_prefix + (acfg.force_answer_text if forced else "")
        limit = context_limit(self.engine)
        if not limit:
            return prefix, forced, sampling
        n = len(e.ctx.tokens)
        room = limit - n - len(self.encoder.text.markup(prefix))
        if room >= sampling.max_new_tokens:
            return prefix, forced, sampling
        if not forced:
            forced, prefix = True, acfg.think_prefix + acfg.force_answer_text
            room = limit - n - len(self.encoder.text.markup(prefix))
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
        ids, lps, cut = self.encoder.cut_visual(list(r.token_ids), list(r.logprobs))
        e.ctx.add_generated(ids, lps, self.version)
        text = self.encoder.decode_text(ids)
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
        t.calls = self.encoder.parse(text, e.meta.duration)
        for k, c in enumerate(t.calls):
            st.calls[c.status] += 1
            if c.status != "ok":
                e.errors.append(f"turn {turn} call {k}: {c.status}: {c.error}")
        if not t.calls:
            e.done = True

    def _run_tools(self, calling: list[_Episode], turn: int, seed: int, st: RolloutStats) -> None:
        """The tool step (``paravt.agent.calls.run_calls``: one planner run, one pixel pack,
        one sub-agent engine call) for every valid call of the calling episodes; each call's
        result is recorded on it, failures as error responses, then the tool turns appended."""
        jobs = [
            CallJob(e.uid, e.group, e.sample, e.meta, k, c)
            for e in calling
            for k, c in enumerate(e.turns[-1].calls)
            if c.status == "ok"
        ]
        by_uid = {e.uid: e for e in calling}
        results, dt = run_calls(
            jobs,
            encoder=self.encoder,
            engine=self.engine,
            turn=turn,
            seeds=[stable_seed(seed, j.uid, turn, j.index, "sub") for j in jobs],
            version=self.version,
            st=st,
        )
        # Failures are logged as they happened: decoding's first, then the sub-agents'.
        for stage in (0, 1):
            for j, r in zip(jobs, results):
                if r.stage != stage or r.status == "ok":
                    continue
                j.call.status, j.call.error = r.status, r.error
                by_uid[j.uid].errors.append(f"turn {turn} call {j.index}: {r.status}: {r.detail}")
                st.calls["ok"] -= 1
                st.calls[r.status] += 1
        shown: dict[tuple[str, int], Clip] = {}
        for j, r in zip(jobs, results):
            if r.status == "ok":
                j.call.response = r.response
            if r.clip is not None:
                shown[(j.uid, j.index)] = r.clip
            if r.sub is not None:
                by_uid[j.uid].subs.append(r.sub)
        frames = self.cfg.agent.crop_mode == "frames"
        for e in calling:
            _add_time(e, "tool_s", dt)
            clips = (
                [shown.get((e.uid, k)) for k in range(len(e.turns[-1].calls))] if frames else None
            )
            self._add_responses(e, clips, st)

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
        if not (t.finish_reason == "stop" and e.ctx.tokens[-1] == self.encoder.im_end):
            e.ctx.add_markup([self.encoder.im_end])  # close the turn the length cap cut off
        before = [c.status for c in t.calls]
        contents = self.encoder.tool_texts(t.calls)  # a plug-in label that fails marks its call
        for k, (was, c) in enumerate(zip(before, t.calls)):
            if was == "ok" and c.status != "ok":
                e.errors.append(f"turn {len(e.turns) - 1} call {k}: {c.status}: {c.error}")
                st.calls["ok"] -= 1
                st.calls[c.status] += 1
        if clips is not None:  # the shared over-limit error has no frames
            clips = [cl for cl, c in zip(clips, t.calls) if c.status != "over_parallel_limit"]
            clips += [None] * (len(contents) - len(clips))
        cut = add_tool_turn(
            e.ctx, self.encoder.text, contents, acfg.max_tool_response_tokens, clips
        )
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
