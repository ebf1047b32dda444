"""Packed multi-sequence forwards (``paravt.models.forward.packed_hidden_states``, the
"packed" log-prob path of ``paravt.algo.logprobs``, ``microbatches``) against the one-sequence-per-forward reference.

The batch is a real one: the scripted tiny-model step of ``scripted_engine`` (main rows with
their video, sub-agent rows with their crop clips, main T = 0.7, sub T = 0.3), captured at the
policy update; one text-only sequence (a main row's text tokens, no visuals) is appended so
packs mix sequences with and without visual inputs. fp32 on CPU (SDPA).
"""

from __future__ import annotations

import copy

import pytest
import torch
from scripted_engine import MAIN_T, SUB_T, captured_update_batch, scripted_trainer


def _text_only(batch, i: int):
    """Sequence ``i`` of ``batch`` without its visual tokens, as a one-sequence batch."""
    from paravt.types import PackedBatch

    a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    keep = batch.mm_token_type_ids[a:b] == 0
    n = int(keep.sum())
    return PackedBatch(
        input_ids=batch.input_ids[a:b][keep],
        cu_seqlens=torch.tensor([0, n], dtype=torch.int32),
        loss_mask=batch.loss_mask[a:b][keep],
        old_logprobs=batch.old_logprobs[a:b][keep],
        advantages=batch.advantages[a:b][keep],
        seq_weights=batch.seq_weights[i : i + 1],
        temperatures=torch.tensor([0.5]),
        top_ps=torch.tensor([1.0]),
        uids=[batch.uids[i] + "/text"],
        visuals=[None],
        mm_token_type_ids=torch.zeros(n, dtype=torch.int64),
        parent_index=torch.tensor([-1]),
        roles=["main"],
    )


@pytest.fixture(scope="module")
def setup(assets, tmp_path_factory):
    """(model, batch): the step's weights and its packed batch + one text-only sequence."""
    from paravt.algo.packing import concat_packed

    def score(model, r, ids):
        return [-1.0] * (len(ids) - len(r.prompt_ids))

    tr = scripted_trainer(
        assets, str(tmp_path_factory.mktemp("packed") / "run"), score, **{"algo.kl_coef": 0.0}
    )
    batch = captured_update_batch(tr)
    batch = concat_packed([batch, _text_only(batch, 0)])
    model = tr.policy
    model.eval()
    return model, batch


def _alone(model, batch, i: int) -> torch.Tensor:
    """Reference: sequence ``i`` in its own backbone forward (what sequence_logprobs runs)."""
    from paravt.vision.preprocess import build_model_inputs

    a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    inputs = build_model_inputs(
        batch.input_ids[a:b].tolist(), batch.mm_token_type_ids[a:b].tolist(),
        batch.visuals[i], "cpu", merge_size=int(model.config.vision_config.spatial_merge_size),
    )  # fmt: skip
    return model.model(**inputs, use_cache=False).last_hidden_state[0]


def _packs(batch) -> list[list[int]]:
    roles = batch.roles
    n = len(roles)
    mains = [i for i, r in enumerate(roles) if r == "main" and batch.visuals[i] is not None]
    subs = [i for i, r in enumerate(roles) if r == "sub"]
    text = n - 1
    assert batch.visuals[text] is None and len(mains) == 4 and len(subs) >= 2
    return [[mains[0], subs[0]], [subs[1], text, mains[1]], [mains[2], subs[0], text, mains[3]]]


def test_batch_mixes_visual_and_text_only_rows_of_different_lengths(setup):
    _, batch = setup
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    assert len(set(lengths)) >= 3
    kinds = {v.kind if v is not None else None for v in batch.visuals}
    assert kinds == {"video", None}
    assert {MAIN_T, SUB_T} <= set(round(t, 6) for t in batch.temperatures.tolist())


@pytest.mark.parametrize("vision", ["packed", "hf"])
def test_packed_hidden_states_equal_per_sequence_forwards(setup, vision):
    """With the project's packed vision encoder (``model.packed_vision``, the default) and
    with HF's own vision forward (several grids in one call there too)."""
    from paravt.models.forward import packed_hidden_states

    model, batch = setup
    assert "get_image_features" in model.model.__dict__  # use_packed_vision installed
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        if vision == "hf":
            mp.delattr(model.model, "get_image_features")
        alone = {i: _alone(model, batch, i) for i in range(batch.cu_seqlens.numel() - 1)}
        for seqs in _packs(batch):
            h = packed_hidden_states(model, batch, seqs)
            ref = torch.cat([alone[i] for i in seqs])
            assert h.shape == ref.shape
            err = float((h - ref).abs().max())
            assert err <= 1e-5, (seqs, err)


