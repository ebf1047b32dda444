"""The verified weight push (``paravt.weight_sync``) between two real gloo groups in one
process (trainer rank 0 and a worker as two threads, the groups of ``paravt.workers.roles``).

* the bucketed push (inline and overlapped) delivers the same bytes as the per-tensor host
  path, the reference, for every dtype and odd size a state dict holds;
* a byte corrupted in flight is named (tensor, version) by the worker's check on receipt;
* the HF engine's copy is read back after a sync and a tensor its loader skipped is named;
* the checksum sees a changed, a moved and a swapped value, and is the same on CPU and CUDA
  (the ``cuda`` case runs in scripts/gpu_check.sh).

The 2-process run that corrupts a tensor in flight and must stop naming it is in
tests/test_train_async.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import paravt.weight_sync as ws
from paravt.engines.hf import HFEngine
from paravt.models import build_tiny_checkpoint, load_model
from paravt.weight_sync import (
    EngineSums,
    Spec,
    Staged,
    SumRecorder,
    WeightPublisher,
    WeightSyncError,
    checksum,
    element_sum,
    plan_buckets,
    receive,
    verify_element_sums,
    verify_engine,
)
from paravt.workers.roles import Channel, WeightGroup

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _weights() -> dict[str, torch.Tensor]:
    """A state dict's variety: float32 and bfloat16 (odd sizes), int64, bool (odd bytes), a
    0-dim tensor, an empty one, one larger than the test's bucket."""
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(37, 29, generator=g),
        "a.bias": torch.randn(29, generator=g).bfloat16(),
        "b.odd": torch.randn(7, generator=g).bfloat16(),
        "b.count": torch.tensor(12345678901, dtype=torch.int64),
        "b.mask": torch.rand(5, 3, generator=g) > 0.5,
        "b.empty": torch.zeros(0, 4),
        "big.weight": torch.randn(300, 41, generator=g),
        "c.scale": torch.tensor(0.5),
    }


def _specs(w: dict[str, torch.Tensor]) -> list[Spec]:
    return [Spec(n, tuple(t.shape), t.dtype) for n, t in w.items()]


