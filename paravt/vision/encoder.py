"""ONE varlen vision-encoder forward over every crop of a batch (main-agent overviews and
sub-agent crops alike), fed by :func:`paravt.vision.pack.pack_vision`.

HF's ``Qwen3VLVisionModel.forward`` recomputes rotary ids, position-embedding taps and
``cu_seqlens`` from ``grid_thw`` with host syncs, and without flash-attn its attention splits
the packed sequence with ``.tolist()`` and runs one SDPA call per segment in every layer
(hundreds of calls per layer for a tool turn's crops). :func:`encode_packed` is a small override of that
forward: it reuses the model's own modules and weights (patch embed, learned position table,
rotary embedding, blocks' norms/qkv/proj/MLP, mergers, deepstack mergers), takes the
metadata precomputed once by ``pack_vision``, and replaces only the attention call:

* ``flash``: ``flash_attn_varlen_func`` over ``cu_seqlens`` with the precomputed
  ``max_seqlen`` (CUDA, fp16/bf16, flash-attn installed).
* ``sdpa``: block-diagonal attention without materialising the ``N x N`` mask: segments of
  equal length are gathered into one ``(G, heads, L, d)`` batch and attended with one SDPA
  call per distinct length (a batch of crops resized to a pixel budget has few). The gather
  plan is built once per batch on the host from the grid (no device sync) and shared by all
  layers. Exact, since attention never crosses a segment.
* ``auto``: ``flash`` when available for the inputs, else ``sdpa``.

:func:`use_packed_vision` installs this path in a whole HF Qwen3-VL model (its
``get_image_features``, which ``get_video_features`` calls), so ``forward``/``generate`` of the
rollout and training code encode all visual segments of a batch in one packed forward.

Limits: Qwen3-VL only (Qwen2.5-VL's window attention is packed by ``pack_vision`` but not run
here). Gradient checkpointing follows HF's per-block flag (``gradient_checkpointing_enable``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from paravt.vision.pack import PackedVision, packed_from_grid

AttnImpl = Literal["auto", "flash", "sdpa"]


def _flash_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@dataclass
class VarlenPlan:
    """How to run block-diagonal attention over the packed sequence with dense SDPA calls.

    ``groups[k] = (L, index)``: ``index`` ``(G*L,)`` int64 lists the rows of the ``G`` segments
    of length ``L``, segment after segment, so ``x[index].view(G, L, ...)`` is a dense batch.
    """

    groups: list[tuple[int, torch.Tensor]]
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @staticmethod
    def build(packed: PackedVision, device: torch.device) -> VarlenPlan:
        """From the host grid: segments are the temporal patches, ``h*w`` rows each."""
        starts_by_len: dict[int, list[int]] = {}
        offset = 0
        for t, h, w in packed.grid:
            for _ in range(t):
                starts_by_len.setdefault(h * w, []).append(offset)
                offset += h * w
        groups = []
        for length, starts in sorted(starts_by_len.items()):
            s = torch.tensor(starts, dtype=torch.int64)
            index = (s[:, None] + torch.arange(length)).reshape(-1)
            groups.append((length, index.to(device, non_blocking=True)))
        return VarlenPlan(groups, packed.cu_seqlens.to(device), packed.max_seqlen)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: VarlenPlan,
    scale: float,
    impl: AttnImpl = "auto",
) -> torch.Tensor:
    """Attention restricted to the segments of ``plan`` (non-causal).

    Args:
        q, k, v: ``(N, heads, d)`` packed rows.
    Returns:
        ``(N, heads, d)``: ``softmax(q_i k_j^T * scale) v_j`` over ``j`` in ``i``'s segment.
    """
    flash = _flash_varlen() if impl in ("auto", "flash") else None
    usable = flash is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    if impl == "flash" and not usable:
        raise RuntimeError(
            f"encode_packed: attn_impl='flash' needs flash-attn and fp16/bf16 CUDA tensors "
            f"(got {q.dtype} on {q.device}, flash-attn "
            f"{'installed' if flash is not None else 'not installed'}); use 'sdpa' or 'auto'"
        )
    if usable:
        cu = plan.cu_seqlens
        return flash(q, k, v, cu, cu, plan.max_seqlen, plan.max_seqlen, softmax_scale=scale)
    out = torch.empty_like(q)
    heads, d = q.shape[1], q.shape[2]
    for length, index in plan.groups:
        # (G*L, heads, d) -> (G, heads, L, d): one dense SDPA call per distinct segment length.
        def gather(
            x: torch.Tensor, index: torch.Tensor = index, length: int = length
        ) -> torch.Tensor:
            return x.index_select(0, index).view(-1, length, heads, d).transpose(1, 2)

        o = F.scaled_dot_product_attention(gather(q), gather(k), gather(v), scale=scale)
        out.index_copy_(0, index, o.transpose(1, 2).reshape(-1, heads, d))
    return out


@dataclass
class PackedVisionFeatures:
    """Outputs of :func:`encode_packed` for ``n`` crops.

    Attributes:
        embeds: ``(sum_i tokens_i, out_hidden)`` merged visual tokens, crop after crop
            (HF's ``pooler_output``; the LLM's visual-placeholder embeddings).
        deepstack: one ``(sum_i tokens_i, out_hidden)`` tensor per deepstack layer.
        last_hidden_state: ``(N, hidden)`` per-patch states before the merger.
        tokens_per_crop: ``t*h*w / m^2`` per crop, to split ``embeds``.
    """

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]
    last_hidden_state: torch.Tensor
    tokens_per_crop: list[int]

    def split(self) -> list[torch.Tensor]:
        """Per-crop ``(tokens_i, out_hidden)`` views of ``embeds``."""
        return list(torch.split(self.embeds, self.tokens_per_crop))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class _PackedState:
    """What every block of one packed forward shares (built once per batch)."""

    cos: torch.Tensor
    sin: torch.Tensor
    plan: VarlenPlan
    attn_impl: AttnImpl


def _packed_block(blk: torch.nn.Module, x: torch.Tensor, st: _PackedState) -> torch.Tensor:
    """One Qwen3-VL vision block over the packed rows: HF's maths, varlen attention."""
    attn, n = blk.attn, x.shape[0]
    q, k, v = attn.qkv(blk.norm1(x)).reshape(n, 3, attn.num_heads, -1).unbind(1)
    # HF applies the rotary in fp32 and casts back (apply_rotary_pos_emb_vision).
    qf, kf = q.float(), k.float()
    q = (qf * st.cos + _rotate_half(qf) * st.sin).to(q.dtype)
    k = (kf * st.cos + _rotate_half(kf) * st.sin).to(k.dtype)
    o = varlen_attention(q, k, v, st.plan, attn.scaling, st.attn_impl)
    x = x + attn.proj(o.reshape(n, -1))
    return x + blk.mlp(blk.norm2(x))