def test_packing_without_the_block_diagonal_mask_differs(setup):
    """The mask is necessary: the same packed row under plain causal attention (later
    sequences attend to earlier ones) is wrong from the second sequence on."""
    from paravt.models.forward import _packed_inputs, packed_attention_kwargs, packed_hidden
    from paravt.models.prefix import shared_layout

    model, batch = setup
    seqs = _packs(batch)[1]
    n0 = int(batch.cu_seqlens[seqs[0] + 1] - batch.cu_seqlens[seqs[0]])
    with torch.no_grad():
        good = packed_hidden(model, batch, seqs)
        bad = packed_hidden(model, batch, seqs, isolate=False)
        ref = torch.cat([_alone(model, batch, i) for i in seqs])
        # Not relied on, pinned: transformers' own packed-sequence detection (no mask; the
        # restarting text row of the 4-row position ids) also isolates the sequences.
        kwargs = _packed_inputs(model, batch, seqs, shared_layout(batch, seqs, []))
        detected = model.model(**kwargs).last_hidden_state[0]
    assert float((bad[:n0] - ref[:n0]).abs().max()) <= 1e-5  # the first sequence is unaffected
    assert float((bad[n0:] - ref[n0:]).abs().max()) > 1e-2
    assert float((good - ref).abs().max()) <= 1e-5
    assert float((detected - ref).abs().max()) <= 1e-5
    # The argument itself: an additive block-diagonal causal mask for eager, cu_seqlens for
    # SDPA (per-sequence attention, varlen_sdpa_attention) and flash-attn.
    m = packed_attention_kwargs([2, 3], "eager", torch.device("cpu"), torch.float32)
    allowed = torch.zeros(5, 5, dtype=torch.bool)
    allowed[:2, :2] = torch.tril(torch.ones(2, 2, dtype=torch.bool))
    allowed[2:, 2:] = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    assert torch.equal(m["attention_mask"][0, 0] == 0, allowed)
    for impl in ("sdpa", "flash_attention_2"):
        fa = packed_attention_kwargs([2, 3], impl, torch.device("cpu"), torch.float32)
        assert fa["attention_mask"] is None and fa["cu_seq_lens_q"].tolist() == [0, 2, 5]
        assert fa["max_length_q"] == 3


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_packed_path_equals_per_sequence_path(setup, top_p):
    import paravt_kernels

    from paravt.algo.logprobs import packed_logprobs
    from paravt.algo.packing import microbatches

    model, batch = setup
    batch = copy.copy(batch)
    batch.top_ps = torch.full_like(batch.top_ps, top_p)
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    budget = max(lengths) + min(lengths)  # several micro-batches, some with 2+ sequences
    mbs = microbatches(batch, budget)
    assert 1 < len(mbs) < len(lengths)
    calls = []
    real = paravt_kernels.linear_logprob
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            paravt_kernels,
            "linear_logprob",
            lambda h, *a, **k: calls.append(h.shape[0]) or real(h, *a, **k),
        )
        lp_p, ent_p = packed_logprobs(model, batch, True, path="packed", max_tokens=budget)
        n_packed_calls = len(calls)
        lp_s, ent_s = packed_logprobs(model, batch, True, path="per_sequence")
    m = batch.loss_mask.bool()
    m[batch.cu_seqlens[:-1].long()] = False
    assert m.sum() > 0 and (lp_p[~m] == 0).all() and (ent_p[~m] == 0).all()
    torch.testing.assert_close(lp_p, lp_s, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_p, ent_s, rtol=1e-5, atol=1e-6)
    if top_p == 1.0:
        # One fused lm_head call per (micro-batch, temperature), on the gathered rows only.
        assert sum(calls[:n_packed_calls]) == int(m.sum())
        assert n_packed_calls <= 3 * len(mbs)
    # The default budget packs the whole (small) batch into one forward: same values.
    with torch.no_grad():
        lp_1, _ = packed_logprobs(model, batch)
    torch.testing.assert_close(lp_1, lp_s, rtol=0, atol=1e-5)


