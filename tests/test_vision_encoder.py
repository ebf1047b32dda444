"""Packed vision forward (paravt.vision.encoder) vs the HF Qwen3-VL vision tower per crop."""

from __future__ import annotations

import random

import pytest
import torch

from paravt.vision import pack as pk
from paravt.vision.encoder import VarlenPlan, encode_packed, use_packed_vision, varlen_attention
from paravt.vision.hf_reference import tiny_vision_tower

SPEC = dict(patch_size=16, temporal_patch_size=2, merge_size=2)


@pytest.fixture(scope="module")
def visual():
    torch.manual_seed(0)
    model = tiny_vision_tower(
        depth=3,
        hidden_size=64,
        num_heads=4,
        out_hidden_size=48,
        num_position_embeddings=64,  # an 8x8 table: every crop size interpolates
        deepstack_visual_indexes=(0, 2),
    )
    # HF's init (std 0.02) makes every block nearly the identity; larger weights make the
    # comparison sensitive to rotary, position-table and attention-mask mistakes.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
    return model


def crops_for(seed: int, n: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        T = rng.randint(1, 6)
        H, W = rng.randint(1, 4) * 32, rng.randint(1, 5) * 32
        out.append(torch.randint(0, 256, (T, H, W, 3), dtype=torch.uint8))
    return out


@pytest.mark.parametrize("n", [1, 5, 17])
def test_packed_forward_equals_per_crop_hf_forward(visual, n):
    torch.manual_seed(n)
    crops = crops_for(n, n)
    packed = pk.pack_vision(crops, **SPEC, num_position_embeddings=64)
    with torch.no_grad():
        feats = encode_packed(visual, packed, attn_impl="sdpa")
        per_crop = feats.split()
        assert len(per_crop) == n
        for i, crop in enumerate(crops):
            one = pk.pack_vision([crop], **SPEC, num_position_embeddings=64, impl="torch")
            ref = visual(one.pixel_values, grid_thw=one.grid_thw)  # HF's own forward
            torch.testing.assert_close(per_crop[i], ref.pooler_output, atol=1e-5, rtol=1e-5)
            start = sum(feats.tokens_per_crop[:i])
            for mine, theirs in zip(feats.deepstack, ref.deepstack_features, strict=True):
                torch.testing.assert_close(
                    mine[start : start + feats.tokens_per_crop[i]], theirs, atol=1e-5, rtol=1e-5
                )


def test_packed_forward_equals_hf_packed_forward_with_our_metadata(visual):
    """HF's forward also accepts our precomputed metadata (model_kwargs) and agrees."""
    packed = pk.pack_vision(crops_for(3, 6), **SPEC, num_position_embeddings=64)
    with torch.no_grad():
        ours = encode_packed(visual, packed).embeds
        hf = visual(packed.pixel_values, grid_thw=packed.grid_thw, **packed.model_kwargs())
    torch.testing.assert_close(ours, hf.pooler_output, atol=1e-5, rtol=1e-5)


def test_attention_never_crosses_segments():
    """Perturbing one segment's keys/values changes only that segment's outputs."""
    torch.manual_seed(0)
    crops = [
        torch.zeros(4, 64, 32, 3, dtype=torch.uint8),
        torch.zeros(2, 32, 96, 3, dtype=torch.uint8),
    ]
    packed = pk.pack_vision(crops, **SPEC)
    plan = VarlenPlan.build(packed, torch.device("cpu"))
    n = packed.pixel_values.shape[0]
    q, k, v = (torch.randn(n, 2, 8) for _ in range(3))
    out = varlen_attention(q, k, v, plan, 8**-0.5, "sdpa")
    cu = packed.cu_seqlens.tolist()
    k2, v2 = k.clone(), v.clone()
    k2[cu[1] : cu[2]] += 1.0
    v2[cu[1] : cu[2]] += 1.0
    out2 = varlen_attention(q, k2, v2, plan, 8**-0.5, "sdpa")
    changed = (out2 - out).abs().amax(dim=(1, 2)) > 0
    assert changed[cu[1] : cu[2]].all()
    assert not changed[: cu[1]].any() and not changed[cu[2] :].any()
    # Against an explicit block-diagonal mask.
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    mask = seg[:, None] == seg[None, :]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=8**-0.5
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_flash_request_without_flash_attn_raises(visual):
    packed = pk.pack_vision(crops_for(0, 1), **SPEC, num_position_embeddings=64)
    with pytest.raises(RuntimeError, match="attn_impl='flash' needs flash-attn"):
        encode_packed(visual, packed, attn_impl="flash")


def test_gradients_flow_to_vision_weights(visual):
    packed = pk.pack_vision(crops_for(1, 3), **SPEC, num_position_embeddings=64)
    visual.zero_grad()
    encode_packed(visual, packed).embeds.square().mean().backward()
    assert visual.pos_embed.weight.grad is not None and visual.pos_embed.weight.grad.abs().sum() > 0
    assert visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    visual.zero_grad()


def test_rejects_qwen2_5_packing(visual):
    packed = pk.pack_vision(crops_for(0, 1), **SPEC, model="qwen2_5_vl")
    with pytest.raises(ValueError, match="pack with model='qwen3_vl'"):
        encode_packed(visual, packed)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_packed_forward_on_cuda_matches_cpu(visual):
    packed = pk.pack_vision(crops_for(7, 9), **SPEC, num_position_embeddings=64)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # the patch-embed Conv3d would run in TF32
    with torch.no_grad():
        cpu = encode_packed(visual, packed, attn_impl="sdpa").embeds
        gpu_visual = visual.to("cuda")
        try:
            gpu = encode_packed(gpu_visual, packed, attn_impl="sdpa").embeds
        finally:
            visual.to("cpu")
            torch.backends.cudnn.allow_tf32 = tf32
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-4, rtol=1e-4)


