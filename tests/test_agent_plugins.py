"""Plug-ins named by ``module:attr``: a second tool (``tests/agent_plugins.py``'s
``zoom_frame``) beside ``crop_video``, called in parallel in one turn, and a reward term —
through the agent loop with a scripted engine, and through one ``paravt.train`` step."""

from __future__ import annotations

import json

import pytest
import torch
from agent_plugins import ZOOM_SCHEMA, region_pixels
from test_agent_loop import (  # noqa: F401  (bundle: the module's fixture)
    CountingPlanner,
    ScriptedEngine,
    _call,
    _check_token_exact,
    bundle,
)

from paravt.agent import AgentRunner
from paravt.agent.prompts import CROP_VIDEO_SCHEMA
from paravt.agent.tools import load_tools
from paravt.config import ConfigError, load_config
from paravt.rewards import score_groups
from paravt.types import FrameRequest, Sample
from paravt.video import DecodePlanner
from paravt.video.sampling import resize_frames
from paravt.vision.resize import smart_resize

TOOLS = "agent.tools=[paravt.agent.crop:CROP,agent_plugins:ZOOM]"
TERMS = 'reward.extra_terms=[{fn: "agent_plugins:zoom_calls", weight: 0.5}]'


def _zoom(t, x0, y0, x1, y1) -> str:
    args = {"time": t, "x0": x0, "y0": y0, "x1": x1, "y1": y1}
    return (
        "<tool_call>\n" + json.dumps({"name": "zoom_frame", "arguments": args}) + "\n</tool_call>"
    )


def test_two_tools_in_one_turn_and_a_reward_term(bundle, make_clip):  # noqa: F811
    video = make_clip(duration=20.0)
    cfg = load_config("tiny_cpu", overrides=[TOOLS, TERMS, "agent.max_parallel=5"])
    turn0 = "Both.\n</think>\n" + "\n".join(
        [
            _call(2, 6),  # ok
            _zoom(5.0, 0.25, 0.5, 0.75, 1.0),  # ok: the lower middle of the frame at 5 s
            _zoom(5.0, 0.6, 0.0, 0.4, 1.0),  # x0 >= x1
            _zoom(99.0, 0.0, 0.0, 1.0, 1.0),  # after the end
            _call(1, 2, name="pan"),  # unknown tool
        ]
    )
    turn1 = "Seen.\n</think>\n<answer>B</answer>"
    eng = ScriptedEngine(
        bundle.tokenizer,
        lambda u, t: [turn0, turn1][t],
        lambda r: (
            "A zoomed region." if "region x" in bundle.tokenizer.decode(r.prompt_ids) else "A clip."
        ),
    )
    planner = CountingPlanner()
    runner = AgentRunner(eng, bundle, cfg, planner=planner)
    sample = Sample("qa", video, "Which shape appears?", "B", "mcq", options=["a", "b", "c", "d"])
    done = runner.rollout([sample], [4], group_size=2, seed=1)
    (g,) = done.groups

    # Both tools' calls of both rollouts: ONE planner run, ONE sub-agent engine call.
    assert planner.runs == [1, 4]
    assert [[eng.is_sub(r) for r in b] for b in eng.requests] == [
        [False] * 2,
        [True] * 4,
        [False] * 2,
    ]
    for t in g.trajectories:
        calls = t.turns[0].calls
        assert [(c.name, c.status) for c in calls] == [
            ("crop_video", "ok"),
            ("zoom_frame", "ok"),
            ("zoom_frame", "bad_range"),
            ("zoom_frame", "outside_video"),
            ("pan", "unknown_tool"),
        ]
        assert "the tools are crop_video, zoom_frame" in calls[4].error
        assert [c.response for c in calls[:2]] == ["A clip.", "A zoomed region."]
        _check_token_exact(t, eng)
        prompt = bundle.tokenizer.decode(t.tokens[: t.prompt_len])
        assert json.dumps(CROP_VIDEO_SCHEMA) + "\n" + json.dumps(ZOOM_SCHEMA) in prompt
        text = bundle.tokenizer.decode(t.tokens[t.prompt_len :])
        assert "[2.0-6.0 s] A clip." in text
        assert "[zoom 5.0 s, x 0.25-0.75, y 0.5-1] A zoomed region." in text
        assert "need 0 <= x0 < x1 <= 1" in text and "outside the video" in text
    # The zoom's sub-agent saw the region of the frame at 5 s, resized to the crop budget.
    (fb,) = DecodePlanner().run([FrameRequest(video, (5.0,))])
    zoom_call = g.trajectories[0].turns[0].calls[1]
    top, bottom, left, right = region_pixels(zoom_call, fb.frames.shape[1], fb.frames.shape[2])
    region = fb.frames[:1, top:bottom, left:right]
    want = resize_frames(
        region, smart_resize(region.shape[1], region.shape[2], 32, 32 * 32, 32 * 32)
    )
    subs = {
        s.uid.rsplit(":", 1)[1]: s for s in g.sub_trajectories if s.parent == g.trajectories[0].uid
    }
    assert set(subs) == {"c0", "c1"}
    assert torch.equal(subs["c1"].visuals.frames[0], want)
    assert subs["c0"].visuals.frames[0].shape[0] >= 2  # the crop: several frames of its window
    for s in g.sub_trajectories:
        _check_token_exact(s, eng)
    st = done.stats
    assert st.calls["ok"] == 4 and st.crops == 4 and st.sub_engine_calls == 1

    # The reward term: logged under its name, weighted into the total.
    score_groups([g], cfg.reward)
    t = g.trajectories[0]
    b = t.reward_breakdown
    assert b["zoom_calls"] == 1.0
    assert b["total"] == pytest.approx(b["acc"] + cfg.reward.w_fmt * b["fmt"] + b["tool"] + 0.5)
    assert g.sub_trajectories[0].reward == t.reward


