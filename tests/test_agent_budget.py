"""A hostile turn can neither blow a tool turn's token budget nor send a request past the
engine's context (issue 27, item 1).

Before: every call past ``agent.max_parallel`` got its own error response (a 224-token turn of
74 minimal calls appended ~1,960 tokens), the pre-run context check did not count them, and the
next main-agent request passed vLLM's ``max_model_len``: vLLM raised out of ``rollout`` and the
training step died. Now a tool turn appends at most ``context.tool_turn_max_tokens`` tokens,
and a request that would not fit ends its episode with a counted status instead.
"""

from __future__ import annotations

import json
import random

import pytest
from test_agent_hostile import IdEngine, _cfg, _check_trajectory, _hostile_turn

from paravt.agent import AgentRunner
from paravt.agent.context import TextCache, tool_turn_max_tokens
from paravt.engines.engine import GenerationRequest, GenerationResult, context_limit
from paravt.engines.hf import HFEngine
from paravt.models import build_tiny_checkpoint, load_model
from paravt.models.tiny import QWEN_SPECIAL, TAG_TOKENS
from paravt.types import RolloutStats, Sample
from paravt.video import DecodePlanner

N_CALLS = 74  # the turn: 74 minimal calls in ~224 tokens


class ContextError(ValueError):
    """What vLLM raises for a request past its context."""


# The fuzz tests' shapes (here and tests/test_vllm_agent_budget.py): short turns and summaries,
# small frames, so thousands of turns run in seconds.
FUZZ_SETTINGS = {
    "rollout.max_new_tokens": 96,
    "rollout.sub_max_new_tokens": 24,
    "agent.max_tool_response_tokens": 24,
    "video.overview_max_pixels": 64 * 64,
    "video.overview_min_pixels": 32 * 32,
    "video.crop_max_pixels": 32 * 32,
    "video.crop_min_pixels": 32 * 32,
}


def check_fits(r: GenerationRequest, limit: int) -> None:
    """vLLM's rule, strictly: prompt + max_tokens must fit ``max_model_len``."""
    n = len(r.prompt_ids) + r.sampling.max_new_tokens
    if limit and n > limit:
        raise ContextError(
            f"request {r.request_id!r}: prompt {len(r.prompt_ids)} + max_tokens "
            f"{r.sampling.max_new_tokens} = {n} tokens is longer than max_model_len={limit}"
        )


