"""Shared-prefix forwards (``algo.share_prefix``; ``paravt.models.prefix``): a group's prompt
encoded once gives the same log-probs, loss and parameter gradients as the unshared forward.

The batch is a real one: the scripted tiny-model step of ``scripted_engine`` with G = 8 and
two turns (a forced first turn of two parallel crop calls, the tool responses, a sampled
second turn), main rows with their overview video and sub-agent rows with their crop clips,
captured at the policy update. fp32 on CPU (SDPA). The forced first turn is the same in every
member of a group, so each group's shared prefix runs past the prompt into trained tokens:
those rows are shared too, and each member still reads its own targets.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from scripted_engine import captured_update_batch, scripted_trainer

G = 8


@pytest.fixture(scope="module")
def setup(assets, tmp_path_factory):
    """(model, batch, objective): the step's weights, its shared packed batch, the loss."""

    def score(model, r, ids):
        return [-1.0] * (len(ids) - len(r.prompt_ids))

    tr = scripted_trainer(
        assets, str(tmp_path_factory.mktemp("shared") / "run"), score,
        **{"algo.kl_coef": 0.0, "rollout.group_size": G, "agent.max_turns": 2},
    )  # fmt: skip
    batch = captured_update_batch(tr)
    model = tr.policy
    model.eval()
    # A gradient to compare: behaviour log-probs at the policy's (ratio 1, no clipping) and
    # advantages of both signs (the scripted rewards are all equal, so theirs are 0).
    from paravt.algo.logprobs import packed_logprobs

    with torch.no_grad():
        lp, _ = packed_logprobs(model, _unshared(batch))
    batch.old_logprobs = lp.float()
    gen = torch.Generator().manual_seed(0)
    batch.advantages = torch.randn(batch.input_ids.numel(), generator=gen) * batch.loss_mask
    return model, batch, tr.objective


def _unshared(batch):
    b = copy.copy(batch)
    b.group_ids = None
    return b


def test_groups_share_their_prompt_and_the_sub_rows_do_not(setup):
    from paravt.models.prefix import prefix_groups, shared_layout

    _, batch, _ = setup
    assert batch.group_ids is not None  # algo.share_prefix is on by default
    n = len(batch.uids)
    groups = prefix_groups(batch, range(n))
    mains = [i for i, r in enumerate(batch.roles) if r == "main"]
    assert len(groups) == 2 and sorted(i for g in groups for i in g.members) == mains
    cu = batch.cu_seqlens.tolist()
    for g in groups:
        assert len(g.members) == G and g.prefix_segments == batch.visuals[g.members[0]].num_segments
        # The forced first turn is common to the group: the prefix covers the whole prompt.
        trained = [int(batch.loss_mask[cu[i] : cu[i + 1]].nonzero()[0]) for i in g.members]
        assert g.prefix_len > min(trained)
    layout = shared_layout(batch, range(n), groups)
    assert layout.shared and layout.num_rows == n_rows(batch, groups)
    assert torch.equal(batch.input_ids[layout.src][layout.row_of], batch.input_ids)


def n_rows(batch, groups) -> int:
    total = int(batch.cu_seqlens[-1])
    return total - sum((len(g.members) - 1) * g.prefix_len for g in groups)


def test_logprobs_and_entropy_equal_the_unshared_forward(setup):
    from paravt.algo.logprobs import packed_logprobs

    model, batch, _ = setup
    with torch.no_grad():
        lp, ent = packed_logprobs(model, batch, with_entropy=True)
        lp0, ent0 = packed_logprobs(model, _unshared(batch), with_entropy=True)
    assert float(batch.loss_mask.sum()) > 0
    assert float((lp - lp0).abs().max()) <= 1e-5
    assert float((ent - ent0).abs().max()) <= 1e-5


def _loss_and_grads(model, batch, objective, parts):
    from paravt.algo.loss import agg_denominator, policy_minibatch_backward

    model.zero_grad(set_to_none=True)
    den = agg_denominator(objective.effective_mask(batch), batch, objective.algo.agg)
    res = policy_minibatch_backward(
        model, batch, objective, global_den=den, max_tokens=10**9, parts=parts
    )
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return res, grads


