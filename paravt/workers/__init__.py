"""Asynchronous PARA-GRPO: rollout workers generate while the trainers update.

``torchrun --nproc-per-node N -m paravt.train rollout.workers=W rollout.max_staleness=η``:
ranks ``0 .. N-W-1`` train (FSDP2 among themselves), ranks ``N-W .. N-1`` are rollout workers,
each with its own engine (``rollout.engine``: HF or vLLM). Everything travels over
torch.distributed: prompts, weights (one tensor at a time, tagged with a policy version) and
finished rollouts. ``roles`` builds the process groups, ``worker`` is a worker's loop,
``pipeline`` the trainer's end (admission, staleness filter, ``async/*`` metrics).
``rollout.workers=0`` (the default) is the synchronous, colocated loop, unchanged.
"""

from paravt.workers.pipeline import RolloutPipeline, WorkerFailed, staleness_metrics
from paravt.workers.roles import AsyncRoles, init_async
from paravt.workers.worker import TrainerGone, run_worker

__all__ = [
    "AsyncRoles",
    "RolloutPipeline",
    "TrainerGone",
    "WorkerFailed",
    "init_async",
    "run_worker",
    "staleness_metrics",
]
