"""An asynchronous run's rollouts travel without their pixels (``paravt.workers.pixels``):
real rollouts of the tiny Qwen3-VL on real H.264 files, with parallel crops (sub-agents, and
``agent.crop_mode=frames``: three clips in one main row), stripped as a worker strips them,
pickled, and restored with a fresh planner as a trainer rank restores them.

* the restored pixels, frames, times and grids are bitwise the worker's, shared as they were
  (a group's G main rows: one overview object), and the overview is decoded once per group;
* what crosses the process boundary is a small fraction of the pixels' bytes;
* a file that decodes differently on the trainer (here: changed since the rollout) drops its
  group with an error naming the file and the fix, and keeps the others;
* a clip with no decode request (a plug-in view that changed its frames) keeps its pixels.

The end-to-end runs (a worker and one or two trainer ranks, behaviour log-probs recomputed on
the restored pixels to 1e-5) are in ``tests/test_train_async.py``.
"""

from __future__ import annotations

import pickle
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from scripted_engine import TWO_CROPS, ScriptedFirstTurn

from paravt.agent import AgentRunner
from paravt.config import load_config
from paravt.data.readers import load_samples
from paravt.engines.hf import HFEngine
from paravt.models import build_tiny_checkpoint, load_model
from paravt.types import Group, Trajectory
from paravt.video import DecodePlanner
from paravt.workers.pixels import restore_pixels, strip_pixels


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    return load_model(path, dtype="float32", device="cpu")


def _rollout(tiny, samples, crop_mode: str = "subagent") -> list[Group]:
    cfg = load_config(
        "tiny_cpu",
        overrides=[
            "rollout.max_new_tokens=6",
            "rollout.sub_max_new_tokens=4",
            "agent.max_turns=1",
            "video.crop_max_frames=4",
            f"agent.crop_mode={crop_mode}",
        ],
    )
    eng = ScriptedFirstTurn(
        HFEngine(tiny, seed=0), TWO_CROPS, lambda m, r, ids: [0.0] * (len(ids) - len(r.prompt_ids))
    )
    return (
        AgentRunner(eng, tiny, cfg)
        .rollout(samples, [8] * len(samples), group_size=2, seed=0)
        .groups
    )


def _rows(groups: list[Group]) -> list[Trajectory]:
    return [t for g in groups for t in (*g.trajectories, *g.sub_trajectories)]


@pytest.mark.parametrize("crop_mode", ["subagent", "frames"])
def test_rows_travel_as_requests_and_come_back_bitwise(tiny, synth_dir, crop_mode) -> None:
    samples = load_samples(synth_dir, split="train")[:2]
    groups = _rollout(tiny, samples, crop_mode)
    rows = _rows(groups)
    assert all(t.visuals is not None for t in rows)
    if crop_mode == "frames":  # the overview and both crops in each main row
        assert {t.visuals.num_segments for g in groups for t in g.trajectories} == {3}
    else:
        assert sum(len(g.sub_trajectories) for g in groups) == 2 * 2 * 2

    wire = strip_pixels(groups)
    assert all(t.visuals is not None for t in _rows(groups))  # the worker's own: unchanged
    sent = _rows(wire)
    assert all(t.visuals is None and t.visual_source is not None for t in sent)
    full, light = len(pickle.dumps(groups)), len(pickle.dumps(wire))
    assert light * 8 < full, (light, full)

    planner = DecodePlanner("pyav")  # a fresh one: another process's cache
    back = pickle.loads(pickle.dumps(wire))
    done = restore_pixels(back, planner, tiny)
    assert done.errors == [] and len(done.groups) == 2
    got = _rows(done.groups)
    for a, b in zip(rows, got):
        va, vb = a.visuals, b.visuals
        assert b.visual_source is None and vb is not None
        assert torch.equal(va.pixel_values, vb.pixel_values), a.uid
        assert torch.equal(va.grid_thw, vb.grid_thw) and va.timestamps == vb.timestamps
        assert all(torch.equal(x, y) for x, y in zip(va.frames, vb.frames))
        assert va.requests is not None and vb.requests is not None
    # Shared as the worker shared them: a group's main rows hold one overview object.
    for g, h in zip(groups, done.groups):
        same = len({id(t.visuals) for t in g.trajectories})
        assert len({id(t.visuals) for t in h.trajectories}) == same
    if crop_mode == "subagent":
        assert same == 1
        # Each distinct clip requested once (an overview once per group, not per row; a
        # group's rows crop the same two windows; two samples may share a file).
        clips = {(r.video, r.timestamps, r.size) for t in rows for r in t.visuals.requests}
        assert planner.stats["requests"] == len(clips) <= 2 + 2 * 2 < len(rows)
        assert planner.stats["frames_requested"] == sum(len(ts) for _, ts, _ in clips)
    assert done.metrics["async/restore_rows"] == len(rows)
    assert done.metrics["async/restore_dropped_groups"] == 0.0