def test_a_tool_that_raises_fails_only_its_call(bundle, make_clip, caplog):  # noqa: F811
    """A plug-in whose ``view`` raises (a bug) fails its own call as a ``tool_error`` (issue
    66: was a ``decode_error``, which named no tool); the crop beside it and the episode go on
    (the runner's ``tools`` given directly)."""
    from agent_plugins import ZoomFrame

    from paravt.agent.crop import CROP
    from paravt.agent.tools import ToolBox

    class Broken(ZoomFrame):
        def view(self, call, batch, vcfg, factor):
            raise RuntimeError("boom")

    video = make_clip(duration=20.0)
    turn0 = "Both.\n</think>\n" + _call(2, 6) + "\n" + _zoom(5.0, 0.0, 0.0, 0.5, 0.5)
    eng = ScriptedEngine(
        bundle.tokenizer, lambda u, t: [turn0, "x\n</think>\n<answer>B</answer>"][t]
    )
    cfg = load_config("tiny_cpu")
    runner = AgentRunner(eng, bundle, cfg, tools=ToolBox([CROP, Broken()]))
    sample = Sample("qa", video, "Which shape appears?", "B", "mcq")
    with caplog.at_level("WARNING", logger="paravt.agent.tools"):
        done = runner.rollout([sample], [4], group_size=1, seed=0)
        (g,) = done.groups
    (t,) = g.trajectories
    crop, zoom = t.turns[0].calls
    assert crop.status == "ok" and crop.response
    assert zoom.status == "tool_error"
    assert zoom.error == "the zoom_frame tool failed (view: raised RuntimeError: boom)"
    assert "tool zoom_frame: view raised RuntimeError: boom" in caplog.text
    assert [s.uid for s in g.sub_trajectories] == [f"{t.uid}:t0:c0"]
    assert len(t.turns) == 2 and done.stats.calls["tool_error"] == 1
    _check_token_exact(t, eng)


def test_plugin_config_errors_name_key_problem_and_fix(bundle) -> None:  # noqa: F811
    with pytest.raises(ConfigError, match=r"agent\.tools: 'nope' is not of the form 'module:attr'"):
        load_config("tiny_cpu", overrides=["agent.tools=[nope]"])
    with pytest.raises(ConfigError, match="agent.tools is empty"):
        load_config("tiny_cpu", overrides=["agent.tools=[]"])
    with pytest.raises(ConfigError, match=r"module 'no_such_mod' does not import .*PYTHONPATH"):
        load_tools(["no_such_mod:X"])
    with pytest.raises(ConfigError, match=r"has no attribute 'NOPE'; fix the name"):
        load_tools(["agent_plugins:NOPE"])
    with pytest.raises(ConfigError, match=r"is a int, not a tool"):
        load_tools(["agent_plugins:NOT_A_TOOL"])
    with pytest.raises(ConfigError, match="two tools are named 'crop_video'"):
        load_tools(["paravt.agent.crop:CROP", "paravt.agent.crop:CropVideo"])
    cfg = load_config("tiny_cpu", overrides=["agent.tools=[agent_plugins:NOPE]"])
    with pytest.raises(ConfigError, match="agent_plugins:NOPE"):
        AgentRunner(None, bundle, cfg)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"reward\.extra_terms: two terms are named 'f'"):
        load_config(
            "tiny_cpu",
            overrides=['reward.extra_terms=[{fn: "a:f"}, {fn: "b:f"}]'],
        )
    from paravt.rewards.compose import load_terms
    from paravt.validate import validate_run

    # validate_run (before anything loads) names both broken plug-ins at once.
    cfg = load_config(
        "tiny_cpu",
        overrides=[
            "agent.tools=[paravt.agent.crop:CROP,no_such_mod:ZOOM]",
            'reward.extra_terms=[{fn: "agent_plugins:nope"}]',
            "sft.steps=0",
        ],
    )
    with pytest.raises(ConfigError) as e:
        validate_run(cfg, world_size=1)
    assert "agent.tools: 'no_such_mod:ZOOM': module 'no_such_mod' does not import" in str(e.value)
    assert "reward.extra_terms[0].fn: 'agent_plugins:nope'" in str(e.value)

    bad = load_config(
        "tiny_cpu", overrides=['reward.extra_terms=[{fn: "agent_plugins:zoom_calls", name: acc}]']
    )
    with pytest.raises(
        ConfigError, match=r"reward\.extra_terms\[0\]: the name 'acc' is a built-in"
    ):
        load_terms(bad.reward)
    bad = load_config(
        "tiny_cpu", overrides=['reward.extra_terms=[{fn: "agent_plugins:NOT_A_TOOL"}]']
    )
    with pytest.raises(
        ConfigError, match=r"extra_terms\[0\]\.fn: 'agent_plugins:NOT_A_TOOL' is a int"
    ):
        load_terms(bad.reward)