def _run_pair(trainer: Any, worker: Any) -> Any:
    """Run ``trainer(ctrl, group)`` and ``worker(ctrl, group)`` as the two members of fresh
    gloo groups; returns the worker's result (re-raising either side's error)."""
    store = dist.HashStore()
    out: dict[str, Any] = {}

    def side(member: int, fn: Any) -> None:
        try:
            ctrl = Channel(store, "ctrl", member, 2)
            group = WeightGroup(store, "weights", member, 2, torch.device("cpu"))
            out[member] = fn(ctrl, group)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out[f"err{member}"] = e

    threads = [threading.Thread(target=side, args=(m, f)) for m, f in ((0, trainer), (1, worker))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "a side hung"
    for k in ("err1", "err0"):
        if k in out:
            raise out[k]
    return out[1]


def _push(w: dict[str, torch.Tensor], mode: str, overlap: bool, version: int = 3) -> Staged:
    def trainer(ctrl: Channel, group: WeightGroup) -> None:
        pub = WeightPublisher(ctrl, group, mode, bucket_bytes=4096, overlap=overlap)
        pub.push(version, _specs(w), iter(w.items()))
        assert pub.wait(30)

    def worker(ctrl: Channel, group: WeightGroup) -> Staged:
        header = ctrl.bcast()
        return receive(header, ctrl, group if mode == "bucketed" else None)

    return _run_pair(trainer, worker)


def test_bucket_plan_aligns_and_gives_a_large_tensor_its_own_bucket() -> None:
    specs = _specs(_weights())
    plan = plan_buckets(specs, 4096)
    assert sorted(sl.index for b in plan for sl in b.slots) == list(range(len(specs)))
    for b in plan:
        assert all(sl.offset % ws.ALIGN == 0 for sl in b.slots)
        assert b.nbytes == b.slots[-1].offset + b.slots[-1].nbytes
        assert b.nbytes <= 4096 or len(b.slots) == 1
    (big,) = [b for b in plan if any(specs[s.index].name == "big.weight" for s in b.slots)]
    assert len(big.slots) == 1 and big.nbytes == 300 * 41 * 4
    assert len(plan) >= 3


@pytest.mark.parametrize("mode, overlap", [("bucketed", True), ("bucketed", False)])
def test_bucketed_push_gives_bitwise_the_host_paths_weights(mode: str, overlap: bool) -> None:
    w = _weights()
    host = _push(w, "host", False)
    got = _push(w, mode, overlap)
    assert got.version == host.version == 3
    assert [s.name for s in got.specs] == list(w)
    for (name, ref), a, b in zip(w.items(), host.tensors, got.tensors):
        assert a.dtype == b.dtype == ref.dtype and a.shape == b.shape == ref.shape, name
        assert torch.equal(ws.as_bytes(a), ws.as_bytes(ref)), name
        assert torch.equal(ws.as_bytes(b), ws.as_bytes(ref)), name
    assert torch.equal(got.sums, host.sums)


def test_a_byte_corrupted_in_flight_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ws.unpack_bucket

    def corrupt(bucket: Any, buf: torch.Tensor, specs: list[Spec]) -> list[torch.Tensor]:
        views = real(bucket, buf, specs)
        for sl, v in zip(bucket.slots, views):
            if specs[sl.index].name == "a.bias":
                v.view(-1).view(torch.uint8)[7] ^= 1
        return views

    monkeypatch.setattr(ws, "unpack_bucket", corrupt)
    with pytest.raises(WeightSyncError, match=r"tensor 'a\.bias' of version 5 differs .*as rec"):
        _push(_weights(), "bucketed", True, version=5)


def test_a_byte_corrupted_on_the_host_path_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host fallback's tensors arrive one broadcast each on the control stream: one bit
    flipped in one of them on the worker's side is named the same way (the 2-process run of
    tests/test_train_async.py corrupts the default, bucketed path)."""
    real = Channel.bcast_tensor
    seen = []

    def corrupt(self: Channel, t: torch.Tensor) -> None:
        real(self, t)
        # the worker's side, a.bias (bf16, 29): the only tensor of that dtype and size
        if self.member == 1 and t.dtype == torch.bfloat16 and t.numel() == 29:
            seen.append(t)
            t.view(-1).view(torch.uint8)[3] ^= 1

    monkeypatch.setattr(Channel, "bcast_tensor", corrupt)
    with pytest.raises(WeightSyncError, match=r"tensor 'a\.bias' of version 7 differs"):
        _push(_weights(), "host", False, version=7)
    assert len(seen) == 1


def test_checksum_sees_a_changed_a_moved_and_a_swapped_value() -> None:
    t = torch.randn(3000, 7)
    base = checksum(t)
    assert torch.equal(base, checksum(t.clone()))
    flipped = t.clone()
    flipped.view(-1).view(torch.int32)[4321] ^= 1 << 3
    swapped = t.clone().view(-1)
    swapped[[10, 5000]] = swapped[[5000, 10]]  # same multiset of words: the total is equal
    rolled = t.view(-1).roll(1024)  # whole rows moved: column sums are equal
    for other in (flipped, swapped.view(3000, 7), rolled):
        assert not torch.equal(base, checksum(other))
    assert checksum(t)[0] == checksum(swapped)[0]  # (so the weighted sums caught the swap)
    # a dtype's bytes, not its values: -0.0 and 0.0 differ
    assert not torch.equal(checksum(torch.tensor([0.0])), checksum(torch.tensor([-0.0])))


def test_checksum_in_chunks_equals_the_whole_tensor_sums() -> None:
    """A tensor of more than ``CHUNK_ROWS`` rows (plus a tail) is summed in chunks: the three
    sums equal the same formula over the whole tensor at once (the reference, written out)."""
    from paravt.weight_sync import _P, _ROW_PERIOD, CHUNK_ROWS, COLS

    g = torch.Generator().manual_seed(0)
    t = torch.randn(2 * CHUNK_ROWS * COLS + 5 * COLS + 3, generator=g).to(torch.bfloat16)
    w = t.view(torch.int16)  # 2-byte words: an odd count of bf16 values
    rows = w.numel() // COLS
    head, tail = w[: rows * COLS].view(rows, COLS), w[rows * COLS :]
    col, row = head.to(torch.int64).sum(0), head.to(torch.int64).sum(1)
    total = col.sum() + tail.to(torch.int64).sum()
    cw = torch.arange(1, COLS + 1, dtype=torch.int64)
    tw = torch.arange(1, tail.numel() + 1, dtype=torch.int64)
    cols = (col.remainder(_P) * cw).sum() + (tail.to(torch.int64).remainder(_P) * tw).sum()
    rw = torch.arange(rows, dtype=torch.int64).remainder(_ROW_PERIOD) + 1
    want = torch.stack([total, cols, (row.remainder(_P) * rw).sum()])
    assert torch.equal(checksum(t), want)
    f = torch.randn(CHUNK_ROWS * COLS + 7 * COLS, generator=g)  # 4-byte words, no tail
    assert torch.equal(checksum(f), checksum(f.clone()))


def test_element_sum_ignores_order_adds_over_concatenation_and_sees_a_changed_value() -> None:
    """What an engine that fuses and repacks the checkpoint's tensors (vLLM) is compared by:
    the same under any permutation, a fused tensor's sum is its parts', a one-ulp change or a
    sign flip shows, and a cast to the engine's dtype is taken before summing."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 8, generator=g).bfloat16() for n in (16, 4, 4))
    qkv = torch.cat([q, k, v])
    assert int(element_sum(qkv)) == sum(int(element_sum(x)) for x in (q, k, v))
    assert torch.equal(element_sum(qkv.t().contiguous()), element_sum(qkv))  # repacked layout
    assert torch.equal(element_sum(qkv.flatten()[torch.randperm(qkv.numel())]), element_sum(qkv))
    bumped = qkv.clone()
    bumped.view(torch.int16)[3, 5] += 1  # one ulp
    assert not torch.equal(element_sum(bumped), element_sum(qkv))
    flipped = qkv.clone()
    flipped[0, 0] = -flipped[0, 0]
    assert not torch.equal(element_sum(flipped), element_sum(qkv))
    f32 = torch.randn(33, generator=g)
    assert torch.equal(element_sum(f32, torch.bfloat16), element_sum(f32.bfloat16()))
    assert element_sum(f32).dtype == torch.int64  # fp32 as int32 words, summed in int64
    from paravt.weight_sync import CHUNK_ROWS, COLS

    big = torch.randn(2 * CHUNK_ROWS * COLS + 7, generator=g)  # three chunks, the last short
    whole = big.bfloat16().view(torch.int16).to(torch.int64).sum()
    assert torch.equal(element_sum(big, torch.bfloat16), whole)  # chunked = the whole sum


