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
2. after the swap, the engine's own copy (``verify_engine``): the HF engine's by name
   (``loaded_weights``: its module state dict, read back and summed on its device); vLLM's by
   ``element_sum`` (``VLLMEngine.element_sums``): vLLM renames and fuses the checkpoint's
   tensors (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``) and may repack a layout,
   so its parameters are compared by the sum of their elements' bit patterns, which is blind
   to order and adds over concatenation: a fused parameter's sum is its parts'. Where vLLM
   keeps no tensor to read (on CPU it moves linear weights into oneDNN handles and empties
   them; GPU keeps them) or shards it (tensor parallel), that parameter is not compared;
   vLLM's reload raises itself for any parameter it did not reach (``paravt.engines.vllm``).

A mismatch raises ``WeightSyncError`` naming the tensor and the version: the worker reports it
and exits, and the trainer raises it as ``WorkerFailed`` at its next ``collect`` (the existing
failure path: the last completed step is checkpointed).
"""

from __future__ import annotations

import contextlib
import json
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


class PushStalled(RuntimeError):
    """A weight push passed its deadline (``rollout.weight_push_timeout_s``) with a worker not
    holding the version; the message names each such worker and what its heartbeat says.
    Raised by ``WeightPublisher.wait``; ``RolloutPipeline`` turns it into ``WorkerFailed``
    at its next ``collect``."""


#: A worker's heartbeat on the rendezvous store (``Heartbeat``, read by ``PushWatch``).
HEARTBEAT_KEY = "paravt/async/heartbeat/{rank}"
#: A heartbeat older than this many intervals counts as gone (not merely busy).
STALE_BEATS = 3


class Heartbeat:
    """A rollout worker's heartbeat on the rendezvous ``store`` (``paravt.workers.worker``):
    every ``interval_s`` (a daemon thread) and at once on each change, it writes the version it
    last received whole and verified (``received``) and its total wait for weights
    (``waited``: the main thread blocked until the version its work needs arrived) with the
    wall time. The trainer's ``PushWatch`` reads them: a fresh beat without the pushed version
    is a worker alive but silent (hung), a stale one a worker gone; ``WeightPublisher.metrics``
    reports each worker's wait. ``start`` begins the beats; ``stop`` ends them."""

    def __init__(self, store: Any, rank: int, interval_s: float = 2.0) -> None:
        self.store, self.rank, self.interval_s = store, int(rank), float(interval_s)
        self.version = -1
        self.wait_s = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def received(self, version: int) -> None:
        """A version arrived whole and verified (``receive``)."""
        with self._lock:
            self.version = max(self.version, int(version))
        self.beat()

    def waited(self, seconds: float) -> None:
        """The worker's main thread waited ``seconds`` for the weights its work needs."""
        with self._lock:
            self.wait_s += max(0.0, float(seconds))
        self.beat()

    def beat(self) -> bool:
        """Write this worker's state to the store; False when the store is gone (the trainer
        that hosts it has exited: its own fault path names that, a beat never raises)."""
        with self._lock:
            state = {"t": time.time(), "version": self.version, "wait_s": self.wait_s,
                     "interval_s": self.interval_s}  # fmt: skip
        try:
            self.store.set(HEARTBEAT_KEY.format(rank=self.rank), json.dumps(state))
        except Exception:  # noqa: BLE001 - a closed store raises several kinds
            return False
        return True

    def start(self) -> Heartbeat:
        self.beat()
        self._thread = threading.Thread(
            target=self._run, name=f"paravt-heartbeat-{self.rank}", daemon=True
        )
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.beat():  # the store is gone: the trainer has exited
                return

    def stop(self) -> None:
        self._stop.set()


def read_heartbeat(store: Any, rank: int) -> dict[str, float] | None:
    """Worker ``rank``'s last heartbeat (``Heartbeat``), or None when it never beat."""
    key = HEARTBEAT_KEY.format(rank=int(rank))
    if not store.check([key]):
        return None
    return json.loads(store.get(key))


