"""Issue 66 item 3: a training prompt whose question alone fills the engine's context is
skipped in training and counted (``skipped_context``), as the evaluation makes it an error
row of kind "context". On the main of issue 66 its rows went through every forward of the
update (one such step ran over 10 minutes on a CPU), and no metric said so."""

from __future__ import annotations

import json
import random

from test_train import small_overrides

from paravt.config import load_config
from paravt.metrics import read_metrics


def test_a_prompt_longer_than_the_context_is_skipped_and_counted(assets, tmp_path) -> None:
    from paravt.train import run

    rows = [json.loads(x) for x in open(f"{assets['data']}/train.jsonl")]
    rows = rows[:3]
    # Random letters and spaces: about one token a character to the tiny byte-level BPE,
    # past its 8,192-token context (max_position_embeddings) on its own.
    rng = random.Random(0)
    long_q = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(30_000))
    rows[1] = {**rows[1], "id": "too-long", "question": long_q + "\n" + rows[1]["question"]}
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    over = small_overrides(
        assets,
        out,
        **{
            "data.path": str(data),
            "data.video_root": assets["data"],
            "train.prompts_per_step": 3,
            "train.steps": 1,
            "train.save_every": 0,
            "sft.steps": 0,
        },
    )
    res = run(load_config(overrides=over))
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert row["skipped_context"] == 1.0, row
    assert row["num_groups"] == 2.0 and row["skipped_prompts"] == 1.0
    # What was packed is the two short prompts' rows, nowhere near the long one's 8k tokens.
    assert row["packed_tokens"] < 4 * 2_000, row["packed_tokens"]
    assert res.last["skipped_context"] == 1.0


def test_drop_unfit_prompts_keeps_groups_that_generated() -> None:
    from paravt.train import drop_unfit_prompts
    from paravt.types import Group, RolloutBatch, Sample, Trajectory, Turn

    def traj(uid: str, turns: list, errors: list[str]) -> Trajectory:
        return Trajectory(uid, "main", uid[0], 0, [1], [0], [0.0], 1, turns=turns, errors=errors)

    full = "turn 0: the prompt alone (9000 tokens: the overview frames and the question) ..."
    s1, s2 = Sample("a", "v.mp4", "q", "A"), Sample("b", "v.mp4", "q", "A")
    g_long = Group(s1, 0, 4, [traj("a/0", [], [full]), traj("a/1", [], [full])])
    g_ok = Group(s2, 1, 4, [traj("b/0", [Turn(text="x")], [full])])
    batch = RolloutBatch(groups=[g_long, g_ok])
    assert drop_unfit_prompts(batch) == 1
    assert batch.groups == [g_ok]
    assert batch.errors == [f"sample a: {full} (not trained)"]