@pytest.fixture(scope="module")
def unshared_update(setup):
    """The reference: the unshared packed forward and backward, itself equal to one forward
    per sequence (tests/test_algo_packed_forward.py, tests/test_algo_loss.py)."""
    model, batch, objective = setup
    return _loss_and_grads(model, _unshared(batch), objective, [list(range(len(batch.uids)))])


@pytest.mark.parametrize("split", [False, True], ids=["one-forward", "group-split"])
def test_loss_and_every_gradient_equal_the_unshared_path(setup, unshared_update, split):
    """The policy update: loss, log-probs and every parameter's gradient, shared against
    unshared, with the whole batch in one forward and with a budget that cuts each group into
    parts (each part holding the prompt again)."""
    from paravt.algo.packing import microbatches
    from paravt.models.prefix import prefix_groups

    model, batch, objective = setup
    lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
    groups = prefix_groups(batch, range(len(lengths)))
    # Split: room for the shorter prompt and three suffixes: that group needs several parts
    # that each share their prompt; the longer group may run member by member.
    suffix = max(lengths[i] - g.prefix_len for g in groups for i in g.members)
    budget = min(g.prefix_len for g in groups) + 3 * suffix if split else sum(lengths)
    parts = microbatches(batch, budget)
    if split:
        cut = [
            g
            for g in groups
            if len([p for p in parts if set(p) & set(g.members)]) >= 2
            and any(len(set(p) & set(g.members)) >= 2 for p in parts)
        ]
        assert cut
    else:
        assert len(parts) == 1
    res, grads = _loss_and_grads(model, batch, objective, parts)
    ref, ref_grads = unshared_update
    assert abs(res.loss_num - ref.loss_num) <= 1e-5 * max(1.0, abs(ref.loss_num))
    assert float((res.logprobs - ref.logprobs).abs().max()) <= 1e-5
    assert grads.keys() == ref_grads.keys() and len(grads) > 10
    worst = max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads)
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    assert scale > 1e-4 and worst <= 1e-5, (worst, scale)


def test_a_group_of_one_runs_the_unshared_layout(setup):
    """G = 1: one main row per group, nothing to share; the same values as sharing off."""
    from paravt.algo.logprobs import packed_logprobs
    from paravt.algo.packing import select_sequences
    from paravt.models.prefix import prefix_groups

    model, batch, _ = setup
    first = {}
    for i, r in enumerate(batch.roles):
        if r == "main":
            first.setdefault(int(batch.group_ids[i]), i)
    one = select_sequences(batch, sorted(first.values()))
    assert prefix_groups(one, range(len(one.uids))) == []
    with torch.no_grad():
        lp, _ = packed_logprobs(model, one)
        lp0, _ = packed_logprobs(model, _unshared(one))
    assert torch.equal(lp, lp0)


# ------------------------------------------------------- what is shared: hand-built batches


def _batch(rows, group_ids, visuals):
    """A packed batch of token rows ``(ids, mm)`` (mm 2 = video placeholder)."""
    from paravt.types import PackedBatch

    ids = torch.tensor([t for r, _ in rows for t in r])
    mm = torch.tensor([m for _, ms in rows for m in ms])
    cu = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor([len(r) for r, _ in rows]), 0)
    n = ids.numel()
    return PackedBatch(
        input_ids=ids, cu_seqlens=cu, loss_mask=torch.ones(n), old_logprobs=torch.zeros(n),
        advantages=torch.zeros(n), seq_weights=torch.ones(len(rows)), visuals=list(visuals),
        mm_token_type_ids=mm, group_ids=torch.tensor(group_ids),
    )  # fmt: skip


def _clip(*seeds):
    """A video of one segment per seed (grid 1x2x4: 2 placeholders at merge 2)."""
    from paravt.types import VisualInputs

    px = torch.cat([torch.randn(8, 3, generator=torch.Generator().manual_seed(s)) for s in seeds])
    return VisualInputs(px, torch.tensor([[1, 2, 4]] * len(seeds)))


