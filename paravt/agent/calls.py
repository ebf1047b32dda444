"""The agent loop's tool step: every valid call of a turn, of every tool, served together.

Per turn, for ALL valid calls of ALL calling main agents (``paravt.agent.loop``)::

    1. plan + decode   — each call's tool plans its frames (``Tool.plan``); ONE
                         ``DecodePlanner.run`` for all of them; each tool cuts its view
                         (``Tool.view``)
    2. pixel pack      — ONE ``encode_frames_batch`` for every view
    3. sub-agents      — ONE ``engine.generate`` for every view's sub-agent
                         (``paravt.agent.subagent``: a failed batch is retried request by
                         request); with ``agent.crop_mode=frames`` none: the view itself is
                         the tool response

What tools share lives here, so a plug-in tool (``agent.tools``) gets it for free: the
batching above, the engine's context limit for sub-agent requests, the sub-agents' seeds and
request ids, their token-exact trajectories, and failures as results: :func:`run_calls`
returns one :class:`CallResult` per call and raises for none of them (an undecodable view is a
``decode_error``, a failed or blank summary a ``sub_agent_error``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from paravt.agent.context import Clip, Context, encode_frames_batch
from paravt.agent.encoder import AgentEncoder
from paravt.agent.subagent import SubOutcome, run_sub_agents
from paravt.agent.tools import ToolFailure
from paravt.engines.engine import Engine, context_limit
from paravt.types import RolloutStats, Sample, ToolCall, ToolCallStatus, Trajectory, Turn, VideoMeta


@dataclass
class CallJob:
    """One valid call of one main agent's turn (``index``: its place among the turn's calls)."""

    uid: str  # the main agent's
    group: int
    sample: Sample
    meta: VideoMeta
    index: int
    call: ToolCall


@dataclass
class CallResult:
    """What one call returned: ``status`` ``'ok'`` with its ``response`` (a summary, or in
    ``agent.crop_mode=frames`` a note on the ``clip`` shown), or a failure status with the
    ``error`` the main agent reads and ``detail`` for the trajectory's error log. ``sub`` is
    the sub-agent's trajectory when it generated something trainable. ``stage``: 0 failed
    before any sub-agent ran (decoding), 1 after (the order the loop logs them in)."""

    status: ToolCallStatus = "ok"
    response: str = ""
    error: str = ""
    detail: str = ""
    clip: Clip | None = None
    sub: Trajectory | None = None
    stage: int = 1


def run_calls(
    jobs: list[CallJob],
    *,
    encoder: AgentEncoder,
    engine: Engine,
    turn: int,
    seeds: list[int],
    version: int,
    st: RolloutStats,
) -> tuple[list[CallResult], float]:
    """Serve ``jobs`` (one turn's valid calls; ``seeds``: each one's sub-agent seed). Returns
    a result per job, in order, and the seconds the step took (each calling episode's
    ``tool_s``). Counts planner runs, views (``crops``), sub-agent engine calls and their
    times in ``st``."""
    acfg = encoder.cfg.agent
    t0 = time.perf_counter()
    views, runs, sources = encoder.decode_views([(j.call, j.sample.video, j.meta) for j in jobs])
    st.planner_runs += runs
    results = [CallResult() for _ in jobs]
    ok: list[int] = []
    for i, v in enumerate(views):
        if isinstance(v, ToolFailure):
            results[i] = CallResult(v.status, "", v.error, v.detail or v.error, stage=0)
        else:
            ok.append(i)
    # ONE pixel pack for every view of every rollout in this turn.
    clips = encode_frames_batch(
        encoder.bundle,
        [views[i] for i in ok],  # type: ignore[misc]
        [sources[i] for i in ok],
    )
    nframes = {i: int(views[i][0].shape[0]) for i in ok}  # type: ignore[index]
    if acfg.crop_mode == "frames":  # the view itself is the tool response: no sub-agent
        for i, clip in zip(ok, clips):
            results[i].response = f"{nframes[i]} frames of this window are shown above."
            results[i].clip = clip
        st.crops += len(ok)
        dt_tool = time.perf_counter() - t0
        st.crop_s += dt_tool
        return results, dt_tool
    sub_ctx: list[tuple[int, Context]] = []
    for i, clip in zip(ok, clips):
        ctx = encoder.sub_context(jobs[i].sample, jobs[i].call, clip)
        if isinstance(ctx, ToolFailure):  # the tool's instruction raised or was no text
            results[i] = CallResult(ctx.status, "", ctx.error, ctx.detail or ctx.error, stage=0)
        else:
            sub_ctx.append((i, ctx))
    st.crops += len(sub_ctx)
    dt_tool = time.perf_counter() - t0

    reqs = [
        ctx.request(
            encoder.sampling(seeds[i], sub=True),
            f"{jobs[i].uid}:t{turn}:c{jobs[i].index}",
        )
        for i, ctx in sub_ctx
    ]
    # A sub-agent request must fit the engine's context too (vLLM fails the whole call
    # otherwise): its summary is cut to what fits; a view whose prompt leaves no room
    # becomes that call's error.
    limit = context_limit(engine)
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
            engine, [reqs[j] for j in send], encoder.tokenizer, stop_ids=set(encoder.stop_ids)
        ),
    ):
        outcomes[j] = o
    dt_sub = time.perf_counter() - t0
    st.sub_engine_calls += 1 if send else 0
    st.crop_s += dt_tool  # plan + decode + encode of the views
    st.sub_gen_s += dt_sub
    for (i, ctx), req, o in zip(sub_ctx, reqs, outcomes):
        assert o is not None
        job, res = jobs[i], results[i]
        if o.error:
            res.status, res.error, res.detail = "sub_agent_error", o.error, o.error
        else:
            res.response = o.summary
        if o.result is None or o.error:
            continue  # nothing usable to train on
        ids, lps, _ = encoder.cut_visual(list(o.result.token_ids), list(o.result.logprobs))
        if ids:
            ctx.check_special_tokens(req.request_id)
            ctx.add_generated(ids, lps, version)
            res.sub = ctx.to_trajectory(
                uid=req.request_id,
                role="sub",
                sample_id=job.sample.id,
                group_id=job.group,
                prompt_len=len(req.prompt_ids),
                parent=job.uid,
                num_frames=nframes[i],
                turns=[Turn(encoder.decode_text(ids), finish_reason=o.result.finish_reason)],
                answer_text=o.summary,
                temperature=req.sampling.temperature,
                top_p=req.sampling.top_p,
            )
    return results, dt_tool + dt_sub
