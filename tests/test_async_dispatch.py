"""Group-level dispatch of an asynchronous run (``rollout.dispatch=group``, issue 51 item 5),
the parts that need no process: the trainer's ``GroupLedger`` (what is drawn, issued, trained;
what a checkpoint records and ``--resume`` re-issues), the workers' claims on the rendezvous
store, and the renumbering of a step's groups. The torchrun run with a deliberately slow worker
is ``tests/test_train_async.py::test_group_dispatch_does_not_wait_for_a_slow_worker``.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import pytest
import torch.distributed as dist

from paravt.config import ConfigError, load_config
from paravt.data.sampler import PromptSampler
from paravt.distributed import DistContext
from paravt.rollout_source import plan_prompts
from paravt.types import Group, RolloutStats, Sample, Trajectory
from paravt.workers.messages import (
    AssignGroups,
    Claimed,
    ClaimRollouts,
    PlannedGroup,
    TicketGroup,
    TicketSkipped,
)
from paravt.workers.pipeline import (
    CLAIM_KEY,
    ClaimWatchdog,
    GroupLedger,
    RolloutPipeline,
    renumber,
)
from paravt.workers.roles import AsyncRoles
from paravt.workers.worker import GroupClaims, ticket_entries

P = 4
SAMPLES = [Sample(f"s{i}", f"v{i}.mp4", f"q{i}", "A") for i in range(10)]


def _cfg(**kv: object):
    over = {"train.prompts_per_step": P, "rollout.workers": 2, "rollout.max_staleness": 1}
    return load_config(overrides=[f"{k}={v}" for k, v in {**over, **kv}.items()])


def _key(e: PlannedGroup) -> tuple:
    """What decides a group's samples: its slot (the seed), index (the uids), prompt, K."""
    return (e.slot, e.index, e.sample.id, e.budget, e.seed)


def test_slots_are_the_static_steps_prompts() -> None:
    """Group (k, i) is prompt i of ``plan_prompts(sampler, cfg, k)`` with its K and step k's
    seed, whichever worker rolls it out: the same prompts, seeds and group indices as step k
    under dispatch=static (10 prompts, 4 a step: epochs roll over inside a slot)."""
    cfg = _cfg()
    ledger = GroupLedger(PromptSampler(SAMPLES, seed=3), cfg)
    got = [_key(e) for e in ledger.issue(3 * P, version=0)]
    ref, static = [], PromptSampler(SAMPLES, seed=3)
    for k in (1, 2, 3):
        plan = plan_prompts(static, cfg, k)
        ref += [(k, i, s.id, b, plan.seed) for i, (s, b) in enumerate(zip(plan.samples, plan.budgets))]  # fmt: skip
    assert got == ref
    assert len({seed for *_, seed in got}) == 3


def test_resume_reissues_exactly_the_untrained_groups() -> None:
    """Groups finish out of order: the checkpoint (``GroupLedger.state``, JSON) after some are
    trained or dropped names the oldest open slot and what of it and after is done; a ledger
    loaded from it issues exactly the groups neither trained nor dropped (issued or only
    drawn), with their slot, index, prompt, K and seed, then the slots the first run would
    have drawn next."""
    cfg = _cfg()
    first = GroupLedger(PromptSampler(SAMPLES, seed=7), cfg)
    issued = first.issue(2 * P + 2, version=0)  # slots 1, 2 and half of 3 (rest only drawn)
    assert first.slot == 3 and len(first.planned) == P - 2
    for t in (0, 2, 3, 5, 6, 9):  # out of order; 9 is slot 3's second group
        first.close(t)
    state = json.loads(json.dumps(first.state()))
    assert state["slot"] == 1  # tickets 1 (slot 1) is still open
    assert state["done"] == [[1, 0], [1, 2], [1, 3], [2, 1], [2, 2], [3, 1]]
    closed = {_key(issued[t]) for t in (0, 2, 3, 5, 6, 9)}
    drawn = [_key(e) for e in issued] + [_key(e) for e in first.planned]
    untrained = [k for k in drawn if k not in closed]
    assert len(untrained) == 3 * P - 6

    second = GroupLedger(PromptSampler(SAMPLES, seed=7), cfg)
    second.load(state, start_step=2)
    again = second.issue(len(untrained) + P, version=2)
    assert [_key(e) for e in again[: len(untrained)]] == untrained  # exactly, in order
    assert [e.ticket for e in again] == list(range(len(again)))  # a new job's tickets
    # ... then slot 4, as the first run draws it.
    first.issue(len(first.planned) + P, version=2)
    assert [_key(e) for e in again[len(untrained) :]] == [
        _key(e) for e in first.open.values() if e.slot == 4
    ]


