"""An asynchronous step's rollouts from a worker to the trainer ranks: with their pixels
(``rollout.async_pixels=ship``) vs as decode requests (``decode``) vs as uint8 frames
(``frames``, the default: only in the HD benchmark at the end, real resolutions at 30 fps),
same groups, same process, one run (CPU).

The groups are built by the agent's own code at the 8B recipe's pixel budgets
(``video.overview_max_pixels`` = ``crop_max_pixels`` = 448 x 448, K = 32 overview frames,
``crop_max_frames`` 16 at 1 fps): per prompt G = 8 main rows sharing one overview and 12 crops
(sub-agent rows) of distinct windows, on real 480 x 640 H.264 files (60 s, 2 fps): the overview
decoded and encoded by ``AgentEncoder.encode_overviews``, the crops by ``decode_views`` and
``encode_frames_batch``, as a rollout does (only the generated text is not sampled: it does not
change what travels). Two prompts, one per trainer rank (two trainer ranks).

The trip, stage by stage, as the processes run it (pickle is what the channels and
``scatter_object_list`` use; the bytes over the wire are not timed, only counted):

* worker: (``decode``: ``strip_pixels``) + pickle its result;
* trainer rank 0: unpickle the result, pickle the share of rank 1 (the scatter);
* trainer rank 1: unpickle its share (``decode``: ``restore_pixels`` with a fresh planner, a
  cold frame cache: the worst case); rank 0 restores its own share the same way, in parallel.

Reported per arm: the bytes that cross processes (worker -> rank 0, rank 0 -> rank 1), the
seconds of each process, and the ratios ``ship / decode`` of the bytes and of trainer rank 0's
seconds (the process every step waits on). On a cluster the bytes also cross the network
(rank 0's NIC carries every worker's results), which this single-process run does not time.

Run: ``pytest bench/test_bench_async_pixels.py --benchmark-only -s``.
"""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path
from typing import Any

import pytest

from paravt.agent.context import Context, encode_frames_batch
from paravt.agent.encoder import AgentEncoder
from paravt.agent.tools import ToolFailure
from paravt.config import load_config
from paravt.data.synth import write_index_clip
from paravt.models import build_tiny_checkpoint, load_model
from paravt.types import Group, RolloutBatch, Sample
from paravt.video import DecodePlanner
from paravt.workers.pixels import compact_pixels, restore_pixels, strip_pixels

G, K, CROPS, CROP_FRAMES, PROMPTS = 8, 32, 6, 8, 2


def _groups(
    tmp: Path,
    *,
    k: int = K,
    crops: int = CROPS,
    crop_frames: int = CROP_FRAMES,
    prompts: int = PROMPTS,
    size: tuple[int, int] = (480, 640),
    duration: float = 60.0,
    fps: float = 2.0,
    gop: int = 12,
    window: float = 8.0,
) -> tuple[list[Group], object]:
    bundle = load_model(build_tiny_checkpoint(tmp / "tiny", seed=0), device="cpu")
    cfg = load_config(
        "tiny_cpu",
        overrides=[
            f"video.overview_max_pixels={448 * 448}",
            f"video.crop_max_pixels={448 * 448}",
            f"video.crop_max_frames={crop_frames}",
            f"agent.max_parallel={crops}",
        ],
    )
    enc = AgentEncoder(bundle, cfg)
    groups = []
    for p in range(prompts):
        video = write_index_clip(tmp / f"v{p}.mp4", duration=duration, fps=fps, gop=gop, size=size)
        s = Sample(f"s{p}", str(video), "What colour?", "A")
        (ctx,) = enc.encode_overviews([s], [k])
        assert isinstance(ctx, Context)
        step = (duration - window - 1) / max(1, crops - 1)
        calls = enc.parse(
            "\n".join(
                '<tool_call>\n{"name": "crop_video", "arguments": {"start_time": '
                f"{step * c + p:.2f}, "
                + f'"end_time": {step * c + p + window:.2f}'
                + "}}\n</tool_call>"
                for c in range(crops)
            ),
            enc.meta(s.video).duration,
        )
        meta = enc.meta(s.video)
        views, _, sources = enc.decode_views([(c, s.video, meta) for c in calls])
        assert not any(isinstance(v, ToolFailure) for v in views)
        clips = encode_frames_batch(bundle, views, sources)  # type: ignore[arg-type]
        mains = [
            ctx.copy().to_trajectory(
                uid=f"{p}:{i}", role="main", sample_id=s.id, group_id=p, prompt_len=0
            )
            for i in range(G)
        ]
        subs = [
            enc.sub_context(s, call, clip).to_trajectory(
                uid=f"{p}:{c % G}:t0:c{c}",
                role="sub",
                sample_id=s.id,
                group_id=p,
                prompt_len=0,
                parent=f"{p}:{c % G}",
            )  # fmt: skip
            for c, (call, clip) in enumerate(zip(calls, clips))
        ]
        groups.append(Group(s, p, k, mains, subs))
    return groups, bundle


