"""Weight push to a rollout worker: step time with the push overlapped vs inline, and bucketed
vs per-tensor (the host path), same processes, same model, one run (CPU, gloo).

Two processes on the CPU, one thread each: this one is trainer rank 0, a second (this file run
as a script) is a rollout worker. The trainer's "step" is a real update of a 48 MiB float32
MLP (12 x Linear(1024, 1024): forward, backward and an AdamW step on a batch of 64), then the
push of the updated weights as the next version through ``paravt.weight_sync.WeightPublisher``,
exactly as ``RolloutPipeline.publish`` does it; the worker receives each version
(``weight_sync.receive``: checksums verified on receipt), loads it into its own copy of the
model and verifies that copy read back (``verify_engine``), as a worker with the HF engine
does between turns. Three arms, interleaved in rounds (so drift hits all of them alike):

* ``host``: the fallback, one broadcast per tensor on the control channel, inline;
* ``bucketed``: 16 MiB buckets over the weights group (gloo), inline (``overlap=False``);
* ``overlap``: the same buckets sent by a background thread while the trainer runs the next
  step (the default; the next push waits for the previous one).

Reported: mean step time (update + push) and mean time in ``push`` per arm (for ``overlap``:
waiting for the previous push, then the snapshot, whose pack + checksums part is shown), the
ratios
``host / overlap``, ``bucketed / overlap`` and ``host / bucketed``. The worker's copy is
checked bitwise against the trainer's last version at the end (the checksums verify every
version on the way).

Run: ``pytest bench/test_bench_weight_sync.py --benchmark-only -s``.

Measured on the 2-core CPU machine (2026-12-06, shared with other jobs; load 3-4.5): step
time host / overlap 1.22x and 1.17x, bucketed / overlap 1.05x both times, host / bucketed
1.16x and 1.12x (steps of 405 / 349 / 332 ms and 473 / 424 / 405 ms). On the CPU the
overlap gains little: the snapshot (pack + checksums, ~70 ms of the ~120 ms push) stays
inline and the background send competes for the same two cores. On GPUs the snapshot is a
device copy plus two reductions and NCCL moves the buckets without the trainer's cores: not
measured here (no multi-GPU machine; scripts/gpu_check.sh runs the CUDA pack / unpack /
checksum only).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from paravt.weight_sync import Spec, WeightPublisher, receive, verify_engine
from paravt.workers.roles import Channel, WeightGroup

LAYERS, WIDTH, BATCH = 12, 1024, 64
BUCKET_MB = 16
STEPS, ROUNDS = 4, 3  # per arm and round
ARMS = ("host", "bucketed", "overlap")
ROOT = Path(__file__).resolve().parents[1]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


class _Replica:
    """The worker's engine stand-in: its own module, loaded by name and read back."""

    def __init__(self) -> None:
        self.model = _model()

    def sync_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        own = self.model.state_dict()
        with torch.no_grad():
            for n, t in named:
                own[n].copy_(t)

    def loaded_weights(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()


def _groups(port: int, member: int) -> tuple[Channel, WeightGroup]:
    store = dist.TCPStore("127.0.0.1", port, 2, member == 0, timedelta(seconds=120))
    return Channel(store, "ctrl", member, 2), WeightGroup(
        store, "weights", member, 2, torch.device("cpu")
    )


def worker_main(port: int) -> None:
    """The worker process: receive, load, verify every version until ``stop``; then send
    its final copy back for the bitwise check."""
    torch.set_num_threads(1)
    ctrl, group = _groups(port, 1)
    replica = _Replica()
    while (header := ctrl.bcast())["kind"] == "weights":
        staged = receive(header, ctrl, group if header["sync"] == "bucketed" else None)
        replica.sync_weights(staged.named())
        assert verify_engine(replica, staged)
    for t in replica.model.state_dict().values():
        ctrl.pg.send([t.contiguous()], 0, 2).wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_arms() -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, __file__, str(port)], env=env, cwd=ROOT)
    try:
        ctrl, group = _groups(port, 0)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(BATCH, WIDTH)
        pubs = {
            "host": WeightPublisher(ctrl, None, "host"),
            "bucketed": WeightPublisher(ctrl, group, "bucketed", BUCKET_MB << 20, overlap=False),
            "overlap": WeightPublisher(ctrl, group, "bucketed", BUCKET_MB << 20, overlap=True),
        }
        times: dict[str, list[tuple[float, float, float]]] = {a: [] for a in ARMS}
        version = 0
        for _ in range(ROUNDS):
            for arm in ARMS:
                pub = pubs[arm]
                for _ in range(STEPS):
                    t0 = time.perf_counter()
                    loss = model(x).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    t1 = time.perf_counter()
                    for p in pubs.values():  # one push in flight (publish waits the same way)
                        p.wait()
                    version += 1
                    sd = model.state_dict()
                    specs = [Spec(n, tuple(t.shape), t.dtype) for n, t in sd.items()]
                    pub.push(version, specs, ((n, t.detach()) for n, t in sd.items()))
                    t2 = time.perf_counter()
                    times[arm].append((t2 - t0, t2 - t1, pub.last_snapshot_s))
        for p in pubs.values():
            p.wait()
        ctrl.bcast({"kind": "stop"})
        for n, t in model.state_dict().items():
            got = torch.empty_like(t)
            ctrl.pg.recv([got], 1, 2).wait()
            assert torch.equal(got, t), n
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # The first step of each arm's round pays the switch (the previous arm's last push):
    # dropped.
    out = {}
    for arm, ts in times.items():
        kept = [t for i, t in enumerate(ts) if i % STEPS]
        out[arm] = {
            "step_s": sum(s for s, _, _ in kept) / len(kept),
            "push_s": sum(p for _, p, _ in kept) / len(kept),
            "snapshot_s": sum(n for _, _, n in kept) / len(kept),  # overlap: pack + checksums
        }
    return out


def test_bench_weight_push_overlap_and_buckets(benchmark) -> None:
    res = benchmark.pedantic(_run_arms, rounds=1, iterations=1)
    h, b, o = (res[a]["step_s"] for a in ARMS)
    ratios = {
        "host_over_overlap": h / o,
        "bucketed_over_overlap": b / o,
        "host_over_bucketed": h / b,
    }
    benchmark.extra_info.update({"arms": res, **ratios})
    mib = LAYERS * (WIDTH * WIDTH + WIDTH) * 4 / 2**20
    print(
        f"\nweight push of {mib:.1f} MiB float32 per step (CPU, gloo, 1 thread per process), "
        f"{ROUNDS} rounds x {STEPS - 1} steps per arm:\n"
        + "\n".join(
            f"  {a:9s} step {res[a]['step_s'] * 1e3:7.1f} ms, of which in push "
            f"{res[a]['push_s'] * 1e3:6.1f} ms"
            + (
                f" (snapshot: pack + checksums {res[a]['snapshot_s'] * 1e3:.1f} ms)"
                if a == "overlap"
                else ""
            )
            for a in ARMS
        )
        + f"\n  step time host / overlap {ratios['host_over_overlap']:.2f}x, bucketed / overlap "
        f"{ratios['bucketed_over_overlap']:.2f}x, host / bucketed "
        f"{ratios['host_over_bucketed']:.2f}x"
    )
    assert all(v > 0 for v in ratios.values())


if __name__ == "__main__":
    worker_main(int(sys.argv[1]))