def test_the_prefix_stops_where_tokens_or_pixels_differ_and_never_inside_a_segment():
    from paravt.models.prefix import prefix_groups, shared_layout

    text = ([1, 2, 3], [0, 0, 0])
    vid = ([9, 9, 9, 9], [2, 2, 2, 2])  # two segments of two placeholders

    def row(*tail):
        return (text[0] + vid[0] + list(tail), text[1] + vid[1] + [0] * len(tail))

    same = _clip(1, 2)
    # Same tokens and the same clip object: the prompt and its two segments are shared.
    b = _batch([row(5, 6), row(5, 7), row(5, 6, 8)], [4, 4, 4], [same, same, same])
    (g,) = prefix_groups(b, range(3))
    assert (g.members, g.prefix_len, g.prefix_segments) == ((0, 1, 2), 8, 2)
    # Equal pixels in another object (a copy moved between ranks) are shared as well.
    b = _batch([row(5, 6), row(5, 7)], [4, 4], [same, _clip(1, 2)])
    assert prefix_groups(b, range(2))[0].prefix_segments == 2
    # The second segment's pixels differ: the prefix ends before its first placeholder.
    b = _batch([row(5, 6), row(5, 7)], [4, 4], [same, _clip(1, 3)])
    (g,) = prefix_groups(b, range(2))
    assert (g.prefix_len, g.prefix_segments) == (5, 1)
    # Tokens differ inside the second segment's run: cut back to that segment's start.
    a = (text[0] + [9, 9, 9, 8, 5], text[1] + [2, 2, 2, 2, 0])
    b = _batch([row(5), a], [4, 4], [same, same])
    assert prefix_groups(b, range(2))[0].prefix_len == 5
    # A member that is all prefix still keeps one token of its own.
    b = _batch([row(5), row(5, 6)], [4, 4], [same, same])
    assert prefix_groups(b, range(2))[0].prefix_len == 7
    # A colliding group id over different first tokens shares nothing; -1 never shares.
    b = _batch([row(5), ([7] + row(5)[0][1:], row(5)[1]), row(5)], [4, 4, -1], [same] * 3)
    assert prefix_groups(b, range(3)) == []
    # No group ids: sharing is off.
    b.group_ids = None
    assert prefix_groups(b, range(3)) == []
    # The layout: the prompt once, each suffix after it, every position mapped back.
    b = _batch([row(5, 6), text, row(5, 7, 1)], [4, -1, 4], [same, None, same])
    groups = prefix_groups(b, range(3))
    lay = shared_layout(b, [0, 1, 2], groups)
    assert lay.blocks == [(0, 8, 0, 0), (8, 9, 0, 8), (9, 11, 0, 8), (11, 14, 0, 0)]
    assert lay.visuals == [(0, 0, 2)]
    assert torch.equal(b.input_ids[lay.src][lay.row_of], b.input_ids)


def test_microbatches_keep_a_group_together_and_cut_it_with_the_prompt_again():
    from paravt.algo.packing import microbatches

    same = _clip(1)
    p = ([1, 2, 3, 9, 9], [0, 0, 0, 2, 2])  # a 5-token prompt
    rows = [(p[0] + [i] * 3, p[1] + [0] * 3) for i in range(4)]  # 4 members, suffixes of 3
    b = _batch([*rows, ([7] * 6, [0] * 6)], [1, 1, 1, 1, -1], [same] * 4 + [None])
    # 5 + 4 * 3 = 17 rows for the group (not 32), 6 for the lone row.
    assert microbatches(b, 23) == [[0, 1, 2, 3, 4]]
    assert microbatches(b, 17) == [[0, 1, 2, 3], [4]]
    # 11 rows: a prompt and two suffixes per part, in member order.
    assert microbatches(b, 11) == [[0, 1], [2, 3], [4]]
    b.group_ids = None  # unshared: 8-token rows
    assert microbatches(b, 17) == [[0, 1], [2, 3], [4]]