def _trip(groups: list[Group], bundle: object, mode: str) -> dict[str, float]:
    """One step's rollouts from the worker to both trainer ranks (see the module docstring)."""
    t0 = time.perf_counter()
    sent = {
        "decode": strip_pixels,
        "frames": lambda gs: strip_pixels(gs, frames=True),
        "ship": compact_pixels,
        "before": list,
    }[mode](groups)
    wire = pickle.dumps({"kind": "groups", "groups": sent})
    t1 = time.perf_counter()
    got = pickle.loads(wire)["groups"]
    share = pickle.dumps(RolloutBatch([g for g in got if g.group_id == 1]))
    t2 = time.perf_counter()
    mine = RolloutBatch([g for g in got if g.group_id == 0])
    other = pickle.loads(share)
    t3 = time.perf_counter()
    out = {}
    for name, b in (("rank0", mine), ("rank1", other)):
        r0 = time.perf_counter()
        if mode in ("decode", "frames"):
            done = restore_pixels(b.groups, DecodePlanner("pyav"), bundle)
            assert not done.errors and all(
                t.visuals is not None
                for g in done.groups
                for t in (*g.trajectories, *g.sub_trajectories)
            )
        out[f"{name}_restore_s"] = time.perf_counter() - r0
    return {
        "worker_to_rank0_mb": len(wire) / 1e6,
        "rank0_to_rank1_mb": len(share) / 1e6,
        "worker_s": t1 - t0,
        # rank 0: receive + scatter + its own share's restore
        "rank0_s": (t2 - t1) + out["rank0_restore_s"],
        "rank1_s": (t3 - t2) + out["rank1_restore_s"],
    }


def _interleaved(
    benchmark: Any, groups: list[Group], bundle: object, modes: tuple[str, ...], rounds: int
) -> dict[str, dict[str, float]]:
    """Each mode's ``_trip`` per round, the modes interleaved (drift hits every arm alike), the
    last mode's first trip timed by ``benchmark``; each arm's mean over the rounds."""
    arms: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(rounds):
        for m in modes:
            if r == 0 and m == modes[-1]:
                arms[m].append(benchmark.pedantic(_trip, args=(groups, bundle, m), rounds=1))
            else:
                arms[m].append(_trip(groups, bundle, m))
    return {a: {k: sum(x[k] for x in xs) / len(xs) for k in xs[0]} for a, xs in arms.items()}


