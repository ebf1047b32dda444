"""Asynchronous dispatch with one slow worker: group-level (``rollout.dispatch=group``) vs
static slices (``rollout.dispatch=static``, the reference), same config, same machine, one run.

Every arm is ``torchrun --nproc-per-node 3 -m paravt.train rollout.workers=2
rollout.max_staleness=1``: one trainer and two HF rollout workers (one thread each), the tiny
Qwen3-VL untrained (``sft.steps=0``) on the synthetic task, 4 prompts x G=2 a step, one turn
of up to 16 new tokens, no evaluation or checkpoints. Worker 2 is made slow with the test hook
``PARAVT_TEST_SLOW_WORKER=2:s=S`` (it sleeps S seconds after each rollout, before sending it;
S in ``SLOW_S``), worker 1 is not. Under static slices each step waits for worker 2's half; under
group dispatch worker 1 claims the next groups while worker 2 sleeps, and the trainer trains
the first 4 finished groups within η.

Reported: mean ``time/step`` and ``async/trainer_wait_s`` over steps 2..STEPS (step 1 holds the
workers' start), the ratio static / group of each, staleness, drops, and the share of trained
groups that came from the slow worker; the same pair without a slow worker (equal workers)
shows what group dispatch costs when there is nothing to balance.

Run: ``pytest bench/test_bench_dispatch.py --benchmark-only -s``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from paravt.data.synth import generate
from paravt.models import build_tiny_checkpoint

STEPS = 10
SLOW_S = (3.0, 0.5)  # a worker far slower than a step, and one about a step slower


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bench_dispatch")
    data = generate(root / "synth", 2, seed=0, task="cue", min_duration=40.0, max_duration=50.0)
    return {"data": str(data), "model": str(build_tiny_checkpoint(root / "tiny", seed=0)), "root": str(root)}  # fmt: skip


def _arm(assets: dict[str, str], name: str, dispatch: str, slow: float) -> dict[str, float]:
    out = Path(assets["root"]) / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    env.pop("PARAVT_TEST_SLOW_WORKER", None)
    if slow:
        env["PARAVT_TEST_SLOW_WORKER"] = f"2:s={slow}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--standalone",
        "-m", "paravt.train", f"data.synth_dir={assets['data']}", "data.synth_task=cue",
        "data.synth_min_duration=40.0", "data.synth_max_duration=50.0",
        "data.synth_num_videos=2", f"model.tiny_dir={assets['model']}", f"train.out_dir={out}",
        f"train.steps={STEPS}", "train.prompts_per_step=4", "train.save_every=0",
        "train.eval_prompts=0", "train.progress=false", "train.summary_plot=false",
        "train.log_trajectories=0", "sft.steps=0", "rollout.group_size=2",
        "rollout.max_new_tokens=16", "agent.max_turns=1", "rollout.workers=2",
        "rollout.max_staleness=1", f"rollout.dispatch={dispatch}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("kind") == "train"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["num_groups"] == 4 and r["async/staleness_max"] <= 1 for r in rows), name
    steady = rows[1:]
    mean = lambda k: sum(r.get(k, 0.0) for r in steady) / len(steady)  # noqa: E731
    trained = sum(r["num_groups"] for r in steady)
    return {
        "s_per_step": mean("time/step"),
        "trainer_wait_s": mean("async/trainer_wait_s"),
        "staleness_max": max(r["async/staleness_max"] for r in rows),
        "dropped_groups": sum(r["async/dropped_groups"] for r in rows),
        "slow_worker_share": sum(r.get("async/groups_worker_2", 0.0) for r in steady) / trained,
    }


def test_bench_group_dispatch_vs_static_with_a_slow_worker(benchmark, assets):
    arms: dict[str, dict[str, float]] = {}
    for slow in (*SLOW_S, 0.0):
        tag = f"slow {slow:g} s" if slow else "equal"
        arms[f"static, {tag}"] = _arm(assets, f"static_{slow:g}", "static", slow)
        if slow == SLOW_S[0]:
            arms[f"group, {tag}"] = benchmark.pedantic(
                _arm, args=(assets, f"group_{slow:g}", "group", slow), rounds=1, iterations=1
            )
        else:
            arms[f"group, {tag}"] = _arm(assets, f"group_{slow:g}", "group", slow)
    ratios = {}
    for slow in (*SLOW_S, 0.0):
        tag = f"slow {slow:g} s" if slow else "equal"
        a, b = arms[f"static, {tag}"], arms[f"group, {tag}"]
        ratios[tag] = {
            "step_time_static_over_group": a["s_per_step"] / b["s_per_step"],
            # (no ratio where neither arm waits: the workers outrun the trainer)
            "wait_static_over_group": a["trainer_wait_s"] / max(b["trainer_wait_s"], 1e-3)
            if max(a["trainer_wait_s"], b["trainer_wait_s"]) >= 1e-3
            else float("nan"),
        }
    benchmark.extra_info.update({"steps": STEPS, "arms": arms, "ratios": ratios})
    fmt = lambda d: ", ".join(f"{k} {v:.3f}" for k, v in d.items())  # noqa: E731
    lines = [f"  {name:<22} {fmt(a)}" for name, a in arms.items()]
    lines += [
        f"  {tag}: step time static / group {r['step_time_static_over_group']:.2f}x, trainer "
        f"wait static / group {r['wait_static_over_group']:.2f}x (waits floored at 1 ms; nan: "
        "neither waits)"
        for tag, r in ratios.items()
    ]
    print(
        f"\n1 trainer + 2 HF workers (1 thread each), eta=1, 4 prompts x G=2, {STEPS} steps, "
        f"mean over steps 2-{STEPS}; worker 2 sleeps S s after each rollout:\n" + "\n".join(lines)
    )
