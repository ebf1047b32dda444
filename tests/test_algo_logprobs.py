"""The trainer's one log-prob path (``paravt.algo.packing.sequence_logprobs``) on a real step.

One ``train_step`` on the tiny model (fp32 CPU; main rows at T = 0.7 forced to call the crop
tool, so sub-agent rows at T = 0.3 exist; decoupled objective; KL to the reference in the
loss) is run with counters on:

* ``paravt_kernels.linear_logprob`` must be called on the gathered rows only (one per trained
  token): once per sequence in the policy pass (with grad, one forward per row), once per
  sampling temperature in the proximal and reference passes (the packed path: the whole
  batch in one forward);
* the lm_head module's forward must never run inside those passes (it does run in rollouts).

The first minibatch and the weights it was trained from are kept, and the PPO loss and every
parameter's gradient are recomputed through the new path and through the OLD materialised
path (full ``(L, V)`` logits of every position, ``log_softmax(top_p(logits / T))``, gather;
kept below as ``old_sequence_logprobs``, the reference of this test only).
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from scripted_engine import MAIN_T, SUB_T, scripted_trainer


def old_sequence_logprobs(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    mm: torch.Tensor,
    visuals,
    temperature: float,
    top_p: float,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-fusion trainer path: lm_head over EVERY position, (L, V) float32 log-probs."""
    from paravt.rollout.hf import sampling_logprobs
    from paravt.vision.preprocess import build_model_inputs

    p0 = next(model.parameters())
    merge = int(model.config.vision_config.spatial_merge_size)
    inputs = build_model_inputs(
        tokens.tolist(), mm.tolist(), visuals, p0.device, merge_size=merge, dtype=p0.dtype
    )
    logits = model(**inputs, use_cache=False).logits[0, :-1]
    logp = sampling_logprobs(logits, temperature, top_p)
    lp = logp.gather(-1, inputs["input_ids"][0, 1:, None]).squeeze(-1)
    lp = torch.cat([lp.new_zeros(1), lp])
    if not with_entropy:
        return lp, lp.new_zeros(0)
    with torch.no_grad():
        p = logp.exp()
        ent = -torch.where(p > 0, p * logp, torch.zeros_like(logp)).sum(-1)
    return lp, torch.cat([ent.new_zeros(1), ent])


def old_row(model, batch, i: int, with_entropy: bool = False):
    a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    return old_sequence_logprobs(
        model, batch.input_ids[a:b], batch.extras["mm_token_type_ids"][a:b], batch.visuals[i],
        float(batch.temperatures[i]), float(batch.top_ps[i]), with_entropy,
    )  # fmt: skip


def new_row(model, batch, i: int, with_entropy: bool = False):
    from paravt.algo.packing import row_logprobs

    return row_logprobs(model, batch, i, with_entropy)


