"""The synthetic task's SFT oracle writes only what the model can read, answers right, calls the
tool only when the overview is not enough, and teaches the sub-agents too; the sub-agent summary
check and the clustered interval the evaluation reports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from paravt.config import ConfigError, load_config
from paravt.data.readers import load_samples
from paravt.data.synth import OracleSettings, generate, oracle_settings, summary_correct
from paravt.eval.conditions import eval_conditions
from paravt.metrics import clustered_mean_ci95
from paravt.models import load_model
from paravt.rewards import score
from paravt.sft import encode_records, read_sft_records
from paravt.types import Sample
from paravt.video import DecodePlanner

NUM = re.compile(r"\d+\.\d")


def _cfg(**kv: object) -> object:
    base = {"video.crop_max_frames": 16, "video.frame_budgets": "[4,16]"}
    base.update(kv)
    return load_config("tiny_cpu", overrides=[f"{k}={v}" for k, v in base.items()])


@pytest.fixture(scope="module")
def oracle_task(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    cfg = _cfg()
    root = tmp_path_factory.mktemp("oracle")
    data = generate(root, 4, seed=3, min_duration=50, max_duration=70, oracle=oracle_settings(cfg))
    return data, cfg


@pytest.fixture(scope="module")
def encoded(oracle_task, assets):
    data, cfg = oracle_task
    bundle = load_model(assets["model"], dtype="float32", device="cpu")
    samples = load_samples(data, split="train")
    trajs = encode_records(
        read_sft_records(data / "sft.jsonl"), samples, bundle, cfg, DecodePlanner()
    )
    return bundle, {s.id: s for s in samples}, trajs


def _segments(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_every_number_the_oracle_writes_is_in_the_model_input(encoded) -> None:
    bundle, _, trajs = encoded
    tok = bundle.tokenizer
    roles = {t.role for t in trajs}
    assert roles == {"main", "sub"}, "SFT must teach the sub-agents too"
    checked = 0
    for t in trajs:
        for a, b in _segments(t.loss_mask):
            seen = tok.decode(t.tokens[:a])
            for n in NUM.findall(tok.decode(t.tokens[a:b])):
                if n == "0.0":  # the start of every video: a constant, nothing to read
                    continue
                assert n in seen, f"{t.uid}: writes {n}, which its input never shows"
                checked += 1
    assert checked > 20


def test_oracle_is_right_and_uses_the_tool_only_when_the_overview_is_not_enough(
    encoded, oracle_task
) -> None:
    _, samples, trajs = encoded
    _, cfg = oracle_task
    mains = [t for t in trajs if t.role == "main"]
    by_k: dict[int, list[bool]] = {}
    for t in mains:
        s = samples[t.sample_id]
        b = score(t, s, cfg.reward)
        assert b["fmt_base"] == 1.0, t.uid
        if s.question_type == "tvg":  # the answer is the crops' printed times: overlap only
            assert b["acc"] > 0.0, t.uid
        else:
            assert b["acc"] == 1.0, t.uid
        calls = [c for turn in t.turns for c in turn.calls]
        assert all(c.status == "ok" for c in calls)
        assert len(calls) <= cfg.agent.max_parallel
        by_k.setdefault(t.num_frames, []).append(bool(calls))
    # A 4-frame overview rarely shows the 2-4 s target, a 16-frame one often does: the oracle
    # crops when its overview does not show the target during the cue, and only then.
    rate = {k: sum(v) / len(v) for k, v in by_k.items()}
    assert rate[4] > 0.5 and rate[4] > rate[16], rate
    # Every crop summary the sub-agents learn is right about the target.
    assert_sub_summaries_right(trajs, samples)


def assert_sub_summaries_right(trajs: list, samples: dict) -> None:
    """Every sub-agent row's summary is right about the target of its crop (the call of its
    parent main trajectory that it answers)."""
    mains = {t.uid: t for t in trajs if t.role == "main"}
    for t in trajs:
        if t.role == "sub":
            parent = mains[t.parent]
            call = next(
                c for turn in parent.turns for c in turn.calls if c.response == t.answer_text
            )
            assert summary_correct(t.answer_text, call.start, call.end, samples[t.sample_id])


def test_sft_rows_per_budget_and_regeneration_follows_the_settings(tmp_path) -> None:
    st = OracleSettings(budgets=(4, 8), crop_max_frames=32)
    d = generate(tmp_path, 2, seed=0, min_duration=40, max_duration=40, oracle=st)
    rows = [json.loads(x) for x in (d / "sft.jsonl").read_text().splitlines()]
    train = (d / "train.jsonl").read_text().splitlines()
    assert len(rows) == 2 * len(train) and {r["num_frames"] for r in rows} == {4, 8}
    stamp = (d / "manifest.json").stat().st_mtime_ns
    assert generate(tmp_path, 2, seed=0, min_duration=40, max_duration=40, oracle=st) == d
    assert (d / "manifest.json").stat().st_mtime_ns == stamp  # same settings: no rewrite
    generate(tmp_path, 2, seed=0, min_duration=40, max_duration=40, oracle=OracleSettings())
    assert (d / "manifest.json").stat().st_mtime_ns != stamp  # other crops: rewritten


def test_summary_correct() -> None:
    s = Sample(
        "x", "v.mp4", "q", "A", event_start=20.0, event_end=23.0, extra={"target": "red circle"}
    )
    assert summary_correct("A red circle appears at 21.4 s while it is blue.", 10, 30, s)
    assert not summary_correct("A red circle appears at 41.4 s.", 10, 30, s)  # wrong time
    assert not summary_correct("A red square appears at 21.4 s.", 10, 30, s)  # wrong shape
    assert not summary_correct("Nothing notable happens.", 10, 30, s)  # missed it
    assert summary_correct("A cyan square appears.", 30, 50, s)  # outside: must not name it
    assert not summary_correct("A red circle appears at 35.0 s.", 30, 50, s)  # invented
    assert summary_correct("anything", 0, 5, Sample("y", "v", "q", "A")) is None


def test_clustered_interval() -> None:
    mu, half = clustered_mean_ci95([1, 1, 0, 0, 1, 0], ["a", "a", "b", "b", "c", "c"])
    assert mu == pytest.approx(0.5)  # prompt means 1, 0, 0.5
    assert half == pytest.approx(1.96 * 0.5 / 3**0.5)
    assert clustered_mean_ci95([1.0], ["a"])[1] != clustered_mean_ci95([1.0], ["a"])[1]  # nan


def test_eval_conditions_parse_and_fail_clearly() -> None:
    cfg = load_config("tiny_cpu")
    assert eval_conditions(cfg) == [
        ("K4_tools", 4, True, False),
        ("K4_tools_greedy", 4, True, True),
        ("K8_tools", 8, True, False),
        ("K8_tools_greedy", 8, True, True),
        ("K4_notools", 4, False, False),
    ]
    cfg = load_config("tiny_cpu", overrides=["train.eval_conditions=[]", "train.eval_frames=8"])
    assert eval_conditions(cfg) == [("K8_tools", 8, True, False)]
    with pytest.raises(ConfigError, match="train.eval_conditions entry '4:maybe'"):
        load_config("tiny_cpu", overrides=["train.eval_conditions=[4:tools, 4:maybe]"])


def test_vanilla_comparison_shares_the_sft_data() -> None:
    """The default and its vanilla comparison train from the same oracle rows: running one
    never regenerates (overwrites) the other's data folder."""
    a, b = load_config("tiny_cpu"), load_config("tiny_cpu_vanilla")
    assert a.video.gating and not b.video.gating
    assert oracle_settings(a) == oracle_settings(b)
    assert oracle_settings(a).budgets == (4, 8, 16, 32)


