"""The tasks whose need for the tool the overview hides (the collapse experiment's, protocol
3). "spot_decoy": the "spot" square shows a wrong colour in exactly the frames of the K = 32
overview in some videos. "spot_late": a spot square and, in some videos, a brief later square;
the question asks for the last one. Each row records, per K, whether the K-frame overview
misses the square asked about (``need_K*``), checked here against the real H.264 frames the
overview and the crops decode; the oracle writes no record where the need is hidden."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from paravt.config import load_config
from paravt.data.readers import load_samples
from paravt.data.synth import (
    COLOUR_RGB,
    NEED_BUDGETS,
    SPOT_COLOURS,
    generate,
    oracle_settings,
)
from paravt.models import load_model
from paravt.rewards import score
from paravt.sft import encode_records, read_sft_records
from paravt.video import DecodePlanner, crop_timestamps, overview_timestamps, stream_index
from paravt.video.planner import decode

N_VIDEOS = 10


def _cfg() -> object:
    over = {
        "video.frame_budgets": "[4,32]",
        "video.fixed_frames": 32,
        "video.crop_fps": 2.0,
        "video.crop_max_frames": 64,
        "data.synth_task": "spot_late",
        # The collapse protocols' oracle (configs/collapse.yaml): no guesses, no crops the
        # overview did not need.
        "data.synth_call_share_missed": 1.0,
        "data.synth_call_share_seen": 0.0,
    }
    return load_config("tiny_cpu", overrides=[f"{k}={v}" for k, v in over.items()])


@pytest.fixture(scope="module")
def late(tmp_path_factory: pytest.TempPathFactory):
    cfg = _cfg()
    root = tmp_path_factory.mktemp("spot_late")
    data = generate(
        root, N_VIDEOS, seed=3, min_duration=60, max_duration=60, oracle=oracle_settings(cfg),
        val_fraction=0.0, task="spot_late",
    )  # fmt: skip
    return data, cfg


def _shows(frames: np.ndarray, colour: str) -> bool:
    """Whether any frame has a block of ``colour`` (the square covers 3/4 of the height)."""
    want = np.array(COLOUR_RGB[colour], np.int16)
    near = (np.abs(frames.astype(np.int16) - want).max(-1) < 40).reshape(len(frames), -1)
    return bool((near.mean(-1) > 0.2).any())


def test_rows_record_the_last_square_and_whether_each_overview_misses_it(late) -> None:
    data, _ = late
    rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    plans = {v["name"]: v for v in json.loads((data / "manifest.json").read_text())["videos"]}
    assert len(rows) == N_VIDEOS - 1  # one held-out video at least
    two = [r for r in rows if r["squares"] == 2]
    assert 0 < len(two) < len(rows)  # both kinds of video occur
    hidden = 0
    for r in rows:
        plan = plans[Path(r["video"]).stem]
        tgt = plan["target"]
        assert r["question"].endswith("What colour is the last one?")
        assert r["answer"] == "ABCD"[SPOT_COLOURS.index(tgt["colour"])]
        if r["squares"] == 2:
            (first,) = plan["distractors"]
            assert first["end"] + 2.0 <= tgt["start"] and tgt["end"] - tgt["start"] == 1.0
            assert first["colour"] != tgt["colour"]
        assert set(r) >= {f"need_K{k}" for k in NEED_BUDGETS}
        meta = stream_index(str(data / r["video"])).meta
        for k in (4, 32):
            # The real frames the overview decodes agree with the generator's record.
            frames = decode(str(data / r["video"]), overview_timestamps(meta, k)).frames.numpy()
            assert r[f"need_K{k}"] == (not _shows(frames, tgt["colour"])), (r["id"], k)
        if r["need_K32"] and r["squares"] == 2:
            frames = decode(str(data / r["video"]), overview_timestamps(meta, 32)).frames.numpy()
            # Hidden need: the overview shows the first square only, as a one-square video.
            assert _shows(frames, plan["distractors"][0]["colour"])
            hidden += 1
    assert hidden >= 1
    assert not any(r["need_K64"] for r in rows if r["squares"] == 1)


def test_oracle_answers_the_last_square_and_writes_nothing_where_the_need_is_hidden(
    late, assets
) -> None:
    from paravt.data.cold_start import all_tool_records

    data, cfg = late
    samples = {s.id: s for s in load_samples(data, split="train")}
    rows = {r["id"]: r for r in map(json.loads, (data / "train.jsonl").read_text().splitlines())}
    plans = {v["name"]: v for v in json.loads((data / "manifest.json").read_text())["videos"]}
    records = read_sft_records(data / "sft.jsonl")
    by = {(r.sample_id, r.num_frames) for r in records}
    missing = {(sid, k) for sid in rows for k in (4, 32) if (sid, k) not in by}
    # No record only where the need is hidden: two squares, the overview misses the last.
    assert missing and all(rows[sid][f"need_K{k}"] and rows[sid]["squares"] == 2
                           for sid, k in missing)  # fmt: skip
    bundle = load_model(assets["model"], dtype="float32", device="cpu")
    trajs = encode_records(records, list(samples.values()), bundle, cfg, DecodePlanner())
    for t in (t for t in trajs if t.role == "main"):
        assert score(t, samples[t.sample_id], cfg.reward)["acc"] == 1.0, t.uid
        calls = [c for turn in t.turns for c in turn.calls]
        if calls and rows[t.sample_id]["squares"] == 2:
            assert "appears last." in t.turns[-1].text
    # The collapse cold start calls at every K; its summaries name both squares in order.
    recs = all_tool_records(data, cfg, [2, 3])
    assert len(recs) == 2 * len(rows)
    for rec in recs:
        r = rows[rec.sample_id]
        first, tool, last = rec.turns
        assert last.content.endswith(f"<answer>{r['answer']}</answer>")
        if r["squares"] == 2:
            plan = plans[Path(r["video"]).stem]
            text = " ".join(tool.content)
            a = text.index(f"A {plan['distractors'][0]['colour']} square appears")
            assert a < text.index(f"A {plan['target']['colour']} square appears")
            assert last.content.startswith(f"<think>\nA {plan['target']['colour']} square "
                                              "appears last.")  # fmt: skip


def test_decoy_rows_show_a_wrong_colour_to_the_k32_overview_only(tmp_path) -> None:
    cfg = load_config("tiny_cpu", overrides=["data.synth_task=spot_decoy"])
    data = generate(
        tmp_path, 12, seed=1, min_duration=60, max_duration=60, oracle=oracle_settings(cfg),
        val_fraction=0.0, task="spot_decoy",
    )  # fmt: skip
    rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    plans = {v["name"]: v for v in json.loads((data / "manifest.json").read_text())["videos"]}
    decoys = [r for r in rows if r["decoy"]]
    assert 0 < len(decoys) < len(rows)
    records = {(r.sample_id, r.num_frames) for r in read_sft_records(data / "sft.jsonl")}
    for r in rows:
        plan = plans[Path(r["video"]).stem]
        tgt, path = plan["target"], str(data / r["video"])
        meta = stream_index(path).meta
        over = decode(path, overview_timestamps(meta, 32)).frames.numpy()
        assert r["need_K32"] == r["decoy"] and r["decoy"] == (plan["decoy"] is not None)
        assert _shows(over, tgt["colour"]) != r["decoy"]  # the K = 32 overview: wrong colour
        # No oracle record where the overview shows the wrong colour.
        assert ((r["id"], 32) in records) != r["decoy"]
        if r["decoy"]:
            assert _shows(over, plan["decoy"])
            # A crop over the square (the crops' 1 frame/s) shows the true colour in most of
            # its frames (a crop frame that is also an overview frame shows the decoy).
            times = crop_timestamps(meta, tgt["start"], tgt["end"], fps=1.0, max_frames=32)
            crop = decode(path, times).frames.numpy()
            true = sum(_shows(f[None], tgt["colour"]) for f in crop)
            assert true > sum(_shows(f[None], plan["decoy"]) for f in crop)
        for k in (4, 16):  # smaller overviews show the truth, or miss the square
            frames = decode(path, overview_timestamps(meta, k)).frames.numpy()
            assert r[f"need_K{k}"] == (not _shows(frames, tgt["colour"])), (r["id"], k)


def test_decoy_share_q_sets_the_decoyed_videos_and_nests() -> None:
    """``data.synth_decoy_share`` (q) reaches the plans: none decoyed at q = 0, every one at
    q = 1, and the videos decoyed at q = 0.25 are decoyed at 0.5 too (one draw per video), so
    a phase diagram over q changes only the share; the manifest records q (a folder made at
    another q is regenerated, not reused)."""
    import random

    from paravt.data.synth import _plan_spot_decoy

    def decoyed(q: float) -> set[int]:
        plans = [
            _plan_spot_decoy(random.Random(f"t:{v}"), f"v{v}", 60, 60, (64, 64), q)
            for v in range(400)
        ]
        return {v for v, p in enumerate(plans) if p.decoy is not None}

    lo, hi = decoyed(0.25), decoyed(0.5)
    assert decoyed(0.0) == set() and decoyed(1.0) == set(range(400))
    assert lo < hi and 0.18 < len(lo) / 400 < 0.32 and 0.42 < len(hi) / 400 < 0.58
    cfg = load_config("tiny_cpu", overrides=["data.synth_decoy_share=0.5"])
    assert cfg.data.synth_decoy_share == 0.5
    with pytest.raises(Exception, match="synth_decoy_share"):
        load_config("tiny_cpu", overrides=["data.synth_decoy_share=1.5"])
    with pytest.raises(ValueError, match="decoy_share"):
        generate("unused", 1, task="spot_decoy", decoy_share=-0.1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spot_need_labels_and_colours_agree_with_the_decoded_frames(tmp_path, seed) -> None:
    """The embedded default's world ("spot", the seeds ``data.synth_seed`` of the 3-seed table
    in docs/default_run.md): each row's ``need_K*`` is what the real decoded overview frames show, the
    square's colour is in the frames during its event and in no frame outside it, and another
    seed draws other videos."""
    data = generate(tmp_path, 4, seed=seed, min_duration=60, max_duration=60, task="spot",
                    val_fraction=0.25)  # fmt: skip
    rows = [json.loads(x) for f in ("train.jsonl", "val.jsonl")
            for x in (data / f).read_text().splitlines()]  # fmt: skip
    plans = {v["name"]: v for v in json.loads((data / "manifest.json").read_text())["videos"]}
    assert len(rows) == 4
    for r in rows:
        tgt = plans[Path(r["video"]).stem]["target"]
        assert r["answer"] == "ABCD"[SPOT_COLOURS.index(tgt["colour"])]
        path = str(data / r["video"])
        meta = stream_index(path).meta
        for k in (4, 8, 32):
            frames = decode(path, overview_timestamps(meta, k)).frames.numpy()
            assert r[f"need_K{k}"] == (not _shows(frames, tgt["colour"])), (seed, r["id"], k)
        inside = decode(path, [tgt["start"] + 0.5, tgt["end"] - 0.5]).frames.numpy()
        outside = decode(path, [tgt["start"] - 1.0, tgt["end"] + 0.5]).frames.numpy()
        assert all(_shows(f[None], tgt["colour"]) for f in inside)
        assert not any(_shows(f[None], c) for f in outside for c in SPOT_COLOURS)
    if seed:
        other = json.loads((data / "manifest.json").read_text())["videos"]
        first = generate(tmp_path / "s0", 4, seed=0, min_duration=60, max_duration=60,
                         task="spot", val_fraction=0.25)  # fmt: skip
        assert json.loads((first / "manifest.json").read_text())["videos"] != other
