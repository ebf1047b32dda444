"""The agent end to end with the real tiny Qwen3-VL model on the synthetic task.

Checks that trajectories are token-exact *with a real model*: a teacher-forced forward over
each finished trajectory reproduces the engine's behaviour log-probs on every generated token.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from paravt.agent import AgentRunner, encode_oracle_trajectory
from paravt.algo.logprobs import sequence_logprobs
from paravt.config import load_config
from paravt.data.readers import load_samples
from paravt.engines.engine import GenerationRequest
from paravt.engines.hf import HFEngine
from paravt.models import build_tiny_checkpoint, load_model
from paravt.rewards import score, score_groups
from paravt.types import Trajectory
from paravt.video import DecodePlanner
from paravt.vision.preprocess import check_visual_tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    return load_model(path, dtype="float32", device="cpu")


def _cfg():
    return load_config(
        "tiny_cpu",
        overrides=[
            "rollout.max_new_tokens=16",
            "rollout.sub_max_new_tokens=8",
            "agent.max_turns=1",
            "video.crop_max_frames=4",
        ],
    )


def _check_logprobs(bundle, traj: Trajectory, temperature: float, start: int = 0) -> None:
    """Teacher forcing reproduces the behaviour log-probs of the generated tokens from
    position ``start`` on (earlier ones may be scripted)."""
    check_visual_tokens(traj.extras["mm_token_type_ids"], traj.visuals, 2)
    with torch.no_grad():
        lp, _ = sequence_logprobs(
            bundle.model,
            traj.tokens,
            traj.extras["mm_token_type_ids"],
            traj.visuals,
            temperature=temperature,
        )
    m = torch.tensor(traj.loss_mask, dtype=torch.bool)
    m[:start] = False
    assert m.any()
    torch.testing.assert_close(lp[m], torch.tensor(traj.logprobs)[m], atol=2e-4, rtol=0)
    assert all(x == 0.0 for x, k in zip(traj.logprobs, traj.loss_mask) if not k)


def test_tiny_model_rollout_reproducible_and_token_exact(tiny, synth_dir):
    cfg = _cfg()
    samples = load_samples(synth_dir, split="train")[:2]  # one mcq + one oe row
    runs = []
    for _ in range(2):
        runner = AgentRunner(HFEngine(tiny, seed=0), tiny, cfg)
        groups = runner.rollout(samples, [4, 8], group_size=2, seed=11).groups
        score_groups(groups, cfg.reward)
        runs.append(groups)
    g1, g2 = runs
    assert [len(g.trajectories) for g in g1] == [2, 2]
    for a, b in zip(g1, g2):
        assert [t.tokens for t in a.trajectories] == [t.tokens for t in b.trajectories]
        assert [t.reward for t in a.trajectories] == [t.reward for t in b.trajectories]
        for t in a.trajectories:
            assert {"total", "acc", "fmt", "anchor", "tool"} <= set(t.reward_breakdown)
            assert t.num_frames == a.num_frames
            _check_logprobs(tiny, t, cfg.rollout.temperature)
    # A different seed samples differently.
    other = (
        AgentRunner(HFEngine(tiny, seed=0), tiny, cfg)
        .rollout(samples, [4, 8], group_size=2, seed=12)
        .groups
    )
    assert [t.tokens for t in other[0].trajectories] != [t.tokens for t in g1[0].trajectories]


class _ScriptedMainRealSub:
    """Main agents scripted (parallel crops), sub-agents the real tiny model."""

    def __init__(self, bundle, text: str):
        self.real = HFEngine(bundle, seed=0)
        self.tok = bundle.tokenizer
        self.text = text

    def generate(self, requests: list[GenerationRequest]):
        subs = [r for r in requests if ":t" in r.request_id]
        if subs:
            return self.real.generate(requests)
        from paravt.engines.engine import GenerationResult

        ids = self.tok.encode(self.text, add_special_tokens=False) + [
            self.tok.convert_tokens_to_ids("<|im_end|>")
        ]
        return [GenerationResult(ids, [0.0] * len(ids), "stop", r.request_id) for r in requests]

    def sync_weights(self, model):
        return None


def test_real_sub_agents_token_exact(tiny, synth_dir):
    cfg = _cfg()
    (sample,) = load_samples(synth_dir, split="train")[:1]
    calls = "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": "crop_video", "arguments": {"start_time": s, "end_time": e}})
        + "\n</tool_call>"
        for s, e in ((5, 9), (20, 26), (40, 44))
    )
    eng = _ScriptedMainRealSub(tiny, "x\n</think>\n" + calls)
    (g,) = AgentRunner(eng, tiny, cfg).rollout([sample], [4], group_size=2, seed=0).groups
    n_ok = sum(c.status == "ok" for t in g.trajectories for c in t.turns[0].calls)
    assert (
        n_ok + sum(c.status == "sub_agent_error" for t in g.trajectories for c in t.turns[0].calls)
        == 6
    )
    assert len(g.sub_trajectories) >= 1
    for s in g.sub_trajectories:
        assert s.parent in {t.uid for t in g.trajectories} and s.num_frames == 4
        _check_logprobs(tiny, s, cfg.rollout.sub_temperature)


def test_oracle_sft_rows_encode(tiny, synth_dir):
    cfg = _cfg()
    samples = {s.id: s for s in load_samples(synth_dir, split="train")}
    rows = [json.loads(x) for x in (synth_dir / "sft.jsonl").read_text().splitlines()]
    rows = [r for r in rows if len(r["turns"]) == 3 and "-tvg" not in r["sample_id"]][:3]
    assert len(rows) == 3  # oracle rows with crops (tvg answers are scored by overlap)
    planner = DecodePlanner()
    for rec in rows:
        traj = encode_oracle_trajectory(tiny, cfg, samples[rec["sample_id"]], rec, planner)
        assert traj.num_frames == rec["num_frames"]
        assert sum(c.status == "ok" for c in traj.turns[0].calls) == len(rec["turns"][1]["content"])
        check_visual_tokens(traj.extras["mm_token_type_ids"], traj.visuals, 2)
        assert traj.visuals.grid_thw[0, 0] == rec["num_frames"] // 2
        # The oracle is right, well-formed and used its (executed) crops.
        b = score(traj, samples[rec["sample_id"]], cfg.reward)
        assert b["acc"] == 1.0 and b["fmt_base"] == 1.0 and b["flow"] == 1.0
        n_ok = sum(c.status == "ok" for c in traj.turns[0].calls)
        assert b["tool"] == pytest.approx(cfg.reward.tool_bonus - cfg.reward.call_cost * n_ok)


def test_frames_crop_mode_puts_the_crops_in_the_main_context(tiny, synth_dir):
    """``agent.crop_mode=frames`` (the reference evaluation's protocol): each crop's frames go
    into the main agent's tool response, no sub-agent runs, and the next main turn, sampled by
    the real model over three video segments, is token-exact under teacher forcing."""
    from scripted_engine import ScriptedFirstTurn

    cfg = load_config(
        "tiny_cpu",
        overrides=[
            "rollout.max_new_tokens=12",
            "agent.max_turns=1",
            "video.crop_max_frames=4",
            "agent.crop_mode=frames",
        ],
    )
    (sample,) = load_samples(synth_dir, split="train")[:1]
    calls = "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": "crop_video", "arguments": {"start_time": s, "end_time": e}})
        + "\n</tool_call>"
        for s, e in ((5, 9), (20, 26))
    )
    eng = ScriptedFirstTurn(
        HFEngine(tiny, seed=0),
        "x\n</think>\n" + calls,
        lambda model, req, ids: [0.0] * (len(ids) - len(req.prompt_ids)),
    )
    runner = AgentRunner(eng, tiny, cfg)
    done = runner.rollout([sample], [4], group_size=1, seed=0)
    (g,) = done.groups
    (t,) = g.trajectories
    assert g.sub_trajectories == [] and done.stats.sub_engine_calls == 0
    assert done.stats.crops == 2
    assert [c.status for c in t.turns[0].calls] == ["ok", "ok"]
    assert all(c.response == "4 frames of this window are shown above." for c in t.turns[0].calls)
    assert len(t.turns) == 2 and t.visuals is not None and t.visuals.num_segments == 3
    text = tiny.tokenizer.decode(t.tokens, skip_special_tokens=False)
    # Qwen3-VL's video layout: "<t seconds>" text before each temporal patch's vision block.
    assert len(re.findall(r"<tool_response>\n<[\d.]+ seconds><\|vision_start\|>", text)) == 2
    assert "[5.0-9.0 s] 4 frames of this window are shown above.\n</tool_response>" in text
    # The second turn was sampled over the overview AND both crops: teacher forcing agrees.
    last = max(i for i, m in enumerate(t.extras["mm_token_type_ids"]) if m)
    _check_logprobs(tiny, t, cfg.rollout.temperature, start=last)