class PushWatch:
    """Trainer rank 0's deadline on each weight push (``WeightPublisher``): from ``start``,
    every worker in ``ranks`` must hold the version (its ``Heartbeat`` says so) within
    ``timeout_s``; ``overdue`` names the ones that do not, as ``PushStalled``: alive but
    silent (a fresh heartbeat: hung in its receive or its checksum) or gone (no beat for
    ``STALE_BEATS`` intervals)."""

    def __init__(
        self,
        store: Any,
        ranks: Iterable[int],
        timeout_s: float = 600.0,
        on_stall: Any = None,
    ) -> None:
        self.store, self.ranks, self.timeout_s = store, [int(r) for r in ranks], float(timeout_s)
        #: ``on_stall(rank, error)``: called once per stalled push, from the publisher's watch
        #: thread, with the first late worker (``RolloutPipeline`` queues it as that worker's
        #: failure, so the trainer's wait for rollouts raises ``WorkerFailed`` at once).
        self.on_stall = on_stall
        self.version = -1
        self.t0 = 0.0

    def start(self, version: int) -> None:
        self.version, self.t0 = int(version), time.perf_counter()

    def beats(self) -> dict[int, dict[str, float] | None]:
        return {r: read_heartbeat(self.store, r) for r in self.ranks}

    def missing(self) -> list[int]:
        """The workers that do not hold the pushed version yet."""
        return [r for r, b in self.beats().items() if b is None or b["version"] < self.version]

    def remaining(self) -> float:
        """Seconds left until the push's deadline (a send on the caller's thread waits no
        longer: ``WeightPublisher.push``)."""
        return self.t0 + self.timeout_s - time.perf_counter()

    def overdue(self) -> None:
        """Raise ``PushStalled`` when the deadline has passed and a worker lacks the version."""
        if time.perf_counter() - self.t0 <= self.timeout_s or not self.missing():
            return
        raise self.stalled()

    def stalled(self) -> PushStalled:
        """``PushStalled`` naming the workers that do not hold the version and what their
        heartbeats say (alive but silent, or gone)."""
        took, late = time.perf_counter() - self.t0, self.missing()
        now, parts = time.time(), []
        for r in late:
            b = read_heartbeat(self.store, r)
            if b is None:
                parts.append(f"rank {r} never beat (no heartbeat on the store)")
                continue
            age = now - b["t"]
            state = ("alive but silent (hung)" if age <= STALE_BEATS * b["interval_s"]
                     else f"gone (no heartbeat for {age:.0f} s)")  # fmt: skip
            parts.append(
                f"rank {r} is {state}: last heartbeat {age:.1f} s ago, holds version "
                f"{int(b['version'])}"
            )
        return PushStalled(
            f"weight push of version {self.version}: {len(late)} rollout worker(s) did not "
            f"receive it within rollout.weight_push_timeout_s={self.timeout_s:g} "
            f"({took:.0f} s): {'; '.join(parts)}. Stopping (--resume continues from the last "
            "checkpoint); raise rollout.weight_push_timeout_s if the fabric is just slow"
        )