def _dispatch_block_forward(
    self: torch.nn.Module, *args, packed_state: _PackedState | None = None, **kwargs
):
    """Instance ``forward`` of a vision block: the packed path when given a packed state, HF's
    own forward otherwise (so the block still works for every HF caller)."""
    if packed_state is None:
        return type(self).forward(self, *args, **kwargs)
    return _packed_block(self, args[0], packed_state)


def _bind(func, obj: torch.nn.Module) -> functools.partial:
    """``func`` bound to ``obj`` as an instance attribute that survives ``copy.deepcopy`` (the
    copy is bound to the copied module) and pickling (a bound method would not unpickle: its
    name is not an attribute of the HF class)."""
    return functools.partial(func, obj)


def _installed(attr: object, func) -> bool:
    return isinstance(attr, functools.partial) and attr.func is func


def _install_packed_block_forward(blk: torch.nn.Module) -> None:
    if not _installed(vars(blk).get("forward"), _dispatch_block_forward):
        blk.forward = _bind(_dispatch_block_forward, blk)


def encode_packed(
    visual: torch.nn.Module,
    packed: PackedVision,
    *,
    attn_impl: AttnImpl = "auto",
) -> PackedVisionFeatures:
    """Run a HF ``Qwen3VLVisionModel`` (``model.visual`` / ``model.model.visual``) once over
    all crops of ``packed``.

    Same maths as ``visual(packed.pixel_values, grid_thw=packed.grid_thw)``, per block:
    ``x += proj(attn(rope(qkv(norm1(x)))))``, ``x += mlp(norm2(x))``, attention confined to
    each temporal patch of each crop. Differences from HF: the position table is read with
    one ``embedding_bag`` (weighted sum of the 4 bilinear taps) instead of ``embedding`` then
    a sum (same values up to fp32 summation order), and attention is :func:`varlen_attention`.
    """
    if packed.interp_indices is None:
        raise ValueError(
            "encode_packed: packed has no position-embedding taps; pack with model='qwen3_vl'"
        )
    side = getattr(visual, "num_grid_per_side", None)
    if side is None or not hasattr(visual, "deepstack_merger_list"):
        raise TypeError(
            f"encode_packed: expected a Qwen3-VL vision tower (Qwen3VLVisionModel), got "
            f"{type(visual).__name__}"
        )
    weight = visual.patch_embed.proj.weight
    device, dtype = weight.device, weight.dtype
    packed = packed.to(device)

    x = visual.patch_embed(packed.pixel_values.to(dtype))  # (N, hidden)
    pos = F.embedding_bag(
        packed.interp_indices,
        visual.pos_embed.weight,
        per_sample_weights=packed.interp_weights.to(visual.pos_embed.weight.dtype),
        mode="sum",
    )
    x = x + pos.to(x.dtype)
    cos, sin = visual.rotary_pos_emb(x, packed.position_ids)  # (N, head_dim) each, fp32
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    plan = VarlenPlan.build(packed, device)

    deepstack = []
    layers = list(visual.deepstack_visual_indexes)
    state = _PackedState(cos, sin, plan, attn_impl)
    for i, blk in enumerate(visual.blocks):
        # Through the block's own __call__, so module hooks run (FSDP2 unshards the block's
        # parameters there) and HF's per-block gradient checkpointing applies.
        _install_packed_block_forward(blk)
        x = blk(x, packed_state=state)
        if i in layers:
            deepstack.append(visual.deepstack_merger_list[layers.index(i)](x))
    embeds = visual.merger(x)
    return PackedVisionFeatures(embeds, deepstack, x, packed.tokens_per_crop)


