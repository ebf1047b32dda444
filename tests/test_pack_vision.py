"""paravt._C pack_vision: parity with HF's Qwen3-VL processors and vision-model internals.

Oracles are HF's own code: ``Qwen3VLVideoProcessor._preprocess`` (normalise + patchify),
``Qwen2VLImageProcessorPil`` (single frames), and the ``transformers.vision_utils`` helpers that
``Qwen3VLVisionModel.forward`` / ``Qwen2_5_VisionTransformerPretrainedModel.forward`` call with
the model's own attributes (position ids, bilinear taps, cu_seqlens, window index).

The HF oracles live in ``paravt.vision.hf_reference`` (shared with the benchmarks).
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from transformers import vision_utils as hf_vu
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from paravt.vision import hf_reference as hf_ref
from paravt.vision import pack as pk
from paravt.vision.patchify import VisionSpec, patchify_frames

NATIVE = pk.native_available()
IMPLS = ["torch", "native"] if NATIVE else ["torch"]
QWEN3_SPEC = dict(patch_size=16, temporal_patch_size=2, merge_size=2)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # Qwen2.5-VL's processor uses the CLIP stats
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@pytest.fixture
def video_processor():
    return hf_ref.video_processor(**QWEN3_SPEC)


def hf_video(proc, crops, mean, std):
    """HF processor output for uint8 (T, H, W, 3) crops, no resize, no frame sampling."""
    return hf_ref.hf_video_pixels(proc, crops, mean, std)


def random_crops(rng: random.Random, n: int, frames: tuple[int, int], sides: tuple[int, int], f=32):
    """n crops, T in [frames], H != W (mostly) in [sides], multiples of f."""
    crops = []
    for _ in range(n):
        T = rng.randint(*frames)
        H = rng.randint(sides[0] // f, sides[1] // f) * f
        W = rng.randint(sides[0] // f, sides[1] // f) * f
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        crops.append(torch.randint(0, 256, (T, H, W, 3), dtype=torch.uint8, generator=g))
    return crops


# (n crops, frame range, side range): the many-small, the few-large and the mixed batches.
# Totals are kept to a few tens of MB so the HF processor oracle stays fast on 2 cores.
CROP_LISTS = [
    (1, (2, 2), (32, 32)),
    (64, (2, 5), (32, 96)),
    (7, (2, 33), (32, 160)),
    (2, (15, 17), (416, 448)),
    (23, (3, 9), (32, 448)),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(CROP_LISTS)))
def test_pixels_match_hf_video_processor(video_processor, impl, case):
    n, frames, sides = CROP_LISTS[case]
    crops = random_crops(random.Random(case), n, frames, sides)
    pv_hf, grid_hf = hf_video(video_processor, crops, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    packed = pk.pack_vision(crops, **QWEN3_SPEC, impl=impl)
    assert torch.equal(packed.grid_thw, grid_hf)
    # The LUT replays HF's float32 ops, so equality is exact, not approximate.
    assert torch.equal(packed.pixel_values, pv_hf)
    assert packed.grid == tuple(tuple(r) for r in grid_hf.tolist())


@pytest.mark.parametrize("impl", IMPLS)
def test_pixels_match_hf_with_clip_stats_and_odd_frames(video_processor, impl):
    """Non-trivial mean/std (rounding matters) and odd T (last frame repeated)."""
    crops = random_crops(random.Random(7), 5, (1, 7), (32, 128))
    crops[0] = crops[0][:3]
    pv_hf, grid_hf = hf_video(video_processor, crops, CLIP_MEAN, CLIP_STD)
    packed = pk.pack_vision(crops, **QWEN3_SPEC, mean=CLIP_MEAN, std=CLIP_STD, impl=impl)
    assert torch.equal(packed.grid_thw, grid_hf)
    assert torch.equal(packed.pixel_values, pv_hf)


@pytest.mark.parametrize("impl", IMPLS)
def test_single_frames_match_hf_image_processor(impl):
    proc = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2)
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in [(64, 96), (224, 32)]]
    from PIL import Image

    out = proc(images=[Image.fromarray(f) for f in frames], do_resize=False, return_tensors="pt")
    packed = pk.pack_vision(
        [torch.from_numpy(f)[None] for f in frames],
        **QWEN3_SPEC,
        mean=tuple(proc.image_mean),
        std=tuple(proc.image_std),
        impl=impl,
    )
    assert torch.equal(packed.grid_thw, out["image_grid_thw"])
    # The PIL processor rescales and normalises in two float steps: ~1 ulp apart from ours.
    torch.testing.assert_close(packed.pixel_values, out["pixel_values"], atol=1e-6, rtol=0)


def hf_vision_internals(grid_thw, config):
    """What Qwen3VLVisionModel.forward computes internally (same helpers, same arguments)."""
    cu, pos, idx, wt, _ = hf_ref.hf_vision_metadata(
        grid_thw,
        merge_size=config.spatial_merge_size,
        num_position_embeddings=config.num_position_embeddings,
    )
    return cu, pos, idx, wt


@pytest.fixture(scope="module")
def tiny_vision_model():
    return hf_ref.tiny_vision_tower()


def test_model_uses_the_interpolation_we_match(tiny_vision_model):
    """Guards the oracle: the model's own interpolation settings are the ones tested here."""
    m = tiny_vision_model
    assert (m.interpolation_mode, m.interpolation_align_corners) == ("bilinear", True)
    assert m.num_grid_per_side == 48


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", range(4))
def test_metadata_matches_hf_vision_model(tiny_vision_model, impl, seed):
    rng = random.Random(100 + seed)
    n = rng.choice([1, 5, 64])
    grid = [
        ((rng.randint(2, 33) + 1) // 2, rng.randint(1, 14) * 2, rng.randint(1, 14) * 2)
        for _ in range(n)
    ]
    g = torch.tensor(grid)
    cfg = tiny_vision_model.config
    cu_hf, pos_hf, idx_hf, wt_hf = hf_vision_internals(g, cfg)
    cu, pos, idx, wt, widx, cuw = pk.vision_metadata(
        g, merge_size=2, num_grid_per_side=48, impl=impl
    )
    assert cu.dtype == cu_hf.dtype and torch.equal(cu, cu_hf)
    assert torch.equal(pos, pos_hf)
    assert torch.equal(idx, idx_hf)
    assert torch.equal(wt, wt_hf)  # same float32 op order: bit-identical
    assert widx.numel() == 0 and cuw.numel() == 0


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_vision_metadata_and_max_seqlen(tiny_vision_model, impl):
    crops = random_crops(random.Random(11), 9, (2, 9), (32, 224))
    packed = pk.pack_vision(crops, **QWEN3_SPEC, impl=impl)
    cu_hf, pos_hf, idx_hf, wt_hf = hf_vision_internals(packed.grid_thw, tiny_vision_model.config)
    assert torch.equal(packed.cu_seqlens, cu_hf)
    assert torch.equal(packed.position_ids, pos_hf)
    assert torch.equal(packed.interp_indices, idx_hf)
    assert torch.equal(packed.interp_weights, wt_hf)
    assert packed.max_seqlen == int((cu_hf[1:] - cu_hf[:-1]).max())
    assert packed.tokens_per_crop == [int(t * h * w) // 4 for t, h, w in packed.grid_thw.tolist()]
    assert packed.window_index is None


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seed", range(4))
def test_window_index_matches_qwen2_5_vl(impl, seed):
    """Qwen2.5-VL: patch 14, merge 2, window 112 -> 4x4 merged-token windows."""
    rng = random.Random(200 + seed)
    n = rng.choice([1, 6, 40])
    # h/m multiples of the window (HF pads a whole empty window there) and not.
    grid = [(rng.randint(1, 9), rng.randint(1, 16) * 2, rng.randint(1, 16) * 2) for _ in range(n)]
    g = torch.tensor(grid)
    widx_hf, cuw_hf = hf_vu.get_vision_window_index(
        g, spatial_merge_size=2, window_size=112, patch_size=14
    )
    cu, pos, idx, wt, widx, cuw = pk.vision_metadata(
        g, merge_size=2, window_size=112, patch_size=14, impl=impl
    )
    assert torch.equal(widx, widx_hf)
    assert cuw.dtype == cuw_hf.dtype and torch.equal(cuw, cuw_hf)
    assert idx.numel() == 0
    assert torch.equal(pos, hf_vu.get_vision_position_ids(g, 2))


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_vision_qwen2_5_vl_record(impl):
    crops = random_crops(random.Random(5), 4, (2, 6), (56, 308), f=28)
    packed = pk.pack_vision(
        crops, patch_size=14, temporal_patch_size=2, merge_size=2, model="qwen2_5_vl", impl=impl
    )
    widx_hf, cuw_hf = hf_vu.get_vision_window_index(packed.grid_thw, 2, 112, 14)
    assert torch.equal(packed.window_index, widx_hf)
    assert torch.equal(packed.cu_window_seqlens, cuw_hf)
    assert packed.max_window_seqlen == int((cuw_hf[1:] - cuw_hf[:-1]).max())
    assert packed.interp_indices is None
    kw = packed.model_kwargs()
    assert set(kw) >= {"cu_seqlens", "position_ids", "window_index", "cu_window_seqlens"}


def test_native_equals_reference_and_patchify():
    """Native vs torch reference on one batch; and both vs the repo's patchify reference."""
    crops = random_crops(random.Random(9), 6, (1, 5), (32, 192))
    ref = pk.pack_vision(crops, **QWEN3_SPEC, impl="torch")
    spec = VisionSpec()
    pv = torch.cat([patchify_frames(c, spec)[0] for c in crops])
    # All three replay HF's fused rescale+normalise: (x - mean/r) / (std/r), bit for bit.
    assert torch.equal(ref.pixel_values, pv)
    if NATIVE:
        nat = pk.pack_vision(crops, **QWEN3_SPEC, impl="native")
        for name in ("pixel_values", "grid_thw", "cu_seqlens", "position_ids", "interp_indices"):
            assert torch.equal(getattr(nat, name), getattr(ref, name)), name
        assert torch.equal(nat.interp_weights, ref.interp_weights)


def test_non_contiguous_crops_are_packed_correctly():
    base = torch.randint(0, 256, (4, 96, 128, 3), dtype=torch.uint8)
    view = base[:, 32:96, 32:96]  # a non-contiguous spatial crop
    for impl in IMPLS:
        a = pk.pack_vision([view], **QWEN3_SPEC, impl=impl)
        b = pk.pack_vision([view.contiguous()], **QWEN3_SPEC, impl="torch")
        assert torch.equal(a.pixel_values, b.pixel_values)


@pytest.mark.parametrize("impl", IMPLS)
def test_errors_name_the_crop_and_the_fix(impl):
    good = torch.zeros(2, 32, 32, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"crop 1 has frame size 32x40.*smart_resize"):
        pk.pack_vision([good, torch.zeros(2, 32, 40, 3, dtype=torch.uint8)], impl=impl)
    with pytest.raises(ValueError, match=r"crop 0 is \(2, 32, 32, 3\) torch.float32"):
        pk.pack_vision([good.float()], impl=impl)
    with pytest.raises(ValueError, match="empty list"):
        pk.pack_vision([], impl=impl)
    with pytest.raises(ValueError, match="perfect square"):
        pk.pack_vision([good], num_position_embeddings=50, impl=impl)


@pytest.mark.skipif(not NATIVE, reason="paravt._C not built")
def test_native_op_checks_its_own_inputs():
    """The C++ op validates too (callers may use torch.ops.paravt directly)."""
    lut = pk.normalization_lut((0.5,) * 3, (0.5,) * 3)
    bad = torch.zeros(2, 32, 48, 3, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="crop 0 has frame size 32x48"):
        torch.ops.paravt.pack_vision([bad], lut, 16, 2, 2, 48, 0)
    with pytest.raises(
        RuntimeError, match=r"lut must be a float32, bfloat16 or float16 \(3, 256\)"
    ):
        torch.ops.paravt.pack_vision([bad[:, :, :32]], lut[:2], 16, 2, 2, 48, 0)


@pytest.mark.skipif(not NATIVE, reason="paravt._C not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stats", ["half", "clip"])
def test_native_affine_kernel_equals_lut_gather_bitwise(dtype, stats):
    """The CPU op's vectorised affine kernel ((v - mean') / std', chosen when the table was
    built from mean/std) writes the same bits as the LUT gather, for every uint8 level and
    both output dtypes it serves (float16 always gathers); Qwen2.5-VL's 14-px patches too."""
    mean, std = ((0.5,) * 3, (0.5,) * 3) if stats == "half" else (CLIP_MEAN, CLIP_STD)
    other = (CLIP_MEAN, CLIP_STD) if stats == "half" else ((0.5,) * 3, (0.5,) * 3)
    lut = pk.normalization_lut(mean, std).to(dtype)
    aff = pk.affine_params(mean, std)
    # A table of OTHER stats: where the affine kernel runs, it ignores the table, so its
    # output equals this test's LUT gather only if the kernel really ran.
    decoy = pk.normalization_lut(*other).to(dtype)
    levels = torch.arange(256, dtype=torch.uint8).repeat(6 * 32 * 32 * 3 // 256 * 2)
    every_level = levels[: 6 * 32 * 32 * 3].view(6, 32, 32, 3)
    crops = [every_level, *random_crops(random.Random(4), 5, (1, 7), (32, 160))]
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    for p in (16, 14):
        cs = [c[:, : c.shape[1] // (2 * p) * 2 * p, : c.shape[2] // (2 * p) * 2 * p] for c in crops]
        cs = [c for c in cs if c.shape[1] and c.shape[2]]
        gathered = torch.ops.paravt.pack_vision(cs, lut, p, 2, 2, 0, 0)[0]
        table = decoy if dtype != torch.float16 else lut  # float16 always gathers
        computed = torch.ops.paravt.pack_vision(cs, table, p, 2, 2, 0, 0, affine=aff)[0]
        assert computed.dtype == dtype
        assert torch.equal(computed.view(bits), gathered.view(bits))
        out = torch.full_like(gathered, float("nan"))
        torch.ops.paravt.pack_pixels_out(cs, table, p, 2, 2, out, affine=aff)
        assert torch.equal(out.view(bits), gathered.view(bits))
    with pytest.raises(RuntimeError, match="affine must hold 6 floats"):
        torch.ops.paravt.pack_vision(crops[:1], lut.float(), 16, 2, 2, 0, 0, affine=aff[:5])


@pytest.mark.skipif(not NATIVE, reason="paravt._C not built")
@pytest.mark.skipif(os.environ.get("PARAVT_PACK_POOL_MB") == "0", reason="output pool disabled")
def test_output_pool_reuses_only_freed_buffers():
    """pack_vision's outputs come from a pool of freed buffers: a live output is never handed
    out again (its values survive later packs); once freed, its pages serve the next pack."""
    # An output size no other test produces, so no earlier freed buffer can match it.
    crops_a = [torch.randint(0, 256, (7, 224, 160, 3), dtype=torch.uint8) for _ in range(3)]
    crops_b = [torch.flip(c, dims=(2,)) for c in crops_a]  # same sizes, different pixels
    ref_a = pk.pack_vision(crops_a, **QWEN3_SPEC, impl="torch").pixel_values
    ref_b = pk.pack_vision(crops_b, **QWEN3_SPEC, impl="torch").pixel_values
    a = pk.pack_vision(crops_a, **QWEN3_SPEC, impl="native").pixel_values
    ptr_a = a.data_ptr()
    view = a[1:]  # a view keeps the buffer alive after `a` itself is gone
    del a
    b = pk.pack_vision(crops_b, **QWEN3_SPEC, impl="native").pixel_values
    assert b.data_ptr() != ptr_a
    assert torch.equal(view, ref_a[1:]) and torch.equal(b, ref_b)
    del view  # now the buffer is free: the next pack of this size gets it back
    c = pk.pack_vision(crops_a, **QWEN3_SPEC, impl="native").pixel_values
    assert c.data_ptr() == ptr_a
    assert torch.equal(c, ref_a) and torch.equal(b, ref_b)


@pytest.mark.skipif(not NATIVE, reason="paravt._C not built")
def test_opcheck():
    lut = pk.normalization_lut((0.5,) * 3, (0.5,) * 3)
    crops = random_crops(random.Random(1), 3, (1, 4), (32, 64))
    torch.library.opcheck(
        torch.ops.paravt.pack_vision.default,
        (crops, lut, 16, 2, 2, 48, 0),
        test_utils=("test_schema", "test_faketensor"),
    )
    aff = pk.affine_params((0.5,) * 3, (0.5,) * 3)
    torch.library.opcheck(
        torch.ops.paravt.pack_vision.default,
        (crops, lut, 16, 2, 2, 48, 0),
        {"affine": aff},
        test_utils=("test_schema", "test_faketensor"),
    )
    n_patch = sum(((c.shape[0] + 1) // 2) * (c.shape[1] // 16) * (c.shape[2] // 16) for c in crops)
    for kwargs in ({}, {"affine": aff}):
        torch.library.opcheck(
            torch.ops.paravt.pack_pixels_out.default,
            (crops, lut, 16, 2, 2, torch.empty(n_patch, 1536)),
            kwargs,
            test_utils=("test_schema",),
        )
    torch.library.opcheck(
        torch.ops.paravt.vision_metadata.default,
        (torch.tensor([[1, 2, 4], [3, 4, 2]]), 2, 48, 112, 14),
        test_utils=("test_schema",),
    )


def test_fallback_is_loud(monkeypatch):
    monkeypatch.setattr(pk, "_NATIVE", None)
    monkeypatch.setenv("PARAVT_SKIP_EXT", "1")
    with pytest.warns(RuntimeWarning, match="native extension unavailable"):
        assert pk.native_available() is False
    crop = torch.randint(0, 256, (2, 32, 64, 3), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="impl='native'.*not built"):
        pk.pack_vision([crop], impl="native")
    # auto still works, through the torch path.
    assert pk.pack_vision([crop]).pixel_values.shape == (8, 1536)
    monkeypatch.setattr(pk, "_NATIVE", None)


@pytest.mark.parametrize("impl", IMPLS)
def test_pack_into_reused_buffer(impl):
    crops = random_crops(random.Random(4), 5, (1, 6), (32, 160))
    ref = pk.pack_vision(crops, **QWEN3_SPEC, impl="torch")
    buf = torch.full((ref.pixel_values.numel() + 1000,), float("nan"))
    got = pk.pack_vision(crops, **QWEN3_SPEC, out=buf, impl=impl)
    assert got.pixel_values.data_ptr() == buf.data_ptr()  # a view, no new allocation
    assert torch.equal(got.pixel_values, ref.pixel_values)
    assert torch.isnan(buf[ref.pixel_values.numel() :]).all()  # nothing written past the pack
    for name in ("grid_thw", "cu_seqlens", "position_ids", "interp_indices", "interp_weights"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    with pytest.raises(ValueError, match="out holds 10 floats but this batch needs"):
        pk.pack_vision(crops, **QWEN3_SPEC, out=torch.empty(10), impl=impl)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["qwen3_vl", "qwen2_5_vl"])
def test_cuda_pack_equals_cpu_pack(model):
    """GPU frames (the DALI path): the CUDA op (or the torch path on GPU when the extension
    has no CUDA kernels) gives exactly the CPU result."""
    f = 32 if model == "qwen3_vl" else 28
    p = 16 if model == "qwen3_vl" else 14
    crops = random_crops(random.Random(21), 12, (1, 9), (f, 8 * f), f=f)
    kw = dict(patch_size=p, temporal_patch_size=2, merge_size=2, model=model)
    cpu = pk.pack_vision(crops, **kw)
    gpu = pk.pack_vision([c.cuda() for c in crops], **kw)
    assert gpu.pixel_values.is_cuda and gpu.position_ids.is_cuda
    for name in (
        "pixel_values",
        "grid_thw",
        "cu_seqlens",
        "position_ids",
        "interp_indices",
        "interp_weights",
        "window_index",
        "cu_window_seqlens",
    ):
        a, b = getattr(gpu, name), getattr(cpu, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a.cpu(), b), name
    assert (gpu.max_seqlen, gpu.max_window_seqlen) == (cpu.max_seqlen, cpu.max_window_seqlen)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_output_is_the_rounded_hf_output(video_processor, impl, dtype):
    """A 16-bit pack is exactly the HF float32 result cast the way the model casts it."""
    crops = random_crops(random.Random(8), 6, (1, 7), (32, 160))
    pv_hf, _ = hf_video(video_processor, crops, CLIP_MEAN, CLIP_STD)
    packed = pk.pack_vision(
        crops, **QWEN3_SPEC, mean=CLIP_MEAN, std=CLIP_STD, dtype=dtype, impl=impl
    )
    assert packed.pixel_values.dtype == dtype
    assert torch.equal(packed.pixel_values, pv_hf.to(dtype))
    buf = torch.empty(packed.pixel_values.numel(), dtype=dtype)
    again = pk.pack_vision(
        crops, **QWEN3_SPEC, mean=CLIP_MEAN, std=CLIP_STD, dtype=dtype, out=buf, impl=impl
    )
    assert torch.equal(again.pixel_values, packed.pixel_values)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        pk.pack_vision(crops, **QWEN3_SPEC, dtype=dtype, out=buf.float(), impl=impl)