def _tiny_qwen3_vl():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration

    text = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True
        ),
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    cfg = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=500,
        video_token_id=501,
        vision_start_token_id=502,
        vision_end_token_id=503,
    )
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for param in model.model.visual.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
    return model


def _video_prompt(packed, prefix: list[int], after_each: list[int]) -> torch.Tensor:
    """``(1, L)`` ids of the tiny model's video layout: per crop, one
    ``<9><vision_start> <video_pad>*(h*w/4) <vision_end>`` per temporal patch, then
    ``after_each``."""
    ids = list(prefix)
    for t, h, w in packed.grid:
        for _ in range(t):
            ids += [9, 502] + [501] * (h * w // 4) + [503]
        ids += after_each
    return torch.tensor([ids])


def test_use_packed_vision_in_the_full_model_forward():
    """A whole Qwen3-VL forward (videos of several crops) gives the same logits with the packed
    encoder installed; the vision features demonstrably reach the logits."""
    model = _tiny_qwen3_vl()
    crops = crops_for(5, 4)
    packed = pk.pack_vision(crops, **SPEC, num_position_embeddings=64)
    input_ids = _video_prompt(packed, [1, 2, 3], [7])
    mm = (input_ids == 501).long() * 2

    def logits(pixels):
        kw = dict(pixel_values_videos=pixels, video_grid_thw=packed.grid_thw, mm_token_type_ids=mm)
        return model(input_ids=input_ids, **kw).logits

    with torch.no_grad():
        ref = logits(packed.pixel_values)
        blank = logits(torch.zeros_like(packed.pixel_values))
        use_packed_vision(model)
        got = logits(packed.pixel_values)
    assert (ref - blank).abs().max() > 1e-2  # the test would notice a wrong vision output
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert "get_image_features" in vars(model.model)  # installed on the instance only


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_vision_training_gradients_equal_hf(checkpointing):
    """Training through the packed encoder: the loss and every vision-tower gradient equal
    HF's vision forward, with and without HF's gradient checkpointing of the blocks (the
    packed blocks run through their own __call__, so checkpointing and FSDP hooks apply)."""
    model = _tiny_qwen3_vl().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    crops = crops_for(11, 3)
    packed = pk.pack_vision(crops, **SPEC, num_position_embeddings=64)
    input_ids = _video_prompt(packed, [1, 2], [7, 8])
    kw = dict(
        input_ids=input_ids,
        pixel_values_videos=packed.pixel_values,
        video_grid_thw=packed.grid_thw,
        mm_token_type_ids=(input_ids == 501).long() * 2,
    )

    def loss_and_grads():
        model.zero_grad()
        loss = (
            model(**kw)
            .logits.float()
            .log_softmax(-1)[0, :-1]
            .gather(-1, input_ids[0, 1:, None])
            .mean()
        )
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.model.visual.named_parameters()}
        return loss.detach(), grads

    import paravt.vision.encoder as enc

    ref_loss, ref = loss_and_grads()
    with torch.no_grad():
        hf_tower = model.model.visual(packed.pixel_values, grid_thw=packed.grid_thw).pooler_output
    use_packed_vision(model)
    runs = []
    orig = enc._packed_block

    def counting(blk, x, st):
        runs.append(1)
        return orig(blk, x, st)

    enc._packed_block = counting
    try:
        loss, got = loss_and_grads()
    finally:
        enc._packed_block = orig
    depth = len(model.model.visual.blocks)
    assert len(runs) == (2 * depth if checkpointing else depth)  # recomputed in backward
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    assert ref.keys() == got.keys()
    assert sum(g.abs().sum() for g in ref.values()) > 0
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-4, msg=name)
    # HF callers of a block still get HF's forward (the override dispatches on packed_state).
    assert "forward" in vars(model.model.visual.blocks[0])
    with torch.no_grad():
        again = model.model.visual(packed.pixel_values, grid_thw=packed.grid_thw).pooler_output
    assert torch.equal(again, hf_tower)