def test_the_vision_tower_encodes_a_groups_overview_once(setup):
    """The patches through the vision tower and the rows through the backbone: a group's
    overview and prompt once, not G times."""
    from paravt.algo.logprobs import packed_logprobs

    model, batch, _ = setup
    seen = {"patches": 0, "rows": 0}
    video_fn = model.model.get_video_features
    lm_forward = model.model.language_model.forward

    def count_video(pixels, grid, **kw):
        seen["patches"] += int(pixels.shape[0])
        return video_fn(pixels, grid, **kw)

    def count_rows(*a, **kw):
        seen["rows"] += int(kw["inputs_embeds"].shape[1])
        return lm_forward(*a, **kw)

    counts = {}
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(model.model, "get_video_features", count_video)
        mp.setattr(model.model.language_model, "forward", count_rows)
        for name, b in (("shared", batch), ("unshared", _unshared(batch))):
            seen.update(patches=0, rows=0)
            packed_logprobs(model, b)
            counts[name] = dict(seen)
    mains = [i for i, r in enumerate(batch.roles) if r == "main"]
    subs = [i for i, r in enumerate(batch.roles) if r == "sub"]
    patches = [int(batch.visuals[i].pixel_values.shape[0]) for i in range(len(batch.uids))]
    overview = sum(patches[i] for i in mains)
    assert counts["unshared"]["patches"] == sum(patches)
    # Each group's overview once (2 groups of G), every sub-agent's crop as before.
    assert counts["shared"]["patches"] == overview * 2 // len(mains) + sum(patches[i] for i in subs)
    assert counts["unshared"]["rows"] == int(batch.cu_seqlens[-1])
    assert counts["shared"]["rows"] < 0.6 * counts["unshared"]["rows"]


def test_a_group_moved_between_ranks_sends_its_overview_once():
    """Rank balancing pickles a group with its overview compacted once and shared by the
    copies: the receiving rank sees one clip object (no pixel comparison) and the bytes
    sent are about one overview, not G."""
    import pickle

    from paravt.algo.packing import _portable_group
    from paravt.types import SequenceUnit, Trajectory

    clip = _clip(*range(64))  # 64 segments of 8 patches
    units = [
        SequenceUnit(
            Trajectory(
                uid=f"r{r}",
                role="main",
                sample_id="s",
                group_id=0,
                tokens=[1, 2],
                loss_mask=[0, 1],
                logprobs=[0.0, -1.0],
                prompt_len=1,
                visuals=clip,
            ),
            [],
            0.0,
            0,
        )  # fmt: skip
        for r in range(G)
    ]
    each = pickle.dumps([u.portable() for u in units])
    once = pickle.dumps(_portable_group(units))
    assert len(once) < 1.5 * len(each) / G
    moved = pickle.loads(once)
    assert all(u.main.visuals is moved[0].main.visuals for u in moved)
    assert torch.equal(moved[0].main.visuals.pixel_values, clip.pixel_values)


# ------------------------------------------------ the attention implementations that share


@pytest.fixture
def lm_attention(setup):
    """Set the tiny policy's language model to an attention implementation for one test; the
    one it had (sdpa, switched to its packed twin) comes back after."""
    cfg = setup[0].model.language_model.config
    old = cfg._attn_implementation

    def use(impl: str) -> None:
        cfg._attn_implementation = impl

    yield use
    cfg._attn_implementation = old


def test_the_8b_presets_attention_setting_shares_the_prompt(setup, lm_attention, tmp_path):
    """The shipped recipe's attention (qwen3vl_8b_paragrpo, cut to the tiny model) runs the
    shared layout, with the unshared forward's log-probs. Before issue 51 the preset named
    flash_attention_2, under which every packed forward ran unshared."""
    from paravt.algo.logprobs import packed_logprobs
    from paravt.config import load_config
    from paravt.models.forward import FLASH_VARLEN_KERNELS, flash_varlen_reference, packed_forward

    cfg = load_config("qwen3vl_8b_paragrpo", overrides=[f"model.path={tmp_path}"])
    assert cfg.algo.share_prefix
    model, batch, _ = setup
    lm_attention(cfg.model.attn_implementation)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        # a flash_attention_* preset on CPU: flash-attn's contract in its place
        for impl in ("flash_attention_2", "flash_attention_3"):
            mp.setitem(FLASH_VARLEN_KERNELS, impl, flash_varlen_reference)
        _, layout = packed_forward(model, batch, range(len(batch.uids)))
        lp, _ = packed_logprobs(model, batch)
        lp0, _ = packed_logprobs(model, _unshared(batch))
    assert layout.shared and layout.num_rows < 0.6 * int(batch.cu_seqlens[-1])
    assert float((lp - lp0).abs().max()) <= 1e-5


