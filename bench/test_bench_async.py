"""Asynchronous PARA-GRPO vs synchronous: steps per second, same config, same machine, one run.

Both arms train the embedded default's RL part (preset ``tiny_cpu``: 4 prompts x G=4 per step,
up to 224 new tokens a turn, the tiny Qwen3-VL on the synthetic task) from the same untrained
tiny model (``sft.steps=0``: no cold start, so no tool calls: one 224-token turn per episode;
the mix of generation and update is what matters here), without evaluation or checkpoints:

* synchronous: ``python -m paravt.train`` in one process with every core (``OMP_NUM_THREADS``
  = the machine's cores), generation and update alternating;
* asynchronous: ``torchrun --nproc-per-node 2 -m paravt.train rollout.workers=1
  rollout.max_staleness=1``: one trainer and one rollout worker (HF engine in its own
  process), the cores split between them (one thread each on a 2-core machine).

Throughput is steps / (sum of ``time/step`` over the steps after the first) — the first step
of each arm holds its warm-up. The phase breakdown comes from the same metrics: rollout,
rewards, log-probs, update and weight push of the trainer (for the asynchronous arm ``rollout``
is the trainer's wait for the worker), and the worker's busy / idle time.

It also prints a PROJECTION (not a measurement) for the reference's layout (8 GPUs: 1 rollout
GPU + 7 trainer GPUs, AReaL) from the measured phase shares: see ``projection``.

Run: ``pytest bench/test_bench_async.py --benchmark-only -s``. Target on the 2-core machine:
>= 1.3x.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 8
CORES = os.cpu_count() or 2


def _overrides(root: Path, out: Path) -> list[str]:
    return [
        f"data.synth_dir={root / 'synth'}",
        "data.synth_num_videos=8",
        f"model.tiny_dir={root / 'tiny'}",
        f"train.out_dir={out}",
        f"train.steps={STEPS}",
        "train.save_every=0",
        "train.eval_prompts=0",
        "train.progress=false",
        "train.log_trajectories=0",
        "sft.steps=0",
    ]


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "train"]


def _run(cmd: list[str], threads: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONHASHSEED": "0"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _phases(rows: list[dict]) -> dict[str, float]:
    steady = rows[1:]
    keys = ("time/step", "time/rollout", "time/reward", "time/logprobs", "time/update",
            "time/sync", "async/worker_busy_s", "async/worker_idle_frac")  # fmt: skip
    return {k: sum(r[k] for r in steady) / len(steady) for k in keys if k in steady[0]}


def projection(rollout_s: float, train_s: float, gpus: int = 8) -> dict[str, float]:
    """PROJECTION, not a measurement: a step's time on ``gpus`` GPUs from a measured split of
    one synchronous step into rollout (``rollout_s``) and everything else (``train_s``),
    assuming both scale linearly with the GPUs they get and that the asynchronous schedule
    overlaps them fully (η >= 1). Synchronous colocated: ``(R + U) / gpus``. Disaggregated
    with ``n`` rollout GPUs: ``max(R / n, U / (gpus - n))``; reported for the reference's
    n = 1 (AReaL: 1 inference + 7 FSDP GPUs) and for the best n."""
    sync = (rollout_s + train_s) / gpus

    def disagg(n: int) -> float:
        return max(rollout_s / n, train_s / (gpus - n))

    best = min(range(1, gpus), key=disagg)
    return {
        "speedup_1_plus_7": sync / disagg(1),
        "best_rollout_gpus": float(best),
        "speedup_best_split": sync / disagg(best),
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A fresh folder: the first run writes the synthetic task and the tiny model there."""
    return tmp_path_factory.mktemp("bench_async")


def _async(root: Path, out: Path, workers: int, eta: int) -> None:
    _run(
        [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
            str(1 + workers), "--standalone", "-m", "paravt.train", *_overrides(root, out),
            f"rollout.workers={workers}", f"rollout.max_staleness={eta}",
        ],
        max(CORES // 2, 1),
    )  # fmt: skip


def test_bench_async_vs_sync_steps_per_second(benchmark, root):
    sync_out, async_out, wide_out = root / "sync", root / "async", root / "async_w2"
    _run([sys.executable, "-m", "paravt.train", *_overrides(root, sync_out)], CORES)
    benchmark.pedantic(_async, args=(root, async_out, 1, 1), rounds=1, iterations=1)
    # A second asynchronous layout: two workers (each half of a step's prompts), eta=2.
    _async(root, wide_out, 2, 2)
    s, a, w = (_phases(_rows(o)) for o in (sync_out, async_out, wide_out))
    ratio, ratio_w = s["time/step"] / a["time/step"], s["time/step"] / w["time/step"]
    rollout = s["time/rollout"]
    proj = projection(rollout, s["time/step"] - rollout)
    stale = max(r["async/staleness_max"] for r in _rows(async_out))
    stale_w = max(r["async/staleness_max"] for r in _rows(wide_out))
    benchmark.extra_info.update(
        {
            "steps": STEPS,
            "speedup_async_over_sync": ratio,
            "sync": s,
            "async": a,
            "async_staleness_max": stale,
            "speedup_async_2workers_eta2_over_sync": ratio_w,
            "async_2workers_eta2": w,
            "projection_8gpu": proj,
        }  # fmt: skip
    )
    fmt = lambda d: ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in d.items())  # noqa: E731
    print(
        f"\nasync (1 trainer + HF worker(s), {max(CORES // 2, 1)} thread(s) each) vs sync "
        f"(1 process, {CORES} threads), {STEPS} steps, mean over steps 2-{STEPS}:\n"
        f"  sync             s/step {s['time/step']:.3f}: {fmt(s)}\n"
        f"  async 1w eta=1   s/step {a['time/step']:.3f}: {fmt(a)}\n"
        f"  async 2w eta=2   s/step {w['time/step']:.3f}: {fmt(w)}\n"
        f"  speed-up 1 worker eta=1: {ratio:.2f}x (target >= 1.3x; staleness max {stale:.0f}); "
        f"2 workers eta=2: {ratio_w:.2f}x (staleness max {stale_w:.0f})\n"
        f"  PROJECTION (not measured) for 8 GPUs from the sync phase shares (rollout "
        f"{rollout / s['time/step']:.0%}): 1 rollout + 7 trainer GPUs "
        f"{proj['speedup_1_plus_7']:.2f}x sync colocated; best split "
        f"{proj['best_rollout_gpus']:.0f} + {8 - proj['best_rollout_gpus']:.0f}: "
        f"{proj['speedup_best_split']:.2f}x"
    )
    assert stale <= 1 and stale_w <= 2
