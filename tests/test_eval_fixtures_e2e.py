"""Every benchmark end to end on fixture files in its on-disk format: the adapters read them,
the real agent loop runs (real H.264 decoding, real crops, the tiny model's tokenizer and
vision layout), a scripted engine gives known answers, and ``summary.json`` is exactly what the
script implies (hand-computed below, not by ``summarize``)."""

from __future__ import annotations

import json

import pytest
from eval_fixtures import expected_samples, write_benchmark

from paravt.agent import AgentRunner
from paravt.config import load_config
from paravt.engines.engine import GenerationResult
from paravt.engines.oracle import OracleMainEngine
from paravt.eval.benchmarks import BENCHMARKS, load_benchmark
from paravt.eval.runner import EvalSettings, run_eval
from paravt.models import load_model

CROP = '<tool_call>\n{"name": "crop_video", "arguments": {"start_time": 1, "end_time": 5}}\n</tool_call>'
BAD_JSON = "<tool_call>\n{not json\n</tool_call>"


def call_then(answer: str, call: str = CROP) -> list[str]:
    return [
        f"I should look closer.\n</think>\n{call}",
        f"Seen.\n</think>\n<answer>{answer}</answer>",
    ]


def direct(answer: str) -> list[str]:
    return [f"Clear from the overview.\n</think>\n<answer>{answer}</answer>"]


class _SubAgents:
    """Sub-agents always say the same thing (the main agents' script decides the scores)."""

    def __init__(self, tok) -> None:
        self.ids = tok.encode("A person near a door at 3 s.", add_special_tokens=False)
        self.ids.append(tok.convert_tokens_to_ids("<|im_end|>"))
        self.calls = 0

    def generate(self, requests):
        self.calls += 1
        return [
            GenerationResult(list(self.ids), [0.0] * len(self.ids), "stop", r.request_id)
            for r in requests
        ]

    def sync_weights(self, model):
        return None


@pytest.fixture(scope="module")
def tiny(assets):
    return load_model(assets["model"], dtype="float32", device="cpu")


def _run(tiny, name, root, script, out):
    cfg = load_config("tiny_cpu", overrides=["video.crop_max_frames=4"])
    records = {
        sid: {"turns": [{"role": "assistant", "content": t} for t in turns]}
        for sid, turns in script.items()
    }
    subs = _SubAgents(tiny.tokenizer)
    engine = OracleMainEngine(subs, tiny.tokenizer, records, cfg.agent.think_prefix)
    settings = EvalSettings(name, str(root), "tiny", "hf", 4, "subagent", 0.0, 1.0, 0.0, 3, 5, 256)
    samples = load_benchmark(name, root)
    summary = run_eval(
        samples, AgentRunner(engine, tiny, cfg), out, settings, batch_size=2, show_progress=False
    )
    saved = json.loads((out / "summary.json").read_text())
    assert saved.pop("settings")["benchmark"] == name
    assert saved == {k: v for k, v in summary.items() if k != "settings"}
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [s.id for s in samples]
    return saved, {r["id"]: r for r in rows}, subs


def test_videomme_exact_summary(tiny, tmp_path):
    write_benchmark("videomme", tmp_path / "data")
    script = {
        "001-1": call_then("C"),  # correct after one crop
        "001-2": direct("The answer is D"),  # wrong (gold B)
        "002-1": call_then("no idea", BAD_JSON),  # a malformed call, then no letter
        "003-1": direct("D"),  # never runs: its video is missing
    }
    summary, rows, subs = _run(tiny, "videomme", tmp_path / "data", script, tmp_path / "out")
    assert summary == {
        "benchmark": "videomme",
        "n": 4,
        "n_errors": 1,
        "n_unparseable": 1,
        "metric": "accuracy",
        "score": 0.25,
        "accuracy": 0.25,
        "by_category": {
            "domain": {
                "Film & Television": {"n": 1, "score": 0.0},
                "Knowledge": {"n": 2, "score": 0.5},
                "Sports Competition": {"n": 1, "score": 0.0},
            },
            "duration": {
                "long": {"n": 1, "score": 0.0},
                "medium": {"n": 1, "score": 0.0},
                "short": {"n": 2, "score": 0.5},
            },
            "sub_category": {
                "Basketball": {"n": 1, "score": 0.0},
                "Humanity & History": {"n": 2, "score": 0.5},
                "Movie & TV Show": {"n": 1, "score": 0.0},
            },
            "task_type": {
                "Action Recognition": {"n": 1, "score": 0.0},
                "Counting Problem": {"n": 1, "score": 1.0},
                "Information Synopsis": {"n": 1, "score": 0.0},
                "Temporal Reasoning": {"n": 1, "score": 0.0},
            },
        },
        "tools": {
            "tool_call_rate": 0.5,
            "calls_per_sample": 0.5,
            "calls_ok_per_sample": 0.25,
            "call_format_error_rate": 0.5,
            "turns_per_sample": 1.25,
        },
    }
    assert rows["003-1"]["error"].startswith("video not found: ")
    assert rows["001-1"]["trace"][0]["calls"][0]["status"] == "ok"
    assert rows["001-1"]["trace"][0]["calls"][0]["response"] == "A person near a door at 3 s."
    assert rows["002-1"]["trace"][0]["calls"][0]["status"] == "bad_json"
    assert rows["001-2"]["parsed"] == "D" and rows["001-2"]["correct"] is False
    assert subs.calls == 1  # one batched sub-agent call for the one valid crop