def test_flash_reference_is_the_block_attention_with_a_bottom_right_mask():
    """``flash_varlen_reference`` (flash-attn's varlen contract, the flash path's reference)
    over ``prefix_varlen_kwargs``' gathered keys equals the SDPA path's per-block attention
    (``varlen_sdpa_attention`` with the layout's blocks), grouped-query heads included; its
    causal mask is the bottom-right one (a top-left one differs)."""
    from paravt.models.forward import (
        flash_varlen_kernel,
        flash_varlen_reference,
        prefix_varlen_kwargs,
        varlen_sdpa_attention,
    )

    blocks = [(0, 5, 0, 0), (5, 8, 0, 5), (8, 12, 0, 5), (12, 14, 0, 0), (14, 14, 0, 5)]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 14, 8, generator=gen) for h in (4, 2, 2))
    cu = torch.tensor([0, 5, 8, 12, 14], dtype=torch.int32)
    ref, _ = varlen_sdpa_attention(None, q, k, v, None, cu_seq_lens_q=cu, paravt_blocks=blocks)
    kw = prefix_varlen_kwargs(blocks, torch.device("cpu"))
    assert kw["cu_seq_lens_q"].tolist() == [0, 5, 8, 12, 14]
    assert kw["cu_seq_lens_k"].tolist() == [0, 5, 13, 22, 24]
    assert (kw["max_length_q"], kw["max_length_k"]) == (5, 9)
    assert kw["paravt_key_index"][5:13].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    idx = kw["paravt_key_index"]
    args = (kw["cu_seq_lens_q"], kw["cu_seq_lens_k"], kw["max_length_q"], kw["max_length_k"])
    q3, k3, v3 = (x[0].transpose(0, 1) for x in (q, k, v))
    out = flash_varlen_reference(q3, k3[idx], v3[idx], *args, causal=True)
    assert out.shape == (14, 4, 8) and float((out - ref[0]).abs().max()) <= 1e-6
    # Top-left alignment (SDPA's is_causal: query i sees keys <= i) is what a suffix must NOT get.
    keys = torch.cat([k[:, :, :5], k[:, :, 5:8]], 2), torch.cat([v[:, :, :5], v[:, :, 5:8]], 2)
    top_left = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, 5:8], *keys, is_causal=True, enable_gqa=True
    )
    assert float((top_left.transpose(1, 2) - ref[:, 5:8]).abs().max()) > 1e-2
    # Without flash-attn (this machine): the kernel's lookup says what to install or use.
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(
            ImportError, match=r"flash_attn package.*model.attn_implementation=sdpa"
        ):
            flash_varlen_kernel("flash_attention_2")
    # An unshared layout has no key gather.
    assert (
        prefix_varlen_kwargs([(0, 3, 0, 0), (3, 7, 0, 0)], torch.device("cpu"))["paravt_key_index"]
        is None
    )