def test_a_file_that_decodes_differently_drops_its_group_naming_the_fix(
    tiny, synth_dir, tmp_path
) -> None:
    rows = load_samples(synth_dir, split="train")
    samples = [rows[0], next(s for s in rows if s.video != rows[0].video)]
    own = []
    for s in samples:  # copies the test may change
        dst = tmp_path / f"{s.id}.mp4"
        shutil.copy(s.video, dst)
        own.append(replace(s, video=str(dst)))
    wire = strip_pixels(_rollout(tiny, own))
    # The first sample's file changes after the rollout: now it holds the second's video.
    shutil.copy(own[1].video, own[0].video)
    done = restore_pixels(wire, DecodePlanner("pyav"), tiny, "trainer rank 1")
    assert [g.sample.id for g in done.groups] == [own[1].id]
    (err,) = done.errors
    assert err.startswith(f"{own[0].id}: its rollouts were dropped")
    assert own[0].video in err and "trainer rank 1" in err
    assert "rollout.async_pixels=ship" in err
    assert done.metrics["async/restore_dropped_groups"] == 1.0
    assert all(t.visuals is not None for t in _rows(done.groups))


def test_a_clip_without_a_request_keeps_its_pixels(tiny, synth_dir) -> None:
    (sample,) = load_samples(synth_dir, split="train")[:1]
    (g,) = _rollout(tiny, [sample])
    sub = g.sub_trajectories[0]
    sub.visuals = replace(sub.visuals, requests=None)  # as a view that changed its frames
    (w,) = strip_pixels([g])
    kept = [t for t in (*w.trajectories, *w.sub_trajectories) if t.visuals is not None]
    assert [t.uid for t in kept] == [sub.uid] and kept[0].visual_source is None
    (h,) = restore_pixels([w], DecodePlanner("pyav"), tiny).groups
    assert all(t.visuals is not None for t in (*h.trajectories, *h.sub_trajectories))


@pytest.mark.parametrize("crop_mode", ["subagent", "frames"])
def test_frames_mode_reencodes_the_workers_frames_bitwise_without_decoding(
    tiny, synth_dir, tmp_path, crop_mode
) -> None:
    """``rollout.async_pixels=frames``: the rows carry their clips' uint8 frames (each clip
    once), the trainer re-encodes them with no decode at all (the video may be gone), and the
    pixels are bitwise the worker's; the wire is well under the pixels' (``ship``)."""
    rows0 = load_samples(synth_dir, split="train")[:2]
    samples = []
    for s in rows0:  # copies the test deletes after the rollout
        dst = tmp_path / f"{s.id}.mp4"
        shutil.copy(s.video, dst)
        samples.append(replace(s, video=str(dst)))
    groups = _rollout(tiny, samples, crop_mode)
    rows = _rows(groups)
    wire = strip_pixels(groups, frames=True)
    sent = _rows(wire)
    assert all(t.visuals is None and t.visual_source.frames is not None for t in sent)
    full, light = len(pickle.dumps(groups)), len(pickle.dumps(wire))
    assert light * 3 < full, (light, full)  # uint8 frames vs float32 patches (and views)
    for s in samples:
        Path(s.video).unlink()  # nothing is decoded again
    planner = DecodePlanner("pyav")
    done = restore_pixels(pickle.loads(pickle.dumps(wire)), planner, tiny)
    assert done.errors == [] and len(done.groups) == 2
    assert planner.stats["requests"] == 0 and planner.stats["frames_decoded"] == 0
    for a, b in zip(rows, _rows(done.groups)):
        va, vb = a.visuals, b.visuals
        assert torch.equal(va.pixel_values, vb.pixel_values), a.uid
        assert torch.equal(va.grid_thw, vb.grid_thw) and va.timestamps == vb.timestamps
        assert all(torch.equal(x, y) for x, y in zip(va.frames, vb.frames))
        assert vb.requests == va.requests
    for g, h in zip(groups, done.groups):  # shared as the worker shared them
        assert len({id(t.visuals) for t in h.trajectories}) == len(
            {id(t.visuals) for t in g.trajectories}
        )
    assert done.metrics["async/restore_clips_sent_as_frames"] > 0
    assert done.metrics["async/restore_frames_decoded"] == 0.0


def test_the_trainers_decode_deadline_is_above_the_workers() -> None:
    """A worker decodes a group's clips of a file in up to 1 + max_turns planner runs, each
    under ``video.decode_timeout_s``; the trainer decodes them in one pass, so its deadline is
    their sum (a trainer deadline at the worker's would drop groups the worker read in time)."""
    from types import SimpleNamespace

    from paravt.workers.pipeline import RolloutPipeline

    cfg = load_config("tiny_cpu", overrides=["video.decode_timeout_s=7", "agent.max_turns=3"])
    deadline = RolloutPipeline.restore_deadline_s.fget(SimpleNamespace(cfg=cfg))
    assert deadline == 4 * 7.0 > cfg.video.decode_timeout_s
