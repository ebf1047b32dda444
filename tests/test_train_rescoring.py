"""Every trainer log-prob pass scores each row under the distribution it was sampled from.

Sub-agents sample at ``rollout.sub_temperature``, main agents at ``rollout.temperature``. With
the two different, the policy forward of the first minibatch (before any update), the
proximal pass and the reference pass must all reproduce the engine's behaviour log-probs on
every trained token of every row: PPO ratio exp(trainer - behaviour) = 1. Scoring every row at
the main temperature (the old behaviour) put the sub-agent rows' ratios at 0.5-1.9.
"""

from __future__ import annotations

import pytest
import torch
from scripted_engine import MAIN_T, SUB_T, own_score, scripted_trainer

# float32 CPU forwards, batched generate vs one teacher-forced forward (tests/test_hf_engine.py
# checks behaviour log-probs to 2e-4 the same way).
ATOL = 2e-4


def test_first_minibatch_ratios_are_one_for_main_and_sub_rows(assets, tmp_path, monkeypatch):
    import paravt.algo.loss as loss_mod
    from paravt.train import train_step

    tr = scripted_trainer(
        assets,
        str(tmp_path / "run"),
        own_score,
        **{
            # Exercise all three passes: policy, proximal (decoupled) and reference (KL).
            "algo.loss": "decoupled",
            "algo.kl_coef": 0.01,
        },
    )

    seen: dict[str, list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    real_backward = loss_mod.minibatch_backward

    def checking_backward(batch, objective, part_loss, parts, **kw):
        res = real_backward(batch, objective, part_loss, parts, **kw)
        if not seen:  # the first minibatch: its log-probs come from the pre-update weights
            cu = batch.cu_seqlens.tolist()
            for i, role in enumerate(batch.roles):
                a, e = cu[i], cu[i + 1]
                m = batch.loss_mask[a:e].bool()
                old = batch.old_logprobs[a:e][m]
                seen.setdefault(role, []).append(
                    (
                        batch.uids[i],
                        (res.logprobs[a:e][m] - old).exp(),
                        (batch.prox_logprobs[a:e][m] - old).exp(),
                        (batch.ref_logprobs[a:e][m] - old).exp(),
                    )
                )
            temps = dict(zip(batch.roles, batch.temperatures.tolist()))
            assert temps == pytest.approx({"main": MAIN_T, "sub": SUB_T})
        return res

    monkeypatch.setattr(loss_mod, "minibatch_backward", checking_backward)
    train_step(tr, 1)

    assert len(seen.get("main", [])) == 4 and len(seen.get("sub", [])) >= 2, seen.keys()
    for rows in seen.values():
        for uid, policy, prox, ref in rows:
            assert policy.numel() > 0, uid
            for name, ratio in (("policy", policy), ("proximal", prox), ("reference", ref)):
                torch.testing.assert_close(
                    ratio, torch.ones_like(ratio), atol=ATOL, rtol=0,
                    msg=lambda s, n=name, u=uid: f"{n} ratio of {u}: {s}",
                )  # fmt: skip
