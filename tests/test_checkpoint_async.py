"""The trainer's checkpoint written in the background (``train.async_save``:
``paravt.checkpoint.Checkpointer.save(background=True)`` and ``Checkpointer.finish``, through
``Trainer.checkpoint`` / ``finish_checkpoint``).

* On two gloo ranks under FSDP2 (float32 masters, bf16 compute): ``Checkpointer.save`` returns
  while every rank's shard write is still held back, the step folder is not in place until
  ``Checkpointer.finish``, the next step's update runs meanwhile, and the committed
  checkpoint holds the state of the step it was taken at (a snapshot): bitwise the same
  training state, export and ``trainer_state.pt`` as a synchronous save of that state, and a
  resume on 2 and on 1 ranks gets it back bitwise.
* A shard write that fails after the save started (a rank's disk full) fails at the next
  wait on every rank, naming the step; the previous checkpoint stays the newest.
* One process, no process group: the same snapshot, and a ``kill -9`` during the background
  write leaves the previous checkpoint the newest and loadable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_trainer import linear_trainer
from test_checkpoint_sharded import COMMON, RESUME
from torchrun import run_worker

from paravt import checkpoint as C

# test_checkpoint_sharded's harness with a smaller model (8 blocks of 128x128, 0.5 MB of
# masters): what is tested here is when and what the write writes, not its memory.
SMALL = COMMON + textwrap.dedent(
    """
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(128, 128) for _ in range(8))
        def forward(self, x):
            for b in self.blocks:
                x = torch.tanh(b(x))
            return x
    """
)
RESUME_SMALL = SMALL + RESUME[len(COMMON) :]

ASYNC = SMALL + textwrap.dedent(
    """
    import copy, threading
    import torch.distributed.checkpoint.filesystem as fs
    from paravt.distributed import all_gather_objects

    def train_step():
        model(torch.randn(4, 128)).square().mean().backward()
        opt.step(); sched.step(); opt.zero_grad()

    out, out_sync = sys.argv[1], sys.argv[2]
    ctx, model, opt, sched = build(0)
    torch.manual_seed(100 + ctx.rank)
    for _ in range(2):
        train_step()
    rng = C.rng_state()
    # The baseline: a synchronous save of this state (train.async_save unset: off).
    assert trainer(ctx, model, opt, sched, out_sync).checkpoint(1, begin=({"pos": 7}, rng))
    # (a copy: the gathered optimizer state holds the live step counts, updated in place)
    want = copy.deepcopy(full_state(model, opt, ctx))
    if ctx.is_main:
        torch.save(want, os.path.join(out_sync, "reference.pt"))

    # The same state saved in the background. Every rank's shard write is held until this
    # thread lets it go, after the next update: a save that blocked on its write fails here.
    tr = trainer(ctx, model, opt, sched, out)
    tr.cfg.train.async_save, tr.times = True, {}
    real = fs._write_item
    go = threading.Event()
    def held(*a, **k):
        if not go.wait(20):
            raise TimeoutError("the save did not return before its shards were written")
        return real(*a, **k)
    fs._write_item = held
    assert tr.checkpoint(1, begin=({"pos": 7}, rng)) is True
    root = Path(out) / C.CKPT_DIR
    in_flight = tr.checkpointer.pending is not None and not (root / "step_000001").exists()
    train_step()                      # step 2's update: the live state moves on
    moved = full_state(model, opt, ctx)
    go.set()
    done = tr.finish_checkpoint()
    fs._write_item = real
    assert done == (1, True) and tr.checkpointer.pending is None and (root / "step_000001").is_dir()
    changed = any(not torch.equal(moved["masters"][k], v) for k, v in want["masters"].items())

    # A write that fails after the save started (the last rank's disk is full): the save
    # returns, the next wait raises on every rank naming the step, step 1 stays the newest.
    late = threading.Event()
    def full_disk(*a, **k):
        late.wait(20)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/the/shard/file")
    if ctx.rank == ctx.world_size - 1:
        fs._write_item = full_disk
    assert tr.checkpoint(2) is True
    late.set()
    try:
        tr.finish_checkpoint()
        error = ""
    except C.CheckpointSaveError as e:
        error = str(e)
    fs._write_item = real
    errors = all_gather_objects(error, ctx)
    if ctx.is_main:
        json.dump({"in_flight": in_flight, "changed": changed, "errors": errors,
                   "latest": C.latest_checkpoint(out).name,
                   "tmp": [p.name for p in root.glob(".tmp-*")]},
                  open(os.path.join(out, "async.json"), "w"))

    # A resume on these 2 ranks (other initial weights) gets step 1's state back bitwise.
    _, model, opt, sched = build(1)
    ckpt = C.latest_checkpoint(out)
    st = C.load_trainer_state(ckpt)
    C.load_train_state(ckpt, st, model, opt, ctx)
    sched.load_state_dict(st["scheduler"])
    got = full_state(model, opt, ctx)
    if ctx.is_main:
        for k, v in want["masters"].items():
            assert torch.equal(got["masters"][k], v), k
        for k, v in want["optimizer"]["state"].items():
            for name in ("exp_avg", "exp_avg_sq", "step"):
                g = torch.as_tensor(got["optimizer"]["state"][k][name])
                assert torch.equal(g, torch.as_tensor(v[name])), (k, name, g, v[name])
        assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
        assert opt.param_groups[0]["lr"] == sched.get_last_lr()[0] == 1e-3 * 3 / 4
        print(f"RESUMED_OK world={ctx.world_size} from {ckpt.name}")
    cleanup(ctx)
    """
)


def _run(tmp_path: Path, name: str, source: str, nproc: int, *args: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    return run_worker(folder, source, nproc, *args).stdout


def _same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` equal, tensors and arrays bitwise."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif hasattr(a, "shape"):  # numpy's RNG state
        assert (a == b).all(), where
    else:
        assert a == b, where


def test_async_save_is_a_snapshot_committed_later_and_resumes_on_two_and_one_ranks(
    tmp_path: Path,
) -> None:
    run, run_sync = tmp_path / "run", tmp_path / "sync"
    run.mkdir()
    run_sync.mkdir()
    out = _run(tmp_path, "save", ASYNC, 2, str(run), str(run_sync))
    assert "RESUMED_OK world=2 from step_000001" in out  # resumed on the saving ranks
    res = json.loads((run / "async.json").read_text())
    assert res["in_flight"], "the save blocked until its write was committed"
    assert res["changed"], "the update after the save did not change the masters"

    # Bitwise what a synchronous save of the same state wrote: shards, export, small state.
    ckpt, base = run / C.CKPT_DIR / "step_000001", run_sync / C.CKPT_DIR / "step_000001"
    assert sorted(p.name for p in (ckpt / C.TRAIN_STATE_DIR).iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"
    ]  # fmt: skip
    _same(C.read_train_state(ckpt), C.read_train_state(base), "train_state")
    _same(C.load_model_state(ckpt), C.load_model_state(base), "export")
    # Both spread over the two ranks (each rank's background thread wrote its file), and the
    # manifest (every rank's digests) names every file of the folder.
    files = sorted(f.name for f in ckpt.iterdir() if f.is_file())
    assert files == sorted(f.name for f in base.iterdir() if f.is_file())
    assert [f for f in files if f.startswith("model")] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", C.EXPORT_INDEX
    ]  # fmt: skip
    manifest = json.loads((ckpt / C.MANIFEST).read_text())["files"]
    assert {f for f in manifest if "/" not in f} == set(files) - {C.MANIFEST}
    _same(C.load_trainer_state(ckpt), C.load_trainer_state(base), "trainer_state")

    # The failed background write: raised on both ranks, naming step 2; step 1 is the newest.
    assert len(res["errors"]) == 2
    for e in res["errors"]:
        assert "checkpoint step 2 " in e and "No space left on device" in e, e
        assert "step_000001 is intact" in e, e
    assert res["latest"] == "step_000001" and res["tmp"] == []
    assert [p.name for p in C.list_checkpoints(run)] == ["step_000001"]

    # On one process: a plain python process (no torchrun agent to start), as a 1-rank run.
    script = tmp_path / "resume_one.py"
    script.write_text(RESUME_SMALL)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(script), str(run), str(run_sync / "reference.pt")]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESUMED_OK world=1" in proc.stdout


def _one_process(out: Path) -> tuple[Any, Any]:
    """A trainer of one process without a process group (a plain module and AdamW) that has
    taken two steps, and its step function."""
    tr, step = linear_trainer(out, shape=(64, 32), rows=4, keep_last=2, warmup=4, async_save=True)
    step()
    return tr, step


def test_one_process_async_save_holds_the_state_it_was_taken_at(tmp_path: Path) -> None:
    """No process group (DCP's one-process path), float32 only: the export's tensors are the
    live parameters' own unless copied, the optimizer's steps are updated in place."""
    tr, step = _one_process(tmp_path)
    lin, opt = tr.policy, tr.optimizer
    weights = {k: v.clone() for k, v in lin.state_dict().items()}
    moments = {
        n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in lin.named_parameters()
    }
    assert tr.checkpoint(1)
    assert tr.checkpointer.pending is not None
    step()  # changes the weights, the moments, the step counts and the learning rate in place
    assert not torch.equal(lin.weight, weights["weight"])
    assert tr.finish_checkpoint() == (1, True)
    assert tr.finish_checkpoint() is None  # nothing in flight any more
    ckpt = C.latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step_000001"
    _same(C.load_model_state(ckpt), weights, "export")
    state = C.read_train_state(ckpt)["optimizer"]
    _same(state["state"], moments, "moments")
    assert state["param_groups"][0]["lr"] == 1e-2 * 3 / 4
    assert C.load_trainer_state(ckpt)["scheduler"]["last_epoch"] == 2
    assert tr.times["time/checkpoint_write"] > 0


def test_kill_during_the_background_write_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked child saves step 1, then step 2 in the background and is SIGKILLed inside the
    background shard write: step 1 stays the newest and loads; the next save clears the
    debris."""
    tr, _ = _one_process(tmp_path)
    assert tr.checkpoint(1, background=False)
    want = C.read_train_state(C.latest_checkpoint(tmp_path))
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            import torch.distributed.checkpoint.filesystem as fs

            def die(*a: Any, **k: Any) -> None:
                os.kill(os.getpid(), signal.SIGKILL)

            monkeypatch.setattr(fs, "_write_item", die)
            tr.checkpoint(2)
            tr.finish_checkpoint()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    root = tmp_path / C.CKPT_DIR
    assert (root / ".tmp-step_000002").is_dir()  # killed mid-write, never renamed in
    ckpt = C.latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step_000001"
    _same(C.read_train_state(ckpt), want, "step 1")
    assert tr.checkpoint(3)
    assert tr.finish_checkpoint() == (3, True)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000003"]


def test_the_train_loop_commits_background_saves_at_the_next_one_and_on_sigterm(
    assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m paravt.train``'s loop with ``train.async_save=true`` and a checkpoint every
    step, SIGTERM during step 3 of 4: step 1's checkpoint is committed by step 2's save, step
    2's by step 3's, and step 3's (still being written when the run stops) by the preemption's
    save, which then has nothing left to write. Each holds its own step's state."""
    from test_train_resume import tiny_overrides

    import paravt.train as T
    from paravt.config import load_config
    from paravt.preempt import TEST_SIGNAL_ENV

    commits: list[tuple[int, bool]] = []  # every commit of a background save (the real one)
    real = C.Checkpointer.finish

    def finish(self: C.Checkpointer) -> C.Saved | None:
        done = real(self)
        if done is not None:
            commits.append((done.step, done.ok))
        return done

    monkeypatch.setattr(C.Checkpointer, "finish", finish)
    monkeypatch.setenv(TEST_SIGNAL_ENV, "SIGTERM:3:metrics")
    out = tmp_path / "run"
    over = tiny_overrides(assets, out, 4)
    over += ["train.save_every=1", "train.keep_last=2", "train.async_save=true"]
    res = T.run(load_config(overrides=over))
    assert res.stopped is not None
    assert res.stopped.ok and res.stopped.outcome == "finished step 3"
    assert commits == [(1, True), (2, True), (3, True)]
    two, three = (out / C.CKPT_DIR / C.step_dirname(s) for s in (2, 3))
    assert C.list_checkpoints(out) == [two, three] and C.latest_checkpoint(out) == three
    assert not list((out / C.CKPT_DIR).glob(".tmp-*"))
    s2, s3 = C.load_trainer_state(two), C.load_trainer_state(three)
    assert (s2["step"], s3["step"]) == (2, 3)
    assert s2["scheduler"]["last_epoch"] < s3["scheduler"]["last_epoch"]
    a, b = C.read_train_state(two)["optimizer"], C.read_train_state(three)["optimizer"]
    n2, n3 = ({int(torch.as_tensor(v["step"])) for v in o["state"].values()} for o in (a, b))
    assert len(n2) == len(n3) == 1 and 0 < n2.pop() < n3.pop()  # AdamW's updates by then
