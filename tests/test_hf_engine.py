"""HFEngine on the tiny Qwen3-VL: batching, stops, behaviour log-probs, seeds, weight sync."""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch

from paravt.algo.logprobs import sequence_logprobs
from paravt.engines.engine import Engine, GenerationRequest, SamplingParams
from paravt.engines.hf import HFEngine
from paravt.models import build_tiny_checkpoint, load_model
from paravt.models.sampling import top_p_filter
from paravt.vision.preprocess import encode_clip

TOL = 1e-4  # behaviour vs teacher-forced log-prob (float32, batched sdpa vs unpadded)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def bundle(tiny_dir):
    return load_model(tiny_dir, device="cpu")


def make_request(
    bundle, text: str, clip: tuple[int, int, int] | None, **sampling
) -> GenerationRequest:
    """A chat-formatted prompt, optionally with a video clip of (frames, H, W)."""
    tok = bundle.tokenizer
    ids = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    mm = [0] * len(ids)
    visuals = None
    if clip is not None:
        t, h, w = clip
        g = torch.Generator().manual_seed(t * 1000 + h * 10 + w)
        frames = torch.randint(0, 256, (t, h, w, 3), dtype=torch.uint8, generator=g)
        enc = encode_clip(frames, [0.5 * i for i in range(t)], bundle.vision, tok)
        ids, mm, visuals = ids + enc.token_ids, mm + enc.mm_token_type_ids, enc.visuals
    tail = tok.encode(f"{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    sampling.setdefault("max_new_tokens", 12)
    return GenerationRequest(
        ids + tail, SamplingParams(**sampling), visuals, {"mm_token_type_ids": mm + [0] * len(tail)}
    )


def mixed_requests(bundle, **sampling) -> list[GenerationRequest]:
    # different prompt lengths, patch counts, and one request without video
    return [
        make_request(bundle, "What happens?", (4, 64, 64), **sampling),
        make_request(bundle, "Describe the clip in detail please", (3, 32, 96), **sampling),
        make_request(bundle, "no video here", None, **sampling),
        make_request(bundle, "q", (6, 64, 32), **sampling),
    ]


def teacher_forced(bundle, req: GenerationRequest, out_ids: list[int]) -> torch.Tensor:
    full = req.prompt_ids + out_ids
    mm = req.extras["mm_token_type_ids"] + [0] * len(out_ids)
    with torch.no_grad():
        lp, _ = sequence_logprobs(
            bundle.model,
            full,
            mm,
            req.visuals,
            temperature=req.sampling.temperature,
            top_p=req.sampling.top_p,
        )
    return lp[len(req.prompt_ids) :]


def test_implements_engine_protocol(bundle):
    assert isinstance(HFEngine(bundle), Engine)


@pytest.mark.parametrize("max_batch_size", [0, 3])
def test_greedy_batched_equals_single(bundle, max_batch_size):
    reqs = mixed_requests(bundle, temperature=0.0)
    eng = HFEngine(bundle, max_batch_size=max_batch_size)
    batched = eng.generate(reqs)
    for r, b in zip(reqs, batched):
        single = eng.generate([r])[0]
        assert b.token_ids == single.token_ids
        assert len(b.token_ids) == r.sampling.max_new_tokens and b.finish_reason == "length"
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(single.logprobs), rtol=0, atol=TOL
        )
        # greedy: every chosen token is the argmax, so its log-prob is the max of the row
        assert all(lp <= 0 for lp in b.logprobs)


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_behaviour_logprobs_match_teacher_forced(bundle, temperature, top_p):
    reqs = mixed_requests(bundle, temperature=temperature, top_p=top_p)
    for i, r in enumerate(reqs):
        reqs[i] = GenerationRequest(
            r.prompt_ids,
            SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12, seed=i),
            r.visuals,
            r.extras,
        )
    outs = HFEngine(bundle).generate(reqs)  # batched, left-padded
    for r, o in zip(reqs, outs):
        assert len(o.logprobs) == len(o.token_ids) > 0
        ref = teacher_forced(bundle, r, o.token_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, rtol=0, atol=TOL)
        assert torch.isfinite(ref).all()  # every sampled token lies inside the nucleus


