"""Fuzz: a plug-in tool whose every method raises or returns garbage, and plug-in reward terms
that fail (issue 66 items 2 and 6, the plug-in surface).

A tool is code the project does not control. Whatever one of its methods does — raise any
exception, return ``None``, a string, a float tensor, 10,000 frames, a 1 MB instruction, a
lone surrogate, another file's frames — the rollout finishes, the ``crop_video`` call beside it
is served, and only the plug-in's call fails, as a ``tool_error`` whose short error the model
reads, counted by tool in the step's metrics. On the main of issue 66 ``check``, ``label`` and
``instruction`` raised out of the rollout (killing the run), and garbage reached the pixel
pack or the tokenizer.
"""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch
from agent_plugins import ZoomFrame
from test_agent_loop import (  # noqa: F401  (bundle: the module's fixture)
    ScriptedEngine,
    _call,
    _check_token_exact,
    bundle,
)

from paravt.agent import AgentRunner
from paravt.agent.crop import CROP
from paravt.agent.tools import MAX_INSTRUCTION_CHARS, ToolBox, ToolFailure
from paravt.config import load_config
from paravt.metrics import rollout_metrics, trajectory_record
from paravt.rewards import score_groups
from paravt.types import FrameRequest, Sample

HUGE = "x" * (1 << 20)  # 1 MB of text
LONE = "half \ud83d of a pair"


class _Boom(Exception):
    pass


RAISES = [
    ValueError("bad"),
    KeyError("start"),
    ZeroDivisionError(),
    RecursionError("deep"),
    _Boom("x" * 5000),  # a long message: the model reads a short one
    AssertionError(),
]


def _raise(e: BaseException):
    def f(*a, **k):
        raise e

    return f


def _returns(v):
    return lambda *a, **k: v


def _check_garbage():
    def bad_status(self, call, args, duration):
        call.status = "exploded"

    def huge_error(self, call, args, duration):
        call.status, call.error = "bad_arguments", HUGE

    def none_error(self, call, args, duration):
        call.status, call.error = "bad_range", None

    def lone_error(self, call, args, duration):
        call.status, call.error = "bad_range", LONE

    return [bad_status, huge_error, none_error, lone_error]


def _plan_garbage(video_of):
    return [
        _returns(None),
        _returns("frames please"),
        _returns(FrameRequest("/etc/passwd", (1.0,), None)),
        lambda self, call, video, *a: FrameRequest(video, tuple(float(i) for i in range(10_000))),
        lambda self, call, video, *a: FrameRequest(video, (), None),
        _returns(ToolFailure("ok", "not a failure")),  # type: ignore[arg-type]
        _returns(ToolFailure("exploded", "x")),  # type: ignore[arg-type]
    ]


def _view_garbage():
    def frames(t=1, h=32, w=32, dtype=torch.uint8, c=3):
        return torch.zeros(t, h, w, c, dtype=dtype)

    return [
        _returns(None),
        _returns((frames(),)),
        _returns((frames(dtype=torch.float32), [1.0])),
        _returns((frames()[0], [1.0])),
        _returns((frames(c=4), [1.0])),
        _returns((frames(t=10_000, h=32, w=32), [1.0] * 10_000)),
        _returns((frames(h=4096, w=4096), [1.0])),
        _returns((frames(h=33), [1.0])),
        _returns((frames(), [1.0, 2.0])),
        _returns((frames(), [math.nan])),
        _returns((frames(), ["soon"])),
        _returns((frames(), None)),
    ]


def _text_garbage():
    return [_returns(None), _returns(42), _returns(HUGE), _returns(LONE), _returns(b"bytes")]


def _cases():
    out = []
    for method in ("check", "plan", "view", "instruction", "label"):
        for e in RAISES:
            out.append((method, _raise(e), f"raise-{type(e).__name__}"))
    out += [("check", f, f"garbage-{f.__name__}") for f in _check_garbage()]
    out += [("plan", f, f"garbage-{i}") for i, f in enumerate(_plan_garbage(None))]
    out += [("view", f, f"garbage-{i}") for i, f in enumerate(_view_garbage())]
    for m in ("instruction", "label"):
        out += [(m, f, f"garbage-{i}") for i, f in enumerate(_text_garbage())]
    return out


CASES = _cases()


def _zoom(t, x0, y0, x1, y1) -> str:
    args = {"time": t, "x0": x0, "y0": y0, "x1": x1, "y1": y1}
    return (
        "<tool_call>\n" + json.dumps({"name": "zoom_frame", "arguments": args}) + "\n</tool_call>"
    )