@pytest.mark.benchmark(group="async_pixels")
def test_bench_async_pixels_decode_vs_ship(benchmark, tmp_path) -> None:
    groups, bundle = _groups(tmp_path)
    rows = [t for g in groups for t in (*g.trajectories, *g.sub_trajectories)]
    assert all(t.visuals is not None and t.visuals.requests for t in rows)
    mean = _interleaved(benchmark, groups, bundle, ("before", "ship", "decode"), rounds=3)
    d = mean["decode"]

    def over_decode(s: dict[str, float]) -> dict[str, float]:
        return {
            "bytes_through_rank0": (s["worker_to_rank0_mb"] + s["rank0_to_rank1_mb"])
            / (d["worker_to_rank0_mb"] + d["rank0_to_rank1_mb"]),
            "rank0_s": s["rank0_s"] / d["rank0_s"],
            "rank1_s": s["rank1_s"] / d["rank1_s"],
            "worker_s": s["worker_s"] / d["worker_s"],
        }

    ratios = {f"{a} / decode": over_decode(mean[a]) for a in ("before", "ship")}
    benchmark.extra_info.update({"arms": mean, "ratios": ratios})
    print(
        f"\n{PROMPTS} prompts x G={G}, K={K} overview + {CROPS} crops of {CROP_FRAMES} frames "
        "a group at 448x448 (mean of 3 interleaved rounds):\n"
        + "\n".join(
            f"  {a:<7} {json.dumps({k: round(v, 3) for k, v in m.items()})}"
            for a, m in mean.items()
        )  # fmt: skip
        + "".join(
            f"\n  {name}: " + ", ".join(f"{k} {v:.2f}x" for k, v in r.items())
            for name, r in ratios.items()
        )
    )
    assert ratios["ship / decode"]["bytes_through_rank0"] > 10


@pytest.mark.benchmark(group="async_pixels_hd")
@pytest.mark.parametrize(
    ("size", "duration"),
    [((720, 1280), 120.0), ((1080, 1920), 60.0)],
    ids=["720p-120s", "1080p-60s"],
)
def test_bench_async_pixels_hd_frames_vs_decode(benchmark, tmp_path, size, duration) -> None:
    """Real benchmark clips (30 fps, a keyframe every 2 s, 720p for 2 minutes and 1080p for
    one), one group as the 8B recipe rolls it out at its largest budget: K = 64 overview frames
    and 12 crops of 16 frames (16 s windows at 1 fps), 448 x 448 pixel budgets. The trip of
    ``_trip`` per arm (``ship``: the float pixels; ``decode``: the trainer decodes the clips
    again; ``frames``: the worker's uint8 frames, re-encoded by the trainer without a decode),
    interleaved over 2 rounds; the ratios are against ``decode`` (the default before
    2026-12-07) on the trainer's critical path (rank 0's seconds: receive + restore)."""
    groups, bundle = _groups(
        tmp_path, k=64, crops=12, crop_frames=16, prompts=1, size=size,
        duration=duration, fps=30.0, gop=60, window=16.0,
    )  # fmt: skip
    mean = _interleaved(benchmark, groups, bundle, ("ship", "decode", "frames"), rounds=2)
    d = mean["decode"]
    ratios = {
        f"{a} / decode": {
            "rank0_s": m["rank0_s"] / d["rank0_s"],
            "worker_to_rank0_mb": m["worker_to_rank0_mb"] / d["worker_to_rank0_mb"],
        }
        for a, m in mean.items()
        if a != "decode"
    }
    benchmark.extra_info.update({"arms": mean, "ratios": ratios})
    print(
        f"\n{size[0]}p {duration:.0f} s 30 fps, K=64 + 12 crops x 16 frames, G={G} "
        "(mean of 2 interleaved rounds):\n"
        + "\n".join(
            f"  {a:<7} {json.dumps({k: round(v, 3) for k, v in m.items()})}"
            for a, m in mean.items()
        )  # fmt: skip
        + "".join(
            f"\n  {name}: " + ", ".join(f"{k} {v:.3f}x" for k, v in r.items())
            for name, r in ratios.items()
        )
    )
    # The frames' bytes are between the decode requests' and the float pixels'.
    assert mean["decode"]["worker_to_rank0_mb"] < mean["frames"]["worker_to_rank0_mb"]
    assert mean["frames"]["worker_to_rank0_mb"] * 3 < mean["ship"]["worker_to_rank0_mb"]