def test_state_is_bounded_and_moves_with_training() -> None:
    """Once every group of the oldest slots is closed, the checkpoint moves past them: its
    ``done`` holds only groups of the open slots (not the run's history), and a checkpoint
    with nothing open is the plain sampler position of the next slot."""
    cfg = _cfg()
    ledger = GroupLedger(PromptSampler(SAMPLES, seed=1), cfg)
    for _ in range(5):  # five steps of P groups each, trained in order
        for e in ledger.issue(P, version=0):
            ledger.close(e.ticket)
    state = ledger.state()
    assert state["slot"] == 6 and state["done"] == []
    assert {k: state[k] for k in ("epoch", "pos")} == ledger.sampler.state()
    old = {"epoch": 0, "pos": 4}  # a checkpoint without "slot": slots follow the steps
    fresh = GroupLedger(PromptSampler(SAMPLES, seed=1), cfg)
    fresh.load(old, start_step=1)
    assert fresh.issue(1, version=1)[0].slot == 2


def _assigns() -> list[AssignGroups]:
    """Three assignments (3, 5, 3 groups) of slots 1-3 as after a resume that had trained
    slot 2's group 1: tickets 0-3 are slot 1's groups 0-3, 4-6 slot 2's 0, 2, 3, 7-10 slot 3's
    0-3."""
    ledger = GroupLedger(PromptSampler(SAMPLES, seed=2), _cfg())
    ledger.done = {(2, 1)}
    return [AssignGroups(tuple(ledger.issue(n, version=0))) for n in (3, 5, 3)]


def _claims(
    rank: int, store: dist.Store, assigns: list[AssignGroups]
) -> tuple[GroupClaims, queue.Queue]:
    cfg = _cfg(**{"rollout.dispatch_groups": 3})
    jobs: queue.Queue = queue.Queue()
    for a in assigns:
        jobs.put(a)
    return GroupClaims(cfg, AsyncRoles(rank, [0], [1, 2], store=store), jobs), jobs


def _store() -> dist.Store:
    store = dist.HashStore()
    store.set(CLAIM_KEY, "0")
    return store


def test_a_claim_is_the_next_consecutive_groups_of_one_slot() -> None:
    """Two workers claiming in turn (``rollout.dispatch_groups=3``): each claim is the next
    free tickets, at most 3, consecutive groups of one slot (a slot's end or a group trained
    before the resume cuts it), rolled out with that slot's seed from its first index."""
    assigns, store = _assigns(), _store()
    one, _ = _claims(1, store, assigns)
    two, _ = _claims(2, store, assigns)
    every = [e for a in assigns for e in a.groups]
    got = []
    for claims in (one, two, one, two, one, two):
        w = claims.next_work()
        got.append(list(w.tickets))
        es = [every[t] for t in w.tickets]
        assert w.seed == es[0].seed and w.first_group == es[0].index
        assert w.samples == [e.sample for e in es]
        assert w.budgets == [e.budget for e in es]
    assert got == [[0, 1, 2], [3], [4], [5, 6], [7, 8, 9], [10]]
    assert store.get(CLAIM_KEY).split(b"/")[0] == b"11"  # every ticket is claimed


def test_racing_workers_claim_each_ticket_once() -> None:
    """Two workers in threads race for the same tickets on one store (one compare-and-set per
    claim): every ticket is claimed exactly once."""
    assigns, store = _assigns(), _store()
    out: list = []
    gate = threading.Barrier(2)

    def run(claims: GroupClaims, rank: int) -> None:
        gate.wait()
        while (w := claims.next_work()) is not None:
            out.append((rank, list(w.tickets)))

    workers = []
    for rank in (1, 2):
        claims, jobs = _claims(rank, store, assigns)
        th = threading.Thread(target=run, args=(claims, rank))
        th.start()
        workers.append((th, jobs))
    deadline = time.monotonic() + 30
    while sum(len(ts) for _, ts in out) < 11 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)  # (a ticket claimed twice would show now)
    for th, jobs in workers:
        jobs.put(None)  # the trainer's stop
        th.join(timeout=30)
        assert not th.is_alive()
    assert sorted(t for _, ts in out for t in ts) == list(range(11))