def _shifted_old_score(model, r, ids) -> list[float]:
    """Behaviour log-probs of the scripted turn: the model's teacher-forced ones (old path)
    shifted by +-0.3 in turn, so the decoupled objective's behaviour weights pi_prox / mu are
    not all 1."""
    mm = list(r.extras["mm_token_type_ids"]) + [0] * (len(ids) - len(r.prompt_ids))
    with torch.no_grad():
        lp, _ = old_sequence_logprobs(
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

    import paravt.algo.loss as loss_mod
    import paravt.algo.packing as packing
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

    rec = {"in_pass": 0, "passes": 0, "packed_passes": 0, "head_in_pass": 0, "head_total": 0}
    rec["kernel"] = []
    real_seq, real_kernel = packing.sequence_logprobs, paravt_kernels.linear_logprob
    real_packed = packing._packed_logprob_rows
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

    def counting_kernel(hidden, *a, **kw):
        rec["kernel"].append((hidden.shape[0], hidden.requires_grad, bool(rec["in_pass"])))
        return real_kernel(hidden, *a, **kw)

    def head_hook(*_):
        rec["head_total"] += 1
        rec["head_in_pass"] += bool(rec["in_pass"])

    def capturing_backward(batch, objective, seq_logprobs, **kw):
        if "batch" not in rec:  # first minibatch: weights not updated yet
            rec["batch"] = copy.deepcopy(batch)
            rec["model"] = copy.deepcopy(tr.policy)
            rec["passes_before_policy"] = rec["passes"]
            rec["packed_before_policy"] = rec["packed_passes"]
        return real_backward(batch, objective, seq_logprobs, **kw)

    hooks = [m.lm_head.register_forward_hook(head_hook) for m in (tr.policy, tr.reference.model)]
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(packing, "sequence_logprobs", counting(real_seq, "passes"))
            mp.setattr(packing, "_packed_logprob_rows", counting(real_packed, "packed_passes"))
            mp.setattr(paravt_kernels, "linear_logprob", counting_kernel)
            mp.setattr(loss_mod, "minibatch_backward", capturing_backward)
            metrics = train_step(tr, 1)
    finally:
        for h in hooks:
            h.remove()
    rec["metrics"], rec["cfg"] = metrics, tr.cfg
    return rec


def test_train_step_log_probs_go_through_linear_logprob_not_lm_head(step):
    batch = step["batch"]
    n_seq = batch.cu_seqlens.numel() - 1
    roles = batch.extras["roles"]
    assert roles.count("main") == 4 and roles.count("sub") >= 2, roles
    assert sorted(set(batch.temperatures.tolist())) == pytest.approx([SUB_T, MAIN_T])
    # Reference + proximal before the update: the packed path, the whole batch in one forward
    # each; then one policy forward per row (1 epoch, 1 minibatch).
    assert step["packed_before_policy"] == step["packed_passes"] == 2
    assert step["passes_before_policy"] == 0 and step["passes"] == n_seq
    kernel = step["kernel"]
    assert all(in_pass for _, _, in_pass in kernel)
    # Only the rows that predict a trained token are gathered: one row per loss-mask token;
    # the packed passes make one fused call per sampling temperature (main, then sub rows).
    cu = batch.cu_seqlens.tolist()
    trained = [int(batch.loss_mask[cu[i] : cu[i + 1]].sum()) for i in range(n_seq)]
    temps = batch.temperatures.tolist()
    per_t = [sum(n for n, t in zip(trained, temps) if t == tt) for tt in dict.fromkeys(temps)]
    assert len(per_t) == 2
    assert [n for n, _, _ in kernel] == per_t * 2 + trained
    assert sum(trained) < batch.input_ids.numel() / 2  # the prompt + video rows were skipped
    assert [g for _, g, _ in kernel] == [False] * 4 + [True] * n_seq
    # The lm_head module ran in the rollouts (the hook works) but never in a log-prob pass.
    assert step["head_total"] > 0
    assert step["head_in_pass"] == 0
    assert step["metrics"]["entropy"] > 0 and step["metrics"]["grad_norm"] > 0


def _loss_and_grads(model, batch, algo, row_fn):
    from paravt.algo.loss import agg_denominator, make_objective, minibatch_backward

    obj = make_objective(algo)
    den = agg_denominator(obj.effective_mask(batch), batch, algo.agg)
    model.zero_grad(set_to_none=True)
    res = minibatch_backward(batch, obj, lambda i: row_fn(model, batch, i, True), global_den=den)
    grads = {
        n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }
    model.zero_grad(set_to_none=True)
    return res.loss_num / den, grads, res


def _with_passes(model, batch, row_fn):
    """A copy of ``batch`` whose proximal and reference log-probs come from ``row_fn`` (the
    step's weights are both the proximal and the reference policy: sft.steps=0, step 1)."""
    out = copy.copy(batch)
    out.extras = dict(batch.extras)
    with torch.no_grad():
        lp = torch.cat([row_fn(model, batch, i)[0] for i in range(batch.cu_seqlens.numel() - 1)])
    out.extras["prox_logprobs"] = lp.float().cpu()
    out.extras["ref_logprobs"] = lp.float().cpu()
    return out


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_ppo_minibatch_loss_and_gradients_match_the_materialised_path(step, agg):
    model, batch = step["model"], step["batch"]
    model.train()
    algo = replace(step["cfg"].algo, agg=agg)
    new_b, old_b = _with_passes(model, batch, new_row), _with_passes(model, batch, old_row)
    m = batch.loss_mask.bool()
    # The trainer's own proximal / reference passes are the packed path on these weights: the
    # per-row path's values up to fp32 round-off (tests/test_algo_packed_forward.py).
    for k in ("prox_logprobs", "ref_logprobs"):
        torch.testing.assert_close(batch.extras[k], new_b.extras[k], rtol=0, atol=1e-5)
        torch.testing.assert_close(new_b.extras[k][m], old_b.extras[k][m], rtol=0, atol=1e-5)
        assert (new_b.extras[k][~m] == 0).all()  # not gathered -> 0

    loss_new, g_new, res_new = _loss_and_grads(model, new_b, algo, new_row)
    loss_old, g_old, res_old = _loss_and_grads(model, old_b, algo, old_row)
    assert loss_new == pytest.approx(loss_old, rel=1e-6, abs=0)
    w = (new_b.extras["prox_logprobs"] - batch.old_logprobs)[m].exp()
    assert (w - 1).abs().max() > 0.2  # the +-0.3 behaviour shifts: weights pi_prox/mu != 1
    assert res_new.stats["kl_mean"] == pytest.approx(res_old.stats["kl_mean"], rel=1e-5, abs=1e-9)
    assert res_new.entropy_sum == pytest.approx(res_old.entropy_sum, rel=1e-5)
    assert res_new.entropy_sum > 0
    moved = 0
    for name, go in g_old.items():
        gn = g_new[name]
        ref = float(go.norm())
        err = float((gn - go).norm())
        assert err <= 1e-5 * ref or (ref == 0 and err == 0), f"{name}: |dg| {err:.3g} |g| {ref:.3g}"
        moved += ref > 0
    assert moved > len(g_old) // 2  # vision tower, language model and lm_head all get gradient
    assert float(g_old["lm_head.weight"].norm()) > 0


def test_top_p_below_one_matches_the_materialised_path_on_gathered_rows(step):
    model, batch = step["model"], copy.copy(step["batch"])
    model.train()
    n_seq = batch.cu_seqlens.numel() - 1
    batch.top_ps = torch.tensor([0.6 if i % 2 else 0.9 for i in range(n_seq)])
    cu = batch.cu_seqlens.tolist()
    for i in range(n_seq):
        m = batch.loss_mask[cu[i] : cu[i + 1]].bool()
        lp_new, ent_new = new_row(model, batch, i, True)
        lp_old, ent_old = old_row(model, batch, i, True)
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
    from paravt.algo.packing import sequence_logprobs

    batch = step["batch"]
    n = int(batch.cu_seqlens[1])
    with pytest.raises(ValueError, match=rf"target_mask has {n - 1} entries for {n} tokens"):
        sequence_logprobs(
            step["model"], batch.input_ids[:n], batch.extras["mm_token_type_ids"][:n],
            batch.visuals[0], target_mask=batch.loss_mask[: n - 1],
        )  # fmt: skip
