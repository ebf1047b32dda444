"""CPU benchmark: the log-prob + loss + backward phase of one PPO minibatch, real vocabulary.

A Qwen3-VL-architecture model with Qwen3-VL's vocabulary (151,936) and a small text tower
(hidden 256, 2 layers, fp32), and 8 rollouts of 2,000 tokens of which the last 15% are
generated (trained), scored under T = 0.7, with the KL to a reference in the loss
(``AlgoConfig`` defaults: PPO clip, k3, token-mean; micro-batches of
``max_tokens_per_microbatch`` = 16,384 tokens) and gradient checkpointing on, as the
real-scale presets run (``model.gradient_checkpointing``). Two paths on the same inputs, in
the same run:

* ``ours``: the trainer's path (``paravt.algo.loss.policy_minibatch_backward``): micro-batches
  by token budget, one packed backbone forward each, the trained rows' hidden states through
  the fused ``paravt_kernels.linear_policy_loss``;
* ``baseline``: the materialised path the trainer used before (``paravt.algo.naive``): one
  forward per sequence through the full model, ``(L, V)`` float32 logits and log-softmax.

Reports ``time_ratio`` and ``mem_ratio`` (ours / baseline, lower is better; peak memory = the
peak of torch's CPU allocator events during the phase, ``peak_cpu_alloc_bytes``) and checks
that both paths give the same loss and lm_head gradient first. Text-only rollouts: the vision
tower is the same on both paths and would only add the same constant to both. Without
gradient checkpointing the activations of a 16k-token micro-batch (~0.6 GB here) count
against ours: measured 0.155 of the baseline's peak at 16,384 tokens, 0.146 at 8,192.

    pytest bench/test_bench_train_logprob_phase.py --benchmark-only -s
"""

from __future__ import annotations

import pytest
import torch
from paravt_kernels.profiling import median_seconds, peak_cpu_alloc_bytes, report_ratios

from paravt.algo.loss import agg_denominator, make_objective, policy_minibatch_backward
from paravt.algo.naive import materialised_minibatch_backward
from paravt.config import AlgoConfig
from paravt.types import PackedBatch

VOCAB, HIDDEN, LAYERS = 151_936, 256, 2
ROLLOUTS, LENGTH, GENERATED = 8, 2000, 0.15
TEMPERATURE = 0.7


def _model() -> torch.nn.Module:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    head_dim = 64
    cfg = Qwen3VLConfig(
        text_config=dict(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS, num_attention_heads=HIDDEN // head_dim,
            num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=8192,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                             "mrope_section": [16, 8, 8], "mrope_interleaved": True},
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=1, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=HIDDEN,
            num_position_embeddings=64, deepstack_visual_indexes=[0],
        ),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3VLForConditionalGeneration(cfg)
    model.gradient_checkpointing_enable()
    return model.float().train()


def _batch() -> PackedBatch:
    g = torch.Generator().manual_seed(1)
    n = ROLLOUTS * LENGTH
    gen = int(LENGTH * GENERATED)
    mask = torch.zeros(ROLLOUTS, LENGTH)
    mask[:, LENGTH - gen :] = 1.0
    mask = mask.reshape(-1)
    old = -3.0 * torch.rand(n, generator=g) * mask
    adv = torch.randn(ROLLOUTS, generator=g).repeat_interleave(LENGTH) * mask
    return PackedBatch(
        input_ids=torch.randint(0, 151_000, (n,), generator=g),  # below the special ids
        cu_seqlens=torch.arange(0, n + 1, LENGTH, dtype=torch.int32),
        loss_mask=mask,
        old_logprobs=old,
        advantages=adv,
        seq_weights=torch.ones(ROLLOUTS),
        temperatures=torch.full((ROLLOUTS,), TEMPERATURE),
        top_ps=torch.ones(ROLLOUTS),
        uids=[f"r{i}" for i in range(ROLLOUTS)],
        visuals=[None] * ROLLOUTS,
        mm_token_type_ids=torch.zeros(n, dtype=torch.int64),
        ref_logprobs=(old - 0.3 * torch.rand(n, generator=g)) * mask,
    )


def test_bench_logprob_loss_backward_phase_vs_materialised(benchmark):
    model, batch = _model(), _batch()
    algo = AlgoConfig()
    obj = make_objective(algo)
    den = agg_denominator(obj.effective_mask(batch), batch, algo.agg)
    max_tokens = algo.max_tokens_per_microbatch
    head = model.get_output_embeddings().weight

    def ours():
        model.zero_grad(set_to_none=True)
        return policy_minibatch_backward(model, batch, obj, global_den=den, max_tokens=max_tokens)

    def baseline():
        model.zero_grad(set_to_none=True)
        return materialised_minibatch_backward(model, batch, obj, global_den=den)

    # Same loss and lm_head gradient on these very inputs before timing anything.
    res_b = baseline()
    g_b = head.grad.clone()
    res_o = ours()
    assert res_o.loss_num == pytest.approx(res_b.loss_num, rel=1e-5)
    assert float((head.grad - g_b).norm()) <= 1e-4 * float(g_b.norm())
    del g_b

    benchmark.pedantic(ours, rounds=2, iterations=1, warmup_rounds=0)
    t_ours = benchmark.stats.stats.median
    t_base = median_seconds(baseline, repeats=1, warmup=0)
    model.zero_grad(set_to_none=True)
    m_ours = peak_cpu_alloc_bytes(ours)
    model.zero_grad(set_to_none=True)
    m_base = peak_cpu_alloc_bytes(baseline)
    info = report_ratios(
        benchmark,
        "log-prob + loss + backward phase",
        f"{ROLLOUTS} rollouts x {LENGTH} tokens ({GENERATED:.0%} trained), hidden {HIDDEN}, "
        f"{LAYERS} layers, vocab {VOCAB}, fp32, gradient checkpointing",
        "materialised per-sequence (full logits, log_softmax, gather)",
        (t_ours, t_base),
        (m_ours, m_base),
    )
    assert info["mem_ratio"] <= 0.15, info
    assert info["time_ratio"] <= 0.6, info