def test_charades_exact_summary(tiny, tmp_path):
    write_benchmark("charades_sta", tmp_path / "data")
    script = {
        # gold 1.2998046875-4.69921875 (float16 as stored): exact window after a crop -> IoU 1
        "3MSZA#0": call_then("1.2998046875-4.69921875"),
        "3MSZA#1": direct("0 - 1.25"),  # gold 0.0-2.5 -> IoU exactly 0.5 (counts for R@0.5)
        "ZZZ99#2": direct("10-15"),  # its video is missing: IoU 0, in the denominator
    }
    summary, rows, _ = _run(tiny, "charades_sta", tmp_path / "data", script, tmp_path / "out")
    assert summary == {
        "benchmark": "charades_sta",
        "n": 3,
        "n_errors": 1,
        "n_unparseable": 0,
        "metric": "mIoU",
        "score": 0.5,
        "mIoU": 0.5,
        "R@0.3": 0.666667,
        "R@0.5": 0.666667,
        "R@0.7": 0.333333,
        "by_category": {},
        "tools": {
            "tool_call_rate": 0.333333,
            "calls_per_sample": 0.333333,
            "calls_ok_per_sample": 0.333333,
            "call_format_error_rate": 0.0,
            "turns_per_sample": 1.0,
        },
    }
    assert rows["3MSZA#1"]["iou"] == 0.5 and rows["3MSZA#0"]["iou"] == 1.0


def _gold(e: dict) -> str:
    qt = e.get("question_type", "mcq")
    return f"{e['event_start']}-{e['event_end']}" if qt == "tvg" else e["answer"]


@pytest.mark.parametrize("name", [b for b in BENCHMARKS if b not in ("videomme", "charades_sta")])
def test_every_benchmark_scores_a_gold_script(tiny, tmp_path, name):
    """Every runnable sample answers its gold answer (the first one after a crop): the score is
    exactly the share of samples whose video exists, and each category counts its rows."""
    write_benchmark(name, tmp_path / "data")
    expected = expected_samples(name, tmp_path / "data")
    runnable = [e for e in expected if not e.get("video_missing")]
    script = {e["id"]: direct(_gold(e)) for e in runnable}
    script[runnable[0]["id"]] = call_then(_gold(runnable[0]))
    summary, rows, _ = _run(tiny, name, tmp_path / "data", script, tmp_path / "out")
    n, ok = len(expected), len(runnable)
    assert summary["n"] == n and summary["n_errors"] == n - ok
    assert summary["n_unparseable"] == 0
    assert summary["score"] == round(ok / n, 6)
    for e in expected:
        assert rows[e["id"]]["score"] == (0.0 if e.get("video_missing") else 1.0), e["id"]
    for cat, groups in summary["by_category"].items():
        labels = [
            lab
            for e in expected
            for lab in (
                e["categories"][cat]
                if isinstance(e["categories"].get(cat), list)
                else [e["categories"].get(cat) or "(none)"]
            )
        ]
        assert {k: g["n"] for k, g in groups.items()} == {k: labels.count(k) for k in set(labels)}
    assert summary["tools"]["calls_ok_per_sample"] == round(1 / n, 6)


def test_a_forced_answer_is_scored_with_its_forced_tag(tiny, tmp_path):
    """After the last tool round the loop forces "...</think>\\n<answer>" (mask 0): the answer
    block spans forced and generated text and must score (tvg: from the answer block only)."""
    write_benchmark("charades_sta", tmp_path / "data")
    crop = call_then("")[0]
    script = {"3MSZA#0": [crop, crop, "1.2998046875-4.69921875</answer>"], "3MSZA#1": [crop]}
    summary, rows, _ = _run(tiny, "charades_sta", tmp_path / "data", script, tmp_path / "out")
    (r0, r1) = rows["3MSZA#0"], rows["3MSZA#1"]
    assert r0["trace"][-1]["forced_answer"] and r0["turns"] == 3 and r0["calls_ok"] == 2
    assert r0["iou"] == 1.0 and r0["source"] == "answer_block"
    assert "<answer>1.2998046875-4.69921875</answer>" in r0["prediction"]
    # The other sample calls a crop every turn and then repeats it in the forced answer.
    assert r1["trace"][-1]["forced_answer"] and r1["unparseable"] and r1["iou"] == 0.0
    assert summary["mIoU"] == round(1 / 3, 6)


def test_a_limited_rerun_keeps_the_other_rows(tiny, tmp_path):
    write_benchmark("videomme", tmp_path / "data")
    script = {"001-1": direct("C"), "001-2": direct("B"), "002-1": direct("A")}
    out = tmp_path / "out"
    full, _, _ = _run(tiny, "videomme", tmp_path / "data", script, out)
    assert full["n"] == 4
    cfg = load_config("tiny_cpu")
    settings = EvalSettings("videomme", str(tmp_path / "data"), "tiny", "hf", 4, "subagent", 0.0, 1.0, 0.0, 3, 5, 256)  # fmt: skip
    samples = load_benchmark("videomme", tmp_path / "data")[:2]

    class Never:
        def generate(self, requests):
            raise AssertionError("finished samples must not run again")

    summary = run_eval(samples, AgentRunner(Never(), tiny, cfg), out, settings, show_progress=False)
    assert summary["n"] == 2 and summary["accuracy"] == 1.0
    kept = [json.loads(x)["id"] for x in (out / "results.jsonl").read_text().splitlines()]
    assert kept == ["001-1", "001-2", "002-1", "003-1"]  # this run's first, then the others
