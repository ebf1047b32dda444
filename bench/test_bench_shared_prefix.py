"""CPU benchmark: shared-prefix forwards (``algo.share_prefix``) against every row whole.

The log-prob phase (the proximal / reference pass: ``packed_logprobs`` under ``no_grad``) and
the update phase (``policy_minibatch_backward``: forward, fused loss, backward) on the same
packed batch, with each group's prompt encoded once (``share_prefix``, the default) and with
``PackedBatch.group_ids = None`` (today's unshared path), in the same run. A
Qwen3-VL-architecture model (text hidden 256, 2 layers, head_dim 32; vision depth 1, fp32,
the tiny tokenizer's 4k vocabulary) and two prompts per batch, each a system text, a real
video overview laid out by ``encode_clip`` (timestamped temporal patches) and a question,
rolled out G times; each rollout's suffix is random text, trained.

Shapes:

* ``default``: the embedded default's recipe: G = 4, K = 16 overview frames of 128 x 128,
  suffixes of about 30% of a main row (turns and tool responses);
* ``long``: the long-prompt shape of the 8B recipe's direction: K = 32 frames of 256 x 256,
  G = 8, about 10% of the main tokens generated.

Reports for each phase the time and peak-memory ratios (shared / unshared, lower is better)
and the rows pushed through the backbone (counted at the language model's input), and checks
first that both give the same log-probs (1e-5). Targets at the long shape: <= 0.35x the
backbone rows and <= 0.5x the time of each phase.

``test_bench_peer_prefix_grouper``: the ``prefix-grouper`` package's attention (PyPI
``prefix-grouper``, Prefix Grouper, arXiv 2506.05433; verl's ``use_prefix_grouper``) on the
same query/key/value tensors as paravt's block attention: same outputs, and its time beside
ours (the package pads every group to the longest prompt and suffix; paravt's rows are
padding-free).

    pytest bench/test_bench_shared_prefix.py --benchmark-only -s
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from paravt_kernels.profiling import peak_cpu_alloc_bytes, report_ratios

from paravt.algo.logprobs import packed_logprobs
from paravt.algo.loss import agg_denominator, make_objective, policy_minibatch_backward
from paravt.algo.packing import pack_units
from paravt.config import AlgoConfig
from paravt.types import PackedBatch, SequenceUnit, Trajectory

HIDDEN, LAYERS, HEAD_DIM = 256, 2, 32
SHAPES = {
    "default": dict(frames=16, side=128, group=4, generated=0.30),
    "long": dict(frames=32, side=256, group=8, generated=0.10),
}
PROMPTS = 2


def _model(tok) -> torch.nn.Module:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from paravt.models.tiny import QWEN_SPECIAL

    ids = {s: tok.convert_tokens_to_ids(s) for s in QWEN_SPECIAL}
    cfg = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS, num_attention_heads=HIDDEN // HEAD_DIM,
            num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "mrope_section": [8, 4, 4], "mrope_interleaved": True},
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=1, hidden_size=64, intermediate_size=128, num_heads=4, patch_size=16,
            spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=HIDDEN,
            num_position_embeddings=64, deepstack_visual_indexes=[0],
        ),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3VLForConditionalGeneration(cfg)
    return model.float().train()


def _batch(tok, frames: int, side: int, group: int, generated: float) -> PackedBatch:
    from paravt.vision.patchify import VisionSpec
    from paravt.vision.preprocess import encode_clip

    g = torch.Generator().manual_seed(1)
    text = min(int(i) for i in tok.all_special_ids)  # ids below the specials are plain text

    def words(n: int) -> list[int]:
        return torch.randint(0, text, (n,), generator=g).tolist()

    units = []
    for p in range(PROMPTS):
        video = torch.randint(0, 256, (frames, side, side, 3), dtype=torch.uint8, generator=g)
        clip = encode_clip(video, [2.0 * k for k in range(frames)], VisionSpec(), tok)
        prompt = words(60) + clip.token_ids + words(30)
        mm = [0] * 60 + clip.mm_token_type_ids + [0] * 30
        n_gen = int(len(prompt) * generated / (1 - generated))
        for r in range(group):
            n = max(2, int(n_gen * (0.8 + 0.4 * r / max(1, group - 1))))
            t = Trajectory(
                uid=f"p{p}:r{r}", role="main", sample_id=f"p{p}", group_id=p,
                tokens=prompt + words(n), loss_mask=[0] * len(prompt) + [1] * n,
                logprobs=[0.0] * len(prompt) + (-2.0 * torch.rand(n, generator=g)).tolist(),
                prompt_len=len(prompt), visuals=clip.visuals,
                extras={"mm_token_type_ids": mm + [0] * n}, temperature=0.7,
            )  # fmt: skip
            units.append(SequenceUnit(t, [], float(torch.randn(1, generator=g)), p))
    batch = pack_units(units, share_prefix=True)
    # The KL term of AlgoConfig's defaults reads the reference's log-probs.
    noise = 0.3 * torch.rand(batch.input_ids.numel(), generator=g)
    batch.ref_logprobs = (batch.old_logprobs - noise) * batch.loss_mask
    return batch


def _alternating(ours, base, rounds: int) -> tuple[float, float]:
    """Best wall time of ``ours`` and ``base`` over ``rounds`` alternating rounds."""
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for k, fn in enumerate((ours, base)):
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best[0], best[1]


def _rows_counter(model):
    seen = {"rows": 0}
    forward = model.model.language_model.forward

    def count(*a, **kw):
        seen["rows"] += int(kw["inputs_embeds"].shape[1])
        return forward(*a, **kw)

    model.model.language_model.forward = count
    return seen


@pytest.mark.parametrize("shape", list(SHAPES))
def test_bench_shared_prefix_phases(benchmark, shape):
    from paravt.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    model = _model(tok)
    shared = _batch(tok, **SHAPES[shape])
    whole = copy.copy(shared)
    whole.group_ids = None
    algo = AlgoConfig()
    obj = make_objective(algo)
    den = agg_denominator(obj.effective_mask(shared), shared, algo.agg)
    budget = algo.max_tokens_per_microbatch
    seen = _rows_counter(model)

    def logprob(b):
        with torch.no_grad():
            return packed_logprobs(model, b, max_tokens=budget)[0]

    def update(b):
        model.zero_grad(set_to_none=True)
        return policy_minibatch_backward(model, b, obj, global_den=den, max_tokens=budget)

    lp_s, lp_w = logprob(shared), logprob(whole)
    assert float((lp_s - lp_w).abs().max()) <= 1e-5
    rows = {}
    for name, b in (("shared", shared), ("whole", whole)):
        seen["rows"] = 0
        logprob(b)
        rows[name] = seen["rows"]
    rows_ratio = rows["shared"] / rows["whole"]

    benchmark.pedantic(lambda: update(shared), rounds=1, iterations=1, warmup_rounds=1)
    # Shared and whole alternate, best of three each: a load spike hits both sides alike.
    times = {
        "logprob": _alternating(lambda: logprob(shared), lambda: logprob(whole), 3),
        "update": _alternating(lambda: update(shared), lambda: update(whole), 3),
    }
    mems = {
        "logprob": (peak_cpu_alloc_bytes(lambda: logprob(shared)),
                    peak_cpu_alloc_bytes(lambda: logprob(whole))),
        "update": (peak_cpu_alloc_bytes(lambda: update(shared)),
                   peak_cpu_alloc_bytes(lambda: update(whole))),
    }  # fmt: skip
    desc = (
        f"{shape}: {PROMPTS} prompts x G={SHAPES[shape]['group']}, K={SHAPES[shape]['frames']} "
        f"frames of {SHAPES[shape]['side']}px, {SHAPES[shape]['generated']:.0%} generated, "
        f"{rows['whole']} rows unshared"
    )
    infos = {}
    for phase in ("logprob", "update"):
        infos[phase] = report_ratios(
            benchmark, f"shared-prefix {phase} phase", desc, "every row whole (share_prefix=false)",
            times[phase], mems[phase],
        )  # fmt: skip
    benchmark.extra_info["backbone_rows_ratio"] = rows_ratio
    print(f"backbone rows: shared {rows['shared']} / whole {rows['whole']} = {rows_ratio:.3f}")
    if shape == "long":
        assert rows_ratio <= 0.35, rows
        assert infos["update"]["time_ratio"] <= 0.5, infos
        assert infos["logprob"]["time_ratio"] <= 0.5, infos


def _pg_attention(prefix_len: int, suffix_lens: list[int], heads: int = 8, kv: int = 2):
    """q/k/v for one group in paravt's packed rows ``[prompt; suffix_1; ...]`` and the same
    tensors in prefix-grouper's padded layout."""
    g = torch.Generator().manual_seed(0)
    m = prefix_len + sum(suffix_lens)
    q = torch.randn(1, heads, m, HEAD_DIM, generator=g)
    k = torch.randn(1, kv, m, HEAD_DIM, generator=g)
    v = torch.randn(1, kv, m, HEAD_DIM, generator=g)
    return q, k, v