def use_packed_vision(model: torch.nn.Module, attn_impl: AttnImpl = "auto") -> torch.nn.Module:
    """Route a HF Qwen3-VL model's image AND video features through :func:`encode_packed`.

    ``model`` is a ``Qwen3VLForConditionalGeneration`` or ``Qwen3VLModel``. Replaces the
    instance's ``get_image_features`` (``get_video_features`` delegates to it), so every
    forward / generate encodes all visual segments of the batch in ONE packed forward with
    native metadata, and returns what HF returns (per-segment ``pooler_output`` and
    ``deepstack_features`` tuples). Returns ``model``; the class is untouched.
    """
    inner = getattr(model, "model", model)
    if not hasattr(inner, "visual") or not hasattr(inner, "get_image_features"):
        raise TypeError(
            f"use_packed_vision: {type(model).__name__} has no Qwen3-VL vision tower "
            "(.visual / .get_image_features); pass a Qwen3VLForConditionalGeneration"
        )
    inner._paravt_attn_impl = attn_impl
    inner.get_image_features = _bind(_packed_get_image_features, inner)
    return model


def _packed_get_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
    """``Qwen3VLModel.get_image_features`` through :func:`encode_packed` (installed on the
    instance by :func:`use_packed_vision`); returns what HF returns."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    visual = self.visual
    packed = packed_from_grid(
        pixel_values,
        image_grid_thw,
        merge_size=visual.spatial_merge_size,
        num_position_embeddings=visual.config.num_position_embeddings,
    )
    feats = encode_packed(visual, packed, attn_impl=self._paravt_attn_impl)
    return BaseModelOutputWithDeepstackFeatures(
        last_hidden_state=feats.last_hidden_state,
        pooler_output=torch.split(feats.embeds, feats.tokens_per_crop),
        deepstack_features=[torch.split(d, feats.tokens_per_crop) for d in feats.deepstack],
    )