def test_default_tools_and_terms_are_todays(bundle) -> None:  # noqa: F811
    """The defaults name crop_video alone and no extra term: the prompt is the one-tool prompt
    and the reward keys the built-in ones."""
    from paravt.agent.prompts import system_prompt

    cfg = load_config("tiny_cpu")
    assert cfg.agent.tools == ["paravt.agent.crop:CROP"] and cfg.reward.extra_terms == []
    runner = AgentRunner(ScriptedEngine(bundle.tokenizer, lambda u, t: ""), bundle, cfg)
    assert [t.schema for t in runner.tools.tools.values()] == [CROP_VIDEO_SCHEMA]
    assert system_prompt(5, runner.tools.schemas) == system_prompt(5)


def test_two_tools_through_one_train_step(assets, tmp_path) -> None:
    """One ``paravt.train`` step with both plug-ins: every main agent's first turn calls both
    tools in parallel; the step's metrics log the term and both tools' sub-agents train."""
    from scripted_engine import ScriptedFirstTurn, own_score, scripted_trainer

    from paravt.train import train_step

    tr = scripted_trainer(
        assets,
        str(tmp_path / "run"),
        own_score,
        **{
            "agent.tools": "[paravt.agent.crop:CROP,agent_plugins:ZOOM]",
            "reward.extra_terms": '[{fn: "agent_plugins:zoom_calls", weight: 0.5}]',
            "algo.adv_bias": 0.1,
            "train.log_trajectories": 4,
        },
    )
    calls = _call(5, 9) + "\n" + _zoom(12.0, 0.0, 0.0, 0.5, 0.5)
    tr.runner.engine = ScriptedFirstTurn(tr.engine, "x\n</think>\n" + calls, own_score)
    seen = {}
    real = tr.runner.rollout

    def rollout(*a, **kw):
        seen["done"] = real(*a, **kw)
        return seen["done"]

    tr.runner.rollout = rollout
    m = train_step(tr, 1).metrics
    assert m["reward/zoom_calls"] == 1.0
    # One call of each tool per rollout; each logged call names its tool, and the viewer
    # labels (and colours) its window by it.
    assert (m["tool_calls/crop_video"], m["tool_calls/zoom_frame"]) == (1.0, 1.0)
    tr.logger.log(1, m)
    from paravt.view import load_report, render_trajectory

    rep = load_report(tmp_path / "run")
    assert len(rep.trajectories) == 4
    for t in rep.trajectories:
        assert [(c.tool, c.status) for c in t.calls] == [("crop_video", "ok"), ("zoom_frame", "ok")]
        page = render_trajectory(0, t, {})
        assert 'data-tool="crop_video"' in page and 'data-tool="zoom_frame"' in page
        assert ">crop_video 1</span>" in page and ">zoom_frame 2</span>" in page
    assert torch.isfinite(torch.tensor(m["loss"]))
    for g in seen["done"].groups:
        for t in g.trajectories:
            assert [(c.name, c.status) for c in t.turns[0].calls] == [
                ("crop_video", "ok"),
                ("zoom_frame", "ok"),
            ]
            assert t.reward_breakdown["zoom_calls"] == 1.0
        assert {s.uid.rsplit(":", 1)[1] for s in g.sub_trajectories} == {"c0", "c1"}


