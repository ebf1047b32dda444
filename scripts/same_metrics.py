"""Same fixed-seed runs, same metrics: the check a behaviour-preserving refactor of the training
step is held to (issue 52's "must show").

    python scripts/same_metrics.py run OUT [SFT_STEPS]  # four short runs of this checkout
    python scripts/same_metrics.py compare A B   # every metrics.jsonl value equal, timing aside

The runs: the default preset with its SFT cut to ``SFT_STEPS`` (20; about 800 makes the main
agents call the tool, so crops and sub-agents run in the RL steps) and 3 RL steps, (1) one process,
(2) asynchronous with one rollout worker (torchrun, 2 processes), (3) two FSDP2 ranks on gloo
(torchrun, 2 processes), (4) one process with the decoupled objective and the KL term (the
reference and proximal passes). Each writes ``OUT/<name>/metrics.jsonl``; ``compare`` reads the
``train`` and ``eval_*`` rows of both and prints every value that differs (wall-clock keys, and
the async idle/wait/busy seconds, excepted). Exit 0 when nothing differs.

The synthetic data and the tiny model are built once under ``OUT/assets`` (the first run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMON = [
    "sft.save_every=0",
    "train.steps=3",
    "train.eval_prompts=4",
    "train.progress=false",
    "train.summary_plot=false",
    "train.save_every=0",
]

RUNS: dict[str, tuple[int, list[str]]] = {
    "sync": (1, []),
    "async1": (2, ["rollout.workers=1"]),
    "gloo2": (2, []),
    "decoupled_kl": (1, ["algo.loss=decoupled", "algo.behav_cap=3.0", "algo.kl_coef=0.05"]),
}

#: Keys that measure wall-clock time (legitimately differ between two runs).
TIMING = ("time/", "tokens_per_s", "async/trainer_wait_s", "async/worker_busy_s",
          "async/worker_idle_s", "async/worker_idle_frac", "async/trainer_idle_frac",
          "async/queue_depth", "eval/seconds", "async/push_s", "async/push_snapshot_s",
          "async/restore_s")  # fmt: skip
#: ... and by suffix: each worker's wait for weights (``async/worker_<rank>_wait_weights_s``).
TIMING_SUFFIX = ("_wait_weights_s",)


def _timing(key: str) -> bool:
    return key.startswith(TIMING) or key.endswith(TIMING_SUFFIX)


def run(out: Path, sft_steps: int = 20) -> None:
    assets = out / "assets"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for name, (nproc, extra) in RUNS.items():
        args = [
            f"sft.steps={sft_steps}", *COMMON, *extra, f"train.out_dir={out / name}",
            f"data.synth_dir={assets / 'data'}", f"model.tiny_dir={assets / 'model'}",
        ]  # fmt: skip
        if nproc == 1:
            cmd = [sys.executable, "-m", "paravt.train", *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", "-m", "paravt.train", *args]  # fmt: skip
        print(f"[same_metrics] {name}: {' '.join(cmd[1:])}", flush=True)
        log = out / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            rc = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
            ).returncode
        if rc != 0:
            sys.exit(f"[same_metrics] {name} exited {rc}; see {log}")


def _rows(path: Path) -> dict[tuple[str, int], dict[str, float]]:
    out = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") in ("train", "eval_before", "eval_after", "eval_step"):
            out[(r["kind"], r["step"])] = r
    return out


def compare(a: Path, b: Path) -> int:
    bad = 0
    for name in RUNS:
        ra, rb = _rows(a / name / "metrics.jsonl"), _rows(b / name / "metrics.jsonl")
        if sorted(ra) != sorted(rb):
            print(f"{name}: rows differ: {sorted(ra)} vs {sorted(rb)}")
            bad += 1
            continue
        n = 0
        for key in ra:
            ka = {k for k in ra[key] if not _timing(k)}
            kb = {k for k in rb[key] if not _timing(k)}
            if ka != kb:
                print(f"{name} {key}: keys differ: {sorted(ka ^ kb)}")
                bad += 1
            for k in sorted(ka & kb):
                n += 1
                if ra[key][k] != rb[key][k]:
                    print(f"{name} {key} {k}: {ra[key][k]!r} vs {rb[key][k]!r}")
                    bad += 1
        print(f"{name}: {len(ra)} rows, {n} values compared")
    print("same" if bad == 0 else f"{bad} differences")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) in (3, 4) and sys.argv[1] == "run":
        run(Path(sys.argv[2]).resolve(), *(int(x) for x in sys.argv[3:]))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
