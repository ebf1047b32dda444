"""The trainer's blocking time for a checkpoint: written in the foreground
(``Trainer.checkpoint``: ``Checkpointer.save``, the baseline) vs in the background
(``train.async_save``: ``save(background=True)`` then ``Checkpointer.finish`` at the next
save), same process, same state, one run.

The state is the 8B recipe's kind at a small size: a 15.9M-parameter MLP (8 x Linear(1408,
1408)) under FSDP2 on a world of one with float32 masters and bf16 compute, after real AdamW
steps: 190 MB of sharded training state (masters + two moments) and a 32 MB bf16 export, all
written with fsync into pytest's tmp folder. The arms alternate, ``ROUNDS`` times each; in
the background arm the trainer runs ``STEPS_AFTER`` real update steps while the write goes on,
then waits for it (what the next save does first).

Reported per arm: the save call's seconds (what the step waits for), for the background arm
also the wait at the commit and the whole write's seconds (``time/checkpoint_write``), and the
ratio foreground / background of the blocking time. Every checkpoint written is checked
loadable (the last one's training state bitwise against the foreground one of the same step).

Run: ``pytest bench/test_bench_checkpoint_save.py --benchmark-only -s``.
"""

from __future__ import annotations

import time
import types
from pathlib import Path
from typing import Any

import torch

from paravt import checkpoint as C
from paravt.distributed import Precision, cleanup, init_distributed, shard_model
from paravt.trainer import Trainer

WIDTH, LAYERS, BATCH = 1408, 8, 8
ROUNDS, STEPS_AFTER = 3, 2


def _trainer(out: Path) -> tuple[Any, Any]:
    ctx = init_distributed("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    shard_model(model, ctx, Precision(master=torch.float32, compute=torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    def step() -> None:
        model(torch.randn(BATCH, WIDTH)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()

    train = types.SimpleNamespace(
        out_dir=str(out), keep_last=2, on_save_error="fail", master_dtype="float32",
        async_save=False,
    )  # fmt: skip
    cfg = types.SimpleNamespace(train=train, model=types.SimpleNamespace(dtype="bfloat16"))
    source = types.SimpleNamespace(data_state=lambda done: {"pos": 0})
    tr = Trainer(
        cfg=cfg, ctx=ctx, policy=model, bundle=types.SimpleNamespace(tokenizer=None),
        engine=None, runner=None, reference=None, objective=None, optimizer=opt,
        scheduler=sched, source=source, val_samples=[], logger=None, init_dir=None,
        video_meta=None,
    )  # fmt: skip
    tr.checkpointer = C.Checkpointer.from_config(cfg, ctx, model, opt, states={"trainer": tr})
    step()
    return tr, step


def _run_arms(tmp: Path) -> dict[str, Any]:
    tr, step = _trainer(tmp / "run")
    state_mb = 12 * LAYERS * (WIDTH * WIDTH + WIDTH) / 1e6
    res: dict[str, list[float]] = {"sync": [], "async": [], "wait": [], "write": []}
    n = 0
    try:
        for _ in range(ROUNDS):
            n += 1
            t0 = time.perf_counter()
            assert tr.checkpoint(n, background=False)
            res["sync"].append(time.perf_counter() - t0)
            sync_ckpt = C.latest_checkpoint(tr.cfg.train.out_dir)
            n += 1
            t0 = time.perf_counter()
            assert tr.checkpoint(n, background=True)
            res["async"].append(time.perf_counter() - t0)
            # The same step's state, written in the background: bitwise the foreground's.
            for _ in range(STEPS_AFTER):
                step()
            t0 = time.perf_counter()
            assert tr.finish_checkpoint() == (n, True)
            res["wait"].append(time.perf_counter() - t0)
            res["write"].append(tr.times["time/checkpoint_write"])
            ckpt = C.latest_checkpoint(tr.cfg.train.out_dir)
            assert ckpt is not None and ckpt.name == C.step_dirname(n)
            a, b = C.read_train_state(ckpt), C.read_train_state(sync_ckpt)
            assert all(torch.equal(a["masters"][k], v) for k, v in b["masters"].items())
            step()
    finally:
        cleanup(tr.ctx)
    mean = {k: sum(v) / len(v) for k, v in res.items()}
    return {"state_mb": state_mb, **mean, "runs": res}


def test_bench_checkpoint_save_blocking_time(benchmark, tmp_path: Path) -> None:
    res = benchmark.pedantic(_run_arms, args=(tmp_path,), rounds=1, iterations=1)
    ratio = res["sync"] / res["async"]
    benchmark.extra_info.update({**res, "sync_over_async_blocking": ratio})
    print(
        f"\ncheckpoint of {res['state_mb']:.0f} MB training state + bf16 export (CPU, one "
        f"process, FSDP2 world of one), {ROUNDS} saves per arm:\n"
        f"  foreground: save blocks {res['sync'] * 1e3:7.1f} ms\n"
        f"  background: save blocks {res['async'] * 1e3:7.1f} ms; after {STEPS_AFTER} steps "
        f"the commit waits {res['wait'] * 1e3:.1f} ms; the whole write took "
        f"{res['write'] * 1e3:.1f} ms\n"
        f"  blocking time foreground / background {ratio:.2f}x"
    )
    assert ratio > 0