_BAD_PLUGINS = """
import copy
from agent_plugins import ZoomFrame, ZOOM_SCHEMA


class NeedsArgs(ZoomFrame):
    def __init__(self, scale):
        self.scale = scale


def _named(name, schema=None):
    t = ZoomFrame()
    t.name = name
    s = copy.deepcopy(ZOOM_SCHEMA)
    s["function"]["name"] = name
    t.schema = schema if schema is not None else s
    return t


EMPTY = _named("")
SPECIAL = _named("<|im_start|>")
SPACED = _named("zoom frame")
_bad = copy.deepcopy(ZOOM_SCHEMA)
_bad["function"]["parameters"]["properties"]["time"]["type"] = "nummber"
BAD_SCHEMA = _named("zoom_frame", _bad)
_nan = copy.deepcopy(ZOOM_SCHEMA)
_nan["function"]["parameters"]["properties"]["time"]["default"] = float("nan")
NAN_SCHEMA = _named("zoom_frame", _nan)
_long = copy.deepcopy(ZOOM_SCHEMA)
_long["function"]["description"] = "look " * 200_000
LONG_SCHEMA = _named("zoom_frame", _long)


def three(traj, sample, extra):
    return 0.0


class TermClass:
    def __init__(self, traj, sample):
        pass
"""


def test_validate_run_refuses_broken_plugins_before_anything_loads(tmp_path, monkeypatch) -> None:
    """Issue 66 item 2: a tool class that needs constructor arguments, a module that raises at
    import, a tool named empty / template-special / with a space, an invalid JSON schema, and
    a reward term that is no plug-in function (``os:getpid``, a class, another arity) are each
    a ConfigError from ``validate_run`` naming the key, the spec and the fix. On main the
    constructor's TypeError and the module's own exception escaped raw, and the names, the
    schema and ``os:getpid`` were accepted."""
    from paravt.validate import validate_run

    (tmp_path / "bad_plugins.py").write_text(_BAD_PLUGINS)
    (tmp_path / "raises_at_import.py").write_text("raise RuntimeError('planted')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def refusal(tools: list[str] | None = None, term: str | None = None) -> str:
        over = ["sft.steps=0"]
        if tools:
            over.append(f"agent.tools=[{','.join(tools)}]")
        if term:
            over.append(f'reward.extra_terms=[{{fn: "{term}"}}]')
        cfg = load_config("tiny_cpu", overrides=over)
        with pytest.raises(ConfigError) as e:
            validate_run(cfg, world_size=1)
        return str(e.value)

    msg = refusal(["bad_plugins:NeedsArgs"])
    assert "agent.tools: 'bad_plugins:NeedsArgs' could not be built with no argument" in msg
    assert "TypeError" in msg and "constructor defaults" in msg
    msg = refusal(["raises_at_import:X"])
    assert "importing module 'raises_at_import' raised RuntimeError: planted" in msg
    assert "fix the module" in msg
    for spec, shown in (("EMPTY", "''"), ("SPECIAL", "'<|im_start|>'"), ("SPACED", "'zoom frame'")):
        msg = refusal([f"bad_plugins:{spec}"])
        assert f"'bad_plugins:{spec}' is named {shown}" in msg, msg
        assert "letters, digits, '_' or '-'" in msg and "rename it" in msg
    msg = refusal(["paravt.agent.crop:CROP", "bad_plugins:BAD_SCHEMA"])
    assert "'bad_plugins:BAD_SCHEMA': its schema's parameters are no valid JSON schema" in msg
    assert "nummber" in msg and "fix the tool's schema" in msg
    assert "schema is not JSON" in refusal(["bad_plugins:NAN_SCHEMA"])
    assert "schema is 1,000,584 characters of JSON, over the 8,192" in refusal(
        ["bad_plugins:LONG_SCHEMA"]
    )
    msg = refusal(term="os:getpid")
    assert "reward.extra_terms[0].fn: 'os:getpid' is a built-in, not a Python function" in msg
    assert "is a class" in refusal(term="bad_plugins:TermClass")
    assert "takes (traj, sample, extra), not (trajectory, sample)" in refusal(
        term="bad_plugins:three"
    )
    # The good ones still pass: the example tool and term of this module.
    cfg = load_config(
        "tiny_cpu",
        overrides=[
            "sft.steps=0",
            "agent.tools=[paravt.agent.crop:CROP,agent_plugins:ZoomFrame]",
            'reward.extra_terms=[{fn: "agent_plugins:zoom_calls"}]',
        ],
    )
    validate_run(cfg, world_size=1)
