"""Shared-prefix forwards (``algo.share_prefix``; ``paravt.models.prefix``): a group's prompt
encoded once gives the same log-probs, loss and parameter gradients as the unshared forward.

The batch is a real one: the scripted tiny-model step of ``scripted_engine`` with G = 8 and
two turns (a forced first turn of two parallel crop calls, the tool responses, a sampled
second turn), main rows with their overview video and sub-agent rows with their crop clips,
captured at the policy update. fp32 on CPU (SDPA). The forced first turn is the same in every
member of a group, so each group's shared prefix runs past the prompt into trained tokens:
those rows are shared too, and each member still reads its own targets.
"""

from __future__ import annotations

import copy

import pytest
import torch
from scripted_engine import scripted_trainer

G = 8


class _Captured(Exception):
    pass


@pytest.fixture(scope="module")
def setup(assets, tmp_path_factory):
    """(model, batch, objective): the step's weights, its shared packed batch, the loss."""
    import paravt.algo.loss as loss_mod
    from paravt.train import train_step

    def score(model, r, ids):
        return [-1.0] * (len(ids) - len(r.prompt_ids))

    tr = scripted_trainer(
        assets, str(tmp_path_factory.mktemp("shared") / "run"), score,
        **{"algo.kl_coef": 0.0, "rollout.group_size": G, "agent.max_turns": 2},
    )  # fmt: skip
    rec = {}

    def capture(batch, *a, **kw):
        rec["batch"] = batch
        raise _Captured

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loss_mod, "minibatch_backward", capture)
        with pytest.raises(_Captured):
            train_step(tr, 1)
    model = tr.policy
    model.eval()
    batch = rec["batch"]
    # A gradient to compare: behaviour log-probs at the policy's (ratio 1, no clipping) and
    # advantages of both signs (the scripted rewards are all equal, so theirs are 0).
    from paravt.algo.logprobs import packed_logprobs

    with torch.no_grad():
        lp, _ = packed_logprobs(model, _unshared(batch))
    batch.old_logprobs = lp.float()
    gen = torch.Generator().manual_seed(0)
    batch.advantages = torch.randn(batch.input_ids.numel(), generator=gen) * batch.loss_mask
    return model, batch, tr.objective


def _unshared(batch):
    b = copy.copy(batch)
    b.group_ids = None
    return b


def test_groups_share_their_prompt_and_the_sub_rows_do_not(setup):
    from paravt.models.prefix import prefix_groups, shared_layout

    _, batch, _ = setup
    assert batch.group_ids is not None  # algo.share_prefix is on by default
    n = len(batch.uids)
    groups = prefix_groups(batch, range(n))
    mains = [i for i, r in enumerate(batch.roles) if r == "main"]
    assert len(groups) == 2 and sorted(i for g in groups for i in g.members) == mains
    cu = batch.cu_seqlens.tolist()
    for g in groups:
        assert len(g.members) == G and g.prefix_segments == batch.visuals[g.members[0]].num_segments
        # The forced first turn is common to the group: the prefix covers the whole prompt.
        trained = [int(batch.loss_mask[cu[i] : cu[i + 1]].nonzero()[0]) for i in g.members]
        assert g.prefix_len > min(trained)
    layout = shared_layout(batch, range(n), groups)
    assert layout.shared and layout.num_rows == n_rows(batch, groups)
    assert torch.equal(batch.input_ids[layout.src][layout.row_of], batch.input_ids)


def n_rows(batch, groups) -> int:
    total = int(batch.cu_seqlens[-1])
    return total - sum((len(g.members) - 1) * g.prefix_len for g in groups)


def test_logprobs_and_entropy_equal_the_unshared_forward(setup):
    from paravt.algo.logprobs import packed_logprobs

    model, batch, _ = setup
    with torch.no_grad():
        lp, ent = packed_logprobs(model, batch, with_entropy=True)
        lp0, ent0 = packed_logprobs(model, _unshared(batch), with_entropy=True)
    assert float(batch.loss_mask.sum()) > 0
    assert float((lp - lp0).abs().max()) <= 1e-5
    assert float((ent - ent0).abs().max()) <= 1e-5


def _loss_and_grads(model, batch, objective, parts):
    from paravt.algo.loss import agg_denominator, policy_minibatch_backward

    model.zero_grad(set_to_none=True)
    den = agg_denominator(objective.effective_mask(batch), batch, objective.algo.agg)
    res = policy_minibatch_backward(
        model, batch, objective, global_den=den, max_tokens=10**9, parts=parts
    )
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return res, grads


@pytest.mark.parametrize("split", [False, True], ids=["one-forward", "group-split"])
def test_loss_and_every_gradient_equal_the_unshared_path(setup, split):
    """The policy update: loss, log-probs and every parameter's gradient, shared against
    unshared, with the whole batch in one forward and with a budget that cuts each group into
    parts (each part holding the prompt again)."""
    from paravt.algo.packing import microbatches
    from paravt.models.prefix import prefix_groups, shared_cost

    model, batch, objective = setup
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    groups = prefix_groups(batch, range(len(lengths)))
    # Split: room for the shorter prompt and three suffixes: that group needs several parts
    # that each share their prompt; the longer group may run member by member.
    suffix = max(lengths[i] - g.prefix_len for g in groups for i in g.members)
    budget = min(g.prefix_len for g in groups) + 3 * suffix if split else sum(lengths)
    parts = microbatches(batch, budget)
    if split:
        cut = [
            g
            for g in groups
            if len([p for p in parts if set(p) & set(g.members)]) >= 2
            and any(len(set(p) & set(g.members)) >= 2 for p in parts)
        ]
        assert cut
    else:
        assert len(parts) == 1
    res, grads = _loss_and_grads(model, batch, objective, parts)
    # The unshared packed forward, itself equal to one forward per sequence
    # (tests/test_algo_packed_forward.py, tests/test_algo_loss.py).
    ref, ref_grads = _loss_and_grads(
        model, _unshared(batch), objective, [list(range(len(lengths)))]
    )
    assert abs(res.loss_num - ref.loss_num) <= 1e-5 * max(1.0, abs(ref.loss_num))
    assert float((res.logprobs - ref.logprobs).abs().max()) <= 1e-5
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    worst = max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert scale > 1e-4 and worst <= 1e-5, (worst, scale)


def test_a_group_of_one_runs_the_unshared_layout(setup):
    """G = 1: one main row per group, nothing to share; the same values as sharing off."""
    from paravt.algo.logprobs import packed_logprobs
    from paravt.algo.packing import select_sequences
    from paravt.models.prefix import prefix_groups

    model, batch, _ = setup
    first = {}
    for i, r in enumerate(batch.roles):
        if r == "main":
            first.setdefault(int(batch.group_ids[i]), i)
    one = select_sequences(batch, sorted(first.values()))
    assert prefix_groups(one, range(len(one.uids))) == []
    with torch.no_grad():
        lp, _ = packed_logprobs(model, one)
        lp0, _ = packed_logprobs(model, _unshared(one))
    assert torch.equal(lp, lp0)