def test_mcq_variants_reorder_the_options_of_training_videos_only(tmp_path) -> None:
    d = generate(tmp_path, 5, seed=1, min_duration=40, max_duration=40, mcq_variants=3)
    train = [json.loads(x) for x in (d / "train.jsonl").read_text().splitlines()]
    val = [json.loads(x) for x in (d / "val.jsonl").read_text().splitlines()]
    assert len(train) == 4 * 5 and len(val) == 3  # 4 train videos x (3 mcq + oe + tvg)
    letters = []
    for v in range(4):
        mine = [r for r in train if r["video"].endswith(f"vid_{v:04d}.mp4")]
        mcq = [r for r in mine if r["question_type"] == "mcq"]
        assert [r["id"].rsplit("-", 1)[1] for r in mcq] == ["mcq", "mcq2", "mcq3"]
        assert len({r["target"] for r in mcq}) == 1
        for r in mcq:
            assert r["options"]["ABCD".index(r["answer"])] == r["target"]
            assert "A. " not in r["question"]  # the stem: the prompt lists the options
        assert len({tuple(r["options"]) for r in mcq}) > 1
        letters += [r["answer"] for r in mcq]
    assert len(set(letters)) >= 3
    # One variant is the old layout: the rows of a default generate are a prefix of these.
    d1 = generate(tmp_path / "one", 5, seed=1, min_duration=40, max_duration=40)
    one = [json.loads(x) for x in (d1 / "train.jsonl").read_text().splitlines()]
    assert all(r in train for r in one)
    with pytest.raises(ValueError, match="mcq_variants"):
        generate(tmp_path / "bad", 2, mcq_variants=0)
