"""The "spot" task (the embedded default's): one coloured square per video, a fixed-option
colour question, an oracle that answers from the overview when it shows the square (also as a
forced answer) and otherwise crops the whole video in the same equal windows for every video;
its rows encode through the SFT path and score right."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_synth_oracle import assert_sub_summaries_right

from paravt.agent.prompts import question_text
from paravt.config import ConfigError, load_config
from paravt.data.readers import load_samples
from paravt.data.sft_records import sft_jsonl
from paravt.data.synth import SPOT_COLOURS, generate, oracle_settings
from paravt.eval.benchmarks import load_benchmark
from paravt.models import load_model
from paravt.rewards import score
from paravt.sft import encode_records, lr_factor, read_sft_records
from paravt.video import DecodePlanner


def _cfg(**kv: object) -> object:
    # The oracle's own records (no colour-swapped copies, whose answers are not the video's),
    # the optimal oracle's (no guesses, no crops the overview did not need).
    base = {"video.frame_budgets": "[4,32]", "video.fixed_frames": 32,
            "data.synth_colour_swaps": 0, "data.synth_call_share_missed": 1.0,
            "data.synth_call_share_seen": 0.0}  # fmt: skip
    base.update(kv)
    return load_config("tiny_cpu", overrides=[f"{k}={v}" for k, v in base.items()])


@pytest.fixture(scope="module")
def spot(tmp_path_factory: pytest.TempPathFactory, assets):
    cfg = _cfg()
    root = tmp_path_factory.mktemp("spot")
    data = generate(
        root, 5, seed=4, min_duration=40, max_duration=40, oracle=oracle_settings(cfg), task="spot"
    )
    bundle = load_model(assets["model"], dtype="float32", device="cpu")
    samples = load_samples(data, split="train")
    records = read_sft_records(data / "sft.jsonl")
    trajs = encode_records(records, samples, bundle, cfg, DecodePlanner())
    return data, cfg, bundle, {s.id: s for s in samples}, records, trajs


def test_spot_rows_ask_the_colour_with_fixed_capital_options(spot) -> None:
    data, *_ = spot
    train = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    val = [json.loads(x) for x in (data / "val.jsonl").read_text().splitlines()]
    assert len(train) == 4 and len(val) == 1  # one question per video, 1 of 5 held out
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["params"]["task"] == "spot"
    for r, plan in zip(train + val, manifest["videos"]):
        assert plan["cue"] is None and plan["distractors"] == []
        colour = plan["target"]["colour"]
        assert r["answer"] == "ABCD"[SPOT_COLOURS.index(colour)]
        assert r["options"] == [c.upper() for c in SPOT_COLOURS]
        assert r["target"] == f"{colour} square"
    # The prompt lists the options once, and no lower-case colour word: the only one the main
    # agent reads is a sub-agent's. `python -m paravt.eval --benchmark synth` asks exactly what
    # training asked (a tiny model answers another wording with garbage).
    (s,) = load_samples(data, split="val")
    (b,) = load_benchmark("synth", data)
    text = question_text(s, 40.0)
    assert text == question_text(b, 40.0)
    assert text.count(f"A. {SPOT_COLOURS[0].upper()}") == 1
    assert not any(f" {c}" in text for c in SPOT_COLOURS)


def test_spot_oracle_is_right_and_crops_the_same_windows_for_every_video(spot) -> None:
    _, cfg, bundle, samples, records, trajs = spot
    mains = [t for t in trajs if t.role == "main"]
    assert len(mains) == len(records)
    windows: set = set()
    by_k: dict[int, dict[str, int]] = {}
    for t in mains:
        s = samples[t.sample_id]
        b = score(t, s, cfg.reward)
        assert b["acc"] == 1.0, t.uid
        calls = [c for turn in t.turns for c in turn.calls]
        assert all(c.status == "ok" for c in calls)
        if calls:
            windows.add(tuple((c.start, c.end) for c in calls))
        kind = "forced" if t.turns[0].forced_answer else "tool" if calls else "direct"
        by_k.setdefault(t.num_frames, {"forced": 0, "tool": 0, "direct": 0})[kind] += 1
        if kind == "forced":
            # The forced prefix is the agent loop's own, and never a target.
            assert t.turns[0].prefix == cfg.agent.think_prefix + cfg.agent.force_answer_text
            assert t.answer_text == f"{s.answer}</answer>"
            target = [x for x, m in zip(t.tokens, t.loss_mask) if m]
            assert bundle.tokenizer.decode(target) == f"{s.answer}</answer><|im_end|>"
        else:
            assert b["fmt_base"] == 1.0, t.uid
    n = cfg.agent.max_parallel
    assert windows == {tuple((40.0 * j / n, 40.0 * (j + 1) / n) for j in range(n))}
    # 32 overview frames (1.25 s apart) always show the 4-6 s square: no crop, and a forced
    # twin of every direct answer; 4 frames (10 s apart) mostly miss it.
    assert by_k[32] == {"forced": 5 - 1, "tool": 0, "direct": 4}
    assert by_k[4]["forced"] == by_k[4]["direct"] and by_k[4]["tool"] >= 2
    assert_sub_summaries_right(trajs, samples)


def test_spot_config_is_validated() -> None:
    cfg = load_config("tiny_cpu")
    assert cfg.data.synth_task == "spot" and cfg.sft.schedule == "cosine"
    with pytest.raises(ConfigError, match="data.synth_task='clue'"):
        load_config("tiny_cpu", overrides=["data.synth_task=clue"])
    with pytest.raises(ConfigError, match="synth_min_duration=5"):
        load_config("tiny_cpu", overrides=["data.synth_min_duration=5"])
    with pytest.raises(ConfigError, match="task 'cue'"):
        load_config("tiny_cpu", overrides=["data.synth_task=cue", "data.synth_min_duration=20"])
    with pytest.raises(ValueError, match="task 'dot'"):
        generate(Path("/nonexistent"), 1, task="dot")


def test_sft_lr_schedule() -> None:
    assert lr_factor("constant", 7, 10) == 1.0
    assert lr_factor("cosine", 0, 10) == pytest.approx(1.0)
    assert lr_factor("cosine", 5, 10) == pytest.approx(0.55)
    assert lr_factor("cosine", 10, 10) == pytest.approx(0.1)
    assert all(lr_factor("cosine", i, 9) >= lr_factor("cosine", i + 1, 9) for i in range(9))
    assert not math.isnan(lr_factor("cosine", 0, 0))
    with pytest.raises(ValueError, match="sft.schedule='step'"):
        lr_factor("step", 0, 1)


def test_colour_swapped_copies_train_the_main_agent_only(tmp_path, spot) -> None:
    """``data.synth_colour_swaps=3``: each tool record gets 3 copies naming each other colour
    in every summary, the final thought and the answer; they encode as main trajectories only
    (their summaries are not what the crops show), and score right against their own letter."""
    _, _, bundle, _, _, _ = spot
    cfg = _cfg(**{"data.synth_colour_swaps": 3})
    data = generate(
        tmp_path, 5, seed=4, min_duration=40, max_duration=40, oracle=oracle_settings(cfg),
        task="spot",
    )  # fmt: skip
    records = read_sft_records(data / "sft.jsonl")
    # The typed records write back the file they were read from, byte for byte (main-only
    # copies, forced-answer twins and tool rounds all in it).
    assert sft_jsonl(records) == (data / "sft.jsonl").read_text()
    assert any(t.forced for r in records for t in r.turns)
    plain = [r for r in records if not r.main_only]
    swapped = [r for r in records if r.main_only]
    tools = [r for r in plain if len(r.turns) == 3]
    assert tools and len(swapped) == 3 * len(tools)
    for r in tools:
        copies = [s for s in swapped if s.sample_id == r.sample_id
                  and s.num_frames == r.num_frames]  # fmt: skip
        answers = {c.turns[2].content[-10] for c in copies} | {r.turns[2].content[-10]}
        assert answers == set("ABCD")  # every colour once: the truth and its 3 swaps
        for c in copies:
            letter = c.turns[2].content[-10]
            colour = SPOT_COLOURS["ABCD".index(letter)]
            named = [s for s in c.turns[1].content if "Nothing" not in s]
            assert named and all(f"A {colour} square" in s for s in named)
            assert f"A {colour} square appears." in c.turns[2].content
            assert c.turns[0] == r.turns[0]  # the same calls
    samples = load_samples(data, split="train")
    trajs = encode_records(records, samples, bundle, cfg, DecodePlanner())
    n_sub = sum(t.role == "sub" for t in trajs)
    plain_trajs = encode_records(plain, samples, bundle, cfg, DecodePlanner())
    assert n_sub == sum(t.role == "sub" for t in plain_trajs) > 0
    assert sum(t.role == "main" for t in trajs) == len(records)


def test_oracle_call_shares_decide_where_the_cold_start_calls(tmp_path) -> None:
    """``data.synth_call_share_missed`` / ``_seen`` (the embedded default's 0.25 / 0.25):
    every (row, K) gets both kinds of record in that ratio of first turns, so the cold start
    learns the probability in each context instead of a per-video choice. Missed overview: a
    tool record and its 3 colour-swapped copies (4 first turns that call) and 12 guesses, each
    colour 3 times (a uniform guess). Seen overview: 3 direct answers and 1 record that crops
    anyway (main agent only), plus the forced twin. Calling and not calling differ first at
    one word of the first thought. 1.0 / 0.0 (the base default) is the optimal oracle,
    unchanged."""
    over = {"data.synth_colour_swaps": 3, "video.frame_budgets": "[4,8,16,32]"}
    cfg = _cfg(**over, **{"data.synth_call_share_missed": 0.25, "data.synth_call_share_seen": 0.25})
    data = generate(
        tmp_path / "a", 12, seed=3, min_duration=60, max_duration=60,
        oracle=oracle_settings(cfg), task="spot",
    )  # fmt: skip
    rows = {r.id: r for r in load_samples(data, split="train")}
    kinds: dict[tuple[str, int], list[tuple[str, str]]] = {}
    for r in read_sft_records(data / "sft.jsonl"):
        if r.forced:
            continue
        row = rows[r.sample_id]
        first = r.turns[0].content
        if row.extra[f"need_K{r.num_frames}"]:
            assert first.startswith("<think>\nThe overview shows no shape; I will ")
            kind = "guess" if "I will guess." in first else "call"
        else:
            assert first.startswith(f"<think>\nThe overview shows a {row.extra['target']}")
            kind = "call" if "; I will look at the whole video." in first else "answer"
            if kind == "call":  # the crops name the truth: the answer is the row's
                assert r.main_only and r.turns[2].content.endswith(f"<answer>{row.answer}</answer>")
        assert (kind == "call") == (len(r.turns) == 3)
        kinds.setdefault((r.sample_id, r.num_frames), []).append((kind, r.turns[-1].content[-10]))
    need = seen = 0
    for (sid, k), ks in kinds.items():
        names = sorted(kd for kd, _ in ks)
        if rows[sid].extra[f"need_K{k}"]:
            need += 1
            assert names == ["call"] * 4 + ["guess"] * 12
            guessed = sorted(letter for kd, letter in ks if kd == "guess")
            assert guessed == sorted("ABCD" * 3)  # every colour equally often
        else:
            seen += 1
            assert names == ["answer"] * 3 + ["call"]
    assert need and seen
    # The optimal oracle (the base defaults): always crop when missed, never when seen.
    data = generate(
        tmp_path / "b", 12, seed=3, min_duration=60, max_duration=60,
        oracle=oracle_settings(_cfg(**over)), task="spot",
    )  # fmt: skip
    for r in read_sft_records(data / "sft.jsonl"):
        assert "guess" not in r.turns[0].content
        assert r.forced or rows[r.sample_id].extra[f"need_K{r.num_frames}"] == (len(r.turns) == 3)