class CopyStream:
    """The dedicated CUDA stream the weight push copies its buckets on (issue 61 item 5): the
    snapshot's gather-side copies and checksums (trainer, after the update) and the sending
    thread's host-to-device bucket copies, so neither queues behind nor holds up the next
    step's compute on the default stream. On a CPU the same calls with no stream (no-ops), so
    the CPU runs the CUDA path's code. ``entered`` counts the uses (tests)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.stream: Any = torch.cuda.Stream(self.device) if cuda else None
        self.entered = 0

    @contextlib.contextmanager
    def copying(self, after_compute: bool) -> Iterator[None]:
        """Queue the block's work on the copy stream. ``after_compute``: first wait for what the
        current stream has queued (the update that wrote the weights being packed)."""
        self.entered += 1
        if self.stream is None:
            yield
            return
        if after_compute:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def keep(self, t: torch.Tensor) -> None:
        """``t`` (allocated on another stream) is read on the copy stream: its memory must not
        be reused before that work ends (the caching allocator's ``record_stream``)."""
        if self.stream is not None and t.is_cuda:
            t.record_stream(self.stream)

    def synchronize(self) -> None:
        """Wait for the copy stream's work only (not the compute on the default stream)."""
        if self.stream is not None:
            self.stream.synchronize()


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
    #: (n, 3) int64: the trainer's checksums; (0, 3) where a colocated push recorded element
    #: sums instead (``SumRecorder`` with ``elem_dtype``: vLLM is checked by those alone)
    sums: torch.Tensor
    #: (n,) int64 ``element_sum`` of each tensor in the engine's weight dtype, where the
    #: tensors were streamed past (``SumRecorder``, colocated); None: computed from ``tensors``
    elems: torch.Tensor | None = None

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


def element_sum(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The sum, in int64, of ``t``'s elements (cast to ``dtype`` first, if given) read as
    signed integers of their width (bf16 / fp16 as int16, fp32 as int32): a 0-d tensor on
    ``t``'s device. Unlike :func:`checksum` it ignores where each element sits, and it adds
    over concatenation, so a parameter an engine fused from several checkpoint tensors (vLLM's
    ``qkv_proj``) sums to its parts' sums, and a layout it repacked keeps its sum. What
    :func:`verify_engine` compares vLLM's copy by. Exact integer arithmetic (below 2^32
    elements), the same on CPU and CUDA; cast and summed ``CHUNK_ROWS · COLS`` elements at a
    time, so it holds what :func:`checksum` does besides its input, not an int64 copy of it
    (the 8B recipe's embedding: 5 GiB)."""
    x = t.detach().reshape(-1)  # a view of a contiguous tensor
    want = x.dtype if dtype is None else dtype
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.itemsize]
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    step = CHUNK_ROWS * COLS
    for a in range(0, x.numel(), step):
        chunk = x[a : a + step]
        total += (
            (chunk if chunk.dtype == want else chunk.to(want)).view(ints).sum(dtype=torch.int64)
        )
    return total


@dataclass(frozen=True)
class EngineSums:
    """An engine's own copy read back by :func:`element_sum` (``VLLMEngine.element_sums``):
    ``targets`` the engine parameter each checkpoint name was loaded into, ``sums`` each
    readable parameter's sum in ``dtype``, ``unreadable`` the parameters the engine keeps no
    tensor for (not compared)."""

    targets: dict[str, str]
    sums: dict[str, int]
    unreadable: frozenset[str]
    dtype: torch.dtype


def verify_element_sums(specs: list[Spec], want: list[int], got: EngineSums, version: int) -> int:
    """Raise ``WeightSyncError`` naming the first engine parameter whose element sum is not the
    sum of the trainer's tensors loaded into it (``want``: one per spec); returns how many
    parameters were compared. A push none of whose names reached an engine parameter raises
    too (a broken name mapping would otherwise check nothing)."""
    expect: dict[str, int] = {}
    parts: dict[str, list[str]] = {}
    for s, w in zip(specs, want):
        p = got.targets.get(s.name)
        if p is not None:
            expect[p] = expect.get(p, 0) + int(w)
            parts.setdefault(p, []).append(s.name)
    if specs and not expect:
        raise WeightSyncError(
            f"weight sync of version {version}: none of the {len(specs)} tensors pushed maps to "
            f"a parameter of the engine (e.g. {specs[0].name!r}); its copy cannot be checked"
        )
    compared = 0
    for p, e in expect.items():
        if p in got.unreadable:
            continue
        compared += 1
        if got.sums.get(p) != e:
            raise WeightSyncError(
                f"weight sync: the engine's parameter {p!r} (from {', '.join(parts[p])}) of "
                f"version {version} differs from the trainer's (element sum in "
                f"{str(got.dtype).removeprefix('torch.')} {got.sums.get(p)} != {e}); stopping "
                "rather than generating with wrong weights"
            )
    return compared


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
    trainer's. Read back by name where the engine offers it (``loaded_weights()``, the HF
    engine: each tensor's :func:`checksum`; a tensor held in another dtype than sent is cast
    to the sent one first, exact for a wider engine dtype), else by :func:`element_sum` where
    it offers that (``element_sums``, vLLM: each parameter against the sum of the tensors
    loaded into it, in the engine's ``weight_dtype``; ``staged.elems`` where the tensors were
    streamed past, else summed from ``staged.tensors``). False where neither is possible (an
    engine with neither, or vLLM sharded over tensor-parallel workers)."""
    loaded = getattr(engine, "loaded_weights", None)
    if loaded is None:
        return _verify_element_sums(engine, staged)
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


def _verify_element_sums(engine: Any, staged: Staged) -> bool:
    read = getattr(engine, "element_sums", None)
    if read is None or (staged.elems is None and len(staged.tensors) != len(staged.specs)):
        return False
    dtype = getattr(engine, "weight_dtype", None)
    got = read({s.name for s in staged.specs}, dtype)
    if got is None:
        return False
    if staged.elems is not None:
        want = staged.elems.tolist()
    else:
        want = [int(element_sum(t, dtype)) for t in staged.tensors]
    n = verify_element_sums(staged.specs, want, got, staged.version)
    log.debug(f"weight sync {staged.version}: {n} engine parameters checked by element sum")
    return True


class SumRecorder:
    """Wraps a ``(name, tensor)`` stream (``paravt.distributed.full_weights``, or a state
    dict's items), recording each tensor's spec as it passes and what the engine is checked
    by: its :func:`checksum` (the HF engine, read back by name), or with ``elem_dtype`` (the
    engine's ``weight_dtype``: vLLM) only its :func:`element_sum` in that dtype, the one sum
    ``verify_engine`` reads for such an engine (``Staged.sums`` is then empty). What
    ``push_weights`` checks the colocated engine's copy against after ``sync_weights``
    consumed the stream."""

    def __init__(
        self, stream: Iterable[tuple[str, torch.Tensor]], elem_dtype: torch.dtype | None = None
    ) -> None:
        self.stream = stream
        self.specs: list[Spec] = []
        self._sums: list[torch.Tensor] = []
        self._elems: list[torch.Tensor] = []
        self.elem_dtype = elem_dtype

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.stream:
            self.specs.append(Spec(name, tuple(t.shape), t.dtype))
            if self.elem_dtype is None:
                self._sums.append(checksum(t))
            else:
                self._elems.append(element_sum(t, self.elem_dtype))
            yield name, t

    def staged(self, version: int) -> Staged:
        sums = torch.stack(self._sums) if self._sums else torch.zeros(0, 3, dtype=torch.int64)
        if self.elem_dtype is None:
            elems = None
        else:
            elems = torch.stack(self._elems) if self._elems else torch.zeros(0, dtype=torch.int64)
        return Staged(version, self.specs, [], sums, elems)


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
        watch: PushWatch | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"rollout.weight_sync={mode!r}: choose one of {MODES}")
        if mode == "bucketed" and group is None:
            raise ValueError("the bucketed weight sync needs the weights group (init_async)")
        self.ctrl, self.mode = ctrl, mode
        #: ``Any``, not ``Any | None``: ``None`` only under ``host``, which never sends on it.
        self.group: Any = group
        self.bucket_bytes, self.overlap = int(bucket_bytes), bool(overlap)
        self.device = torch.device(device)
        #: The bucket copies' own CUDA stream (a no-op on a CPU): ``CopyStream``.
        self.copy_stream = CopyStream(self.device)
        #: The push's deadline and the workers' heartbeats (None: no deadline, e.g. tests).
        self.watch = watch
        self._thread: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._error: BaseException | None = None
        self._t0 = 0.0
        self.last_snapshot_s = 0.0
        #: Seconds of the last push that completed: its start until every worker held it.
        self.last_push_s = 0.0

    @property
    def in_flight(self) -> bool:
        """A background push is still sending."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the push to end (``timeout``: seconds, None = until it does); True when it
        has: sent and, with a ``watch``, held by every worker (their heartbeats). Its error,
        if it failed, is raised here (once): a send's, or ``PushStalled`` naming the workers
        that did not hold it by its deadline."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            if isinstance(self._error, PushStalled):  # raised at once: the sender may be stuck
                stalled, self._error = self._error, None
                raise stalled
            alive = [th for th in (self._thread, self._watcher) if th is not None and th.is_alive()]
            if not alive:
                break
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return False
            alive[0].join(0.05 if left is None else min(0.05, left))
        self._thread = self._watcher = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        return True

    def _watch(self, sender: threading.Thread | None) -> None:
        """The push's deadline (its own thread, so that a stall is noticed whoever waits):
        every worker must hold the version (``PushWatch``) by ``rollout.weight_push_timeout_s``,
        else ``PushStalled`` (kept for ``wait``, and handed to ``watch.on_stall``)."""
        w = self.watch
        assert w is not None
        try:
            while True:
                if (sender is None or not sender.is_alive()) and not w.missing():
                    self.last_push_s = time.perf_counter() - self._t0
                    return
                if self._error is not None and (sender is None or not sender.is_alive()):
                    return  # the send failed: that error is the push's
                w.overdue()
                time.sleep(0.05)
        except PushStalled as e:
            late = w.missing()
            if not late:  # every worker took it as the deadline passed: held in time
                self.last_push_s = time.perf_counter() - self._t0
                return
            self._error = self._error or e
            if w.on_stall is not None:
                w.on_stall(late[0], e)

    def metrics(self) -> dict[str, float]:
        """``async/push_s`` (the last completed push: its start until every worker held it),
        ``async/push_snapshot_s`` (its packing on the trainer, overlapped pushes) and, with a
        ``watch``, ``async/worker_<rank>_wait_weights_s`` (each worker's total wait for
        weights so far, from its heartbeat). Logged with every step
        (``paravt.train.train_step``)."""
        out = {"async/push_s": self.last_push_s, "async/push_snapshot_s": self.last_snapshot_s}
        if self.watch is not None:
            for r, b in self.watch.beats().items():
                if b is not None:
                    out[f"async/worker_{r}_wait_weights_s"] = float(b["wait_s"])
        return out

    def push(
        self, version: int, specs: list[Spec], stream: Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Send ``stream`` (the ``specs``' tensors, in order, cast already) as ``version``.
        The stream is always consumed to its end (under FSDP2 each entry is a collective the
        other trainer ranks take part in), also when a send fails; the failure is then
        raised. A previous background push must have ended (``wait``)."""
        if self.in_flight:
            raise RuntimeError("WeightPublisher.push: the previous push is still in flight")
        if self._watcher is not None and self._watcher.is_alive():
            raise RuntimeError("WeightPublisher.push: the previous push is not held yet (wait)")
        self._t0 = time.perf_counter()
        if self.watch is not None:
            self.watch.start(version)
        it = iter(stream)
        sent = False
        try:
            header = {"kind": "weights", "version": int(version), "sync": self.mode,
                      "specs": [(s.name, s.shape, s.dtype) for s in specs],
                      "bucket_bytes": self.bucket_bytes}  # fmt: skip
            self._on_time(lambda: self.ctrl.bcast(header, **self._deadline()))
            if self.mode == "host":
                self._push_host(specs, it)
            else:
                self._push_bucketed(specs, it)
            sent = True
        finally:
            for _ in it:  # a failed send still walks the collectives to the end
                pass
            # (a failed send's error propagates: no deadline to watch)
            if sent and self.watch is not None:
                self._watcher = threading.Thread(
                    target=self._watch, args=(self._thread,), name="paravt-push-watch",
                    daemon=True,
                )  # fmt: skip
                self._watcher.start()
            elif sent and self._thread is None:
                self.last_push_s = time.perf_counter() - self._t0

    def _push_host(self, specs: list[Spec], it: Iterator[tuple[str, torch.Tensor]]) -> None:
        sums = []
        for s, (name, t) in zip(specs, it):
            _check_entry(s, name, t)
            sums.append(checksum(t))
            t = t.detach().to("cpu").contiguous()
            self._on_time(lambda t=t: self.ctrl.bcast_tensor(t, **self._deadline()))
        self._on_time(lambda: self.ctrl.bcast_tensor(_stack(sums, "cpu"), **self._deadline()))

    def _deadline(self) -> dict[str, float]:
        """The ``timeout_s`` of a send on the caller's thread: what is left of the push's
        deadline (none without a ``watch``)."""
        return {} if self.watch is None else {"timeout_s": self.watch.remaining()}

    def _on_time(self, send: Any) -> None:
        """Run a send on the caller's thread under the push's deadline: a worker that does
        not take part in time (alive but silent: it never reads its control stream) raises
        ``PushStalled`` naming it, here, and hands it to ``watch.on_stall``."""
        if self.watch is None:
            send()
            return
        try:
            send()
        except RuntimeError as e:
            if "timed out" not in str(e):  # (the wait was what the deadline left)
                raise
            err = self.watch.stalled()
            late = self.watch.missing()
            if self.watch.on_stall is not None:
                self.watch.on_stall(late[0] if late else -1, err)
            raise err from e

    def _push_bucketed(self, specs: list[Spec], it: Iterator[tuple[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        sums: list[torch.Tensor] = []
        ready: list[torch.Tensor] = []
        # Overlapped on CUDA the snapshot waits in pinned host memory, not on the device (a
        # second compute-dtype model, 16 GiB at 8B): the sending thread copies one bucket at a
        # time back to the device for NCCL (``_send_all``).
        host = self.overlap and self.device.type == "cuda"
        cs = self.copy_stream
        for b in plan_buckets(specs, self.bucket_bytes):
            if host:
                buf = torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=True)
            else:
                with cs.copying(after_compute=False):  # (allocated for the copy stream)
                    buf = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
            for sl in b.slots:
                name, t = next(it)  # (gathered on the default stream: a collective)
                _check_entry(specs[sl.index], name, t)
                with cs.copying(after_compute=True):  # after the gather that produced it
                    cs.keep(t)
                    t = t.detach().to(self.device)
                    sums.append(checksum(t))
                    buf[sl.offset : sl.offset + sl.nbytes].copy_(as_bytes(t), non_blocking=host)
            if self.overlap:
                ready.append(buf)
            else:  # on this thread: under what is left of the push's deadline
                self._packed()
                self._on_time(lambda b=buf: self.group.bcast(b, **self._deadline()))
        ready.append(_stack(sums, self.device))
        self._packed()  # (overlap: the snapshot is complete before the thread sends it)
        if not self.overlap:
            last = ready.pop()
            self._on_time(lambda: self.group.bcast(last, **self._deadline()))
            return
        self.last_snapshot_s = time.perf_counter() - t0
        self._thread = threading.Thread(
            target=self._send_all, args=(ready,), name="paravt-weight-push", daemon=True
        )
        self._thread.start()

    def _packed(self) -> None:
        """CUDA: wait for the packing queued on the copy stream (not for the compute queued on
        the default stream; the weights group sends on a side stream of its own)."""
        self.copy_stream.synchronize()

    def _send_all(self, bufs: list[torch.Tensor]) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            while bufs:
                buf = bufs.pop(0)  # each buffer freed once sent
                if buf.device != self.device:  # pinned host snapshot: one bucket on the device
                    # On the copy stream: the default stream is the next step's compute.
                    with self.copy_stream.copying(after_compute=False):
                        buf = buf.to(self.device, non_blocking=True)
                    self.copy_stream.synchronize()
                self.group.bcast(buf)
            self.last_push_s = time.perf_counter() - self._t0  # (sent; watched: until held)
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
    header: dict[str, Any],
    ctrl: Any,
    group: Any | None,
    device: torch.device | str = "cpu",
    heartbeat: Heartbeat | None = None,
) -> Staged:
    """Receive the version announced by ``header`` (the worker's end of ``push``), verify the
    received tensors against the trainer's checksums and return them staged. ``host``: over
    ``ctrl`` (call it from the thread that reads ``ctrl``), into CPU tensors; ``bucketed``:
    over ``group`` into buffers on ``device`` (the group's). Raises ``WeightSyncError`` on a
    mismatch. ``heartbeat``: told the version once it is verified (the trainer's
    ``PushWatch`` waits for that)."""
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
    if heartbeat is not None:
        heartbeat.received(version)
    return Staged(version, specs, tensors, sums)
