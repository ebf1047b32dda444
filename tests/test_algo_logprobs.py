"""The trainer's log-prob path on a real step: packed forwards, fused kernels, no lm_head.

One ``train_step`` on the tiny model (fp32 CPU; main rows at T = 0.7 forced to call the crop
tool, so sub-agent rows at T = 0.3 exist; decoupled objective; KL to the reference in the
loss) is run with counters on:

* the reference and proximal passes (no grad) run the packed path: one backbone forward per
  micro-batch, ``paravt_kernels.linear_logprob`` once per sampling temperature on the
  gathered rows only (one per trained token);
* the policy pass (with grad) runs ``paravt.algo.loss.policy_part_loss`` once per
  micro-batch: ``paravt_kernels.linear_policy_loss`` on the gathered rows, and no
  ``linear_logprob`` call;
* the lm_head module's forward never runs inside those passes (it does run in rollouts).

The first minibatch and the weights it was trained from are kept, and the PPO loss and every
parameter's gradient are recomputed through the trainer's path and through the OLD
materialised path (``paravt.algo.naive``: one forward per sequence, full ``(L, V)`` logits of
every position, ``log_softmax(top_p(logits / T))``, gather).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from scripted_engine import MAIN_T, SUB_T, scripted_trainer

from paravt.algo.naive import materialised_row_logprobs, materialised_sequence_logprobs


def new_row(model, batch, i: int, with_entropy: bool = False):
    from paravt.algo.logprobs import row_logprobs

    return row_logprobs(model, batch, i, with_entropy)


def _shifted_old_score(model, r, ids) -> list[float]:
    """Behaviour log-probs of the scripted turn: the model's teacher-forced ones (old path)
    shifted by +-0.3 in turn, so the decoupled objective's behaviour weights pi_prox / mu are
    not all 1."""
    mm = list(r.extras["mm_token_type_ids"]) + [0] * (len(ids) - len(r.prompt_ids))
    with torch.no_grad():
        lp, _ = materialised_sequence_logprobs(
            model, torch.tensor(ids), torch.tensor(mm), r.visuals,
            r.sampling.temperature, r.sampling.top_p,
        )  # fmt: skip
    return [
        min(0.0, x + (0.3 if k % 2 else -0.3))
        for k, x in enumerate(lp[len(r.prompt_ids) :].tolist())
    ]


@pytest.fixture(scope="module")
def step(assets, tmp_path_factory):
    """One train_step with counters; returns what the tests below check."""
    import paravt_kernels

    import paravt.algo.logprobs as logprobs_mod
    import paravt.algo.loss as loss_mod
    from paravt.train import train_step

    tr = scripted_trainer(
        assets,
        str(tmp_path_factory.mktemp("logprobs") / "run"),
        _shifted_old_score,
        **{
            "algo.adv_bias": 0.1,  # non-zero advantages although the untrained group ties
            "algo.loss": "decoupled",
            "algo.behav_cap": 3.0,
            "algo.kl_coef": 0.05,
            "algo.kl_mode": "loss",
        },
    )
    assert tr.engine.model is tr.policy and tr.reference is not None

    rec = {"in_pass": 0, "packed_passes": 0, "policy_parts": 0, "head_in_pass": 0}
    rec.update(head_total=0, logprob_calls=[], fused_calls=[])
    real_lp, real_fused = paravt_kernels.linear_logprob, paravt_kernels.linear_policy_loss
    real_packed, real_part = logprobs_mod.packed_logprob_rows, loss_mod.policy_part_loss
    real_backward = loss_mod.minibatch_backward

    def counting(real, key):
        def run(*a, **kw):
            rec[key] += 1
            rec["in_pass"] += 1
            try:
                return real(*a, **kw)
            finally:
                rec["in_pass"] -= 1

        return run

    def counting_lp(hidden, *a, **kw):
        rec["logprob_calls"].append((hidden.shape[0], hidden.requires_grad, bool(rec["in_pass"])))
        return real_lp(hidden, *a, **kw)

    def counting_fused(hidden, *a, **kw):
        rec["fused_calls"].append((hidden.shape[0], hidden.requires_grad, bool(rec["in_pass"])))
        return real_fused(hidden, *a, **kw)

    def head_hook(*_):
        rec["head_total"] += 1
        rec["head_in_pass"] += bool(rec["in_pass"])

    def capturing_backward(batch, *a, **kw):
        if "batch" not in rec:  # first minibatch: weights not updated yet
            rec["batch"] = copy.deepcopy(batch)
            rec["model"] = copy.deepcopy(tr.policy)
            rec["packed_before_policy"] = rec["packed_passes"]
        return real_backward(batch, *a, **kw)

    hooks = [m.lm_head.register_forward_hook(head_hook) for m in (tr.policy, tr.reference.model)]
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(logprobs_mod, "packed_logprob_rows", counting(real_packed, "packed_passes"))
            mp.setattr(loss_mod, "policy_part_loss", counting(real_part, "policy_parts"))
            mp.setattr(paravt_kernels, "linear_logprob", counting_lp)
            mp.setattr(paravt_kernels, "linear_policy_loss", counting_fused)
            mp.setattr(loss_mod, "minibatch_backward", capturing_backward)
            metrics = train_step(tr, 1).metrics
    finally:
        for h in hooks:
            h.remove()
    rec["metrics"], rec["cfg"] = metrics, tr.cfg
    return rec


def test_train_step_goes_through_packed_forwards_and_fused_kernels_not_lm_head(step):
    batch = step["batch"]
    n_seq = batch.cu_seqlens.numel() - 1
    roles = batch.roles
    assert roles.count("main") == 4 and roles.count("sub") >= 2, roles
    assert sorted(set(batch.temperatures.tolist())) == pytest.approx([SUB_T, MAIN_T])
    # The whole minibatch fits one micro-batch: reference + proximal = two packed forwards
    # before the update, then one policy forward (1 epoch, 1 minibatch).
    assert step["packed_before_policy"] == step["packed_passes"] == 2
    assert step["policy_parts"] == 1
    cu = batch.cu_seqlens.tolist()
    trained = [int(batch.loss_mask[cu[i] : cu[i + 1]].sum()) for i in range(n_seq)]
    assert sum(trained) < batch.input_ids.numel() / 2  # the prompt + video rows are skipped
    # No-grad passes: one linear_logprob call per sampling temperature, gathered rows only.
    temps = batch.temperatures.tolist()
    per_t = [sum(n for n, t in zip(trained, temps) if t == tt) for tt in dict.fromkeys(temps)]
    assert len(per_t) == 2
    assert step["logprob_calls"] == [(n, False, True) for n in per_t * 2]
    # The policy pass: ONE fused loss call over every trained row, with grad.
    assert step["fused_calls"] == [(sum(trained), True, True)]
    # The lm_head module ran in the rollouts (the hook works) but never in a log-prob pass.
    assert step["head_total"] > 0
    assert step["head_in_pass"] == 0
    assert step["metrics"]["entropy"] > 0 and step["metrics"]["grad_norm"] > 0


def _grads(model) -> dict[str, torch.Tensor]:
    out = {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return out


def _new_path(model, batch, algo, max_tokens: int):
    from paravt.algo.loss import agg_denominator, make_objective, policy_minibatch_backward

    obj = make_objective(algo)
    den = agg_denominator(obj.effective_mask(batch), batch, algo.agg)
    model.zero_grad(set_to_none=True)
    res = policy_minibatch_backward(model, batch, obj, global_den=den, max_tokens=max_tokens)
    return res.loss_num / den, _grads(model), res


def _old_path(model, batch, algo):
    from paravt.algo.loss import make_objective
    from paravt.algo.naive import materialised_minibatch_backward

    obj = make_objective(algo)
    model.zero_grad(set_to_none=True)
    res = materialised_minibatch_backward(model, batch, obj)
    return res, _grads(model)


def _assert_same_grads(g_new, g_old):
    moved = 0
    for name, go in g_old.items():
        gn = g_new[name]
        ref = float(go.norm())
        err = float((gn - go).norm())
        assert err <= 1e-5 * ref or (ref == 0 and err == 0), f"{name}: |dg| {err:.3g} |g| {ref:.3g}"
        moved += ref > 0
    assert moved > len(g_old) // 2  # vision tower, language model and lm_head all get gradient
    assert float(g_old["lm_head.weight"].norm()) > 0


def test_trainer_passes_match_the_materialised_path(step):
    """The reference / proximal log-probs the step used are the packed path's, and equal the
    materialised path's on every trained token (0 elsewhere)."""
    from paravt.algo.logprobs import packed_logprobs

    model, batch = step["model"], step["batch"]
    m = batch.loss_mask.bool()
    with torch.no_grad():
        packed, _ = packed_logprobs(model, batch)
        old = torch.cat(
            [materialised_row_logprobs(model, batch, i)[0] for i in range(len(batch.uids))]
        )
    for k in ("prox_logprobs", "ref_logprobs"):  # step 1, sft.steps=0: both are these weights
        lp = getattr(batch, k)
        torch.testing.assert_close(lp, packed, rtol=0, atol=1e-6)
        torch.testing.assert_close(lp[m], old[m], rtol=0, atol=1e-5)
        assert (lp[~m] == 0).all()  # not gathered -> 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("max_tokens", [1 << 20, 300])
