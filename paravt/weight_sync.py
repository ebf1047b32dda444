"""Weight sync from trainer rank 0 to the rollout workers of an asynchronous run, verified.

Used by ``RolloutPipeline.publish`` (the sending end), the worker's control and weight threads
(``paravt.workers.worker``: receive, stage, swap) and, for the checksum check alone, the
colocated ``paravt.rollout_source.push_weights``. Two wire formats, chosen by
``rollout.weight_sync``:

* ``bucketed`` (default): a header on the ``ctrl`` stream (the version, every tensor's name,
  shape and dtype, the bucket size), then the tensors' bytes packed into flat uint8 buckets of
  about ``rollout.weight_bucket_mb`` (``plan_buckets``: state-dict order, each tensor 16-byte
  aligned, a tensor larger than a bucket alone in its own), one broadcast per bucket over the
  trainer-worker weights group (``paravt.workers.roles.WeightGroup``: NCCL with CUDA tensors
  when the run is on GPUs, gloo with CPU tensors otherwise), then one ``(n, 3)`` int64 tensor
  of per-tensor checksums on the same group. With ``rollout.weight_sync_overlap`` (default)
  the trainer packs every bucket first (the snapshot: the cast compute-dtype copy, taken
  before the next optimizer step can touch the weights: one compute-dtype copy of the model
  until the push ends, in pinned host memory under CUDA, each bucket copied back to the
  device as the thread sends it, so the device holds one bucket) and a background thread broadcasts
  them while the trainer starts the next step (``WeightPublisher.wait`` joins it before the
  next push or the stop); without, each bucket is broadcast as soon as it is packed (one
  bucket held at a time).
  The worker receives on its own thread (so its control stream never waits for a push) into
  buffers on its device; the staged tensors are views into them (``unpack_bucket``).
* ``host`` (the fallback, and the reference the tests compare against): the header, then one
  ``ctrl`` broadcast per tensor through host memory (gloo), then the checksum tensor, received
  inline by the worker's control thread.

Verification (always on): ``checksum`` is three int64 sums over a tensor's bytes read as
int32 words (int16 / uint8 when its size is not a multiple of 4 / 2) laid out as rows of 1024:
the total, a column-weighted and a row-weighted sum (so a moved or swapped block changes it,
not only a changed value). Integer arithmetic with no overflow for tensors below 2^32 words:
the same on CPU and CUDA, bit-exact, in a few reductions on the tensor's device. The trainer
sums what it sends (after the cast). The worker checks:

1. the staged tensors as received and unpacked (``receive``): a transport or unpack error;
2. after the swap, the engine's own copy (``verify_engine``), where the engine can return it
   by name (``loaded_weights``: the HF engine's module state dict, read back and summed on its
   device). vLLM's copy cannot be read back cheaply (repacked checkpoint names: fused qkv /
   gate-up, tensor-parallel shards), so for vLLM only step 1 runs; its reload raises itself
   for any parameter it did not reach (``paravt.engines.vllm``).

A mismatch raises ``WeightSyncError`` naming the tensor and the version: the worker reports it
and exits, and the trainer raises it as ``WorkerFailed`` at its next ``collect`` (the existing
failure path: the last completed step is checkpointed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from paravt.log import get_logger

log = get_logger(__name__)

#: Byte alignment of every tensor inside a bucket (any dtype's view of it is then legal).
ALIGN = 16
#: Words per row of the checksum's 2-D layout.
COLS = 1024
#: Rows summed at a time: a sum with an int64 ``dtype`` over int32 words makes an int64 copy
#: of its input on the CPU, so ``checksum`` holds at most ``CHUNK_ROWS · COLS · 8`` bytes (32
#: MiB) of it, not twice the tensor (2.3 GiB for the 8B recipe's embedding). int64 sums are
#: exact: the chunked sums equal the whole ones.
CHUNK_ROWS = 4096
#: The most a checksum holds besides its input (``paravt.plan``'s weight-check transient).
CHECKSUM_TRANSIENT_BYTES = CHUNK_ROWS * COLS * 8
#: Modulus applied to column and row sums before weighting (keeps every product in int64).
_P = 2**31 - 1
#: The row weights cycle with this period (prime), so a weight stays below 2^10.
_ROW_PERIOD = 1021
#: The wire formats (``rollout.weight_sync``).
MODES = ("bucketed", "host")


class WeightSyncError(RuntimeError):
    """A tensor the worker received or loaded differs from the trainer's (checksum)."""