class ScriptedHF:
    """The real ``HFEngine`` behind vLLM's context rule, with each main agent's first turn
    scripted as ``first`` (ids, ``<|im_end|>`` appended)."""

    def __init__(self, real: HFEngine, first: list[int]) -> None:
        self.real, self.first = real, first
        self.max_model_len = real.max_model_len
        self.requests: list[GenerationRequest] = []
        self.seen: set[str] = set()

    def generate(self, requests):
        out = []
        for r in requests:
            check_fits(r, self.max_model_len)
            self.requests.append(r)
            if ":t" in r.request_id or r.request_id in self.seen:
                out += self.real.generate([r])
                continue
            self.seen.add(r.request_id)
            ids = list(self.first)
            out.append(GenerationResult(ids, [-0.1] * len(ids), "stop", r.request_id))
        return out

    def sync_weights(self, model) -> None:
        return None


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return load_model(build_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny"), device="cpu")


def _minimal_calls_turn(text: TextCache, n: int) -> list[int]:
    """``</think>`` then ``n`` calls ``<tool_call>{}</tool_call>`` (tags as single tokens)."""
    tag = text.tokenizer.convert_tokens_to_ids
    call = [tag("<tool_call>")] + text.plain("{}") + [tag("</tool_call>")]
    return text.plain("x") + [tag("</think>")] + call * n + [tag("<|im_end|>")]


def _run(hf, video: str, limit: int, max_turns: int = 1, g: int = 2):
    """One prompt, G=2: turn 0 is the scripted 74-call turn, later turns the tiny model's
    (12 new tokens); the embedded default's response cap (104 tokens), 5 calls a turn."""
    text = TextCache(hf.tokenizer)
    eng = ScriptedHF(HFEngine(hf, max_model_len=limit), _minimal_calls_turn(text, N_CALLS))
    cfg = _cfg(**{"agent.max_turns": max_turns, "agent.max_parallel": 5,
                  "agent.max_tool_response_tokens": 104, "rollout.max_new_tokens": 12})  # fmt: skip
    runner = AgentRunner(eng, hf, cfg, planner=DecodePlanner("pyav", cache_frames=64))
    done = runner.rollout([Sample("q", video, "Which?", "B", "mcq")], [4], group_size=g, seed=0)
    (grp,) = done.groups
    return grp, eng, runner, done


def test_over_limit_calls_share_one_error_and_the_turn_stays_in_budget(hf, make_clip) -> None:
    video = make_clip(duration=20.0, size=(64, 64))
    grp, eng, runner, done = _run(hf, video, limit=0)
    cfg = runner.cfg.agent
    tok = hf.tokenizer
    opn = tok.convert_tokens_to_ids("<tool_response>")
    bound = tool_turn_max_tokens(cfg.max_parallel, cfg.max_tool_response_tokens)
    for t in grp.trajectories:
        calls = t.turns[0].calls
        assert len(calls) == N_CALLS
        assert sum(c.status == "over_parallel_limit" for c in calls) == N_CALLS - 5
        # The tool turn: the forced tokens between turn 0's <|im_end|> and turn 1's prefix.
        gen = [i for i, m in enumerate(t.loss_mask) if m]
        end0 = next(i for i in gen if t.tokens[i] == tok.convert_tokens_to_ids("<|im_end|>"))
        req1 = next(r for r in eng.requests if r.request_id == t.uid and len(r.prompt_ids) > end0)
        prefix = len(runner.text.markup(cfg.think_prefix))
        added = len(req1.prompt_ids) - prefix - (end0 + 1)
        assert added <= bound, f"a tool turn of {N_CALLS} calls appended {added} > {bound}"
        tool = t.tokens[end0 + 1 : end0 + 1 + added]
        assert tool.count(opn) == cfg.max_parallel + 1  # 5 own errors + ONE shared
        shown = tok.decode(tool)
        assert "Error: calls 6-74 were not run: at most 5 tool calls run per turn." in shown
        assert shown.count("at most 5 tool calls") == 1
    assert done.stats.calls["over_parallel_limit"] == 2 * (N_CALLS - 5)  # still counted


def test_request_past_the_context_ends_the_episode_with_a_counted_status(hf, make_clip):
    """The engine raises as vLLM does; the loop never sends it such a request."""
    video = make_clip(duration=20.0, size=(64, 64))
    _, eng0, runner0, _ = _run(hf, video, limit=0, max_turns=2)
    acfg, max_new = runner0.cfg.agent, runner0.cfg.rollout.max_new_tokens
    text = runner0.text
    pre = len(text.markup(acfg.think_prefix))
    fpre = len(text.markup(acfg.think_prefix + acfg.force_answer_text))
    assert fpre > pre
    # Turn 1's prompt (with its tool-turn prefix): the same for both rollouts.
    p1 = len(
        [r for r in eng0.requests if r.request_id == eng0.requests[0].request_id][1].prompt_ids
    )

    # One token short of a tool turn: the answer is forced now, and cut to what fits.
    grp, eng, runner, done = _run(hf, video, limit=p1 + max_new - 1, max_turns=2)
    assert len(eng.requests) == 4
    assert all(len(r.prompt_ids) + r.sampling.max_new_tokens <= eng.max_model_len
               for r in eng.requests)  # fmt: skip
    st = done.stats
    assert (st.context_forced_answers, st.context_cut_answers, st.context_ended) == (
        2, 2, 0,
    )  # fmt: skip
    for t in grp.trajectories:
        assert len(t.turns) == 2 and t.turns[1].forced_answer
        assert t.turns[1].prefix == acfg.think_prefix + acfg.force_answer_text
        assert len(t.tokens) <= eng.max_model_len
        assert any("does not fit the engine's context" in e for e in t.errors)

    # No room for even one token after the forced prefix: the episode ends, unanswered.
    grp, eng, runner, done = _run(hf, video, limit=p1 - pre + fpre, max_turns=2)
    assert len(eng.requests) == 2  # turn 0 only
    st = done.stats
    assert (st.context_forced_answers, st.context_ended) == (2, 2)
    for t in grp.trajectories:
        assert len(t.turns) == 1 and t.turns[0].calls
        assert any("the episode ended without an answer" in e for e in t.errors)


def test_hf_engine_states_its_context(hf) -> None:
    assert context_limit(HFEngine(hf)) == hf.model.config.text_config.max_position_embeddings
    assert context_limit(HFEngine(hf, max_model_len=300)) == 300
    assert context_limit(object()) == 0


# ------------------------------------------------------------------------------------ the fuzz
class LimitEngine(IdEngine):
    """``IdEngine`` under vLLM's rules: a request past ``max_model_len`` (prompt + max_tokens)
    raises, and no output is longer than its ``max_new_tokens``."""

    def __init__(self, tok, main, sub, max_model_len: int) -> None:
        super().__init__(tok, main, sub)
        self.max_model_len = max_model_len

    def generate(self, requests):
        for r in requests:
            check_fits(r, self.max_model_len)
        out = super().generate(requests)
        for r, res in zip(requests, out):
            cap = r.sampling.max_new_tokens
            if len(res.token_ids) > cap:
                res.token_ids, res.logprobs = res.token_ids[:cap], res.logprobs[:cap]
                res.finish_reason = "length"
        return out


def _fuzz_turn(rng: random.Random, text: TextCache, tag: dict[str, int]) -> list:
    """A hostile turn (tests/test_agent_hostile.py) with, often, a long thought first, an
    unclosed ``<think>``/call, and tens of calls past the limit (minimal, valid or broken)."""
    out: list = []
    if rng.random() < 0.3:  # a long thought
        out += text.plain(" ".join(rng.choice(["see", "the", "red", "<think>"])
                                   for _ in range(rng.randint(20, 200))))  # fmt: skip
    turn = _hostile_turn(rng, text, tag)
    cut = bool(turn) and turn[-1] is None
    out += turn[:-1] if cut else turn
    if rng.random() < 0.3:  # many calls: minimal, valid, broken
        for _ in range(rng.randint(6, 80)):
            body = rng.choice(["{}", '{"name": "crop_video", "arguments": {"start_time": 2, '
                               '"end_time": 5}}', "[", '{"name": "x"}'])  # fmt: skip
            out += [tag["<tool_call>"]] + text.plain(body) + [tag["</tool_call>"]]
    if rng.random() < 0.1:
        out += [tag["<tool_call>"]] + text.plain('{"name": "crop_video", "argu')  # unclosed
    return out + [None] if cut else out


def test_fuzz_hostile_turns_never_pass_the_context(make_clip) -> None:
    """2,000 hostile main turns against a small max_model_len under vLLM's rule: no exception
    out of ``rollout``, every request within the limit, and the limit was actually hit."""
    from paravt.models import SpecialTokens, build_tiny_tokenizer
    from paravt.models.loader import ModelBundle
    from paravt.vision.patchify import VisionSpec

    tok = build_tiny_tokenizer(0)
    bundle = ModelBundle(None, tok, VisionSpec(), "", SpecialTokens.from_tokenizer(tok))
    text = TextCache(tok)
    tag = {s: tok.convert_tokens_to_ids(s) for s in QWEN_SPECIAL + TAG_TOKENS}
    special, im_end = {tag[s] for s in QWEN_SPECIAL}, tag["<|im_end|>"]
    video = make_clip(duration=20.0, size=(64, 64), fps=2.0)
    cfg = _cfg(**FUZZ_SETTINGS)
    rng = random.Random(27)
    samples = [Sample("qa", video, "Which shape?", "B", "mcq", options=["a", "b"]),
               Sample("qb", video, "When?", "2-4", "tvg")]  # fmt: skip
    probe = AgentRunner(IdEngine(tok, lambda u, t: [], lambda r: []), bundle, cfg)
    prompt = max(len(c.tokens) for c in probe.encode_overviews(samples, [2, 4]))
    # Room for about two tool turns of a well-behaved agent, far less than a hostile one needs.
    limit = prompt + 3 * cfg.rollout.max_new_tokens + 150
    eng = LimitEngine(
        tok,
        lambda u, t: _fuzz_turn(rng, text, tag),
        lambda r: [] if rng.random() < 0.1 else _fuzz_turn(rng, text, tag),
        limit,
    )
    runner = AgentRunner(eng, bundle, cfg, planner=DecodePlanner("pyav", cache_frames=512))
    main_turns, step = 0, 0
    totals = RolloutStats()
    while main_turns < 2_000:
        n_req = len(eng.requests)
        done = runner.rollout(samples, [2, 4], group_size=32, seed=step)
        groups = done.groups  # must not raise
        step += 1
        new = eng.requests[n_req:]
        main_turns += sum(not eng.is_sub(r) for r in new)
        for r in new:
            assert len(r.prompt_ids) + r.sampling.max_new_tokens <= limit, r.request_id
        for g in groups:
            for t in g.trajectories + g.sub_trajectories:
                _check_trajectory(t, eng, special, im_end)
        totals = totals + done.stats  # as an asynchronous step sums its workers'
    over = totals.calls["over_parallel_limit"]
    print(f"fuzz: {main_turns} main turns, limit {limit}, " + json.dumps(
        {k: getattr(totals, k) for k in ("context_forced_answers", "context_cut_answers",
                                         "context_ended")} | {"over_parallel_limit": over}))  # fmt: skip
    # The limit was reached every way it can be, and each was counted.
    assert totals.context_forced_answers > 0 and totals.context_ended > 0
    assert totals.context_cut_answers > 0 and over > 0


def test_the_pre_run_check_counts_the_tool_turn_bound(hf) -> None:
    """The pre-run context check (``paravt.agent.context.context_budget_errors``) counts each
    tool turn at ``tool_turn_max_tokens`` (what the loop enforces), not ``max_parallel``
    responses (which 74 calls overran)."""
    import re
    from pathlib import Path

    from paravt.agent.context import context_budget_errors

    cfg = _cfg(**{"agent.max_turns": 2, "rollout.max_new_tokens": 224,
                  "agent.max_tool_response_tokens": 104, "rollout.engine": "vllm",
                  "rollout.vllm_max_model_len": 64})  # fmt: skip
    (err,) = context_budget_errors(cfg, Path(hf.path))
    gen = int(re.search(r"plus up to (\d+) generated/tool tokens", err).group(1))
    assert gen == 3 * 224 + 2 * tool_turn_max_tokens(5, 104) == 2176