def test_every_tool_method_raising_or_returning_garbage_fails_only_its_call(
    bundle,  # noqa: F811
    make_clip,
) -> None:
    video = make_clip(duration=20.0)
    cfg = load_config("tiny_cpu")
    zoom = ZoomFrame()  # patched per case: one runner, one tool box
    turn0 = "Both.\n</think>\n" + _call(2, 6) + "\n" + _zoom(5.0, 0.0, 0.0, 0.5, 0.5)
    eng = ScriptedEngine(
        bundle.tokenizer, lambda u, t: [turn0, "Seen.\n</think>\n<answer>B</answer>"][t]
    )
    runner = AgentRunner(eng, bundle, cfg, tools=ToolBox([CROP, zoom]))
    sample = Sample("qa", video, "Which shape appears?", "B", "mcq")
    rng = random.Random(0)
    for (method, fault, label), seed in zip(CASES, itertools.count()):
        setattr(zoom, method, fault.__get__(zoom))  # bound: a broken method of this tool
        eng.requests.clear()
        eng.turn.clear()
        try:
            done = runner.rollout([sample], [rng.choice([2, 4])], group_size=1, seed=seed)
            (g,) = done.groups
        finally:
            delattr(zoom, method)
        where = f"{method} {label}"
        (t,) = g.trajectories
        crop, call = t.turns[0].calls
        assert crop.status == "ok" and crop.response, where
        assert call.name == "zoom_frame" and call.status == "tool_error", (where, call.status)
        assert call.error.startswith(f"the zoom_frame tool failed ({method}: "), (where, call.error)
        assert len(call.error) < 400, (where, len(call.error))
        call.error.encode("utf-8")  # no lone surrogate reaches the model's text
        assert any("tool_error" in e for e in t.errors), where
        assert done.stats.calls["tool_error"] == 1, where
        assert len(t.turns) == 2, where  # the episode went on to its answer
        # No sub-agent request carried a 1 MB instruction (the 40 GB batch of issue 66).
        subs = [r for b in eng.requests for r in b if eng.is_sub(r)]
        assert subs and all(len(r.prompt_ids) < 4 * MAX_INSTRUCTION_CHARS for r in subs), where
        _check_token_exact(t, eng)
        text = bundle.tokenizer.decode(t.tokens[t.prompt_len :])
        assert f"Error: the zoom_frame tool failed ({method}:" in text, where
        score_groups([g], cfg.reward)  # neither paid nor penalised: a system failure
        assert t.reward_breakdown["n_system_errors"] == 1.0, where
        m = rollout_metrics([trajectory_record(t, 4)])
        assert m["tool_errors/zoom_frame"] == 1.0 and "tool_errors/crop_video" not in m, where


# --------------------------------------------------------------------------- reward terms
def _term_raises(traj, sample):
    raise RuntimeError("the term's bug")


def _term_nan(traj, sample):
    return math.nan


def _term_str(traj, sample):
    return "1.0"


def _term_huge_int(traj, sample):
    return 10**400


def _term_ok(traj, sample):
    return 0.25


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        ("_term_raises", "raised RuntimeError: the term's bug"),
        ("_term_nan", "returned nan, not a finite number"),
        ("_term_str", "returned str, not a float"),
        ("_term_huge_int", "past a float's range"),
    ],
)
def test_a_failing_reward_term_scores_zero_for_that_rollout_with_a_named_error(
    fn: str, why: str
) -> None:
    """Issue 66 item 2: a term that raises or returns no finite number is a named error of the
    trajectory and scores 0 there (the chosen rule: its other rewards stand); counted as
    ``reward/term_errors``. On main: the exception ended the run."""
    from paravt.types import Group, Trajectory, Turn

    cfg = load_config(
        "tiny_cpu",
        overrides=[
            f'reward.extra_terms=[{{fn: "test_fuzz_plugins:{fn}", weight: 2.0}}, '
            '{fn: "test_fuzz_plugins:_term_ok", weight: 1.0}]'
        ],
    )
    traj = Trajectory("m", "main", "q", 0, [1], [0], [0.0], 1, turns=[Turn("<answer>B</answer>")])
    g = Group(Sample("q", "v.mp4", "q?", "B", "mcq"), 0, 4, [traj])
    score_groups([g], cfg.reward)
    b = traj.reward_breakdown
    assert b[fn] == 0.0 and b["_term_ok"] == 0.25 and b["term_errors"] == 1.0
    assert b["total"] == pytest.approx(b["acc"] + cfg.reward.w_fmt * b["fmt"] + b["tool"] + 0.25)
    (err,) = traj.errors
    assert err.startswith(f"reward term {fn!r} ") and why in err, err
    assert err.endswith("; it scores 0 for this rollout"), err
    assert rollout_metrics([trajectory_record(traj, 4)])["reward/term_errors"] == 1.0
