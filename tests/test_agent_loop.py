"""The agent loop with a scripted engine: real tokenizer, real H.264 clips, real decoding.

The scripted engine returns fixed texts tokenised with the tiny Qwen3-VL tokenizer and
deterministic per-token log-probs, and records every request, so each test can compare the
context the engine was given with the trajectory token by token.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from paravt.agent import AgentRunner, encode_oracle_sub_trajectories, encode_oracle_trajectory
from paravt.config import load_config
from paravt.engines.engine import GenerationRequest, GenerationResult
from paravt.models import SpecialTokens, build_tiny_tokenizer
from paravt.models.loader import ModelBundle
from paravt.rewards import score_groups
from paravt.types import Sample, Trajectory
from paravt.video import DecodePlanner
from paravt.vision.patchify import VisionSpec

LEN = "[[length]]"  # scripted text marker: finish on the length cap (no <|im_end|>)


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    tok = build_tiny_tokenizer(0)
    return ModelBundle(None, tok, VisionSpec(), "", SpecialTokens.from_tokenizer(tok))


def _call(s, e, name="crop_video") -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": {"start_time": s, "end_time": e}})
        + "\n</tool_call>"
    )


class CountingPlanner(DecodePlanner):
    def __init__(self) -> None:
        super().__init__("pyav", cache_frames=256)
        self.runs: list[int] = []

    def run(self, requests):
        self.runs.append(len(requests))
        return super().run(requests)


class ScriptedEngine:
    """Main agents: ``main(uid, turn) -> text``; sub-agents: ``sub(request) -> text`` (may
    raise). Log-probs are a fixed function of token and position (fake but consistent)."""

    def __init__(self, tok, main: Callable[[str, int], str], sub: Callable | None = None):
        self.tok = tok
        self.main = main
        self.sub = sub or (lambda r: "A shape appears in the clip.")
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")
        self.requests: list[list[GenerationRequest]] = []
        self.results: dict[int, GenerationResult] = {}  # id(request) -> result
        self.turn: Counter[str] = Counter()

    @staticmethod
    def is_sub(r: GenerationRequest) -> bool:
        return ":t" in r.request_id and ":c" in r.request_id

    def generate(self, requests):
        self.requests.append(list(requests))
        out = []
        for r in requests:
            if self.is_sub(r):
                text = self.sub(r)
            else:
                text = self.main(r.request_id, self.turn[r.request_id])
                self.turn[r.request_id] += 1
            length = text.endswith(LEN)
            text = text.removesuffix(LEN)
            ids = self.tok.encode(text, add_special_tokens=False) + (
                [] if length else [self.im_end]
            )
            lps = [-0.01 * (1 + (t * 7 + i) % 50) for i, t in enumerate(ids)]
            res = GenerationResult(ids, lps, "length" if length else "stop", r.request_id, text)
            self.results[id(r)] = res
            out.append(res)
        return out

    def sync_weights(self, model):
        return None


def _cfg(**over):
    ov = [f"{k}={v}" for k, v in over.items()]
    return load_config("tiny_cpu", overrides=ov)


def _check_token_exact(traj: Trajectory, engine: ScriptedEngine, role: str = "main") -> None:
    """Every request for this trajectory is a prefix of its tokens; mask/logprobs exact."""
    reqs = [
        r
        for batch in engine.requests
        for r in batch
        if (r.request_id == traj.uid) and id(r) in engine.results
    ]
    assert reqs, f"no requests recorded for {traj.uid}"
    want_mask = [0] * len(traj.tokens)
    want_lp = [0.0] * len(traj.tokens)
    mm = traj.extras["mm_token_type_ids"]
    assert len(mm) == len(traj.tokens)
    for r in reqs:
        n = len(r.prompt_ids)
        assert traj.tokens[:n] == r.prompt_ids, "engine context differs from trajectory prefix"
        assert mm[:n] == r.extras["mm_token_type_ids"]
        assert torch.equal(r.visuals.pixel_values, traj.visuals.pixel_values)
        assert torch.equal(r.visuals.grid_thw, traj.visuals.grid_thw)
        res = engine.results[id(r)]
        k = len(res.token_ids)
        # What the trajectory kept of the generation (visual-token cuts drop a suffix only).
        assert traj.tokens[n : n + k] == res.token_ids[: len(traj.tokens[n : n + k])]
        for i in range(n, min(n + k, len(traj.tokens))):
            want_mask[i] = 1
            want_lp[i] = res.logprobs[i - n]
    assert traj.loss_mask == want_mask
    assert traj.logprobs == pytest.approx(want_lp)
    assert traj.prompt_len == len(reqs[0].prompt_ids)


OPTS = ["red circle", "blue square", "green star", "white ring"]


def _samples(video: str) -> list[Sample]:
    return [
        Sample("qa", video, "Which shape appears?", "B", "mcq", options=OPTS),
        Sample("qb", video, "What shape appears?", "blue square", "oe"),
    ]


# ------------------------------------------------------------------------------- the tests
def test_parallel_mixed_calls_batched_and_token_exact(bundle, make_clip, monkeypatch):
    import paravt.vision.preprocess as pre

    packs: list[int] = []  # clips per pixel pack
    real_pack = pre.pack_pixels
    monkeypatch.setattr(
        pre,
        "pack_pixels",
        lambda crops, *a, **k: packs.append(len(crops)) or real_pack(crops, *a, **k),
    )
    video = make_clip(duration=20.0)
    turn0 = (
        "The shape is probably early.\n</think>\n"
        + _call(2, 6)  # ok
        + '\n<tool_call>\n{"name": crop_video}\n</tool_call>'  # bad json
        + "\n"
        + _call(1, 2, name="zoom")  # unknown tool
        + "\n"
        + _call(15, 40)  # past the end: clamped to [15, duration]
        + "\n"
        + _call(9, 3)  # start >= end
        + "\n"
        + _call(4, 8)  # 6th call: over max_parallel=5
    )
    turn1 = "The crop shows a blue square.\n</think>\n<answer>B</answer>"
    eng = ScriptedEngine(bundle.tokenizer, lambda uid, t: [turn0, turn1][t])
    planner = CountingPlanner()
    cfg = _cfg(**{"agent.max_parallel": 5, "agent.max_turns": 2})
    runner = AgentRunner(eng, bundle, cfg, planner=planner)
    done = runner.rollout(_samples(video), [4, 8], group_size=2, seed=3)
    groups = done.groups

    # ONE main call per turn for all 4 agents of both groups, ONE sub call for all 8 crops.
    kinds = [[eng.is_sub(r) for r in b] for b in eng.requests]
    assert kinds == [[False] * 4, [True] * 8, [False] * 4]
    # ONE planner run for both overviews, ONE for all 8 crop windows.
    assert planner.runs == [2, 8]
    # ONE native pixel pack for both overviews, ONE for all 8 crops.
    assert packs == [2, 8]
    assert [g.num_frames for g in groups] == [4, 8]
    duration = runner.meta(video).duration
    for g in groups:
        assert len(g.trajectories) == 2 and len(g.sub_trajectories) == 4
        for t in g.trajectories:
            calls = t.turns[0].calls
            assert [c.status for c in calls] == [
                "ok",
                "bad_json",
                "unknown_tool",
                "ok",
                "bad_range",
                "over_parallel_limit",
            ]
            assert (calls[0].start, calls[0].end) == (2.0, 6.0)
            assert (calls[3].start, calls[3].end) == (15.0, duration)
            assert calls[0].response == "A shape appears in the clip."
            assert not t.turns[1].calls and t.turns[1].forced_answer is False
            _check_token_exact(t, eng)
            # One <tool_response> per call, in call order, errors visible to the model.
            text = bundle.tokenizer.decode(t.tokens[t.prompt_len :])
            assert text.count("<tool_response>") == 6
            order = [text.index(s) for s in ("[2.0-6.0 s]", "not valid JSON", "unknown tool")]
            assert order == sorted(order)
            assert f"[15.0-{duration:.1f} s]" in text and "at most 5 tool calls" in text
            assert len(t.errors) == 4
        for s in g.sub_trajectories:
            assert s.role == "sub" and s.parent in {t.uid for t in g.trajectories}
            _check_token_exact(s, eng)
            assert s.num_frames >= 2
            prompt = bundle.tokenizer.decode(s.tokens[: s.prompt_len])
            assert g.sample.question in prompt  # sub_agent_include_question default on
    st = done.stats
    assert st.calls["ok"] == 8 and st.calls["bad_json"] == 4 and st.crops == 8
    assert st.main_engine_calls == 2 and st.sub_engine_calls == 1
    score_groups(groups, cfg.reward)
    ga, gb = groups
    assert ga.trajectories[0].reward_breakdown["acc"] == 1.0
    assert ga.trajectories[0].reward_breakdown["n_ok"] == 2.0
    assert ga.sub_trajectories[0].reward == ga.trajectories[0].reward


def test_sub_agent_failures_become_error_responses(bundle, make_clip, caplog):
    video = make_clip(duration=20.0)
    turn0 = "Look.\n</think>\n" + _call(1, 5) + "\n" + _call(6, 9) + "\n" + _call(10, 14)

    def sub(r: GenerationRequest) -> str:
        if r.request_id.endswith(":c0"):
            raise TimeoutError("sub-agent timed out")
        if r.request_id.endswith(":c1"):
            return "  "  # blank summary
        return "Long summary " * 40 + LEN  # cut by the length cap (agent.max_tool_response_tokens)

    eng = ScriptedEngine(
        bundle.tokenizer, lambda u, t: [turn0, "ok\n</think>\n<answer>A</answer>"][t], sub
    )
    runner = AgentRunner(eng, bundle, _cfg())
    with caplog.at_level("WARNING", logger="paravt.agent.subagent"):
        done = runner.rollout(_samples(video)[:1], [4], group_size=1, seed=0)
        (g,) = done.groups
    # The batch's own error is reported once, before the one-by-one retries.
    assert "a batch of 3 sub-agent requests failed (TimeoutError" in caplog.text
    (t,) = g.trajectories
    c0, c1, c2 = t.turns[0].calls
    assert c0.status == "sub_agent_error" and "TimeoutError: sub-agent timed out" in c0.error
    assert c1.status == "sub_agent_error" and "empty summary" in c1.error
    assert c2.status == "ok"
    assert c2.response.startswith("Long summary")
    # In the context, the summary's response is cut to the token budget with a visible marker.
    tok = bundle.tokenizer
    opn, cls = (tok.convert_tokens_to_ids(x) for x in ("<tool_response>", "</tool_response>"))
    starts = [i for i, x in enumerate(t.tokens) if x == opn]
    ends = [i for i, x in enumerate(t.tokens) if x == cls]
    assert len(starts) == len(ends) == 3
    shown = t.tokens[starts[2] + 1 : ends[2]]
    assert len(shown) - 2 == runner.cfg.agent.max_tool_response_tokens  # minus the 2 "\n"
    text = tok.decode(shown).strip()
    head = text.removesuffix(" [truncated]")
    assert head != text and head.startswith("[10.0-14.0 s] Long summary")
    assert ("[10.0-14.0 s] " + c2.response).startswith(head)  # a prefix of the summary, cut
    assert done.stats.truncated_responses == 1
    # The batch raised, so each request was retried alone (3 single calls).
    assert [len(b) for b in eng.requests] == [1, 3, 1, 1, 1, 1]
    # The run continued to the answer; only the good sub-agent has a trajectory.
    assert len(t.turns) == 2 and "<answer>A</answer>" in t.answer_text
    assert [s.uid for s in g.sub_trajectories] == [f"{t.uid}:t0:c2"]
    text = bundle.tokenizer.decode(t.tokens[t.prompt_len :])
    assert "Error: the sub-agent failed (TimeoutError" in text
    assert done.stats.calls["sub_agent_error"] == 2 and done.stats.calls["ok"] == 1
    _check_token_exact(t, eng)


def test_forced_answer_after_max_turns_and_length_cut(bundle, make_clip):
    video = make_clip(duration=20.0)
    cfg = _cfg(**{"agent.max_turns": 2})
    # Turn 0 stops on the length cap right after a complete call; turn 1 calls again; the
    # answer is then forced.
    script = ["a\n</think>\n" + _call(1, 3) + LEN, "b\n</think>\n" + _call(3, 5), "B</answer>"]
    eng = ScriptedEngine(bundle.tokenizer, lambda u, t: script[t])
    runner = AgentRunner(eng, bundle, cfg)
    done = runner.rollout(_samples(video)[:1], [4], group_size=1, seed=0)
    (g,) = done.groups
    (t,) = g.trajectories
    assert [x.forced_answer for x in t.turns] == [False, False, True]
    assert t.turns[0].finish_reason == "length"
    assert t.turns[2].prefix == cfg.agent.think_prefix + cfg.agent.force_answer_text
    _check_token_exact(t, eng)
    tok = bundle.tokenizer
    # The forced text sits right before the last generation, with mask 0.
    last_req = eng.requests[-1][0]
    forced_ids = tok.encode(t.turns[2].prefix, add_special_tokens=False)
    n = len(last_req.prompt_ids)
    assert t.tokens[n - len(forced_ids) : n] == forced_ids
    assert t.loss_mask[n - len(forced_ids) : n] == [0] * len(forced_ids)
    # The length-capped turn was closed with a forced <|im_end|> (mask 0) before the tools.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    first_res = eng.results[id(eng.requests[0][0])]
    end0 = len(eng.requests[0][0].prompt_ids) + len(first_res.token_ids)
    assert t.tokens[end0] == im_end and t.loss_mask[end0] == 0
    assert done.stats.forced_answers == 1
    score_groups([g], cfg.reward)
    b = t.reward_breakdown
    assert b["acc"] == 1.0 and b["forced"] == 1.0 and b["flow"] == 0.0 and b["n_ok"] == 2.0


def test_unclosed_final_call_flag(bundle, make_clip):
    video = make_clip(duration=20.0)
    text0 = 'x\n</think>\n<tool_call>\n{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 4}}'
    for allow, want in ((False, "unclosed"), (True, "ok")):
        eng = ScriptedEngine(
            bundle.tokenizer, lambda u, t: [text0 + LEN, "y\n</think>\n<answer>B</answer>"][t]
        )
        cfg = _cfg(**{"agent.allow_unclosed_final_call": allow})
        (g,) = (
            AgentRunner(eng, bundle, cfg)
            .rollout(_samples(video)[:1], [4], group_size=1, seed=0)
            .groups
        )
        assert [c.status for c in g.trajectories[0].turns[0].calls] == [want]
        assert len(g.sub_trajectories) == (1 if allow else 0)


def test_seeds_reproducible_and_bad_video_skipped(bundle, make_clip, tmp_path):
    video = make_clip(duration=20.0)
    missing = str(tmp_path / "missing.mp4")
    samples = [*_samples(video), Sample("gone", missing, "q?", "A", "mcq")]

    def run(seed: int):
        eng = ScriptedEngine(bundle.tokenizer, lambda u, t: "x\n</think>\n<answer>B</answer>")
        r = AgentRunner(eng, bundle, _cfg())
        done = r.rollout(samples, [4, 4, 4], group_size=2, seed=seed)
        return [q.sampling.seed for b in eng.requests for q in b], done.groups, done

    s1, groups, r = run(5)
    s2, _, _ = run(5)
    s3, _, _ = run(6)
    assert s1 == s2 and s1 != s3 and len(set(s1)) == len(s1)
    assert [g.sample.id for g in groups] == ["qa", "qb"]
    assert len(r.errors) == 1 and "gone" in r.errors[0] and "missing.mp4" in r.errors[0]


def test_generated_visual_token_is_cut(bundle, make_clip):
    video = make_clip(duration=20.0)
    eng = ScriptedEngine(bundle.tokenizer, lambda u, t: "so <|video_pad|> then more")
    runner = AgentRunner(eng, bundle, _cfg())
    done = runner.rollout(_samples(video)[:1], [4], group_size=1, seed=0)
    (g,) = done.groups
    (t,) = g.trajectories
    vp = bundle.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert vp not in t.tokens[t.prompt_len :]
    assert t.turns[0].finish_reason == "visual_token" and len(t.turns) == 1
    assert done.stats.visual_token_stops == 1
    _check_token_exact(t, eng)


def test_oracle_trajectory_uses_the_same_context(bundle, make_clip):
    video = make_clip(duration=20.0)
    sample = _samples(video)[0]
    first = "<think>\nLook at two parts.\n</think>\n" + _call(2, 6) + "\n" + _call(6, 10)
    final = "<think>\nCrop 2 shows it.\n</think>\n<answer>B</answer>"
    rec = {
        "sample_id": "qa",
        "num_frames": 4,
        "turns": [
            {"role": "assistant", "content": first},
            {"role": "tool", "content": ["Nothing here.", "A blue square from 7 s to 9 s."]},
            {"role": "assistant", "content": final},
        ],
    }
    cfg = _cfg()
    traj = encode_oracle_trajectory(bundle, cfg, sample, rec, DecodePlanner())
    tok = bundle.tokenizer
    # The RL loop, scripted with the same texts and summaries, builds the same tokens.
    sums = iter(["Nothing here.", "A blue square from 7 s to 9 s."])
    eng = ScriptedEngine(
        tok,
        lambda u, t: [first, final][t].removeprefix(cfg.agent.think_prefix),
        lambda r: next(sums),
    )
    (g,) = AgentRunner(eng, bundle, cfg).rollout([sample], [4], group_size=1, seed=0).groups
    assert traj.tokens == g.trajectories[0].tokens
    assert traj.loss_mask == g.trajectories[0].loss_mask
    assert traj.extras["mm_token_type_ids"] == g.trajectories[0].extras["mm_token_type_ids"]
    assert set(traj.logprobs) == {0.0}
    # Mask-1 tokens are exactly the assistant texts (think prefix excluded) + <|im_end|>.
    gen = tok.decode([x for x, m in zip(traj.tokens, traj.loss_mask) if m])
    assert gen == (first + "<|im_end|>" + final + "<|im_end|>").replace(cfg.agent.think_prefix, "")
    assert [c.response for c in traj.turns[0].calls] == [
        "Nothing here.",
        "A blue square from 7 s to 9 s.",
    ]
    # Sub-agent SFT targets: the RL sub-agent prompt (same crop) + the oracle summary.
    subs = encode_oracle_sub_trajectories(bundle, cfg, sample, traj, DecodePlanner())
    rl_subs = g.sub_trajectories
    assert [s.parent for s in subs] == [traj.uid] * 2
    for s, r in zip(subs, rl_subs):
        assert s.tokens[: s.prompt_len] == r.tokens[: r.prompt_len]
        assert torch.equal(s.visuals.pixel_values, r.visuals.pixel_values)
    assert tok.decode([x for x, m in zip(subs[1].tokens, subs[1].loss_mask) if m]) == (
        "A blue square from 7 s to 9 s.<|im_end|>"
    )
    bad = dict(rec, turns=[rec["turns"][0], {"role": "tool", "content": ["only one"]}])
    with pytest.raises(ValueError, match="qa turn 1: 1 tool summaries for 2 valid calls"):
        encode_oracle_trajectory(bundle, cfg, sample, bad, DecodePlanner())


def test_max_turns_zero_forces_the_first_turn(bundle, make_clip):
    video = make_clip(duration=20.0)
    eng = ScriptedEngine(bundle.tokenizer, lambda u, t: "B</answer>")
    cfg = _cfg(**{"agent.max_turns": 0})
    (g,) = (
        AgentRunner(eng, bundle, cfg).rollout(_samples(video)[:1], [4], group_size=2, seed=0).groups
    )
    for t in g.trajectories:
        assert len(t.turns) == 1 and t.turns[0].forced_answer and not t.turns[0].calls
        _check_token_exact(t, eng)
    assert len(eng.requests) == 1
    score_groups([g], cfg.reward)
    assert g.trajectories[0].reward_breakdown["acc"] == 1.0


def test_crop_decode_error_is_per_call(bundle, make_clip):
    from paravt.video import VideoError

    class FailFirstCrop(DecodePlanner):
        """The real planner, except that the first crop of each run reports a decode error."""

        def run(self, requests):
            out = super().run(requests)
            return [
                VideoError(r.video, "frame 17 is corrupt") if r.tag == "crop:0" else o
                for r, o in zip(requests, out)
            ]

    video = make_clip(duration=20.0)
    turn0 = "Look.\n</think>\n" + _call(1, 5) + "\n" + _call(6, 9)
    eng = ScriptedEngine(
        bundle.tokenizer, lambda u, t: [turn0, "x\n</think>\n<answer>B</answer>"][t]
    )
    runner = AgentRunner(eng, bundle, _cfg(), planner=FailFirstCrop())
    done = runner.rollout(_samples(video)[:1], [4], group_size=1, seed=0)
    (g,) = done.groups
    (t,) = g.trajectories
    c0, c1 = t.turns[0].calls
    assert c0.status == "decode_error" and "frame 17 is corrupt" in c0.error
    assert c1.status == "ok" and len(g.sub_trajectories) == 1
    assert "Error: the crop could not be decoded (frame 17 is corrupt)" in bundle.tokenizer.decode(
        t.tokens
    )
    assert done.stats.calls["decode_error"] == 1 and done.stats.calls["ok"] == 1
    score_groups([g], runner.cfg.reward)
    assert (
        t.reward_breakdown["n_system_errors"] == 1.0 and t.reward_breakdown["n_model_errors"] == 0
    )


def test_rollout_stats_add_up_by_name() -> None:
    """``RolloutStats + RolloutStats`` (an asynchronous step summing its workers): every
    counter and time adds, tool calls add by status and a status counted 0 stays a key; a
    misspelt counter is an error, not a metric that stays 0."""
    from collections import Counter

    from paravt.types import RolloutStats

    a = RolloutStats(episodes=4, crops=3, main_gen_s=1.5, calls=Counter(ok=2, bad_json=1))
    b = RolloutStats(episodes=2, crops=1, main_gen_s=0.25, calls=Counter(ok=1, decode_error=0))
    s = sum((a, b), RolloutStats())
    assert (s.episodes, s.crops, s.main_gen_s) == (6, 4, 1.75)
    assert s.calls == Counter(ok=3, bad_json=1, decode_error=0) and "decode_error" in s.calls
    assert a.calls == Counter(ok=2, bad_json=1)  # the operands are left as they were
    with pytest.raises(AttributeError):
        s.crop  # noqa: B018