def test_flash_attention_2_shares_through_one_varlen_call(setup, unshared_update, lm_attention):
    """flash_attention_2 with a shared prompt: ONE varlen call per layer with separate query
    and key boundaries (each suffix's keys: the prompt's, then its own), causal; the loss,
    log-probs and every gradient equal the unshared forward's. flash-attn's kernel is the one
    part a CPU cannot run: ``flash_varlen_reference`` (its contract) stands in;
    tests/test_shared_prefix_cuda.py checks that contract against CUDA kernels."""
    from paravt.algo.packing import microbatches
    from paravt.models.forward import FLASH_VARLEN_KERNELS, flash_varlen_reference

    model, batch, objective = setup
    calls = []

    def kernel(q, k, v, **kw):
        calls.append((q.shape[0], k.shape[0], kw["cu_seqlens_q"].tolist(),
                      kw["cu_seqlens_k"].tolist(), kw["causal"]))  # fmt: skip
        return flash_varlen_reference(q, k, v, **kw)

    lm_attention("flash_attention_2")
    parts = microbatches(batch, int(batch.cu_seqlens[-1]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(FLASH_VARLEN_KERNELS, "flash_attention_2", kernel)
        res, grads = _loss_and_grads(model, batch, objective, parts)
    layers = model.config.text_config.num_hidden_layers
    assert len(parts) == 1 and len(calls) == layers  # one forward, no recomputation
    rows, keys, cu_q, cu_k, causal = calls[0]
    assert causal and rows < 0.6 * int(batch.cu_seqlens[-1]) and keys > rows
    assert cu_q[-1] == rows and cu_k[-1] == keys and cu_q != cu_k
    ref, ref_grads = unshared_update
    assert abs(res.loss_num - ref.loss_num) <= 1e-5 * max(1.0, abs(ref.loss_num))
    assert float((res.logprobs - ref.logprobs).abs().max()) <= 1e-5
    assert grads.keys() == ref_grads.keys()
    worst = max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads)
    assert worst <= 1e-5, worst


def test_an_attention_that_cannot_share_warns_once_naming_the_key_and_fix(
    setup, lm_attention, capsys, monkeypatch, tmp_path
):
    """eager (the debugging path) runs every row whole: with algo.share_prefix on, ONE
    warning names the key, why and the fix, from the run's checks and from the forward;
    the values are still the unshared forward's."""
    from paravt.config import load_config
    from paravt.models import forward
    from paravt.models.forward import packed_forward
    from paravt.models.prefix import prefix_groups
    from paravt.validate import validate_run

    monkeypatch.setattr(forward, "_warned_off", set())
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    base = [f"model.path={ckpt}", f"train.out_dir={tmp_path / 'out'}", "rollout.engine=hf",
            "model.device=cpu"]  # fmt: skip
    validate_run(load_config("qwen3vl_8b_paragrpo", overrides=base), world_size=1)
    off = ["algo.share_prefix=false", "model.attn_implementation=eager"]
    validate_run(load_config("qwen3vl_8b_paragrpo", overrides=[*base, *off]), world_size=1)
    assert "share_prefix" not in capsys.readouterr().err  # sdpa shares; off on purpose is quiet
    cfg = load_config("qwen3vl_8b_paragrpo", overrides=[*base, "model.attn_implementation=eager"])
    validate_run(cfg, world_size=1)
    model, batch, _ = setup
    two = prefix_groups(batch, range(len(batch.uids)))[0].members[:2]  # eager's mask is N x N
    lm_attention("eager")
    with torch.no_grad():
        h, layout = packed_forward(model, batch, two)
        h2, _ = packed_forward(model, batch, two)
        h0, _ = packed_forward(model, _unshared(batch), two)
    err = capsys.readouterr().err
    assert err.count("algo.share_prefix is on") == 1, err
    assert "model.attn_implementation='eager'" in err and "N x N" in err
    assert "model.attn_implementation=sdpa" in err and "algo.share_prefix=false" in err
    assert not layout.shared and torch.equal(h, h0) and torch.equal(h, h2)


def test_a_flash_call_outside_a_packed_forward_is_transformers_own(monkeypatch):
    """``varlen_flash_attention`` without paravt's packed kwargs (generation, padded batches)
    hands the call to transformers' flash attention under the original implementation name
    (what its flash-attn import keys on), and the switched name comes back after, also when
    that call raises. transformers' function needs flash-attn, so a recorder stands in."""
    import transformers.integrations.flash_attention as hf_flash

    from paravt.models.forward import VARLEN_FLASH, varlen_flash_attention

    class Layer(torch.nn.Module):
        config = type("C", (), {"_attn_implementation": VARLEN_FLASH + "flash_attention_2"})()

    seen = []

    def record(module, q, k, v, mask, **kw):
        seen.append((module.config._attn_implementation, kw))
        if kw.get("fail"):
            raise RuntimeError("boom")
        return q.transpose(1, 2), None

    monkeypatch.setattr(hf_flash, "flash_attention_forward", record)
    layer = Layer()
    q = torch.randn(1, 4, 3, 8)
    out, _ = varlen_flash_attention(layer, q, q[:, :2], q[:, :2], None, scaling=0.5, position_ids=1)
    assert seen == [("flash_attention_2", {"dropout": 0.0, "scaling": 0.5, "position_ids": 1})]
    assert torch.equal(out, q.transpose(1, 2))
    assert layer.config._attn_implementation == VARLEN_FLASH + "flash_attention_2"
    with pytest.raises(RuntimeError, match="boom"):
        varlen_flash_attention(layer, q, q, q, None, fail=True)
    assert layer.config._attn_implementation == VARLEN_FLASH + "flash_attention_2"