def test_ppo_minibatch_loss_and_gradients_match_the_materialised_path(step, agg, max_tokens):
    """One PPO minibatch (main + sub rows, decoupled objective with behaviour cap, KL in the
    loss) through the trainer's path (packed micro-batches, fused loss; one micro-batch, or a
    300-token budget: several) and through the materialised per-sequence path: same loss
    (1e-6 relative) and same gradient for every parameter (1e-5 relative)."""
    from paravt.algo.loss import agg_denominator, make_objective
    from paravt.algo.packing import microbatches

    model, batch = step["model"], step["batch"]
    model.train()
    algo = replace(step["cfg"].algo, agg=agg)
    n_parts = len(microbatches(batch, max_tokens))
    assert n_parts == 1 if max_tokens > 1000 else n_parts > 2
    loss_new, g_new, res_new = _new_path(model, batch, algo, max_tokens)
    res_old, g_old = _old_path(model, batch, algo)
    den = agg_denominator(make_objective(algo).effective_mask(batch), batch, agg)
    assert loss_new == pytest.approx(res_old.loss_num / den, rel=1e-6, abs=0)
    m = batch.loss_mask.bool()
    w = (batch.prox_logprobs - batch.old_logprobs)[m].exp()
    assert (w - 1).abs().max() > 0.2  # the +-0.3 behaviour shifts: weights pi_prox/mu != 1
    assert res_new.stats["kl_mean"] == pytest.approx(res_old.stats["kl_mean"], rel=1e-5, abs=1e-9)
    assert res_new.entropy_sum == pytest.approx(res_old.entropy_sum, rel=1e-5)
    assert res_new.entropy_sum > 0
    torch.testing.assert_close(res_new.logprobs[m], res_old.logprobs[m], rtol=0, atol=1e-5)
    _assert_same_grads(g_new, g_old)


