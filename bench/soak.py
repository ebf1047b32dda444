"""Soak test of a long run: does ``python -m paravt.train`` leak memory, file descriptors,
threads or disk over hundreds of RL steps?

    python bench/soak.py [--steps 300] [--out runs/soak] [--sft-steps 20] [--prompts 2]

Runs the tiny default (``--preset tiny_cpu``, short SFT, few prompts per step, no held-out
evaluation) as a child process and samples it from outside every 0.2 s through ``/proc``
(Linux): resident memory (VmRSS), open file descriptors and threads, each sample tagged with
the RL step in progress (the number of ``kind: train`` rows in ``metrics.jsonl`` + 1). The
trainer is not instrumented, so what is measured is the real process.

Verdict (issue 27, item 18), written to ``<out>/soak.json`` and printed; exit 1 if any fails:

* peak RSS over the last 10 steps is at most 5% above the peak over steps 41-50;
* open fds and threads at the end equal those at step 50 (within 2: a sample can land while
  a checkpoint file or a decode is open);
* ``thumbs/`` stays under ``train.viewer_max_mb`` and at most ``train.keep_last``
  checkpoints are left.

Not part of ``make test`` (it takes 10-20 minutes on the 2-core machine); docs/hostile_input.md
lists its measured figures with this command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _proc(pid: int) -> tuple[int, int, int] | None:
    """(rss bytes, open fds, threads) of ``pid``, or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss = int(fields["VmRSS"].split()[0]) * 1024
    return rss, fds, int(fields["Threads"])


def _train_rows(path: Path) -> int:
    try:
        with open(path) as f:
            return sum('"kind": "train"' in line for line in f)
    except FileNotFoundError:
        return 0


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="runs/soak")
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--save-every", type=int, default=20)
    a = ap.parse_args(argv)
    if a.steps < 60:
        ap.error(f"--steps {a.steps}: the verdict compares steps 41-50 with the last 10; use >= 60")
    out = Path(a.out)
    if (out / "metrics.jsonl").exists():
        ap.error(f"{out} already holds a run; pass another --out (a soak starts fresh)")
    keep_last, max_mb = 2, 18.0
    cmd = [
        sys.executable, "-m", "paravt.train", "--preset", "tiny_cpu",
        f"train.out_dir={out}", f"train.steps={a.steps}", f"sft.steps={a.sft_steps}",
        f"train.prompts_per_step={a.prompts}", f"train.save_every={a.save_every}",
        f"train.keep_last={keep_last}", f"train.viewer_max_mb={max_mb}",
        "train.eval_prompts=0", "train.eval_before=false", "train.progress=false",
    ]  # fmt: skip
    print("soak:", " ".join(cmd), flush=True)
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}.log", "w")  # noqa: SIM115 - closed after the child
    child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    per_step: dict[int, dict[str, int]] = {}
    last_print = 0
    while child.poll() is None:
        sample = _proc(child.pid)
        if sample is not None:
            step = _train_rows(out / "metrics.jsonl") + 1
            rss, fds, threads = sample
            s = per_step.setdefault(step, {"rss_peak": 0, "fds": 0, "threads": 0})
            s["rss_peak"] = max(s["rss_peak"], rss)
            s["fds"], s["threads"] = fds, threads
            if step >= last_print + 10:
                last_print = step
                print(f"step {step}: rss {rss / 2**20:.0f} MiB, fds {fds}, threads {threads}, "
                      f"{time.time() - t0:.0f} s", flush=True)  # fmt: skip
        time.sleep(0.2)
    log.close()
    if child.returncode != 0:
        print(f"soak: the run failed (exit {child.returncode}); see {log.name}", file=sys.stderr)
        return 1
    steps = sorted(k for k in per_step if k <= a.steps)
    early = [per_step[k] for k in steps if 41 <= k <= 50]
    late = [per_step[k] for k in steps if k > a.steps - 10]
    rss_50 = max(s["rss_peak"] for s in early)
    rss_end = max(s["rss_peak"] for s in late)
    at_50, at_end = early[-1], late[-1]
    thumbs = _dir_bytes(out / "thumbs")
    ckpts = [p for p in (out / "checkpoints").glob("*") if p.is_dir()]
    res = {
        "steps": a.steps,
        "wall_s": round(time.time() - t0, 1),
        "rss_peak_steps_41_50_mib": round(rss_50 / 2**20, 1),
        "rss_peak_last_10_mib": round(rss_end / 2**20, 1),
        "rss_growth": round(rss_end / rss_50 - 1, 4),
        "fds_step_50": at_50["fds"],
        "fds_end": at_end["fds"],
        "threads_step_50": at_50["threads"],
        "threads_end": at_end["threads"],
        "thumbs_mb": round(thumbs / 2**20, 2),
        "checkpoints": len(ckpts),
        "rss_mib_by_step": {k: round(per_step[k]["rss_peak"] / 2**20, 1) for k in steps},
    }
    checks = {
        "rss_growth <= 5%": res["rss_growth"] <= 0.05,
        "fds flat": abs(res["fds_end"] - res["fds_step_50"]) <= 2,
        "threads flat": abs(res["threads_end"] - res["threads_step_50"]) <= 2,
        f"thumbs <= {max_mb} MB": thumbs <= max_mb * 2**20,
        f"checkpoints <= {keep_last}": len(ckpts) <= keep_last,
    }
    res["checks"] = checks
    (out / "soak.json").write_text(json.dumps(res, indent=2))
    print(json.dumps({k: v for k, v in res.items() if k != "rss_mib_by_step"}, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