def test_sequence_logprobs_is_differentiable(bundle):
    r = make_request(bundle, "grad", (2, 32, 32))
    lp, _ = sequence_logprobs(bundle.model, r.prompt_ids, r.extras["mm_token_type_ids"], r.visuals)
    assert lp.shape == (len(r.prompt_ids),) and lp[0] == 0 and lp.requires_grad
    lp.sum().backward()
    g = bundle.model.lm_head.weight.grad
    assert g is not None and g.abs().sum() > 0
    bundle.model.zero_grad(set_to_none=True)


def test_reproducible_from_seeds(bundle, tiny_dir):
    reqs = mixed_requests(bundle, temperature=1.0)
    a = HFEngine(bundle, seed=7).generate(reqs)
    b = HFEngine(bundle, seed=7).generate(reqs)
    c = HFEngine(bundle, seed=8).generate(reqs)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    # the call counter advances the stream: a second call samples anew
    eng = HFEngine(bundle, seed=7)
    eng.generate(reqs)
    assert [o.token_ids for o in eng.generate(reqs)] != [o.token_ids for o in a]
    # a request seed makes a request reproducible whatever shares its batch, and in any order
    seeded = [
        GenerationRequest(
            r.prompt_ids,
            SamplingParams(temperature=1.0, max_new_tokens=12, seed=100 + i),
            r.visuals,
            r.extras,
        )
        for i, r in enumerate(reqs)
    ]
    full = HFEngine(bundle, seed=1).generate(seeded)
    rev = HFEngine(bundle, seed=2, max_batch_size=2).generate(seeded[::-1])[::-1]
    alone = [HFEngine(bundle, seed=3).generate([r])[0] for r in seeded]
    assert [o.token_ids for o in full] == [o.token_ids for o in rev] == [o.token_ids for o in alone]


def test_stop_token_ids(bundle):
    r = make_request(bundle, "stop me", (2, 32, 64), temperature=0.0, max_new_tokens=16)
    eng = HFEngine(bundle)
    free = eng.generate([r])[0].token_ids
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    stopped = eng.generate(
        [
            GenerationRequest(
                r.prompt_ids,
                SamplingParams(temperature=0.0, max_new_tokens=16, stop_token_ids=(free[k],)),
                r.visuals,
                r.extras,
            )
        ]
    )[0]
    assert stopped.token_ids == free[: k + 1]  # trimmed at the stop, stop included
    assert stopped.finish_reason == "stop" and len(stopped.logprobs) == k + 1


def test_stop_strings(bundle):
    r = make_request(bundle, "stop string", (2, 32, 32), temperature=0.0, max_new_tokens=16)
    eng = HFEngine(bundle)
    tok = bundle.tokenizer
    free = eng.generate([r])[0].token_ids
    # a stop string that ends inside the output: the last 2 chars of the text of free[:k+1]
    for k in range(3, len(free)):
        text = tok.decode(free[: k + 1])
        stop = text[-2:]
        if len(stop.strip()) == 2 and stop not in tok.decode(free[:k]):
            break
    else:
        pytest.skip("no usable stop string in this greedy output")
    out = eng.generate(
        [
            GenerationRequest(
                r.prompt_ids,
                SamplingParams(temperature=0.0, max_new_tokens=16, stop_strings=("@@never", stop)),
                r.visuals,
                r.extras,
            )
        ]
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: len(out.token_ids)]
    assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
    assert len(out.token_ids) == k + 1