def test_gradients_through_packed_forward_equal_per_sequence_sum(setup):
    from paravt.algo.logprobs import packed_logprobs

    model, batch = setup
    model.train()
    w = torch.linspace(0.5, 1.5, batch.cu_seqlens.numel() - 1)
    seq_of_token = torch.repeat_interleave(
        torch.arange(w.numel()), (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long()
    )
    grads = []
    try:
        for path in ("packed", "per_sequence"):
            model.zero_grad(set_to_none=True)
            lp, _ = packed_logprobs(model, batch, path=path, max_tokens=10**6)
            (lp * w[seq_of_token]).sum().backward()
            grads.append(
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            )
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
    g_p, g_s = grads
    assert g_p.keys() == g_s.keys() and len(g_s) > 10
    assert any("visual" in n for n in g_s) and "lm_head.weight" in g_s
    for name, gs in g_s.items():
        ref, err = float(gs.norm()), float((g_p[name] - gs).norm())
        assert err <= 1e-5 * ref or (ref == 0 and err == 0), f"{name}: |dg| {err:.3g} |g| {ref:.3g}"


def test_microbatches_budget_coverage_and_long_sequences():
    from paravt.algo.packing import microbatches

    lengths = [5, 30, 7, 12, 3, 12, 50, 1]
    mbs = microbatches(lengths, 20)
    assert sorted(i for mb in mbs for i in mb) == list(range(len(lengths)))
    for mb in mbs:
        assert mb == sorted(mb)
        assert sum(lengths[i] for i in mb) <= 20 or len(mb) == 1
    assert [6] in mbs and [1] in mbs  # longer than the budget: alone
    assert microbatches(lengths, 20) == mbs  # deterministic
    assert microbatches(lengths, 1000) == [list(range(len(lengths)))]
    assert microbatches([], 10) == []
    with pytest.raises(ValueError, match="max_tokens=0"):
        microbatches(lengths, 0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_sdpa_packed_forward_attends_per_sequence_never_over_the_whole_row(setup, impl):
    """SDPA (CPU): the language model's attention runs once per sequence (query lengths
    ``L_i``, never ``N``, no mask tensor anywhere): ``sum L_i^2`` work, no ``N x N`` anything.
    Eager (the additive 4-D mask) gives the same hidden states."""
    from paravt.models.forward import VARLEN_SDPA, packed_hidden

    model, batch = setup
    seqs = _packs(batch)[2]
    lengths = [int(batch.cu_seqlens[i + 1] - batch.cu_seqlens[i]) for i in seqs]
    calls, masks = [], []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *a, **kw):
        calls.append((q.shape[-2], attn_mask is None, kw.get("is_causal")))
        return real(q, k, v, attn_mask, *a, **kw)

    from paravt.models.forward import varlen_sdpa_attention as real_varlen

    def mask_spy(module, q, k, v, attention_mask, *a, **kw):
        masks.append(attention_mask)
        return real_varlen(module, q, k, v, attention_mask, *a, **kw)

    from transformers import AttentionInterface

    lm_cfg = model.model.language_model.config
    old = lm_cfg._attn_implementation
    lm_cfg._attn_implementation = impl
    try:
        with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
            if impl == "sdpa":
                packed_hidden(model, batch, seqs[:1])  # registers VARLEN_SDPA
                mp.setitem(AttentionInterface._global_mapping, VARLEN_SDPA, mask_spy)
                calls.clear()
            h = packed_hidden(model, batch, seqs)
        after = lm_cfg._attn_implementation
    finally:
        lm_cfg._attn_implementation = old
    # SDPA is switched to its varlen twin for good (checkpoint recomputation must match).
    assert after == (VARLEN_SDPA if impl == "sdpa" else "eager")
    with torch.no_grad():
        ref = torch.cat([_alone(model, batch, i) for i in seqs])
    assert float((h - ref).abs().max()) <= 1e-5
    text_calls = [c for c in calls if c[0] in lengths]
    if impl == "sdpa":
        layers = model.config.text_config.num_hidden_layers
        assert sorted(text_calls) == sorted((n, True, True) for n in lengths * layers)
        assert masks == [None] * layers  # create_causal_mask built nothing
    assert all(c[0] != sum(lengths) for c in calls)


def test_packed_forward_under_gradient_checkpointing(setup):
    """Gradient checkpointing re-runs each layer in the backward: the re-run takes the same
    per-sequence attention, and the gradients equal those without checkpointing."""
    from paravt.models.forward import packed_hidden

    model, batch = setup
    model = copy.deepcopy(model).train()
    seqs = _packs(batch)[2]
    w = torch.randn(
        model.config.text_config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    grads = []
    for ckpt in (False, True):
        if ckpt:
            model.gradient_checkpointing_enable()
        model.zero_grad(set_to_none=True)
        (packed_hidden(model, batch, seqs) @ w).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-6, msg=n)