@dataclass(frozen=True)
class Spec:
    """One tensor of a push: its name, shape and dtype as sent (floats in the compute dtype)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Slot:
    """Where tensor ``index`` of a push lies in its bucket."""

    index: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """One broadcast of the bucketed format: its slots and its size in bytes."""

    slots: tuple[Slot, ...]
    nbytes: int


@dataclass
class Staged:
    """One received, verified version, waiting for the worker's main thread to swap it in."""

    version: int
    specs: list[Spec]
    tensors: list[torch.Tensor]
    sums: torch.Tensor  # (n, 3) int64: the trainer's checksums

    def named(self) -> list[tuple[str, torch.Tensor]]:
        return [(s.name, t) for s, t in zip(self.specs, self.tensors)]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(specs: list[Spec], bucket_bytes: int) -> list[Bucket]:
    """Group ``specs`` (in order) into buckets of at most ``bucket_bytes`` (each tensor's
    offset 16-byte aligned); a tensor larger than ``bucket_bytes`` gets a bucket of its own.
    Trainer and worker compute the same plan from the header."""
    if bucket_bytes < 1:
        raise ValueError(f"plan_buckets: bucket_bytes={bucket_bytes} must be >= 1")
    out: list[Bucket] = []
    slots: list[Slot] = []
    end = 0
    for i, s in enumerate(specs):
        start = _align(end)
        if slots and start + s.nbytes > bucket_bytes:
            out.append(Bucket(tuple(slots), end))
            slots, start = [], 0
        slots.append(Slot(i, start, s.nbytes))
        end = start + s.nbytes
    if slots:
        out.append(Bucket(tuple(slots), end))
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a contiguous 1-D uint8 tensor on its device (a view when it can be)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def unpack_bucket(bucket: Bucket, buf: torch.Tensor, specs: list[Spec]) -> list[torch.Tensor]:
    """The tensors of ``bucket`` as views into ``buf`` (its received bytes), in slot order."""
    out = []
    for sl in bucket.slots:
        s = specs[sl.index]
        out.append(buf[sl.offset : sl.offset + sl.nbytes].view(s.dtype).view(s.shape))
    return out


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Three int64 sums over ``t``'s bytes (see the module docstring), on ``t``'s device."""
    b = as_bytes(t)
    n = b.numel()
    width = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    if b.storage_offset() % width:
        b = b.clone()
    w = b.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[width])
    rows = w.numel() // COLS
    head, tail = w[: rows * COLS].view(rows, COLS), w[rows * COLS :]
    dev = t.device
    col = torch.zeros(COLS, dtype=torch.int64, device=dev)
    parts = [torch.zeros(0, dtype=torch.int64, device=dev)]
    for a in range(0, rows, CHUNK_ROWS):  # (CHUNK_ROWS: the int64 copy stays small)
        chunk = head[a : a + CHUNK_ROWS]
        col += chunk.sum(0, dtype=torch.int64)
        parts.append(chunk.sum(1, dtype=torch.int64))
    row = torch.cat(parts)
    total = col.sum() + tail.sum(dtype=torch.int64)
    cw = torch.arange(1, COLS + 1, device=dev, dtype=torch.int64)
    tw = torch.arange(1, tail.numel() + 1, device=dev, dtype=torch.int64)
    cols = (col.remainder(_P) * cw).sum() + (tail.to(torch.int64).remainder(_P) * tw).sum()
    rw = torch.arange(rows, device=dev, dtype=torch.int64).remainder(_ROW_PERIOD) + 1
    rows_sum = (row.remainder(_P) * rw).sum()
    return torch.stack([total, cols, rows_sum])


def _first_mismatch(got: torch.Tensor, want: torch.Tensor) -> int | None:
    """Index of the first row where ``got`` and ``want`` ((n, 3) int64) differ; None if none."""
    bad = (got.to(want.device) != want).any(dim=1).nonzero()
    return int(bad[0, 0]) if bad.numel() else None


def verify(
    specs: list[Spec], tensors: list[torch.Tensor], sums: torch.Tensor, version: int, where: str
) -> None:
    """Raise ``WeightSyncError`` naming the first of ``tensors`` whose checksum is not the
    trainer's (``sums``), with ``version`` and ``where`` (what was checked)."""
    if len(tensors) != len(specs) or sums.shape != (len(specs), 3):
        raise WeightSyncError(
            f"weight sync of version {version}: {len(tensors)} tensor(s) and checksums of "
            f"shape {tuple(sums.shape)} for {len(specs)} announced ({where})"
        )
    if not specs:
        return
    got = torch.stack([checksum(t) for t in tensors])
    i = _first_mismatch(got, sums)
    if i is not None:
        s = specs[i]
        raise WeightSyncError(
            f"weight sync: tensor {s.name!r} of version {version} differs from the trainer's "
            f"({where}: checksum {got[i].tolist()} != the trainer's {sums[i].tolist()}, "
            f"shape {list(s.shape)}, {str(s.dtype).removeprefix('torch.')}); stopping rather "
            "than generating with wrong weights"
        )