def _traj(uid: str, role: str = "main", parent: str | None = None) -> Trajectory:
    return Trajectory(uid, role, "s", 3, [1], [1], [0.0], 0, parent=parent)


def test_renumber_moves_group_ids_and_uids() -> None:
    """A group trained at position 0 of its step (it was group 3 of its slot): its id, its
    trajectories' ids, uids and the sub-agents' parents say 0; other uids are untouched."""
    g = Group(
        Sample("s", "v.mp4", "q", "A"), 3, 4, [_traj("3:s:r0"), _traj("3:s:r1")],
        [_traj("3:s:r0:t0:c0", "sub", parent="3:s:r0")],
    )  # fmt: skip
    renumber(g, 0)
    assert g.group_id == 0 and all(t.group_id == 0 for t in (*g.trajectories, *g.sub_trajectories))
    assert [t.uid for t in g.trajectories] == ["0:s:r0", "0:s:r1"]
    assert g.sub_trajectories[0].uid == "0:s:r0:t0:c0"
    assert g.sub_trajectories[0].parent == "0:s:r0"


def test_bad_dispatch_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"rollout.dispatch='slices' is not one of group\|static"):
        load_config(overrides=["rollout.dispatch=slices"])
    with pytest.raises(ConfigError, match=r"rollout.dispatch_groups=-1"):
        load_config(overrides=["rollout.dispatch_groups=-1"])
    assert load_config().rollout.dispatch == "group"


def test_a_skipped_ticket_is_closed_and_the_ledger_stays_exact() -> None:
    """A claim of tickets 0-1 whose first sample's video could not be read: the worker answers
    each ticket (``ticket_entries``: ticket 0 skipped with its reason, ticket 1 its group) and
    the trainer closes ticket 0 (done, never issued again, not even on ``--resume``) and holds
    the group for ticket 1. Paired by position (before), ticket 0 took ticket 1's group and
    ticket 1 stayed open forever: the η = 0 step never filled, and a checkpoint re-issued the
    trained group."""
    cfg = _cfg(**{"rollout.dispatch_groups": 2})
    ctx = DistContext(rank=1, world_size=2)  # a trainer rank > 0: no threads, no publisher
    pipe = RolloutPipeline(cfg, ctx, AsyncRoles(1, [0], [2, 3], store=_store()), None)
    pipe.sampler = PromptSampler(SAMPLES, seed=2)
    issued = pipe.ledger.issue(P, version=0)  # tickets 0-3: slot 1's groups 0-3
    g1 = Group(issued[1].sample, 1, issued[1].budget, [], [])
    why = f"sample {issued[0].sample.id}: skipped, its video could not be read (torn)"
    entries = ticket_entries([0, 1], 0, [g1], {0: why})
    assert entries == [TicketSkipped(0, why), TicketGroup(1, g1)]
    msg = ClaimRollouts(worker=2, tickets=(0, 1), entries=tuple(entries),
                        errors=(why,), stats=RolloutStats(), busy_s=1.0, idle_s=0.0)  # fmt: skip
    pipe._take(Claimed(2, (0, 1)), "in the test")
    assert list(pipe.watchdog.held) == [2]  # the claim is timed from here
    pipe._take(msg, "in the test")
    assert not pipe.watchdog.held and len(pipe.watchdog.durations) == 1
    assert list(pipe._ready) == [1] and pipe._ready[1] == (g1, 2)
    assert sorted(pipe.ledger.open) == [1, 2, 3] and (1, 0) in pipe.ledger.done
    assert pipe._pool.skipped == 1 and pipe._pool.errors == [why]
    assert pipe._unreplaced == 1  # the next collect admits a replacement at once
    # Ticket 1 trained: a checkpoint now re-issues exactly slot 1's groups 2 and 3.
    del pipe._ready[1]
    pipe.ledger.close(1)
    fresh = GroupLedger(PromptSampler(SAMPLES, seed=2), cfg)
    fresh.load(json.loads(json.dumps(pipe.ledger.state())), start_step=0)
    assert [(e.slot, e.index) for e in fresh.issue(2, version=0)] == [(1, 2), (1, 3)]