def test_policy_pass_with_top_p_below_one_matches_the_materialised_path(step):
    """A micro-batch with a ``top_p < 1`` row leaves the fused op (no nucleus there) for the
    gathered-rows log-probs + ``policy_loss``: still the materialised path's loss/grads."""
    from paravt.algo.loss import agg_denominator, make_objective

    model, batch = step["model"], copy.copy(step["batch"])
    model.train()
    n_seq = batch.cu_seqlens.numel() - 1
    batch.top_ps = torch.tensor([0.95 if i % 2 else 1.0 for i in range(n_seq)])
    algo = replace(step["cfg"].algo, loss="ppo", behav_cap=None, kl_coef=0.0)
    # Behaviour log-probs inside every nucleus: the materialised path's own, shifted.
    with torch.no_grad():
        own = torch.cat([materialised_row_logprobs(model, batch, i)[0] for i in range(n_seq)])
    keep = torch.isfinite(own)
    batch.loss_mask = batch.loss_mask * keep
    batch.old_logprobs = torch.where(keep, own - 0.1, 0.0) * batch.loss_mask
    loss_new, g_new, _ = _new_path(model, batch, algo, 1 << 20)
    res_old, g_old = _old_path(model, batch, algo)
    den = agg_denominator(make_objective(algo).effective_mask(batch), batch, algo.agg)
    assert loss_new == pytest.approx(res_old.loss_num / den, rel=1e-6, abs=0)
    _assert_same_grads(g_new, g_old)