def test_eos_stops_by_default_and_sync_weights(tiny_dir):
    """A policy whose <|im_end|> logit is 2x that of the greedy token must stop on EOS, once
    its weights are synced into the engine (a different module: load_state_dict path)."""
    engine_bundle = load_model(tiny_dir, device="cpu")
    eng = HFEngine(engine_bundle)
    r = make_request(engine_bundle, "eos", (2, 32, 32), temperature=0.0, max_new_tokens=12)
    free = eng.generate([r])[0]
    policy = copy.deepcopy(engine_bundle.model)
    eos = engine_bundle.special.im_end
    with torch.no_grad():
        policy.lm_head.weight[eos] = 2 * policy.lm_head.weight[free.token_ids[0]]
    eng.sync_weights(policy)
    torch.testing.assert_close(eng.model.lm_head.weight, policy.lm_head.weight)
    out = eng.generate([r])[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    assert out.text == ""  # special tokens are skipped in the decoded text
    # syncing the engine's own module is a no-op; a mismatched state dict is an error
    eng.sync_weights(eng.model)
    with pytest.raises(ValueError, match="policy and rollout model differ"):
        eng.sync_weights({"not.a.weight": torch.zeros(1)})
    # Streamed (name, tensor) pairs, as the trainer pushes them under FSDP2, copied in place;
    # a stream that leaves an entry out is an error too.
    with torch.no_grad():
        policy.lm_head.weight[eos] = 0.0
    eng.sync_weights((k, v) for k, v in policy.state_dict().items())
    torch.testing.assert_close(eng.model.lm_head.weight, policy.lm_head.weight)
    assert eng.generate([r])[0].token_ids == free.token_ids  # EOS no longer wins
    with pytest.raises(ValueError, match="missing"):
        eng.sync_weights((k, v) for k, v in policy.state_dict().items() if "lm_head" not in k)


def test_request_errors(bundle):
    eng = HFEngine(bundle)
    r = make_request(bundle, "x", (2, 32, 32))
    bad = GenerationRequest(
        r.prompt_ids[:-3],
        r.sampling,
        r.visuals,
        {"mm_token_type_ids": r.extras["mm_token_type_ids"][:-3]},
    )
    ok_len = GenerationRequest(r.prompt_ids[:5], r.sampling, r.visuals, {})  # no video tokens
    with pytest.raises(ValueError, match="visual placeholder tokens"):
        eng.generate([ok_len])
    assert len(eng.generate([bad])) == 1  # trimming text tokens keeps the placeholders intact
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([GenerationRequest([], SamplingParams())])
    assert eng.generate([]) == []


def test_top_p_filter_keeps_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = torch.isfinite(top_p_filter(logits, 0.7))
    assert kept.tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(logits, 0.01)).sum() == 1  # the top token always stays


def test_rows_that_stop_early_leave_the_batch_exactly(bundle):
    """One row stops after 3 tokens: it is dropped from the KV cache mid-decode, and the rows
    left keep decoding exactly as they would alone (their cache rows were selected right)."""
    reqs = mixed_requests(bundle, temperature=0.0)
    eng = HFEngine(bundle)
    free = [eng.generate([r])[0] for r in reqs]
    stop_tok = free[1].token_ids[2]
    k = free[1].token_ids.index(stop_tok)
    reqs[1] = GenerationRequest(
        reqs[1].prompt_ids,
        SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop_tok,)),
        reqs[1].visuals,
        reqs[1].extras,
    )
    outs = eng.generate(reqs)
    assert outs[1].token_ids == free[1].token_ids[: k + 1] and outs[1].finish_reason == "stop"
    for i in (0, 2, 3):
        assert outs[i].token_ids == free[i].token_ids
        torch.testing.assert_close(
            torch.tensor(outs[i].logprobs), torch.tensor(free[i].logprobs), rtol=0, atol=TOL
        )