def test_ticket_entries_refuse_a_group_outside_the_claim() -> None:
    g = Group(SAMPLES[0], 7, 4, [], [])
    with pytest.raises(RuntimeError, match=r"groups \[7\] outside its claim of tickets 3..4"):
        ticket_entries([3, 4], 0, [g], {})
    assert ticket_entries([3], 0, [], {}) == [
        TicketSkipped(3, "group 0: the rollout returned nothing for it")
    ]


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_claim_watchdog_names_a_worker_far_slower_than_its_peers() -> None:
    """Claims of 2 s each finish; worker 3's claim then runs: named (once) only after both
    ``factor`` x the median (5 x 2 s) and the floor (4 s) have passed; 0 turns it off."""
    clock = _Clock()
    dog = ClaimWatchdog(5.0, 4.0, clock=clock)
    assert dog.overdue() == [] and dog.longest() == 0.0  # nothing finished: no yardstick
    for w, tickets in ((1, [0, 1]), (2, [2, 3]), (1, [4, 5])):
        dog.claimed(w, tickets)
        clock.t += 2.0
        dog.finished(w)
    dog.claimed(3, [6, 7])
    dog.claimed(1, [8, 9])
    clock.t += 9.0
    assert dog.overdue() == [] and dog.longest() == 9.0
    clock.t += 2.0
    dog.finished(1)  # worker 1's claim ends after 11 s: the median becomes 2 s still
    (line,) = dog.overdue()
    assert line.startswith("rollout worker rank 3 has held its claim of tickets 6..7 for 11 s")
    assert "5.5x the median claim (2.0 s over 4)" in line and "claim_watchdog_factor" in line
    assert dog.overdue() == []  # named once
    off = ClaimWatchdog(0.0, 0.0, clock=clock)
    off.claimed(1, [0])
    clock.t += 1.0
    off.finished(1)
    off.claimed(2, [1])
    clock.t += 1e6
    assert off.overdue() == []


def test_the_claim_watchdog_names_a_worker_hung_from_its_first_claim() -> None:
    """Before any claim has finished (the first claims carry the engines' warm-up) there is no
    median to compare with: the limit is ``factor * min_s``, so a worker hung from its first
    claim is still named (before, never)."""
    clock = _Clock()
    dog = ClaimWatchdog(5.0, 4.0, clock=clock)
    dog.claimed(1, [0, 1])
    clock.t += 20.0
    assert dog.overdue() == []  # 20 s = 5 x 4 s: not past it
    clock.t += 1.0
    (line,) = dog.overdue()
    assert line.startswith("rollout worker rank 1 has held its claim of tickets 0..1 for 21 s")
    assert "no claim has finished yet (limit 20 s)" in line


def test_messages_cross_the_wire_and_an_unknown_one_is_named() -> None:
    """A message pickled as a ``Channel`` carries it comes back equal and of the same type; a
    receiver that gets something it does not handle there raises ``UnexpectedMessage`` naming
    it and what it expected (a dict of the old wire format included)."""
    from paravt.workers.messages import UnexpectedMessage, WorkerError, expect
    from paravt.workers.roles import _decode, _encode

    g = Group(SAMPLES[0], 1, 4, [_traj("1:s0:r0")], [])
    msg = ClaimRollouts(worker=2, tickets=(0, 1), entries=(TicketSkipped(0, "torn"), TicketGroup(1, g)),
                        errors=("torn",), stats=RolloutStats(), busy_s=1.5, idle_s=0.5)  # fmt: skip
    back = _decode(_encode(msg))
    assert type(back) is ClaimRollouts and back.tickets == (0, 1) and back.skipped == 1
    assert back.entries[1].group.trajectories[0].uid == "1:s0:r0" and back.busy_s == 1.5
    assert expect(back, (Claimed, ClaimRollouts), "here") is back
    with pytest.raises(UnexpectedMessage, match=r"at the test: unexpected message dict\(kind='groups'\); expected Claimed or WorkerError"):  # fmt: skip
        expect({"kind": "groups"}, (Claimed, WorkerError), "at the test")