def test_element_sums_compare_each_engine_parameter_with_its_parts() -> None:
    """``verify_element_sums``: a fused parameter against the sum of the tensors loaded into
    it, named with them on a mismatch; an unreadable parameter is skipped; a push none of
    whose names reached the engine raises rather than checking nothing."""
    q, k, v, n = (torch.full((2,), x, dtype=torch.bfloat16) for x in (1.0, 2.0, 3.0, 0.5))
    specs = [Spec(x, (2,), torch.bfloat16) for x in ("m.q_proj.weight", "m.k_proj.weight",
                                                     "m.v_proj.weight", "m.norm.weight")]  # fmt: skip
    want = [int(element_sum(t)) for t in (q, k, v, n)]
    fused = int(element_sum(torch.cat([q, k, v])))
    targets = {s.name: "e.qkv_proj.weight" for s in specs[:3]} | {specs[3].name: "e.norm.weight"}
    good = EngineSums(targets, {"e.qkv_proj.weight": fused, "e.norm.weight": want[3]},
                      frozenset(), torch.bfloat16)  # fmt: skip
    assert verify_element_sums(specs, want, good, 3) == 2
    bad = EngineSums(targets, {**good.sums, "e.qkv_proj.weight": fused + 1}, frozenset(),
                     torch.bfloat16)  # fmt: skip
    with pytest.raises(WeightSyncError, match=r"'e.qkv_proj.weight' \(from m.q_proj.weight, "
                       r"m.k_proj.weight, m.v_proj.weight\) of version 3"):  # fmt: skip
        verify_element_sums(specs, want, bad, 3)
    hidden = EngineSums(targets, {"e.norm.weight": want[3]}, frozenset({"e.qkv_proj.weight"}),
                        torch.bfloat16)  # fmt: skip
    assert verify_element_sums(specs, want, hidden, 3) == 1  # a oneDNN-packed linear: skipped
    nowhere = EngineSums({}, {}, frozenset(), torch.bfloat16)
    with pytest.raises(WeightSyncError, match="none of the 4 tensors pushed maps"):
        verify_element_sums(specs, want, nowhere, 3)