def test_draw_follows_the_distribution():
    """Inverse-CDF draws: frequencies match the probabilities; a masked token never appears."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 4000
    lp = torch.log(p).expand(n, -1)
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    draws = HFEngine._draw(lp, gens)
    freq = torch.bincount(draws, minlength=5).double() / n
    assert freq[4] == 0
    sigma = (p * (1 - p) / n).sqrt().double()
    assert ((freq - p.double()).abs() <= 4 * sigma + 1e-12).all(), freq
    # same generators, same draws
    again = HFEngine._draw(lp, [torch.Generator().manual_seed(i) for i in range(n)])
    assert torch.equal(draws, again)


def test_qwen2_5_vl_batched_equals_single_and_teacher_forced(tmp_path_factory):
    """The same engine on a Qwen2.5-VL checkpoint: M-RoPE with second_per_grid_ts, left
    padding, a text-only row, sampled with top-p."""
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("m25") / "tiny25", arch="qwen2_5_vl")
    b25 = load_model(d, device="cpu")
    reqs = [
        make_request(b25, "What happens?", (4, 56, 56), temperature=0.0),
        make_request(b25, "Describe it please", (3, 28, 84), temperature=0.0),
        make_request(b25, "none", None, temperature=0.0),
    ]
    assert reqs[0].visuals.second_per_grid_ts is not None
    eng = HFEngine(b25)
    for r, o in zip(reqs, eng.generate(reqs)):
        assert o.token_ids == eng.generate([r])[0].token_ids
    sampled = [
        GenerationRequest(r.prompt_ids, SamplingParams(0.8, 0.9, 10, seed=i), r.visuals, r.extras)
        for i, r in enumerate(reqs)
    ]
    for r, o in zip(sampled, eng.generate(sampled)):
        ref = teacher_forced(b25, r, o.token_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, rtol=0, atol=TOL)


def _clone(v):
    return dataclasses.replace(v, pixel_values=v.pixel_values.clone())


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_shared_clip_is_encoded_once(tmp_path_factory, arch):
    """G requests holding the SAME VisualInputs object (a group's overview) run the vision
    tower once for it; results equal those of requests holding separate copies."""
    d = build_tiny_checkpoint(tmp_path_factory.mktemp(arch) / "tiny", arch=arch)
    b = load_model(d, device="cpu")
    size = (4, 64, 64) if arch == "qwen3_vl" else (4, 56, 56)
    base = make_request(b, "shared overview", size, temperature=0.0)
    other = make_request(b, "another clip", (2, size[1], size[2] // 2), temperature=0.0)
    shared = [
        GenerationRequest(base.prompt_ids, base.sampling, base.visuals, base.extras)
        for _ in range(3)
    ] + [other]
    copies = [
        GenerationRequest(r.prompt_ids, r.sampling, _clone(r.visuals), r.extras) for r in shared
    ]
    # The copies' baseline prefills every prompt (with shared prefixes, content-equal copies
    # in a shared prefix are not encoded either: test_shared_prefix_equals_unshared).
    e_shared, e_copies = HFEngine(b), HFEngine(b, share_prefix=False)
    out_s, out_c = e_shared.generate(shared), e_copies.generate(copies)
    n_base = base.visuals.pixel_values.shape[0]
    n_other = other.visuals.pixel_values.shape[0]
    assert e_shared.stats["vision_patches"] == n_base + n_other
    assert e_copies.stats["vision_patches"] == 3 * n_base + n_other
    for s, c in zip(out_s, out_c):
        assert s.token_ids == c.token_ids
        torch.testing.assert_close(
            torch.tensor(s.logprobs), torch.tensor(c.logprobs), rtol=0, atol=TOL
        )


def test_packed_vision_engine_equals_hf_vision(tiny_dir, bundle):
    """load_model(packed_vision=True) routes every generate's vision tower through ONE packed
    forward: greedy tokens equal HF's vision path, behaviour log-probs agree, and the packed
    path really ran (it counts its calls)."""
    import paravt.vision.encoder as enc

    packed = load_model(tiny_dir, device="cpu", packed_vision=True)
    assert "get_image_features" in vars(packed.model.model)
    assert "get_image_features" not in vars(bundle.model.model)
    calls = []
    orig = enc.encode_packed

    def counting(visual, p, **kw):
        calls.append(p.num_crops)
        return orig(visual, p, **kw)

    enc.encode_packed = counting
    try:
        greedy = mixed_requests(bundle, temperature=0.0)
        got = HFEngine(packed).generate(greedy)
        ref = HFEngine(bundle).generate(greedy)
        sampled = mixed_requests(bundle, temperature=0.9, seed=5)
        got_s = HFEngine(packed).generate(sampled)
    finally:
        enc.encode_packed = orig
    # One packed vision forward per generate call (all clips of the batch), not per clip.
    assert calls == [3, 3]
    for g, r in zip(got, ref):
        assert g.token_ids == r.token_ids
        torch.testing.assert_close(
            torch.tensor(g.logprobs), torch.tensor(r.logprobs), atol=TOL, rtol=0
        )
    for req, o in zip(sampled, got_s):  # behaviour log-probs = HF-vision teacher forcing
        torch.testing.assert_close(
            torch.tensor(o.logprobs), teacher_forced(bundle, req, o.token_ids), rtol=0, atol=TOL
        )


def test_packed_vision_survives_deepcopy_pickle_and_skips_qwen2_5(
    tiny_dir, tmp_path_factory, caplog
):
    """The installed methods are bound partials: a deepcopy (e.g. a reference policy) runs on
    its OWN weights, a pickled model loads and runs. Qwen2.5-VL keeps HF's vision forward."""
    packed = load_model(tiny_dir, device="cpu", packed_vision=True)
    twin = copy.deepcopy(packed.model)
    assert twin.model.get_image_features.args[0] is twin.model
    req = make_request(packed, "What happens?", (4, 64, 64), temperature=0.0)
    kw = {
        "input_ids": torch.tensor([req.prompt_ids]),
        "mm_token_type_ids": torch.tensor([req.extras["mm_token_type_ids"]]),
        "pixel_values_videos": req.visuals.pixel_values,
        "video_grid_thw": req.visuals.grid_thw,
    }
    with torch.no_grad():
        before = packed.model(**kw).logits
        for p in twin.model.visual.parameters():
            p.add_(0.05)
        assert torch.equal(packed.model(**kw).logits, before)  # the original is untouched
        assert not torch.allclose(twin(**kw).logits, before)  # the copy uses its own weights
        # A pickled packed model (torch.save of the module, spawn workers) loads and runs.
        buf = io.BytesIO()
        torch.save(packed.model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert loaded.model.get_image_features.args[0] is loaded.model
        assert torch.equal(loaded(**kw).logits, before)
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("m25p") / "tiny25", arch="qwen2_5_vl")
    with caplog.at_level("INFO", logger="paravt.models.loader"):
        b25 = load_model(d, device="cpu", packed_vision=True)
    assert "get_image_features" not in vars(b25.model.model)
    assert "no packed vision forward yet" in caplog.text


def _with(r: GenerationRequest, *, seed: int, prompt=None, visuals=None, mm=None, t=1.0):
    return GenerationRequest(
        list(r.prompt_ids if prompt is None else prompt),
        SamplingParams(temperature=t, top_p=0.9, max_new_tokens=10, seed=seed),
        r.visuals if visuals is None else visuals,
        {"mm_token_type_ids": list(r.extras["mm_token_type_ids"] if mm is None else mm)},
    )


def test_shared_prefix_equals_unshared(bundle):
    """Two GRPO groups of G=4 identical prompts (one clip object per group) plus a distinct
    prompt: the shared-prefix engine prefills each group's prompt once and forks its cache, and
    gives the same tokens and behaviour log-probs (to float rounding) as the unshared engine and
    as teacher forcing. The saved tokens are counted."""
    a = make_request(bundle, "What happens?", (4, 64, 64))
    c = make_request(bundle, "Describe another clip", (2, 32, 64))
    d = make_request(bundle, "no video here", None)
    reqs = [_with(a, seed=i) for i in range(4)] + [_with(c, seed=4 + i) for i in range(4)]
    reqs.insert(3, _with(d, seed=9))  # a group need not be contiguous in the call
    on, off = HFEngine(bundle), HFEngine(bundle, share_prefix=False)
    got, ref = on.generate(reqs), off.generate(reqs)
    for r, g, f in zip(reqs, got, ref):
        assert g.token_ids == f.token_ids and g.finish_reason == f.finish_reason
        torch.testing.assert_close(
            torch.tensor(g.logprobs), torch.tensor(f.logprobs), rtol=0, atol=TOL
        )
        torch.testing.assert_close(
            torch.tensor(g.logprobs), teacher_forced(bundle, r, g.token_ids), rtol=0, atol=TOL
        )
    assert len({tuple(g.token_ids) for g in got[:3]}) > 1  # the samples of a group differ
    la, lc, ld = len(a.prompt_ids), len(c.prompt_ids), len(d.prompt_ids)
    total = 4 * la + 4 * lc + ld
    # each group's prompt but its last token once; every request's last token on its own
    assert on.stats["prefill_tokens_shared"] == 3 * (la - 1) + 3 * (lc - 1)
    assert on.stats["prefill_tokens"] == total - on.stats["prefill_tokens_shared"]
    assert off.stats["prefill_tokens"] == total and off.stats["prefill_tokens_shared"] == 0
    # rollout.share_prefix reaches the engine the trainer builds
    from paravt.config import load_config
    from paravt.engines.hf import from_config

    for flag in (True, False):
        cfg = load_config("tiny_cpu", overrides=[f"rollout.share_prefix={str(flag).lower()}"])
        assert from_config(cfg, bundle).share_prefix is flag


def test_shared_prefix_of_later_turns(bundle):
    """A later turn: a group's contexts share the prompt, then differ (each its own earlier
    sample, one with a crop clip appended, in a NEW VisualInputs object holding a copy of the
    overview). The common prefix — overview included, compared by content — is prefilled once
    and each suffix on top of the forked cache; tokens and log-probs equal the unshared path's
    and teacher forcing. A request whose ids equal another's but whose clip differs in pixels
    shares only the tokens before that clip."""
    from paravt.types import VisualInputs

    tok = bundle.tokenizer
    base = make_request(bundle, "What happens?", (4, 64, 64))
    crop = make_request(bundle, "crop", (2, 32, 32))
    head = len(tok.encode("<|im_start|>user\n", add_special_tokens=False))
    crop_ids = crop.prompt_ids[head : -len(tok.encode("crop<|im_end|>\n<|im_start|>assistant\n"))]
    crop_mm = crop.extras["mm_token_type_ids"][head : head + len(crop_ids)]
    base_mm = base.extras["mm_token_type_ids"]
    reqs = []
    for i, text in enumerate(["I think A", "Let me look closer at", "B"]):
        more = tok.encode(f"{text}<|im_end|>\n<|im_start|>user\n", add_special_tokens=False)
        ids, mm, vis = base.prompt_ids + more, base_mm + [0] * len(more), _clone(base.visuals)
        if i == 1:  # the tool's crop frames come back into the context
            ids, mm = ids + crop_ids, mm + crop_mm
            vis = VisualInputs.concat([vis, crop.visuals])
        tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
        reqs.append(_with(base, seed=i, prompt=ids + tail, visuals=vis, mm=mm + [0] * len(tail)))
    other = dataclasses.replace(base.visuals, pixel_values=base.visuals.pixel_values.flip(0))
    reqs.append(_with(base, seed=7, visuals=other))  # same ids, different overview pixels
    reqs.append(_with(base, seed=8))
    on, off = HFEngine(bundle), HFEngine(bundle, share_prefix=False)
    got, ref = on.generate(reqs), off.generate(reqs)
    for r, g, f in zip(reqs, got, ref):
        assert g.token_ids == f.token_ids
        torch.testing.assert_close(
            torch.tensor(g.logprobs), torch.tensor(f.logprobs), rtol=0, atol=TOL
        )
        torch.testing.assert_close(
            torch.tensor(g.logprobs), teacher_forced(bundle, r, g.token_ids), rtol=0, atol=TOL
        )
    assert got[3].token_ids != got[4].token_ids or got[3].logprobs != got[4].logprobs
    # the three later-turn contexts and the fresh prompt (seed 8) share the whole first prompt
    # but its last token; the flipped clip (sharing only the text before its clip) goes alone
    lb = len(base.prompt_ids)
    assert on.stats["prefill_tokens_shared"] == 3 * (lb - 1)
    total = sum(len(r.prompt_ids) for r in reqs)
    assert on.stats["prefill_tokens"] + on.stats["prefill_tokens_shared"] == total
    # overview encoded once for the shared rows, once for the flipped copy, plus the crop
    n_base, n_crop = base.visuals.pixel_values.shape[0], crop.visuals.pixel_values.shape[0]
    assert on.stats["vision_patches"] == 2 * n_base + n_crop
