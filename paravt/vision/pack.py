"""Pack many crops into ONE batched varlen vision-encoder input (``paravt._C.pack_vision``).

A parallel tool turn yields dozens of crops of different lengths and sizes. HF prepares each
one separately (processor normalise + patchify per video; the vision model then rebuilds
rotary ids and bilinear position-embedding taps per image in Python loops with host syncs).
:func:`pack_vision` does all of it in one native call and returns a :class:`PackedVision`
whose tensors the encoder consumes as they are (see :mod:`paravt.vision.encoder`).

Three implementations, chosen per call by ``impl=`` under the rule shared by every paravt fast
op (``paravt_kernels.dispatch.resolve_native``):

* ``native`` CPU: ``torch.ops.paravt.pack_vision`` (csrc/pack_vision_cpu.cpp), parallel over
  patches; normalisation is HF's own float32 arithmetic ``(v - mean') / std'`` in a vectorised
  kernel (``affine=``; float32 and bfloat16 outputs) or a gather from the (3, 256) table it
  produces (float16, or a caller's own ``lut``) — the same bits either way, and HF's.
  Outputs come from a pool of freed output buffers (pages already faulted in; a buffer is
  reused only after every tensor on it is gone), capped by ``PARAVT_PACK_POOL_MB`` (default
  1/16 of physical memory, at most 4096 MB of idle buffers; 0 disables it).
* ``native`` CUDA: the same op on GPU frames (csrc/cuda/pack_kernels.cu; built only where
  torch has CUDA), fused uint8 -> normalised -> patchified in one pass.
* ``torch``: :func:`pack_vision_reference`, pure torch, the oracle of the native op and the
  fallback when the extension is not built (``PARAVT_SKIP_EXT=1`` or a failed build), which is
  announced loudly once.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from paravt_kernels.dispatch import ext_skipped, resolve_native

from paravt.vision.patchify import VisionSpec

log = logging.getLogger(__name__)

ModelType = Literal["qwen3_vl", "qwen2_5_vl"]
Impl = Literal["auto", "native", "torch"]

_NATIVE: bool | None = None
_NATIVE_ERROR: str = ""


def native_available() -> bool:
    """True when ``paravt._C`` is built and loaded (imports it on first call).

    ``PARAVT_SKIP_EXT=1`` forces the torch path. A missing or broken build is reported once
    with a warning that says how to build it.
    """
    global _NATIVE, _NATIVE_ERROR
    if _NATIVE is None:
        if ext_skipped():
            _NATIVE, _NATIVE_ERROR = False, "PARAVT_SKIP_EXT=1 is set"
        else:
            try:
                # lazy: the optional compiled extension (registers torch.ops.paravt.*)
                import paravt._C  # noqa: F401

                _register_fake()
                _NATIVE = True
            except ImportError as exc:
                _NATIVE, _NATIVE_ERROR = False, f"import paravt._C failed: {exc}"
        if not _NATIVE:
            msg = (
                f"paravt: native extension unavailable ({_NATIVE_ERROR}); pack_vision uses the "
                "slower pure-torch path. Build it with `python setup.py build_ext --inplace` "
                "(or `make test`)."
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            log.warning(msg)
    return _NATIVE


def _register_fake() -> None:
    """Shape functions of the native op (torch.compile / FakeTensor tracing): every output size
    follows from the crops' shapes alone."""

    @torch.library.register_fake("paravt::pack_vision")
    def _(
        crops,
        lut,
        patch_size,
        temporal_patch_size,
        merge_size,
        num_grid_per_side,
        window_size,
        affine=None,
    ):
        p, tp, m = patch_size, temporal_patch_size, merge_size
        grid = [((c.shape[0] + tp - 1) // tp, c.shape[1] // p, c.shape[2] // p) for c in crops]
        n_patch = sum(t * h * w for t, h, w in grid)
        n_seg = sum(t for t, _, _ in grid)
        n_tap = n_patch if num_grid_per_side > 0 else 0
        n_win, n_tok = 0, 0
        if window_size > 0:
            vw = window_size // m // p
            n_win = sum(t * -(-(h // m) // vw) * -(-(w // m) // vw) for t, h, w in grid) + 1
            n_tok = n_patch // (m * m)
        new = crops[0].new_empty
        return (
            new((n_patch, 3 * tp * p * p), dtype=lut.dtype),
            new((len(crops), 3), dtype=torch.int64),
            new((n_seg + 1,), dtype=torch.int32),
            new((n_patch, 2), dtype=torch.int64),
            new((n_tap, 4), dtype=torch.int64),
            new((n_tap, 4), dtype=torch.float32),
            new((n_tok,), dtype=torch.int64),
            new((n_win,), dtype=torch.int32),
        )

    @torch.library.register_fake("paravt::pack_pixels_out")
    def _(crops, lut, patch_size, temporal_patch_size, merge_size, out, affine=None):
        return None


def native_has_cuda() -> bool:
    """True when ``paravt._C`` was built with its CUDA kernels (a CUDA torch at build time)."""
    if not native_available():
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("paravt::pack_vision", "CUDA")


@dataclass
class PackedVision:
    """Everything one batched varlen vision forward needs, for ``n`` crops and ``N`` patches.

    Attributes:
        pixel_values: ``(N, 3*tp*p*p)`` float32 (or the requested ``dtype``), patches in
            spatial-merge order, crop after crop.
        grid_thw: ``(n, 3)`` int64, ``(t, h, w)`` in patches per crop.
        cu_seqlens: ``(sum_i t_i + 1,)`` int32; one attention segment per temporal patch
            (``h_i*w_i`` patches each), exactly as the HF vision model builds it.
        max_seqlen: ``max_i h_i*w_i``, a Python int computed once (no per-layer host sync).
        position_ids: ``(N, 2)`` int64 rotary (row, col) of each patch.
        interp_indices: ``(N, 4)`` int64 taps into the flattened ``side x side`` learned
            position table (Qwen3-VL; bilinear, align_corners=True), or None.
            This is the layout transformers 5.19's vision_utils consumes; older releases
            (``fast_pos_embed_interpolate``) used the transposed ``(4, N)``: ``.T`` gives it.
        interp_weights: ``(N, 4)`` float32 bilinear weights of those taps, or None.
        window_index: ``(N / m^2,)`` int64 window-ordered merged-token ids (Qwen2.5-VL), or None.
        cu_window_seqlens: ``(num_windows + 1,)`` int32 window boundaries in patches, or None.
        max_window_seqlen: the largest window in patches, or None.
        merge_size: spatial merge size ``m`` (merged tokens per crop = ``t*h*w / m^2``).
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    interp_indices: torch.Tensor | None
    interp_weights: torch.Tensor | None
    window_index: torch.Tensor | None
    cu_window_seqlens: torch.Tensor | None
    max_window_seqlen: int | None
    merge_size: int
    grid: tuple[tuple[int, int, int], ...] = ()  # host copy of grid_thw, no device sync needed

    @property
    def num_crops(self) -> int:
        return len(self.grid)

    @property
    def patches_per_crop(self) -> list[int]:
        return [t * h * w for t, h, w in self.grid]

    @property
    def tokens_per_crop(self) -> list[int]:
        """Merged (LLM-side) visual tokens of each crop: ``t*h*w / m^2``."""
        mm = self.merge_size**2
        return [t * h * w // mm for t, h, w in self.grid]

    def model_kwargs(self) -> dict:
        """Keyword arguments that make the HF (>=5.16) Qwen-VL vision ``forward`` use these
        precomputed tensors instead of recomputing them (transformers.vision_utils pops them)."""
        kw: dict = {
            "cu_seqlens": self.cu_seqlens,
            "max_seqlen": self.max_seqlen,
            "position_ids": self.position_ids,
        }
        if self.interp_indices is not None:
            kw["interp_indices"] = self.interp_indices
            kw["interp_weights"] = self.interp_weights
        if self.window_index is not None:
            kw["window_index"] = self.window_index
            kw["cu_window_seqlens"] = self.cu_window_seqlens
            kw["max_window_seqlen"] = self.max_window_seqlen
        return kw

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedVision:
        """The same record on ``device`` (ints and the host grid stay on the host)."""

        def mv(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(device, non_blocking=non_blocking)

        return PackedVision(
            mv(self.pixel_values),
            mv(self.grid_thw),
            mv(self.cu_seqlens),
            self.max_seqlen,
            mv(self.position_ids),
            mv(self.interp_indices),
            mv(self.interp_weights),
            mv(self.window_index),
            mv(self.cu_window_seqlens),
            self.max_window_seqlen,
            self.merge_size,
            self.grid,
        )


def _folded_mean_std(
    mean: tuple[float, ...] | list[float],
    std: tuple[float, ...] | list[float],
    rescale_factor: float = 1.0 / 255.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's fused rescale+normalise constants: float32 ``mean / rescale`` and ``std / rescale``."""
    return (
        torch.tensor(list(mean)) * (1.0 / rescale_factor),
        torch.tensor(list(std)) * (1.0 / rescale_factor),
    )


def affine_params(
    mean: tuple[float, ...] | list[float],
    std: tuple[float, ...] | list[float],
    rescale_factor: float = 1.0 / 255.0,
) -> list[float]:
    """``[mean'_0..2, std'_0..2]`` (float32 values) of :func:`normalization_lut`'s arithmetic:
    the native CPU op's vectorised kernel computes ``(v - mean') / std'`` with them, which is
    the table's own formula, so both paths give the same bits."""
    m, s = _folded_mean_std(mean, std, rescale_factor)
    return [float(x) for x in torch.cat([m, s]).tolist()]


def normalization_lut(
    mean: tuple[float, ...] | list[float],
    std: tuple[float, ...] | list[float],
    rescale_factor: float = 1.0 / 255.0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``(3, 256)`` float32 table: ``lut[c, v]`` is the processor's output for uint8 value ``v``
    in channel ``c``.

    Mirrors HF's fused rescale+normalise op for op: ``mean' = float32(mean) * (1/rescale)``,
    ``std'`` likewise, ``(float32(v) - mean') / std'`` — so a gather from this table is
    bit-identical to the processor (and cheaper than any arithmetic).
    """
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"normalization_lut: mean {mean} and std {std} need 3 channels each")
    if any(s == 0 for s in std):
        raise ValueError(f"normalization_lut: std {std} has a zero; use the model's image_std")
    m, s = _folded_mean_std(mean, std, rescale_factor)
    levels = torch.arange(256, dtype=torch.float32)
    return ((levels[None, :] - m[:, None]) / s[:, None]).contiguous().to(device)


def _check_crops(crops: list[torch.Tensor], factor: int) -> None:
    if not crops:
        raise ValueError("pack_vision: got an empty list of crops; pass at least one crop")
    for i, c in enumerate(crops):
        if c.dtype != torch.uint8 or c.dim() != 4 or c.shape[-1] != 3:
            raise ValueError(
                f"pack_vision: crop {i} is {tuple(c.shape)} {c.dtype}; expected uint8 "
                "(T, H, W, 3) channels-last RGB frames"
            )
        T, H, W, _ = c.shape
        if T == 0:
            raise ValueError(f"pack_vision: crop {i} has no frames; drop it or decode one")
        if H % factor or W % factor:
            raise ValueError(
                f"pack_vision: crop {i} has frame size {H}x{W}, not a multiple of patch*merge="
                f"{factor}; resize it with paravt.vision.resize.smart_resize first"
            )


def vision_metadata_reference(
    grid: list[tuple[int, int, int]] | torch.Tensor,
    *,
    merge_size: int,
    num_grid_per_side: int = 0,
    window_size: int = 0,
    patch_size: int = 16,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, ...]:
    """Pure-torch metadata for grids ``(t, h, w)``: the oracle of ``torch.ops.paravt.vision_metadata``.

    Returns ``(cu_seqlens, position_ids, interp_indices, interp_weights, window_index,
    cu_window_seqlens)`` with the shapes of :class:`PackedVision` (empty tensors for the parts
    switched off by ``num_grid_per_side=0`` / ``window_size=0``).

    Maths, per patch ``j`` of a crop, ``f = j mod h*w``:
    ``row = (f // (m*m*(w/m)))*m + (f//m) mod m``, ``col = ((f // m^2) mod (w/m))*m + f mod m``;
    bilinear align_corners taps ``src = row*(side-1)/max(h-1, 1)``, ``w0 = 1-(src-floor(src))``,
    ``w1 = 1-|src-floor(src)-1|`` per axis, outer product over (h, w).
    Windows (Qwen2.5-VL): merged tokens sorted by ``(t, y//vw, x//vw, y mod vw, x mod vw)``.
    """
    if isinstance(grid, torch.Tensor):
        grid = [tuple(int(v) for v in row) for row in grid.tolist()]
    m = merge_size
    g = torch.tensor(grid, dtype=torch.int64, device=device).view(-1, 3)
    t, h, w = g[:, 0], g[:, 1], g[:, 2]
    seg = torch.repeat_interleave(h * w, t)
    cu_seqlens = torch.nn.functional.pad(seg.cumsum(0, dtype=torch.int32), (1, 0))
    counts = t * h * w
    total = int(counts.sum())
    starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    hh = torch.repeat_interleave(h, counts)
    ww = torch.repeat_interleave(w, counts)
    f = (torch.arange(total, device=device) - starts) % (hh * ww)
    bw = ww // m
    row = (f // (m * m * bw)) * m + (f // m) % m
    col = ((f // (m * m)) % bw) * m + f % m
    position_ids = torch.stack([row, col], dim=-1)

    if num_grid_per_side > 0:
        side = num_grid_per_side

        def taps(idx: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            src = idx.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
            fl = torch.floor(src)
            frac = src - fl
            tap = (fl.long()[:, None] + torch.arange(2, device=device)).clamp(0, side - 1)
            wt = (1 - (frac[:, None] - torch.arange(2, device=device)).abs()).clamp(min=0)
            return tap, wt

        th, wh = taps(row, hh)
        tw, wwt = taps(col, ww)
        interp_indices = (th[:, :, None] * side + tw[:, None, :]).reshape(-1, 4)
        interp_weights = (wh[:, :, None] * wwt[:, None, :]).reshape(-1, 4)
    else:
        interp_indices = torch.empty(0, 4, dtype=torch.int64, device=device)
        interp_weights = torch.empty(0, 4, dtype=torch.float32, device=device)

    if window_size > 0:
        vw = window_size // m // patch_size
        if vw <= 0:
            raise ValueError(
                f"pack_vision: window_size {window_size} < merge_size*patch_size {m * patch_size}"
            )
        idx_parts, len_parts, offset = [], [], 0
        for ti, hi, wi in grid:
            lh, lw = hi // m, wi // m
            tt, yy, xx = torch.meshgrid(
                torch.arange(ti, device=device),
                torch.arange(lh, device=device),
                torch.arange(lw, device=device),
                indexing="ij",
            )
            nwh, nww = -(-lh // vw), -(-lw // vw)
            win = (tt * nwh + yy // vw) * nww + xx // vw
            key = win * vw * vw + (yy % vw) * vw + xx % vw
            idx_parts.append(torch.argsort(key.flatten()) + offset)
            len_parts.append(torch.bincount(win.flatten(), minlength=ti * nwh * nww))
            offset += ti * lh * lw
        window_index = torch.cat(idx_parts)
        lens = torch.cat(len_parts) * (m * m)
        cu_window_seqlens = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    else:
        window_index = torch.empty(0, dtype=torch.int64, device=device)
        cu_window_seqlens = torch.empty(0, dtype=torch.int32, device=device)
    return (
        cu_seqlens,
        position_ids,
        interp_indices,
        interp_weights,
        window_index,
        cu_window_seqlens,
    )


def pack_pixels_reference(
    crops: list[torch.Tensor],
    lut: torch.Tensor,
    patch_size: int,
    temporal_patch_size: int,
    merge_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch ``(pixel_values (N, 3*tp*p*p), grid_thw (n, 3))``: LUT gather, pad odd T by
    repeating the last frame, then HF's patchify permute (t, bh, bw, mh, mw, c, tp, p, p)."""
    p, tp, m = patch_size, temporal_patch_size, merge_size
    out, grids = [], []
    for c in crops:
        T, H, W, _ = c.shape
        x = c.permute(0, 3, 1, 2).long()  # (T, 3, H, W)
        x = lut[torch.arange(3, device=c.device)[None, :, None, None], x]
        if pad := -T % tp:
            x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
        gt, gh, gw = x.shape[0] // tp, H // p, W // p
        x = x.view(gt, tp, 3, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        out.append(x.reshape(gt * gh * gw, 3 * tp * p * p))
        grids.append((gt, gh, gw))
    grid_thw = torch.tensor(grids, dtype=torch.int64, device=crops[0].device)
    return torch.cat(out), grid_thw


def pack_vision_reference(
    crops: list[torch.Tensor],
    lut: torch.Tensor,
    patch_size: int,
    temporal_patch_size: int,
    merge_size: int,
    num_grid_per_side: int,
    window_size: int,
) -> tuple[torch.Tensor, ...]:
    """Pure-torch twin of ``torch.ops.paravt.pack_vision`` (same arguments, same 8 outputs)."""
    pixels, grid_thw = pack_pixels_reference(
        crops, lut, patch_size, temporal_patch_size, merge_size
    )
    meta = vision_metadata_reference(
        grid_thw.tolist(),
        merge_size=merge_size,
        num_grid_per_side=num_grid_per_side,
        window_size=window_size,
        patch_size=patch_size,
        device=crops[0].device,
    )
    return (pixels, grid_thw, *meta)


def _use_native(device: torch.device, impl: Impl) -> bool:
    return resolve_native(
        "pack_vision",
        device,
        impl,
        built=native_available,
        has_kernels=lambda _: native_has_cuda(),
        why_not_built=lambda: _NATIVE_ERROR,
    )


def pack_vision(
    crops: list[torch.Tensor],
    *,
    patch_size: int = 16,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
    std: tuple[float, float, float] = (0.5, 0.5, 0.5),
    model: ModelType = "qwen3_vl",
    num_position_embeddings: int = 2304,
    window_size: int = 112,
    lut: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    impl: Impl = "auto",
) -> PackedVision:
    """Pack ``n`` crops into one varlen vision-encoder input.

    Args:
        crops: list of uint8 ``(T_i, H_i, W_i, 3)`` tensors on one device, ``H_i, W_i``
            multiples of ``patch_size*merge_size`` (odd ``T_i`` is padded by repeating the last
            frame, as the processor does). A single image is a crop with ``T_i = 1``.
        patch_size, temporal_patch_size, merge_size, mean, std: the processor's values.
        model: ``"qwen3_vl"`` (position-embedding interpolation taps from
            ``num_position_embeddings``) or ``"qwen2_5_vl"`` (window index from ``window_size``).
        lut: a precomputed :func:`normalization_lut` (saves rebuilding it per call).
        out: optional reusable contiguous float32 buffer with at least ``N*3*tp*p*p``
            elements on the crops' device; ``pixel_values`` is then a view of its head. A
            steady pipeline packs into one (pinned) staging buffer and never page-faults.
        dtype: ``pixel_values`` dtype: float32 (bit-identical to the HF processor), or
            bfloat16 / float16 — exactly the float32 result rounded, i.e. what the model's
            patch embedding casts to anyway, at half the bytes written and copied.
        impl: ``"auto"`` (native when built, else torch, loudly), ``"native"`` (raise if not
            built), ``"torch"`` (the reference).
    Returns:
        A :class:`PackedVision`; ``N = sum_i ceil(T_i/tp) * (H_i/p) * (W_i/p)`` patches.
    """
    _check_crops(crops, patch_size * merge_size)
    device = crops[0].device
    if model == "qwen3_vl":
        side = int(round(num_position_embeddings**0.5))
        if side * side != num_position_embeddings:
            raise ValueError(
                f"pack_vision: num_position_embeddings {num_position_embeddings} is not a perfect "
                "square; pass the model's vision_config.num_position_embeddings"
            )
        win = 0
    elif model == "qwen2_5_vl":
        side, win = 0, window_size
    else:
        raise ValueError(f"pack_vision: model={model!r}; expected 'qwen3_vl' or 'qwen2_5_vl'")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"pack_vision: dtype {dtype}; expected float32, bfloat16 or float16")
    # A table built here from mean/std also has an affine form: the CPU op's vectorised kernel
    # (same bits). A caller's own lut is only ever gathered from.
    affine = affine_params(mean, std) if lut is None and device.type == "cpu" else None
    if lut is None:
        lut = normalization_lut(mean, std, device=device)
    lut = lut.to(device=device, dtype=dtype)  # RNE rounding: same as casting the fp32 result
    grid = tuple(
        (
            -(-int(c.shape[0]) // temporal_patch_size),
            int(c.shape[1]) // patch_size,
            int(c.shape[2]) // patch_size,
        )
        for c in crops
    )
    args = (list(crops), lut, patch_size, temporal_patch_size, merge_size, side, win)
    native = _use_native(device, impl)
    if out is None:
        result = (
            torch.ops.paravt.pack_vision(*args, affine=affine)
            if native
            else pack_vision_reference(*args)
        )
    else:
        n_patch, dim = sum(t * h * w for t, h, w in grid), 3 * temporal_patch_size * patch_size**2
        if out.dtype != dtype or not out.is_contiguous() or out.device != device:
            raise ValueError(
                f"pack_vision: out must be a contiguous {dtype} buffer on {device}, got "
                f"{out.dtype} contiguous={out.is_contiguous()} on {out.device}"
            )
        if out.numel() < n_patch * dim:
            raise ValueError(
                f"pack_vision: out holds {out.numel()} floats but this batch needs "
                f"{n_patch} x {dim} = {n_patch * dim}; allocate a larger buffer"
            )
        pixels = out.view(-1)[: n_patch * dim].view(n_patch, dim)
        if native and device.type == "cpu":
            torch.ops.paravt.pack_pixels_out(*args[:5], pixels, affine=affine)
            grid_thw = torch.tensor(grid, dtype=torch.int64).view(-1, 3)
            meta = torch.ops.paravt.vision_metadata(grid_thw, merge_size, side, win, patch_size)
        else:
            ref = (
                pack_vision_reference(*args) if not native else torch.ops.paravt.pack_vision(*args)
            )
            pixels.copy_(ref[0])
            grid_thw, meta = ref[1], ref[2:]
        result = (pixels, grid_thw, *meta)
    return _assemble(result, grid, merge_size=merge_size, patch_size=patch_size, side=side, win=win)


def _assemble(
    result: tuple[torch.Tensor, ...],
    grid: tuple[tuple[int, int, int], ...],
    *,
    merge_size: int,
    patch_size: int,
    side: int,
    win: int,
) -> PackedVision:
    """A :class:`PackedVision` from the op's 8 outputs ``(pixels, grid_thw, cu_seqlens,
    position_ids, interp_indices, interp_weights, window_index, cu_window_seqlens)``; the
    Python ints (``max_seqlen``, ``max_window_seqlen``) come from the host grid, no sync."""
    pixels, grid_thw, cu, pos, idx, wt, widx, cuw = result
    max_win = None
    if win:
        vw = win // merge_size // patch_size
        max_win = max(min(vw, h // merge_size) * min(vw, w // merge_size) for _, h, w in grid)
        max_win *= merge_size**2
    return PackedVision(
        pixel_values=pixels,
        grid_thw=grid_thw,
        cu_seqlens=cu,
        max_seqlen=max(h * w for _, h, w in grid),
        position_ids=pos,
        interp_indices=idx if side else None,
        interp_weights=wt if side else None,
        window_index=widx if win else None,
        cu_window_seqlens=cuw if win else None,
        max_window_seqlen=max_win,
        merge_size=merge_size,
        grid=grid,
    )


def packed_from_grid(
    pixel_values: torch.Tensor,
    grid_thw: torch.Tensor,
    *,
    merge_size: int,
    num_position_embeddings: int,
) -> PackedVision:
    """A Qwen3-VL :class:`PackedVision` for pixel values patchified elsewhere (e.g. by the HF
    processor): the metadata comes from one native ``vision_metadata`` call on the host grid."""
    grid = tuple(tuple(int(v) for v in row) for row in grid_thw.tolist())
    side = int(round(num_position_embeddings**0.5))
    meta = vision_metadata(
        torch.tensor(grid, dtype=torch.int64).view(-1, 3),
        merge_size=merge_size,
        num_grid_per_side=side,
    )
    return _assemble(
        (pixel_values, grid_thw, *meta), grid, merge_size=merge_size, patch_size=0, side=side, win=0
    )


def pack_pixels(
    crops: list[torch.Tensor],
    spec: VisionSpec,
    *,
    dtype: torch.dtype = torch.float32,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, tuple[tuple[int, int, int], ...]]:
    """Pixels only: ``(pixel_values (N, 3*tp*p*p), host grid)`` of ``crops`` in ONE call.

    For preprocessing, where the vision encoder builds its own metadata later (the model's
    ``get_image_features``, or :func:`paravt.vision.encoder.use_packed_vision`): the native
    op without position taps or windows, so the output comes from its buffer pool; the torch
    reference otherwise. Bit-identical to :func:`paravt.vision.patchify.patchify_frames`
    per crop (both replay HF's float32 ops).
    """
    p, tp, m = spec.patch_size, spec.temporal_patch_size, spec.merge_size
    _check_crops(crops, p * m)
    device = crops[0].device
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"pack_pixels: dtype {dtype}; expected float32, bfloat16 or float16")
    lut = normalization_lut(spec.mean, spec.std, device=device).to(dtype)
    grid = tuple(
        (-(-int(c.shape[0]) // tp), int(c.shape[1]) // p, int(c.shape[2]) // p) for c in crops
    )
    native = _use_native(device, impl)
    if native:
        # The full op without position taps / windows (side = window = 0): its output comes
        # from the op's buffer pool; the remaining metadata (cu_seqlens, rotary ids) is ~0.3%
        # of the pixel bytes.
        affine = affine_params(spec.mean, spec.std) if device.type == "cpu" else None
        pixels = torch.ops.paravt.pack_vision(list(crops), lut, p, tp, m, 0, 0, affine=affine)[0]
    else:
        pixels = pack_pixels_reference(list(crops), lut, p, tp, m)[0]
    return pixels, grid


def pack_vision_spec(
    crops: list[torch.Tensor],
    spec: VisionSpec,
    *,
    num_position_embeddings: int = 2304,
    window_size: int = 112,
    impl: Impl = "auto",
) -> PackedVision:
    """:func:`pack_vision` with the geometry and normalisation of a :class:`VisionSpec`."""
    return pack_vision(
        crops,
        patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size,
        merge_size=spec.merge_size,
        mean=spec.mean,
        std=spec.std,
        model=spec.model_type,  # type: ignore[arg-type]
        num_position_embeddings=num_position_embeddings,
        window_size=window_size,
        impl=impl,
    )


def vision_metadata(
    grid: list[tuple[int, int, int]] | torch.Tensor,
    *,
    merge_size: int,
    num_grid_per_side: int = 0,
    window_size: int = 0,
    patch_size: int = 16,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, ...]:
    """Metadata only (for pixel values made elsewhere); see :func:`vision_metadata_reference`."""
    g = (
        grid
        if isinstance(grid, torch.Tensor)
        else torch.tensor(grid, dtype=torch.int64).view(-1, 3)
    )
    if _use_native(torch.device("cpu"), impl):
        return tuple(
            torch.ops.paravt.vision_metadata(
                g.cpu(), merge_size, num_grid_per_side, window_size, patch_size
            )
        )
    return vision_metadata_reference(
        g.cpu(),
        merge_size=merge_size,
        num_grid_per_side=num_grid_per_side,
        window_size=window_size,
        patch_size=patch_size,
    )