def test_top_p_below_one_matches_the_materialised_path_on_gathered_rows(step):
    model, batch = step["model"], copy.copy(step["batch"])
    model.train()
    n_seq = batch.cu_seqlens.numel() - 1
    batch.top_ps = torch.tensor([0.6 if i % 2 else 0.9 for i in range(n_seq)])
    cu = batch.cu_seqlens.tolist()
    for i in range(n_seq):
        m = batch.loss_mask[cu[i] : cu[i + 1]].bool()
        lp_new, ent_new = new_row(model, batch, i, True)
        lp_old, ent_old = materialised_row_logprobs(model, batch, i, True)
        assert (lp_new[~m] == 0).all() and (ent_new[~m] == 0).all()
        # Tokens outside a nucleus are -inf on both paths (assert_close compares infs exactly).
        torch.testing.assert_close(lp_new[m], lp_old[m], rtol=0, atol=1e-5)
        torch.testing.assert_close(ent_new[m], ent_old[m], rtol=1e-5, atol=1e-6)
        # Gradients through the nucleus-restricted log-probs (the finite ones) agree too.
        keep = torch.isfinite(lp_old) & m
        grads = []
        for lp in (lp_new, lp_old):
            model.zero_grad(set_to_none=True)
            lp[keep].sum().backward()
            grads.append(model.lm_head.weight.grad.clone())
        model.zero_grad(set_to_none=True)
        assert float((grads[0] - grads[1]).norm()) <= 1e-5 * float(grads[1].norm())
    assert batch.loss_mask.sum() > 0
    # The entropy over a nucleus differs from the full-vocabulary one: the top_p path is used.
    full = [float(new_row(model, step["batch"], i, True)[1].sum()) for i in range(n_seq)]
    assert sum(full) > sum(float(new_row(model, batch, i, True)[1].sum()) for i in range(n_seq))


def test_target_mask_of_the_wrong_length_is_refused(step):
    from paravt.algo.logprobs import sequence_logprobs

    batch = step["batch"]
    n = int(batch.cu_seqlens[1])
    with pytest.raises(ValueError, match=rf"target_mask has {n - 1} entries for {n} tokens"):
        sequence_logprobs(
            step["model"], batch.input_ids[:n], batch.mm_token_type_ids[:n],
            batch.visuals[0], target_mask=batch.loss_mask[: n - 1],
        )  # fmt: skip


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_micro_batches_without_trained_tokens_still_run_their_backward(step, top_p):
    """Rows with an empty loss mask (every other one here) alone in their micro-batch: the
    fused op and the ``top_p < 1`` fallback both return a loss connected to the graph (under
    FSDP the backward's collectives must run), and the minibatch still matches the
    materialised path."""
    from paravt.algo.loss import agg_denominator, make_objective, policy_minibatch_backward

    model, batch = step["model"], copy.copy(step["batch"])
    model.train()
    n_seq = batch.cu_seqlens.numel() - 1
    cu = batch.cu_seqlens.tolist()
    mask = batch.loss_mask.clone()
    for i in range(0, n_seq, 2):
        mask[cu[i] : cu[i + 1]] = 0
    batch.loss_mask, batch.top_ps = mask, torch.full((n_seq,), top_p)
    with torch.no_grad():
        own = torch.cat([materialised_row_logprobs(model, batch, i)[0] for i in range(n_seq)])
    batch.old_logprobs = torch.where(torch.isfinite(own), own - 0.1, -30.0) * mask
    algo = replace(step["cfg"].algo, loss="ppo", behav_cap=None, kl_coef=0.0)
    obj = make_objective(algo)
    den = agg_denominator(obj.effective_mask(batch), batch, algo.agg)
    model.zero_grad(set_to_none=True)
    res = policy_minibatch_backward(
        model, batch, obj, global_den=den, max_tokens=1, parts=[[i] for i in range(n_seq)]
    )
    g_new = _grads(model)
    res_old, g_old = _old_path(model, batch, algo)
    assert res.loss_num == pytest.approx(res_old.loss_num, rel=1e-6)
    _assert_same_grads(g_new, g_old)
