"""Who is who in an asynchronous run, and the process groups between them.

``torchrun --nproc-per-node N -m paravt.train rollout.workers=W ...`` starts N processes; the
first ``T = N - W`` ranks are trainers, the last ``W`` are rollout workers. All of them meet
at torchrun's rendezvous store (``torch.distributed.rendezvous("env://")``); from it:

* the trainers' default process group spans the trainers only (``T > 1``: FSDP2 and the
  step's collectives; ``T = 1``: none, a one-rank context), so no collective of a step ever
  waits on a worker, and a worker's process has no default group at all: its engine (vLLM
  included) starts as it would in a single-process run;
* ``ctrl`` (gloo; trainer rank 0 and every worker): ONE ordered stream of broadcasts from the
  trainer: hello, prompt assignments, weight headers each followed by its tensors, stop;
* ``results[w]`` (gloo; trainer rank 0 and worker ``w``): that worker's finished rollouts, point
  to point. One group per worker, so each of the trainer's receiving threads owns its group.

The message groups are ``ProcessGroupGloo`` objects built on the rendezvous store (each used by
one thread per process), not registered in torch.distributed's world: nothing a model library
does with the default group can touch them. They get a long timeout (``CTRL_TIMEOUT``): a worker
waits on ``ctrl`` through the trainer's SFT cold start and evaluations; a peer that dies closes
its sockets, which fails the waiting operation at once (the fault path, not the timeout).

* ``weights`` (``WeightGroup``; trainer rank 0 and every worker, ``rollout.weight_sync=bucketed``):
  the weight buckets of ``paravt.weight_sync``, device to device: NCCL with CUDA
  tensors when the run's device is CUDA (the workers on other GPUs than trainer rank 0: NCCL
  refuses two ranks on one GPU), gloo with CPU tensors otherwise. Used by one thread per
  process (the trainer's push thread, the worker's weight thread), never by the ``ctrl``
  stream's, so a push in flight never holds up a prompt assignment.

With ``rollout.weight_sync=host`` (the fallback) no weights group is built and the weights go
through ``ctrl``, through host memory, one broadcast per tensor.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paravt.distributed import DistContext, resolve_device

#: The weights group's prefix on the rendezvous store.
_WEIGHTS = "paravt/async/weights"
#: Timeout of the message groups (a worker may wait hours for a long SFT or evaluation).
CTRL_TIMEOUT = timedelta(days=7)


class Channel:
    """A gloo process group between trainer rank 0 (member 0) and some workers, carrying
    pickled objects and tensors. Each process uses it from one thread."""

    def __init__(self, store: dist.Store, name: str, member: int, size: int) -> None:
        self.member, self.size = member, size
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), member, size, CTRL_TIMEOUT)
        self.last_bytes = 0  # the pickled size of the last object ``recv`` returned

    def send(self, obj: Any, dst: int) -> None:
        """Pickle ``obj`` to member ``dst``."""
        data = _encode(obj)
        self.pg.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
        self.pg.send([data], dst, 1).wait()

    def recv(self, src: int) -> Any:
        """The next object member ``src`` sent (blocks)."""
        n = torch.zeros(1, dtype=torch.int64)
        self.pg.recv([n], src, 0).wait()
        data = torch.empty(int(n[0]), dtype=torch.uint8)
        self.pg.recv([data], src, 1).wait()
        self.last_bytes = int(n[0])
        return _decode(data)

    def bcast_tensor(self, t: torch.Tensor, timeout_s: float | None = None) -> None:
        """Broadcast ``t`` (a CPU tensor) from member 0 into every member's ``t``.
        ``timeout_s``: raise ``RuntimeError`` when a member has not taken part by then (the
        weight push's deadline, ``paravt.weight_sync.PushWatch``); None: the group's own."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self.pg.broadcast([t], opts)
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=max(1e-3, timeout_s)))

    def bcast(self, obj: Any = None, timeout_s: float | None = None) -> Any:
        """Member 0's ``obj`` on every member (the others pass nothing). ``timeout_s``: as
        ``bcast_tensor`` (member 0)."""
        if self.member == 0:
            data = _encode(obj)
            kw = {} if timeout_s is None else {"timeout_s": timeout_s}
            self.bcast_tensor(torch.tensor([data.numel()], dtype=torch.int64), **kw)
            self.bcast_tensor(data, **kw)
            return obj
        n = torch.zeros(1, dtype=torch.int64)
        self.bcast_tensor(n)
        data = torch.empty(int(n[0]), dtype=torch.uint8)
        self.bcast_tensor(data)
        return _decode(data)