@CUDA
def test_checksum_and_bucket_round_trip_on_cuda_match_the_cpu() -> None:
    """What the NCCL path does on each end, on one GPU: pack on CUDA, unpack the same buffer,
    checksums equal to the CPU's (the worker verifies CUDA sums against a CUDA trainer's, and
    the integer sums must be exact on both)."""
    w = _weights()
    specs = _specs(w)
    cpu = torch.stack([checksum(t) for t in w.values()])
    dev = torch.device("cuda")
    for b in plan_buckets(specs, 4096):
        buf = torch.empty(b.nbytes, dtype=torch.uint8, device=dev)
        for sl in b.slots:
            buf[sl.offset : sl.offset + sl.nbytes].copy_(
                ws.as_bytes(w[specs[sl.index].name].to(dev))
            )
        for sl, v in zip(b.slots, ws.unpack_bucket(b, buf, specs)):
            ref = w[specs[sl.index].name]
            assert v.is_cuda and torch.equal(v.cpu(), ref) or ref.numel() == 0
            assert torch.equal(checksum(v).cpu(), cpu[sl.index])
    big = torch.randn(4096, 4097, device=dev).bfloat16()  # 16.8 M words: rows and a tail
    assert torch.equal(checksum(big).cpu(), checksum(big.cpu()))


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_model(build_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny"), device="cpu")


def test_the_hf_engines_copy_is_read_back_and_a_skipped_tensor_is_named(bundle: Any) -> None:
    """A real HF engine over its own replica: a full sync verifies; a tensor the loader left
    at the previous version (the failure users report) is named, with the version; an engine
    that cannot be read back (vLLM) is not claimed as verified."""
    import copy

    engine = HFEngine(copy.deepcopy(bundle))
    new = {
        n: t + 0.01 if t.is_floating_point() else t for n, t in bundle.model.state_dict().items()
    }
    rec = SumRecorder(iter(new.items()))  # the colocated push_weights path
    engine.sync_weights(rec)
    staged = rec.staged(version=4)
    assert verify_engine(engine, staged)
    stale = next(n for n, t in new.items() if t.is_floating_point() and t.dim() == 2)
    newer = {n: t + 0.01 if t.is_floating_point() else t for n, t in new.items()}
    rec = SumRecorder(iter(newer.items()))
    engine.sync_weights(rec)
    with torch.no_grad():  # a loader that left one tensor at the previous version
        engine.loaded_weights()[stale].copy_(new[stale])
    with pytest.raises(WeightSyncError, match=rf"tensor '{stale}' of version 7 .*read back"):
        verify_engine(engine, rec.staged(version=7))

    class NoReadBack:
        def sync_weights(self, model: Any) -> None: ...

    assert verify_engine(NoReadBack(), staged) is False


@CUDA
def test_an_overlapped_cuda_push_snapshots_to_pinned_host_and_sends_the_cpu_bytes() -> None:
    """Overlapped on CUDA the snapshot waits in pinned host memory (not a second model on the
    device); each bucket goes back to the device for the broadcast, with exactly the bytes and
    checksums the CPU path sends."""

    class Rec:
        def __init__(self, gate: threading.Event | None = None) -> None:
            self.sent: list[tuple[str, torch.Tensor]] = []
            self.gate, self.waiting = gate, threading.Event()

        def bcast(self, obj: Any = None) -> None:  # the control stream's header, and buckets
            if isinstance(obj, torch.Tensor):
                if self.gate is not None:  # hold the sending thread at its first bucket
                    self.waiting.set()
                    self.gate.wait(60)
                self.sent.append((obj.device.type, obj.clone().cpu()))

    w = _weights()
    specs = _specs(w)
    dev = torch.device("cuda")
    sent = {}
    for device, stream in (("cpu", w.items()), ("cuda", ((n, t.to(dev)) for n, t in w.items()))):
        gate = threading.Event() if device == "cuda" else None
        grp = Rec(gate)
        pub = WeightPublisher(Rec(), grp, bucket_bytes=4096, overlap=True, device=device)
        before = torch.cuda.memory_allocated(dev)
        pub.push(3, specs, stream)
        if gate is not None:  # the snapshot is on the host: one bucket (<= 4 KiB) on the device
            assert grp.waiting.wait(60)
            assert torch.cuda.memory_allocated(dev) - before <= 4096 + 1024
            gate.set()
        assert pub.wait(60)
        sent[device] = grp.sent
    assert [d for d, _ in sent["cuda"]] == ["cuda"] * len(sent["cpu"])  # NCCL gets CUDA buffers
    for (_, a), (_, b) in zip(sent["cpu"], sent["cuda"], strict=True):
        assert torch.equal(a, b)


# ---- issue 61 item 5: the copy stream, the deadline, heartbeats, metrics ---------------------
_HUNG_WORKER = """
import sys, time, torch, torch.distributed as dist
from paravt.weight_sync import Heartbeat, receive
from paravt.workers.roles import Channel, WeightGroup

port, mode = int(sys.argv[1]), sys.argv[2]
store = dist.TCPStore("127.0.0.1", port, 2, False)
ctrl = Channel(store, "ctrl", 1, 2)
group = WeightGroup(store, "weights", 1, 2, torch.device("cpu"))
beat = Heartbeat(store, 1, interval_s=1.0).start()  # stale after 3 s: > the 2 s deadline under load
print("JOINED", flush=True)
if mode == "hung":  # alive (its heartbeat thread beats) but never reads the push
    time.sleep(600)
header = ctrl.bcast()
if mode == "stuck":  # reads the header, then hangs before the buckets
    time.sleep(600)
beat.waited(0.25)
receive(header, ctrl, group, heartbeat=beat)
print("RECEIVED", flush=True)
time.sleep(600)  # the test kills it
"""


def _with_worker_process(tmp_path: Any, mode: str, trainer: Any) -> Any:
    """Trainer rank 0 here (a thread), a rollout worker as a real process joined over a TCP
    store (gloo groups, as ``paravt.workers.roles``); ``trainer(ctrl, group, store)``."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    script = tmp_path / "worker.py"
    script.write_text(_HUNG_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # fmt: skip
    proc = subprocess.Popen([sys.executable, str(script), str(store.port), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        ctrl = Channel(store, "ctrl", 0, 2)
        group = WeightGroup(store, "weights", 0, 2, torch.device("cpu"))
        assert proc.stdout.readline().strip() == "JOINED"
        return trainer(ctrl, group, store), proc
    finally:
        proc.kill()
        proc.wait(30)


@pytest.mark.parametrize(("mode", "overlap"), [("hung", True), ("stuck", True), ("stuck", False)])
def test_a_hung_worker_process_is_named_at_the_push_deadline(
    tmp_path: Any, mode: str, overlap: bool
) -> None:
    """A real worker process that joined the groups and beats, but never reads the push (hung:
    the header's send on the trainer's thread) or hangs after its header (stuck: the buckets'
    sending thread): past ``rollout.weight_push_timeout_s`` the push raises ``PushStalled``
    naming it as alive but silent (on main a push waits 7 days: ``CTRL_TIMEOUT``), and hands
    it to ``on_stall`` (the pipeline's ``WorkerFailed``). Without overlap
    (``rollout.weight_sync_overlap=false``) the buckets go out on the caller's thread, under
    what is left of the same deadline (before, with no timeout: 7 days)."""
    w = {f"layer{i}.weight": torch.randn(1 << 20) for i in range(8)}  # 32 MiB: blocks gloo

    def trainer(ctrl: Channel, group: WeightGroup, store: Any) -> Any:
        stalled: list[tuple[int, str]] = []
        watch = ws.PushWatch(store, [1], timeout_s=2.0,
                             on_stall=lambda r, e: stalled.append((r, str(e))))  # fmt: skip
        pub = WeightPublisher(ctrl, group, bucket_bytes=4 << 20, overlap=overlap, watch=watch)
        t0 = time.monotonic()
        with pytest.raises(ws.PushStalled) as e:
            pub.push(5, _specs(w), iter(w.items()))
            assert mode == "stuck" and overlap  # the header went out: the thread is stuck
            assert pub.wait(0.5) is False  # not held yet, and not overdue yet
            pub.wait(30)
        took = time.monotonic() - t0
        return str(e.value), stalled, took

    (msg, stalled, took), _ = _with_worker_process(tmp_path, mode, trainer)
    assert 2.0 <= took < 15, took
    assert msg.startswith("weight push of version 5: 1 rollout worker(s) did not receive it "
                          "within rollout.weight_push_timeout_s=2")  # fmt: skip
    assert "rank 1 is alive but silent (hung)" in msg and "holds version -1" in msg
    assert stalled and stalled[0][0] == 1 and stalled[0][1] == msg


def test_a_push_is_done_when_the_worker_holds_it_with_its_metrics(tmp_path: Any) -> None:
    """The same real worker process reading the push: ``wait`` returns once its heartbeat
    says it holds the version; ``metrics`` give the push time and the worker's wait."""
    w = _weights()

    def trainer(ctrl: Channel, group: WeightGroup, store: Any) -> Any:
        pub = WeightPublisher(ctrl, group, bucket_bytes=4096, overlap=True,
                              watch=ws.PushWatch(store, [1], timeout_s=60))  # fmt: skip
        pub.push(2, _specs(w), iter(w.items()))
        assert pub.wait(60)
        assert ws.read_heartbeat(store, 1)["version"] == 2
        return pub.metrics(), pub.copy_stream.entered

    (m, entered), _ = _with_worker_process(tmp_path, "reads", trainer)
    assert m["async/push_s"] > 0 and m["async/push_snapshot_s"] > 0
    assert m["async/worker_1_wait_weights_s"] == pytest.approx(0.25)
    # Every entry was copied, and every bucket allocated, on the copy stream (the CUDA path).
    assert entered == len(w) + len(plan_buckets(_specs(w), 4096))


@CUDA
def test_cuda_stream_the_push_does_not_wait_for_the_next_steps_compute() -> None:
    """The sending thread's bucket copies run on the push's own stream: with the next step's
    compute queued on the default stream, the push ends while that compute still runs (on
    main the thread synchronised the default stream: it ended after the compute)."""

    class Grp:
        def bcast(self, obj: Any = None) -> None:
            pass

    dev = torch.device("cuda")
    w = {f"l{i}.weight": torch.randn(1 << 20, device=dev).bfloat16() for i in range(8)}
    pub = WeightPublisher(Grp(), Grp(), bucket_bytes=4 << 20, overlap=True, device=dev)
    assert pub.copy_stream.stream is not None
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    gate = threading.Event()
    real = pub._send_all
    pub._send_all = lambda bufs: (gate.wait(60), real(bufs))  # type: ignore[method-assign]
    pub.push(1, _specs(w), iter(w.items()))  # packed (after the update); sending held
    x = a
    for _ in range(400):  # the next step: ~0.5 s of matmuls queued on the default stream
        x = (x @ a) * 1e-3
    done = torch.cuda.Event()
    done.record()
    gate.set()
    assert pub.wait(60)
    assert not done.query(), "the push waited for the compute on the default stream"
    torch.cuda.synchronize()
