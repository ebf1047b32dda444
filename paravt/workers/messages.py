"""Every message trainer rank 0 and the rollout workers exchange, as frozen dataclasses.

They travel pickled over a ``paravt.workers.roles.Channel`` (``Channel.send`` / ``recv`` and
``bcast``): the classes are module-level, so both ends unpickle them to the same types. A
receiver checks what it got with :func:`expect`, which raises :class:`UnexpectedMessage`
naming the message and what it expected (an unknown message is never silently ignored).

Trainer rank 0 → every worker (``roles.ctrl``, one ordered broadcast stream):

* :class:`Hello` first (the model folder);
* :class:`AssignGroups` (``rollout.dispatch=group``: ticketed groups, :class:`IssuedGroup`) or
  :class:`AssignStep` (static: one step's prompts);
* a weight push's header (``paravt.weight_sync.WeightPublisher.push``: a ``{"kind":
  "weights", ...}`` dict that module writes and reads; :func:`is_weights_header`);
* :class:`Stop`.

A worker → trainer rank 0 (``roles.results[worker]``, its own channel):

* :class:`Claimed` (group dispatch: a claim is announced before its rollout, for the
  trainer's ``ClaimWatchdog``);
* :class:`ClaimRollouts` (group dispatch: one :class:`TicketGroup` or :class:`TicketSkipped`
  per claimed ticket, in claim order) or :class:`StepRollouts` (static: the worker's slice of
  a step), with the runner's errors, counters and the worker's busy / idle seconds;
* :class:`WorkerError` (its rollout, load or weights failed; the worker exits 1) or
  :class:`Bye` (after the trainer's stop).

:class:`WorkerLost` never crosses a channel: the trainer's receiving thread (a worker's
sockets closed) and its weight push's deadline queue it next to the workers' messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from paravt.types import Group, RolloutStats, Sample

#: The ``kind`` of a weight push's header (``paravt.weight_sync``, a dict of its own).
WEIGHTS_KIND = "weights"


class UnexpectedMessage(RuntimeError):
    """A channel delivered something its receiver does not handle there (a message of another
    kind, or not a message at all: the two ends run different code)."""


# --------------------------------------------------------------- trainer -> workers (ctrl)
@dataclass(frozen=True)
class Hello:
    """The first broadcast: where the model the workers load is."""

    init_dir: str


@dataclass(frozen=True)
class PlannedGroup:
    """dispatch=group: group ``index`` of slot ``slot`` (``plan_prompts(sampler, cfg, slot)``):
    its prompt, frame budget K and the slot's seed (``paravt.workers.pipeline.GroupLedger``)."""

    slot: int
    index: int
    sample: Sample
    budget: int
    seed: int

    def issued(self, ticket: int, min_version: int) -> IssuedGroup:
        return IssuedGroup(
            self.slot, self.index, self.sample, self.budget, self.seed, ticket, min_version
        )


@dataclass(frozen=True)
class IssuedGroup(PlannedGroup):
    """A planned group with its ticket (what a worker claims) and the version a worker must
    hold to start it (the trainer's, sent before)."""

    ticket: int
    min_version: int


@dataclass(frozen=True)
class AssignGroups:
    """dispatch=group: groups issued, their tickets consecutive with those sent before."""

    groups: tuple[IssuedGroup, ...]


@dataclass(frozen=True)
class AssignStep:
    """dispatch=static: step ``step``'s prompts with their K (each worker rolls out its
    slice), the step's seed and the version a worker must hold to start it."""

    step: int
    prompts: tuple[tuple[Sample, int], ...]
    seed: int
    min_version: int


@dataclass(frozen=True)
class Stop:
    """The run is over: each worker says :class:`Bye` and exits."""


# ---------------------------------------------------------- a worker -> trainer (results)
@dataclass(frozen=True)
class Claimed:
    """dispatch=group: ``worker`` claimed ``tickets`` and starts rolling them out."""

    worker: int
    tickets: tuple[int, ...]


@dataclass(frozen=True)
class TicketGroup:
    """A claimed ticket's group."""

    ticket: int
    group: Group


@dataclass(frozen=True)
class TicketSkipped:
    """A claimed ticket without a group: why (its video could not be read or decoded in time;
    the runner's ``skipped`` reason)."""

    ticket: int
    why: str


TicketEntry = TicketGroup | TicketSkipped


@dataclass(frozen=True, kw_only=True)
class _Rollouts:
    """What every finished rollout reports: the runner's errors and counters, the worker's
    seconds rolling out (``busy_s``) and waiting for work or weights before it (``idle_s``)
    and, set by the trainer on receipt, the pickled bytes the channel carried."""

    worker: int
    errors: tuple[str, ...] = ()
    stats: RolloutStats = field(default_factory=RolloutStats)
    busy_s: float = 0.0
    idle_s: float = 0.0
    rx_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class ClaimRollouts(_Rollouts):
    """dispatch=group: a claim's reply, one entry per claimed ticket in claim order
    (``paravt.workers.worker.ticket_entries``)."""

    tickets: tuple[int, ...]
    entries: tuple[TicketEntry, ...]

    @property
    def skipped(self) -> int:
        return sum(isinstance(e, TicketSkipped) for e in self.entries)


@dataclass(frozen=True, kw_only=True)
class StepRollouts(_Rollouts):
    """dispatch=static: the worker's slice of step ``step``."""

    step: int
    groups: tuple[Group, ...]


@dataclass(frozen=True)
class WorkerError:
    """``worker`` failed (its traceback in ``message``) and exits 1."""

    worker: int
    message: str


@dataclass(frozen=True)
class Bye:
    """``worker`` stopped after the trainer's :class:`Stop`."""

    worker: int


@dataclass(frozen=True)
class WorkerLost:
    """Trainer-side only: ``worker``'s channel failed (its sockets closed: it died) or it
    missed a weight push's deadline; ``message`` says which."""

    worker: int
    message: str


#: What trainer rank 0 takes off its queue of the workers' messages.
FromWorker = Claimed | ClaimRollouts | StepRollouts | WorkerError | Bye | WorkerLost

M = TypeVar("M")


def is_weights_header(msg: object) -> bool:
    """Whether ``msg`` is a weight push's header (``paravt.weight_sync``'s dict)."""
    return isinstance(msg, dict) and msg.get("kind") == WEIGHTS_KIND


def expect(msg: object, kinds: tuple[type[M], ...] | type[M], where: str) -> M:
    """``msg`` when it is one of ``kinds``; else :class:`UnexpectedMessage` naming it and
    ``where`` it arrived."""
    if isinstance(msg, kinds):
        return msg
    want = kinds if isinstance(kinds, tuple) else (kinds,)
    raise UnexpectedMessage(
        f"{where}: unexpected message {describe(msg)}; expected "
        f"{' or '.join(k.__name__ for k in want)} (do both ends run the same paravt?)"
    )


def describe(msg: Any) -> str:
    """A short description of ``msg`` for an error (its type, and a dict's ``kind``)."""
    if isinstance(msg, dict):
        return f"dict(kind={msg.get('kind')!r})"
    text = repr(msg)
    return f"{type(msg).__name__} {text[:120]}{'...' if len(text) > 120 else ''}"