class WeightGroup:
    """The trainer-worker weights group (member 0: trainer rank 0; then the workers): one
    broadcast per bucket from member 0 (``paravt.weight_sync``). NCCL when ``device``
    is CUDA (tensors on it; written for Hopper, not run by this project's CPU tests), gloo
    otherwise (CPU tensors). Each process uses it from one thread."""

    def __init__(
        self, store: dist.Store, name: str, member: int, size: int, device: torch.device
    ) -> None:
        self.member, self.size, self.device = member, size, torch.device(device)
        self._stream: Any = None  # CUDA: the side stream the broadcasts are ordered on
        prefixed = dist.PrefixStore(name, store)
        if self.device.type == "cuda":
            if not dist.is_nccl_available():
                raise RuntimeError(
                    "rollout.weight_sync=bucketed on CUDA needs NCCL, which this torch build "
                    "lacks; set rollout.weight_sync=host"
                )
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = CTRL_TIMEOUT  # a worker's weight thread waits between pushes
            self.pg = dist.ProcessGroupNCCL(prefixed, member, size, opts)
            self.backend = "nccl"
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, member, size, CTRL_TIMEOUT)
            self.backend = "gloo"

    def bcast(self, t: torch.Tensor, timeout_s: float | None = None) -> None:
        """Broadcast ``t`` (on the group's device) from member 0 into every member's ``t``;
        returns once ``t`` may be reused or read. CUDA: the collective is ordered on a side
        stream of this group's, which is synchronised, so the CPU waits for the broadcast
        only, not for the compute another thread has queued on the default stream (the
        trainer's next step, the worker's generation); whatever wrote ``t`` before must be
        complete (``WeightPublisher`` synchronises its packing first). ``timeout_s`` (gloo:
        the push's deadline, ``RuntimeError`` past it; NCCL: its own watchdog's timeout)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if not t.is_cuda:
            work = self.pg.broadcast([t], opts)
            if timeout_s is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=max(1e-3, timeout_s)))
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(t.device)
        with torch.cuda.stream(self._stream):
            self.pg.broadcast([t], opts).wait()
        self._stream.synchronize()


def _encode(obj: Any) -> torch.Tensor:
    """``obj`` pickled into a uint8 tensor (what a channel carries)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _decode(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


@dataclass
class AsyncRoles:
    """This process's place in an asynchronous run (``init_async``)."""

    rank: int  # global (torchrun) rank
    trainers: list[int]  # global ranks of the trainers (0 .. T-1)
    workers: list[int]  # global ranks of the rollout workers (T .. N-1)
    ctrl: Channel | None = None  # trainer rank 0 and the workers only
    weights: WeightGroup | None = None  # trainer rank 0 and the workers; bucketed sync only
    results: dict[int, Channel] = field(default_factory=dict)  # by worker rank
    store: dist.Store | None = (
        None  # torchrun's rendezvous store (the trainers' per-step "ready" keys)
    )

    @property
    def is_worker(self) -> bool:
        return self.rank in self.workers

    @property
    def worker_index(self) -> int:
        """This worker's index among the workers (its share of a step's prompts)."""
        return self.workers.index(self.rank)


def init_async(
    device: str, workers: int, weight_sync: str = "bucketed"
) -> tuple[DistContext, AsyncRoles]:
    """Join the torchrun job as a trainer or a rollout worker (``rollout.workers`` = W).
    ``weight_sync``: ``rollout.weight_sync`` (``bucketed`` builds the weights group).

    Returns this process's ``DistContext`` (a trainer's spans the trainer ranks; a worker's is
    a one-rank context on its device) and its ``AsyncRoles``. ``paravt.validate.validate_run``
    has checked that at least one trainer rank is left."""
    store, rank, world = next(dist.rendezvous("env://"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    n_train = world - workers
    if n_train < 1:
        raise RuntimeError(f"init_async: {world} processes cannot hold {workers} worker(s)")
    trainers, worker_ranks = list(range(n_train)), list(range(n_train, world))
    roles = AsyncRoles(rank, trainers, worker_ranks, store=store)
    if rank >= n_train:  # a worker: its own device, a world of one for its engine
        dev = torch.device(resolve_device(device, local_rank))
        if dev.type == "cuda":  # pin_worker_gpu made its GPU the only visible one
            dev = torch.device("cuda:0")
            torch.cuda.set_device(dev)
        _own_world(rank=0, world=1)
        member = 1 + worker_ranks.index(rank)
        roles.ctrl = Channel(store, "paravt/async/ctrl", member, 1 + workers)
        roles.results[rank] = Channel(store, f"paravt/async/results/{rank}", 1, 2)
        if weight_sync == "bucketed":
            roles.weights = WeightGroup(store, _WEIGHTS, member, 1 + workers, dev)
        return DistContext(rank=rank, device=dev), roles
    dev = torch.device(resolve_device(device, local_rank))
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if rank == 0:
        roles.ctrl = Channel(store, "paravt/async/ctrl", 0, 1 + workers)
        for w in worker_ranks:
            roles.results[w] = Channel(store, f"paravt/async/results/{w}", 0, 2)
        if weight_sync == "bucketed":
            roles.weights = WeightGroup(store, _WEIGHTS, 0, 1 + workers, dev)
    _own_world(rank=rank, world=n_train)
    if n_train == 1:
        return DistContext(device=dev), roles
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore("paravt/trainers", store),
        rank=rank,
        world_size=n_train,
    )  # (ranks > 0 wait for a step's rollouts on the store, not in a collective: collect)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (n_train,))
    ctx = DistContext(
        rank=rank,
        world_size=n_train,
        local_rank=local_rank,
        device=dev,
        backend=backend,
        mesh=mesh,
    )
    return ctx, roles


def pin_worker_gpu(workers: int, device: str) -> None:
    """On a CUDA machine, make a rollout worker's own GPU (its ``LOCAL_RANK``-th) the only one
    it sees, BEFORE anything starts CUDA (the driver reads ``CUDA_VISIBLE_DEVICES`` once):
    ``paravt.train.run`` calls it first. A no-op on trainer ranks, with ``model.device=cpu``
    and outside torchrun. Untested on GPUs: the lent device has one."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if workers <= 0 or rank < world - workers or device == "cpu" or torch.version.cuda is None:
        return  # (torch.version.cuda: a CUDA build of torch; reading it starts nothing)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(local + 1)]
    if local < len(gpus):
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[local]
        os.environ["LOCAL_RANK"] = "0"


def _own_world(rank: int, world: int) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world)})
    if world == 1:
        os.environ.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    for k in ("GROUP_RANK", "ROLE_RANK"):
        os.environ.pop(k, None)
