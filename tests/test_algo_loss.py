"""Policy objectives assembled over paravt_kernels.policy_loss, on synthetic packed batches."""

from __future__ import annotations

import copy

import pytest
import torch

from paravt.algo.loss import DecoupledPPO, PPOClip, agg_denominator, make_objective
from paravt.algo.packing import pack_units, split_units
from paravt.config import AlgoConfig
from paravt.types import SequenceUnit, Trajectory

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]


def _traj(uid: str, n: int, gen: int, g: torch.Generator, parent: str | None = None):
    mask = [0] * (n - gen) + [1] * gen
    lps = (-torch.rand(n, generator=g) * 2).tolist()
    return Trajectory(
        uid=uid,
        role="sub" if parent else "main",
        sample_id="s",
        group_id=0,
        tokens=list(range(n)),
        loss_mask=mask,
        logprobs=[lp * m for lp, m in zip(lps, mask)],
        prompt_len=n - gen,
        parent=parent,
    )


def _units(seed: int = 0, n_units: int = 6) -> list[SequenceUnit]:
    g = torch.Generator().manual_seed(seed)
    units = []
    for i in range(n_units):
        main = _traj(f"m{i}", 7 + 3 * i, 2 + i, g)
        subs = [_traj(f"m{i}:s{j}", 5 + j, 1 + j, g, parent=f"m{i}") for j in range(i % 3)]
        units.append(SequenceUnit(main, subs, float(torch.randn(1, generator=g)), i // 2))
    return units


def test_pack_units_never_trains_a_sequence_first_token() -> None:
    """Position 0 has no predecessor: no forward scores it, so it must not count in the loss
    normaliser either; pack_units drops it from the mask even if a trajectory set it."""
    units = _units(seed=3, n_units=2)
    units[0].main.loss_mask[0] = 1
    batch = pack_units(units)
    starts = batch.cu_seqlens[:-1].long()
    assert (batch.loss_mask[starts] == 0).all()
    assert batch.loss_mask.sum() == sum(sum(t.loss_mask) for u in units for t in u.sequences) - 1


def _policy_lp(batch) -> torch.Tensor:
    # A deterministic function of each token's content, so identical rows get identical values.
    noise = 0.3 * torch.sin(7.0 * batch.old_logprobs + batch.input_ids.float())
    return (batch.old_logprobs + noise * batch.loss_mask).requires_grad_(True)


@pytest.mark.parametrize("agg", AGGS)
def test_on_policy_loss_is_weighted_mean_of_minus_advantage(agg: str) -> None:
    batch = pack_units(_units())
    obj = make_objective(AlgoConfig(agg=agg, kl_coef=0.0))
    assert isinstance(obj, PPOClip) and not obj.needs_prox
    lp = batch.old_logprobs.clone().requires_grad_(True)
    loss, stats = obj(lp, batch)
    # ratio == 1 everywhere: l_t = -A_t; the aggregation decides the weights.
    cu = batch.cu_seqlens.tolist()
    num, den = 0.0, 0.0
    for i in range(len(cu) - 1):
        m = batch.loss_mask[cu[i] : cu[i + 1]]
        a = batch.advantages[cu[i] : cu[i + 1]]
        w = float(batch.seq_weights[i])
        if agg == "token-mean":
            num += w * float((-a * m).sum())
            den += w * float(m.sum())
        elif m.sum() > 0:
            per = float((-a * m).sum()) / (float(m.sum()) if agg == "seq-mean-token-mean" else 1)
            num += w * per
            den += w
    assert loss.item() == pytest.approx(num / den, rel=1e-5)
    assert stats["clip_frac"].item() == 0.0


def test_sub_agent_weight_does_not_grow_with_number_of_rows() -> None:
    """A trajectory with n identical sub-agent rows pushes exactly as hard as with one."""
    g = torch.Generator().manual_seed(3)
    main = _traj("m", 9, 4, g)
    sub = _traj("m:s", 6, 3, g, parent="m")
    other = _traj("o", 8, 3, g)
    losses, grads = [], []
    for n in (1, 2, 5):
        subs = [copy.deepcopy(sub) for _ in range(n)]
        for k, s in enumerate(subs):
            s.uid = f"m:s{k}"
        batch = pack_units([SequenceUnit(main, subs, 1.5, 0), SequenceUnit(other, [], -1.5, 0)])
        lp = _policy_lp(batch)
        loss, _ = make_objective(AlgoConfig(agg="seq-mean-token-mean", kl_coef=0.0))(lp, batch)
        loss.backward()
        cu = batch.cu_seqlens.tolist()
        sub_grad = sum(lp.grad[cu[1 + k] : cu[2 + k]].sum().item() for k in range(n))
        losses.append(loss.item())
        grads.append(sub_grad)
    assert losses == pytest.approx([losses[0]] * 3, rel=1e-6)
    assert grads == pytest.approx([grads[0]] * 3, rel=1e-5)
    assert grads[0] != 0.0


@pytest.mark.parametrize("agg", AGGS)
def test_rank_split_with_global_denominator_equals_full_batch(agg: str) -> None:
    """What the trainer does under torchrun: each rank scales its local loss by
    W * D_local / D_global; FSDP averages gradients over W ranks."""
    cfg = AlgoConfig(agg=agg, kl_coef=0.05)
    units = _units(seed=5, n_units=6)
    full = pack_units(units)
    full.ref_logprobs = full.old_logprobs - 0.1 * full.loss_mask
    obj = make_objective(cfg)
    lp_full = _policy_lp(full)
    loss_full, _ = obj(lp_full, full)
    loss_full.backward()

    shards = split_units(units, 2)
    packs = [pack_units(s) for s in shards]
    for p in packs:
        p.ref_logprobs = p.old_logprobs - 0.1 * p.loss_mask
    dens = [agg_denominator(obj.effective_mask(p), p, agg) for p in packs]
    world, total = len(packs), sum(dens)
    loss_sum, grads = 0.0, []
    offset = 0
    for p, d in zip(packs, dens):
        n = p.input_ids.numel()
        lp = lp_full.detach()[offset : offset + n].clone().requires_grad_(True)
        offset += n
        local, _ = obj(lp, p)
        scaled = local * (world * d / total)
        (scaled / world).backward()  # the 1/W is FSDP's gradient averaging
        loss_sum += scaled.item() / world
        grads.append(lp.grad)
    assert loss_sum == pytest.approx(loss_full.item(), rel=1e-5)
    torch.testing.assert_close(torch.cat(grads), lp_full.grad, rtol=1e-5, atol=1e-7)


def test_decoupled_uses_proximal_policy_and_caps_behaviour_weight() -> None:
    batch = pack_units(_units(seed=2))
    cfg = AlgoConfig(loss="decoupled", behav_cap=1.5, kl_coef=0.0)
    obj = make_objective(cfg)
    assert isinstance(obj, DecoupledPPO) and obj.needs_prox
    lp = _policy_lp(batch)
    with pytest.raises(ValueError, match="prox_logprobs"):
        obj(lp, batch)
    g = torch.Generator().manual_seed(9)
    batch.prox_logprobs = (
        batch.old_logprobs
        + 0.8 * torch.rand(batch.old_logprobs.shape, generator=g) * batch.loss_mask
    )
    loss, stats = obj(lp, batch)
    eff = obj.effective_mask(batch)
    assert 0 < stats["n_capped"].item() < batch.loss_mask.sum().item()
    assert stats["n_tokens"].item() == pytest.approx(eff.sum().item())
    # With prox == policy (ratio 1) the loss is the behaviour-weighted -A over surviving tokens.
    lp2 = batch.prox_logprobs.clone().requires_grad_(True)
    loss2, _ = make_objective(AlgoConfig(loss="decoupled", behav_cap=1.5, kl_coef=0.0))(lp2, batch)
    w = torch.exp(batch.prox_logprobs - batch.old_logprobs)
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long()
    w_tok = torch.repeat_interleave(batch.seq_weights, lengths)  # sub rows weigh 1/n
    expected = (-batch.advantages * w * eff * w_tok).sum() / (eff * w_tok).sum()
    assert loss2.item() == pytest.approx(expected.item(), rel=1e-5)
    assert torch.isfinite(loss)


def test_kl_term_is_zero_at_reference_and_positive_away() -> None:
    batch = pack_units(_units(seed=4))
    obj = make_objective(AlgoConfig(kl_coef=0.1, kl_type="k3"))
    assert obj.needs_ref
    batch.ref_logprobs = batch.old_logprobs.clone()
    _, st0 = obj(batch.old_logprobs.clone().requires_grad_(True), batch)
    assert st0["kl_mean"].item() == pytest.approx(0.0, abs=1e-7)
    _, st1 = obj(_policy_lp(batch), batch)
    assert st1["kl_mean"].item() > 0


def test_unknown_objective_is_rejected() -> None:
    with pytest.raises(ValueError, match="algo.loss"):
        make_objective(AlgoConfig(loss="reinforce"))


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("grouping", ["one_per_part", "mixed_parts"])
def test_part_accumulation_equals_packed_gradient(agg: str, grouping: str) -> None:
    from paravt.algo.loss import minibatch_backward
    from paravt.algo.packing import select_sequences

    cfg = AlgoConfig(agg=agg, kl_coef=0.02, loss="decoupled", behav_cap=1.8)
    batch = pack_units(_units(seed=7))
    batch.ref_logprobs = batch.old_logprobs - 0.2 * batch.loss_mask
    batch.prox_logprobs = batch.old_logprobs + 0.5 * batch.loss_mask * torch.sin(
        batch.input_ids.float()
    )
    obj = make_objective(cfg)
    theta = _policy_lp(batch).detach()
    packed = theta.clone().requires_grad_(True)
    loss_full, st_full = obj(packed, batch)
    loss_full.backward()

    leaf = theta.clone().requires_grad_(True)
    cu = batch.cu_seqlens.tolist()
    n_seq = len(cu) - 1
    if grouping == "one_per_part":
        parts = [[i] for i in range(n_seq)]
    else:  # out of order, uneven
        order = list(range(n_seq))[::-1]
        parts = [order[:1], order[1:4], order[4:]]
    calls = []

    def part_loss(seqs):
        calls.append(list(seqs))
        lp = torch.cat([leaf[cu[i] : cu[i + 1]] for i in seqs]) * 1.0
        loss, _ = obj(lp, select_sequences(batch, seqs))
        return loss, lp.detach(), torch.zeros(0)

    den = agg_denominator(obj.effective_mask(batch), batch, agg)
    res = minibatch_backward(batch, obj, part_loss, parts, global_den=den, num_parts=len(parts) + 2)
    torch.testing.assert_close(leaf.grad, packed.grad, rtol=1e-5, atol=1e-7)
    assert res.loss_num / den == pytest.approx(loss_full.item(), rel=1e-5)
    assert res.stats["clip_frac"] == pytest.approx(st_full["clip_frac"].item())
    torch.testing.assert_close(res.logprobs, theta)  # scattered back into batch order
    assert calls == [list(p) for p in parts] + [list(parts[0])] * 2  # padded for FSDP balance
    with pytest.raises(ValueError, match="cover each sequence exactly once"):
        minibatch_backward(batch, obj, part_loss, parts[1:], global_den=den)


def _with_ref(batch, seed: int):
    g = torch.Generator().manual_seed(seed)
    ref = batch.old_logprobs - 0.4 * torch.rand(batch.old_logprobs.shape, generator=g) + 0.1
    batch.ref_logprobs = ref * batch.loss_mask
    return batch


def test_kl_reward_mode_moves_advantages_by_the_kl_return_to_go() -> None:
    from paravt.algo.advantages import apply_kl_reward

    beta = 0.05
    batch = _with_ref(pack_units(_units(seed=11)), seed=1)
    before = batch.advantages.clone()
    old, ref, m = batch.old_logprobs, batch.ref_logprobs, batch.loss_mask
    algo = AlgoConfig(kl_coef=beta, kl_type="k1", kl_mode="reward")
    totals = apply_kl_reward(batch, algo)

    # By hand: token t of row s loses beta * sum_{t' >= t in s} m (old - ref); a sub row pays
    # for its own tokens only; the row's total is the shift of its first token.
    cu = batch.cu_seqlens.tolist()
    want = before.clone()
    for s in range(len(cu) - 1):
        for t in range(cu[s], cu[s + 1]):
            want[t] -= beta * sum(float(m[u] * (old[u] - ref[u])) for u in range(t, cu[s + 1]))
        assert float(totals[s]) == pytest.approx(float(before[cu[s]] - want[cu[s]]), abs=1e-6)
    torch.testing.assert_close(batch.advantages, want, atol=1e-6, rtol=0)
    assert (batch.advantages != before).any() and (totals > 0).any()

    # The loss has no KL term: it equals the KL-free loss on the same (shaped) batch, gradient
    # included, while kl_mean still reports KL(pi_theta || pi_ref).
    obj = make_objective(algo)
    assert obj.needs_ref and not obj.kl_in_loss
    lp_a, lp_b = _policy_lp(batch), _policy_lp(batch)
    loss, stats = obj(lp_a, batch)
    plain, _ = make_objective(AlgoConfig(kl_coef=0.0))(lp_b, batch)
    loss.backward()
    plain.backward()
    assert float(loss.detach()) == pytest.approx(float(plain.detach()), abs=1e-7)
    torch.testing.assert_close(lp_a.grad, lp_b.grad)
    assert float(stats["kl_mean"]) != 0.0

    # top_p < 1: the reference may give -inf to forced (mask 0) tokens; no NaN may result.
    shaped = batch.advantages.clone()
    batch.advantages = before.clone()
    forced = (m == 0).nonzero().flatten()
    assert forced.numel() > 0
    batch.ref_logprobs = ref.clone().index_fill_(0, forced, float("-inf"))
    apply_kl_reward(batch, algo)
    assert torch.isfinite(batch.advantages).all()
    torch.testing.assert_close(batch.advantages, shaped, atol=1e-6, rtol=0)

    # k1 in reward mode needs the reference's log-probs.
    batch.ref_logprobs = None
    with pytest.raises(ValueError, match="ref_logprobs"):
        apply_kl_reward(batch, algo)


def test_kl_loss_mode_is_unchanged() -> None:
    from paravt_kernels import policy_loss

    from paravt.algo.advantages import apply_kl_reward

    batch = _with_ref(pack_units(_units(seed=12)), seed=2)
    before = batch.advantages.clone()
    algo = AlgoConfig(kl_coef=0.05, kl_type="k3")
    assert algo.kl_mode == "loss"
    totals = apply_kl_reward(batch, algo)
    assert torch.equal(batch.advantages, before) and not totals.any()
    obj = make_objective(algo)
    assert obj.kl_in_loss
    lp = _policy_lp(batch)
    loss, _ = obj(lp, batch)
    want, _ = policy_loss(
        lp, batch.old_logprobs, batch.advantages, batch.loss_mask,
        ref_logprob=batch.ref_logprobs, kl_coef=0.05, kl_type="k3",
        clip_low=0.2, clip_high=0.2, agg=algo.agg, cu_seqlens=batch.cu_seqlens,
        seq_weights=batch.seq_weights,
    )  # fmt: skip
    plain, _ = make_objective(AlgoConfig(kl_coef=0.0))(lp, batch)
    loss, want, plain = float(loss.detach()), float(want.detach()), float(plain.detach())
    assert loss == pytest.approx(want, abs=1e-7)
    assert loss != pytest.approx(plain, abs=1e-5)  # the KL term is there