def verify_engine(engine: Any, staged: Staged) -> bool:
    """After ``engine.sync_weights(staged.named())``: check the engine's own copy against the
    trainer's checksums, read back by name where the engine offers it (``loaded_weights()``,
    the HF engine); False where it cannot (vLLM: the staged tensors were checked on receipt).
    An engine tensor held in another dtype than sent is cast to the sent one first (exact for
    a wider engine dtype)."""
    loaded = getattr(engine, "loaded_weights", None)
    if loaded is None:
        return False
    own = loaded()
    missing = [s.name for s in staged.specs if s.name not in own]
    if missing:
        raise WeightSyncError(
            f"weight sync: the engine has no tensor {missing[0]!r} (version {staged.version})"
        )
    tensors = [own[s.name] if own[s.name].dtype == s.dtype else own[s.name].to(s.dtype)
               for s in staged.specs]  # fmt: skip
    verify(staged.specs, tensors, staged.sums, staged.version, "read back from the engine")
    return True


class SumRecorder:
    """Wraps a ``(name, tensor)`` stream (``paravt.distributed.full_weights``), recording each
    tensor's spec and checksum as it passes: what ``push_weights`` checks the colocated HF
    engine's replica against after ``sync_weights`` consumed the stream."""

    def __init__(self, stream: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.stream = stream
        self.specs: list[Spec] = []
        self._sums: list[torch.Tensor] = []

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.stream:
            self.specs.append(Spec(name, tuple(t.shape), t.dtype))
            self._sums.append(checksum(t))
            yield name, t

    def staged(self, version: int) -> Staged:
        sums = torch.stack(self._sums) if self._sums else torch.zeros(0, 3, dtype=torch.int64)
        return Staged(version, self.specs, [], sums)


# ---------------------------------------------------------------------------- trainer side
class WeightPublisher:
    """Trainer rank 0's end: ``push`` one version (see the module docstring). ``ctrl``: the
    ordered control stream (a ``paravt.workers.roles.Channel``); ``group``: the weights group
    (a ``paravt.workers.roles.WeightGroup``; None for ``host``); ``device``: where buckets are
    packed (the group's: rank 0's CUDA device under NCCL, the CPU under gloo)."""

    def __init__(
        self,
        ctrl: Any,
        group: Any | None,
        mode: str = "bucketed",
        bucket_bytes: int = 256 << 20,
        overlap: bool = True,
        device: torch.device | str = "cpu",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"rollout.weight_sync={mode!r}: choose one of {MODES}")
        if mode == "bucketed" and group is None:
            raise ValueError("the bucketed weight sync needs the weights group (init_async)")
        self.ctrl, self.group, self.mode = ctrl, group, mode
        self.bucket_bytes, self.overlap = int(bucket_bytes), bool(overlap)
        self.device = torch.device(device)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_snapshot_s = 0.0

    @property
    def in_flight(self) -> bool:
        """A background push is still sending."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Join the background push (``timeout``: seconds, None = until it ends); True when it
        has ended. Its error, if it failed, is raised here (once)."""
        th = self._thread
        if th is not None:
            th.join(timeout)
            if th.is_alive():
                return False
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        return True

    def push(
        self, version: int, specs: list[Spec], stream: Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Send ``stream`` (the ``specs``' tensors, in order, cast already) as ``version``.
        The stream is always consumed to its end (under FSDP2 each entry is a collective the
        other trainer ranks take part in), also when a send fails; the failure is then
        raised. A previous background push must have ended (``wait``)."""
        if self.in_flight:
            raise RuntimeError("WeightPublisher.push: the previous push is still in flight")
        it = iter(stream)
        try:
            header = {"kind": "weights", "version": int(version), "sync": self.mode,
                      "specs": [(s.name, s.shape, s.dtype) for s in specs],
                      "bucket_bytes": self.bucket_bytes}  # fmt: skip
            self.ctrl.bcast(header)
            if self.mode == "host":
                self._push_host(specs, it)
            else:
                self._push_bucketed(specs, it)
        finally:
            for _ in it:  # a failed send still walks the collectives to the end
                pass

    def _push_host(self, specs: list[Spec], it: Iterator[tuple[str, torch.Tensor]]) -> None:
        sums = []
        for s, (name, t) in zip(specs, it):
            _check_entry(s, name, t)
            sums.append(checksum(t))
            self.ctrl.bcast_tensor(t.detach().to("cpu").contiguous())
        self.ctrl.bcast_tensor(_stack(sums, "cpu"))

    def _push_bucketed(self, specs: list[Spec], it: Iterator[tuple[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        sums: list[torch.Tensor] = []
        ready: list[torch.Tensor] = []
        # Overlapped on CUDA the snapshot waits in pinned host memory, not on the device (a
        # second compute-dtype model, 16 GiB at 8B): the sending thread copies one bucket at a
        # time back to the device for NCCL (``_send_all``).
        host = self.overlap and self.device.type == "cuda"
        for b in plan_buckets(specs, self.bucket_bytes):
            if host:
                buf = torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=True)
            else:
                buf = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
            for sl in b.slots:
                name, t = next(it)
                _check_entry(specs[sl.index], name, t)
                t = t.detach().to(self.device)
                sums.append(checksum(t))
                buf[sl.offset : sl.offset + sl.nbytes].copy_(as_bytes(t), non_blocking=host)
            if self.overlap:
                ready.append(buf)
            else:
                self._packed()
                self.group.bcast(buf)
        ready.append(_stack(sums, self.device))
        self._packed()  # (overlap: the snapshot is complete before the thread sends it)
        if not self.overlap:
            self.group.bcast(ready.pop())
            return
        self.last_snapshot_s = time.perf_counter() - t0
        self._thread = threading.Thread(
            target=self._send_all, args=(ready,), name="paravt-weight-push", daemon=True
        )
        self._thread.start()

    def _packed(self) -> None:
        """CUDA: wait for the packing queued on this thread's stream (the weights group sends
        on a side stream of its own)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _send_all(self, bufs: list[torch.Tensor]) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            while bufs:
                buf = bufs.pop(0)  # each buffer freed once sent
                if buf.device != self.device:  # pinned host snapshot: one bucket on the device
                    buf = buf.to(self.device, non_blocking=True)
                    torch.cuda.current_stream(self.device).synchronize()
                self.group.bcast(buf)
        except BaseException as e:  # noqa: BLE001 - raised by wait()
            self._error = e


def _check_entry(spec: Spec, name: str, t: torch.Tensor) -> None:
    if name != spec.name or tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise ValueError(
            f"weight push: the stream's {name!r} {tuple(t.shape)} {t.dtype} is not the header's "
            f"{spec.name!r} {spec.shape} {spec.dtype} (state dict and stream out of order?)"
        )


def _stack(sums: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    if not sums:
        return torch.zeros(0, 3, dtype=torch.int64, device=device)
    return torch.stack(sums).to(device).contiguous()


# ----------------------------------------------------------------------------- worker side
def specs_of(header: dict[str, Any]) -> list[Spec]:
    """The ``Spec`` s of a weights header."""
    return [Spec(n, tuple(int(d) for d in shape), dtype) for n, shape, dtype in header["specs"]]


def receive(
    header: dict[str, Any], ctrl: Any, group: Any | None, device: torch.device | str = "cpu"
) -> Staged:
    """Receive the version announced by ``header`` (the worker's end of ``push``), verify the
    received tensors against the trainer's checksums and return them staged. ``host``: over
    ``ctrl`` (call it from the thread that reads ``ctrl``), into CPU tensors; ``bucketed``:
    over ``group`` into buffers on ``device`` (the group's). Raises ``WeightSyncError`` on a
    mismatch."""
    specs, version = specs_of(header), int(header["version"])
    if header.get("sync", "host") == "host":
        tensors = []
        for s in specs:
            t = torch.empty(s.shape, dtype=s.dtype)
            ctrl.bcast_tensor(t)
            tensors.append(t)
        sums = torch.empty(len(specs), 3, dtype=torch.int64)
        ctrl.bcast_tensor(sums)
    else:
        if group is None:
            raise WeightSyncError(
                f"version {version} comes bucketed but this worker has no weights group"
            )
        tensors = [torch.empty(0)] * len(specs)
        for b in plan_buckets(specs, int(header["bucket_bytes"])):
            buf = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
            group.bcast(buf)
            views = unpack_bucket(b, buf, specs)
            for sl, v in zip(b.slots, views):
                tensors[sl.index] = v
        sums = torch.empty(len(specs), 3, dtype=torch.int64, device=device)
        group.bcast(sums)
    verify(specs, tensors, sums, version, "as received")
    return Staged(version, specs, tensors, sums)