def test_bench_peer_prefix_grouper(benchmark):
    """paravt's block attention against prefix-grouper's on one group (prompt 2,000 tokens,
    8 suffixes of 150-290 tokens): same outputs, both timed."""
    from prefix_grouper import PrefixGrouper

    from paravt.models.forward import _prefix_block_attention

    p, suffixes = 2000, [150 + 20 * i for i in range(8)]
    q, k, v = _pg_attention(p, suffixes)
    blocks, r = [(0, p, 0, 0)], p
    for n in suffixes:
        blocks.append((r, r + n, 0, p))
        r += n
    gqa = {"enable_gqa": True}

    def ours():
        return _prefix_block_attention(q, k, v, blocks, 0.0, None, gqa)

    # prefix-grouper: rows [prompt + suffixes] grouped in one sample, its own ungroup/group.
    pg = PrefixGrouper([[p, *suffixes]], device="cpu")

    def attn(qq, kk, vv, mask):
        # The prompt's call: causal (lq == lk). The suffixes' call: keys [prompt; suffix]
        # (right-padded), the prompt fully and the own keys causally: j <= i + (lk - lq).
        lq, lk = qq.shape[2], kk.shape[2]
        allowed = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)[None, None]
        allowed = allowed & mask[:, None, None, :].bool()
        return torch.nn.functional.scaled_dot_product_attention(
            qq, kk, vv, attn_mask=allowed, enable_gqa=True
        ).transpose(1, 2)

    def theirs():
        return pg.forward(attn, q, k, v)

    mine = ours()[0]
    other = theirs()[0]
    # prefix-grouper returns the grouped layout [prompt; suffixes] of the sample: ours too.
    assert other.shape == mine.shape
    assert float((mine - other).abs().max()) <= 1e-5
    benchmark.pedantic(ours, rounds=1, iterations=1, warmup_rounds=1)
    info = report_ratios(
        benchmark, "shared-prefix attention (one layer, forward)",
        f"prompt {p}, {len(suffixes)} suffixes of {suffixes[0]}-{suffixes[-1]} tokens, "
        "8 heads / 2 kv heads, head_dim 32",
        "prefix-grouper 0.0.1.post1 (same SDPA inside)",
        _alternating(ours, theirs, 3),
        (peak_cpu_alloc_bytes(ours), peak_cpu_alloc_bytes(theirs)),
    )  # fmt: skip
    assert info["time_ratio"] <= 2.0, info
