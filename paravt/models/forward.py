"""The model-forward layer: one backbone forward over several sequences packed into one row.

The trainer's log-prob passes (``paravt.algo.logprobs``), its policy loss
(``paravt.algo.loss.policy_part_loss``) and cold-start SFT (``paravt.sft.sft_loss``) put
several sequences of a ``PackedBatch`` into ONE backbone forward over the row
``(1, sum L_i)`` (``packed_hidden``) and read the last hidden states ``(sum L_i, d)``. What
is here is what makes that forward equal to running each sequence alone:

* attention (``packed_attention_kwargs``): SDPA runs ``varlen_sdpa_attention`` (one causal
  SDPA per sequence, boundaries ``cu_seq_lens_q``; the language model is switched to it for
  good by ``_varlen_language_model``, so gradient checkpointing recomputes the same path);
  flash_attention_2/3 runs ``varlen_flash_attention`` (switched the same way): ONE
  ``flash_attn_varlen_func`` call per layer with ``cu_seqlens_q/k`` from
  ``prefix_varlen_kwargs``; eager (debugging) gets an additive 4-D block-diagonal mask.
  Neither SDPA nor flash holds anything ``N x N``: attention costs ``sum L_i^2``. The flash
  path runs on CPU only with ``flash_varlen_reference`` as its kernel (tests); flash-attn
  itself is not in the GPU image (``tests/test_shared_prefix_cuda.py`` checks the call's
  contract against torch's own FlashAttention-2 varlen kernel there).
* positions (``_packed_inputs``): Qwen3-VL's mrope ids from ``get_rope_index`` on each
  sequence ALONE (cheap, host side), concatenated along the token axis. transformers reads a
  4-row position tensor as ``text_position_ids`` + 3 mrope rows (the rotary embedding uses the
  mrope rows only); row 0 is each sequence's text position ``0..L_i-1``. The SDPA path passes
  the 3 mrope rows only, so that ``create_causal_mask`` sees no packed sequences and builds no
  mask.
* visuals (``_packed_inputs``): the sequences' pixels and grids concatenated in sequence order
  and encoded in ONE vision-tower call (its attention is per frame: ``cu_seqlens`` from
  ``grid_thw``; the ``use_packed_vision`` override is per segment too), passed as
  ``mm_encoder_outputs``; the backbone scatters the features, and the deepstack features,
  into the placeholders in order, which is sequence order. Computing them outside the
  backbone call also keeps the ``cu_seq_lens`` kwargs away from the vision tower (its
  attention passes its own).

Verified on transformers 5.19 / Qwen3-VL, fp32 CPU (tests/test_algo_packed_forward.py, real
scripted batches: main rows with video, sub-agent rows with crop clips, a text-only row):
packed hidden states equal per-sequence ones to <= 1e-6; log-probs, entropy (also with
``top_p < 1``) and parameter gradients (also under gradient checkpointing) equal the
per-sequence path's; the same packed row WITHOUT the separation (plain causal) is off by O(1)
after the first sequence. Pinned too, not relied on: transformers' own packed-sequence
detection (``attention_mask=None`` with the restarting text row) builds a correct
block-diagonal mask for Qwen3-VL. Qwen2.5-VL has the same ``get_rope_index`` /
``mm_encoder_outputs`` API but is not tested packed.

Shared prompts (``algo.share_prefix``; ``paravt.models.prefix``): when a forward holds several
rows of one prompt group, ``packed_forward`` lays the group out as ``[prompt; suffix_1; ...]``
(the prompt's tokens and visual segments once); each suffix sees the prompt fully and itself
causally, through a lower-right causal mask: under sdpa one SDPA per block
(``_prefix_block_attention``), under flash_attention_2/3 one varlen call whose keys per block
are ``[prompt; suffix]`` (``varlen_flash_attention``). eager runs the unshared layout and
warns once (``warn_if_sharing_off``, also from ``paravt.validate``). Callers read rows through
``SharedLayout.row_of`` (``packed_hidden_rows``), so every value and gradient is the unshared
forward's (tests/test_shared_prefix.py).

Under FSDP2 every such forward is a forward of the root unit (``as_root_forward``): the
root's parameters (embeddings, lm_head, final norm) are gathered and their gradients reduced
as in a normal forward, so a caller that applies the lm_head to the hidden rows does it
inside the same root forward.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from paravt.log import get_logger
from paravt.models.prefix import SharedLayout, prefix_groups, shared_layout, split_visuals
from paravt.types import PackedBatch, VisualInputs
from paravt.vision.preprocess import check_visual_tokens

log = get_logger(__name__)


def backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(model.model, model.get_output_embeddings())``: the backbone (vision tower, merger,
    language model, final norm) whose last hidden states every log-prob pass reads, and the
    lm_head whose weight takes the gathered rows (its forward never runs)."""
    backbone = getattr(model, "model", None)
    head = model.get_output_embeddings()
    if backbone is None or head is None:
        raise TypeError(
            f"{type(model).__name__} has no .model backbone / output embeddings: "
            "the log-prob passes need an HF *ForConditionalGeneration (Qwen3-VL, Qwen2.5-VL)"
        )
    return backbone, head


def as_root_forward(model: torch.nn.Module, fn: Callable, *args: Any) -> Any:
    """``fn(model, *args)``; for an FSDP2-sharded model, as a forward of its root unit.

    Calling ``model.model`` directly would skip the root's pre/post-forward hooks: its
    parameters (embeddings, lm_head, final norm) would stay sharded and their gradients would
    not be reduced. ``register_fsdp_forward_method`` wraps a method in exactly those hooks;
    each ``fn`` is registered once, under its own name (``_paravt_<fn name>``).

    A no-grad root forward (the proximal and reference passes) is followed by
    ``model.reshard()``: FSDP2 keeps the ROOT unit's parameters unsharded after its forward
    (``reshard_after_forward`` is off for the root), and the next forward WITH grad then reuses
    those no-grad tensors, so the root's gradients (embeddings, lm_head, final norm) are not
    reduced across ranks as they should be. Measured on torch 2.13 / gloo, two ranks: the
    step's gradient norm 0.163 against 0.344 recomputed in one process
    (tests/test_train_distributed.py, whose proximal pass runs on the sharded policy).
    """
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(model, FSDPModule):
        return fn(model, *args)
    method = f"_paravt{fn.__name__}" if fn.__name__.startswith("_") else f"_paravt_{fn.__name__}"
    if method not in model.__dict__:
        model.__dict__[method] = types.MethodType(fn, model)
        register_fsdp_forward_method(model, method)
    out = getattr(model, method)(*args)
    if not torch.is_grad_enabled():
        model.reshard()
    return out


# --------------------------------------------------------------- packed multi-sequence forwards


def packed_attention_kwargs(
    lengths: Sequence[int], attn_impl: str, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """The ONE argument that keeps sequences of a packed row ``(1, sum L_i)`` apart.

    * ``flash_attention_2``/``_3`` (CUDA) and ``sdpa``: no mask; ``cu_seq_lens_q/k`` +
      ``max_length_q/k`` go through the language model's ``**kwargs`` to its attention
      function. flash-attn: transformers' integration calls ``flash_attn_varlen_func`` over
      those boundaries (``packed_forward`` itself gives a switched flash model
      ``prefix_varlen_kwargs`` instead). SDPA: the language model runs ``VARLEN_SDPA``
      (``_varlen_language_model``; ``varlen_sdpa_attention``: one causal SDPA per sequence).
      Neither holds anything ``N x N``, and attention costs ``sum L_i^2``, not ``N^2``.
    * ``eager`` (debugging): a 4-D additive block-diagonal causal mask ``(1, 1, N, N)``
      (0 / dtype min), as eager attention adds it; ``create_causal_mask`` returns a 4-D mask
      as is.

    Everything else of the packed forward (token ids, visual features, mrope position ids)
    is the same for every implementation.
    """
    n = int(sum(lengths))
    if attn_impl.startswith("flash_attention") or attn_impl in ("sdpa", VARLEN_SDPA):
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.as_tensor(list(lengths), dtype=torch.int32), 0)
        if attn_impl.startswith("flash_attention"):  # the kernel reads them on the device;
            cu = cu.to(device)  # varlen SDPA slices on the host (no sync per layer)
        longest = int(max(lengths))
        return {
            "attention_mask": None, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": longest, "max_length_k": longest,
        }  # fmt: skip
    if attn_impl != "eager":
        raise NotImplementedError(
            f"packed forward: attn_implementation '{attn_impl}' (sdpa, eager and "
            "flash_attention_2/3 are supported)"
        )
    seq_id = torch.repeat_interleave(
        torch.arange(len(lengths), device=device),
        torch.as_tensor(list(lengths), device=device),
    )
    idx = torch.arange(n, device=device)
    allowed = (seq_id[:, None] == seq_id[None, :]) & (idx[None, :] <= idx[:, None])
    mask = torch.zeros(n, n, dtype=dtype, device=device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
    return {"attention_mask": mask[None, None]}


# The attention implementation the language model runs under for a packed SDPA forward.
VARLEN_SDPA = "paravt_varlen_sdpa"


def varlen_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: one causal ``scaled_dot_product_attention`` per
    sequence of a packed row (boundaries ``cu_seq_lens_q``), the CPU/SDPA twin of
    flash-attn varlen. ``query`` ``(1, H, N, D)``, ``key``/``value`` ``(1, H_kv, N, D)``
    (grouped-query heads broadcast by SDPA) -> ``(1, N, H, D)``. Without ``cu_seq_lens_q`` (not a
    packed forward) it is transformers' own SDPA attention."""
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # Grouped-query heads: SDPA broadcasts them (enable_gqa) instead of a repeated K/V copy
    # of the whole row that the backward would keep.
    gqa = {"enable_gqa": True} if query.shape[1] != key.shape[1] else {}
    blocks = kwargs.get("paravt_blocks")
    if blocks is not None:  # a shared prompt (paravt.models.prefix.SharedLayout.blocks)
        masks = kwargs.get("paravt_masks")
        out = _prefix_block_attention(query, key, value, blocks, dropout, scaling, gqa, masks)
        return out, None
    bounds = cu_seq_lens_q.tolist()  # a host tensor (packed_attention_kwargs): no sync
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b],
            key[:, :, a:b],
            value[:, :, a:b],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
            **gqa,
        )
        for a, b in zip(bounds[:-1], bounds[1:])
        if b > a
    ]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _prefix_block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    blocks: Sequence[tuple[int, int, int, int]],
    dropout: float,
    scaling: float | None,
    gqa: dict[str, bool],
    masks: dict[tuple[int, int], Any] | None = None,
) -> torch.Tensor:
    """Attention over a shared layout's ``blocks`` (``(q0, q1, p0, p1)``, covering the rows in
    order): queries ``[q0, q1)`` attend causally to their own keys and fully to the prompt's
    ``[p0, p1)``, one SDPA per block. A suffix's keys are ``[prompt; suffix]`` with a causal
    mask aligned to the bottom right (``causal_lower_right``: query ``i`` sees keys up to
    ``P + i``), which is the mask its rows had inside the whole unshared sequence, so every
    output equals the unshared forward's. Nothing ``N x N`` exists: a suffix's mask is
    ``L_s x (P + L_s)`` at most. Its price is one concatenated copy of the prompt's keys and
    values per suffix, per layer, which autograd keeps for the backward (under gradient
    checkpointing: one layer's at a time). ``masks`` caches each suffix shape's mask over the
    layers of one forward, built once instead of once per layer.

    Which call runs where: on CUDA a suffix's mask is the ``causal_lower_right`` bias, which
    SDPA dispatches (``CausalBias._dispatch``) to torch's flash kernel (``is_causal`` there
    means lower right; bf16/fp16, grouped-query heads native) or else the memory-efficient
    kernel (``custom_mask_type`` lower right), never materialised for those; only where
    neither applies (e.g. float32 with grouped-query heads) does torch build the mask and
    warn. ``tests/test_shared_prefix_cuda.py`` (``scripts/gpu_check.sh``) fails if the 8B
    shape falls back (read from torch 2.13's source; not yet run on a GPU). On CPU it is an
    additive float mask (building it and converting a boolean one took most of a CPU
    forward's extra time). A prompt or an ungrouped row is ``is_causal=True`` everywhere.
    ``(1, H, M, D)`` -> ``(1, M, H, D)``."""
    from torch.nn.attention.bias import causal_lower_right

    if masks is None:
        masks = {}

    def lower_right(lq: int, lk: int) -> Any:
        if (lq, lk) not in masks:
            if query.is_cuda:
                masks[lq, lk] = causal_lower_right(lq, lk)
            else:
                keep = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
                masks[lq, lk] = torch.zeros(lq, lk, dtype=query.dtype, device=query.device)
                masks[lq, lk].masked_fill_(~keep, float("-inf"))
        return masks[lq, lk]

    sdpa = torch.nn.functional.scaled_dot_product_attention
    outs = []
    for q0, q1, p0, p1 in blocks:
        if q1 <= q0:
            continue
        q = query[:, :, q0:q1]
        if p1 <= p0:
            k, v, causal = key[:, :, q0:q1], value[:, :, q0:q1], {"is_causal": True}
        else:
            k = torch.cat([key[:, :, p0:p1], key[:, :, q0:q1]], 2)
            v = torch.cat([value[:, :, p0:p1], value[:, :, q0:q1]], 2)
            causal = {"attn_mask": lower_right(q1 - q0, k.shape[2])}
        outs.append(sdpa(q, k, v, dropout_p=dropout, scale=scaling, **causal, **gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


# The prefix of the attention implementation a flash_attention_2/3 language model runs under
# for packed forwards (``VARLEN_FLASH + "flash_attention_2"``: transformers reads "flash" in the
# name, as for its own flash implementations).
VARLEN_FLASH = "paravt_varlen_"

# flash-attn's varlen entry point for each implementation (imported on first use). Tests on CPU
# put ``flash_varlen_reference`` here: the kernel is the one part of the flash path a CPU
# cannot run.
FLASH_VARLEN_KERNELS: dict[str, Callable[..., Any]] = {}
_FLASH_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def flash_varlen_kernel(impl: str) -> Callable[..., Any]:
    """``flash_attn_varlen_func`` of ``impl`` (flash-attn 2's ``flash_attn`` or 3's
    ``flash_attn_interface``); a clear error when the package is missing, or when it is a
    flash-attn older than 2.1 (its causal mask is aligned to the top left: a suffix would not
    see its prompt)."""
    if impl not in FLASH_VARLEN_KERNELS:
        from transformers.modeling_flash_attention_utils import flash_attn_supports_top_left_mask

        module = _FLASH_MODULES[impl]
        fix = "or use model.attn_implementation=sdpa"
        try:
            kernel = importlib.import_module(module).flash_attn_varlen_func
        except ImportError as e:
            raise ImportError(
                f"model.attn_implementation='{impl}' needs the {module} package ({e}): install "
                f"flash-attn on a CUDA machine, {fix}"
            ) from e
        if impl == "flash_attention_2" and flash_attn_supports_top_left_mask():
            raise ImportError(
                f"model.attn_implementation='{impl}': the installed flash-attn is older than 2.1 "
                f"(causal masks aligned to the top left); install flash-attn >= 2.1, {fix}"
            )
        FLASH_VARLEN_KERNELS[impl] = kernel
    return FLASH_VARLEN_KERNELS[impl]


def prefix_varlen_kwargs(
    blocks: Sequence[tuple[int, int, int, int]], device: torch.device
) -> dict[str, Any]:
    """The varlen arguments of a layout's ``blocks`` (``SharedLayout.blocks``) for ONE
    flash-attn call with separate query and key lengths: block ``b``'s queries are rows
    ``[q0, q1)``, its keys the prompt's rows ``[p0, p1)`` then its own ``[q0, q1)``, gathered
    by ``paravt_key_index`` (None when no block reads a prompt: the keys are the rows
    themselves). ``cu_seq_lens_q`` / ``cu_seq_lens_k`` are their boundaries (int32, on
    ``device``), ``max_length_q`` / ``max_length_k`` their longest. With ``causal=True``
    flash-attn (>= 2.1) aligns the mask to the bottom right (query ``i`` of a block sees keys
    up to ``P + i``): what the rows saw inside the whole unshared sequence."""
    live = [b for b in blocks if b[1] > b[0]]
    lq = [q1 - q0 for q0, q1, _, _ in live]
    lk = [q1 - q0 + p1 - p0 for q0, q1, p0, p1 in live]
    shared = any(p1 > p0 for _, _, p0, p1 in live)
    index = None
    if shared:
        index = torch.cat(
            [torch.cat([torch.arange(p0, p1), torch.arange(q0, q1)]) for q0, q1, p0, p1 in live]
        ).to(device)

    def cu(lengths: list[int]) -> torch.Tensor:
        out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
        return out.to(device)

    return {
        "attention_mask": None, "cu_seq_lens_q": cu(lq), "cu_seq_lens_k": cu(lk),
        "max_length_q": max(lq), "max_length_k": max(lk), "paravt_key_index": index,
    }  # fmt: skip


def flash_varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """``flash_attn_varlen_func``'s contract written out (the reference the flash path is
    tested against on CPU, and the CUDA kernels in ``tests/test_shared_prefix_cuda.py``):
    ``q`` ``(T_q, H, D)``, ``k``/``v`` ``(T_k, H_kv, D)`` (query head ``h`` reads key/value
    head ``h // (H / H_kv)``), sequence ``b`` = queries ``[cu_q[b], cu_q[b+1])`` over keys
    ``[cu_k[b], cu_k[b+1])``; ``causal``: aligned to the bottom right (query ``i`` of ``L_q``
    sees keys ``j <= i + L_k - L_q``, flash-attn >= 2.1). Explicit softmax in float32, one
    sequence at a time; returns ``(T_q, H, D)`` in ``q``'s dtype. No dropout."""
    if dropout_p:
        raise ValueError(f"flash_varlen_reference: dropout_p={dropout_p} (only 0 is emulated)")
    h, hkv = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.empty_like(q)
    for a, b, c, d in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        qs = q[a:b].float().transpose(0, 1)  # (H, L_q, D)
        ks = k[c:d].float().transpose(0, 1).repeat_interleave(h // hkv, 0)
        vs = v[c:d].float().transpose(0, 1).repeat_interleave(h // hkv, 0)
        s = qs @ ks.transpose(1, 2) * scale
        if causal:
            keep = torch.ones(b - a, d - c, dtype=torch.bool, device=q.device).tril(
                (d - c) - (b - a)
            )
            s = s.masked_fill(~keep, float("-inf"))
        out[a:b] = (s.softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def varlen_flash_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function for a flash_attention_2/3 language model
    (``VARLEN_FLASH`` + its name): a packed forward (``paravt_key_index`` among the kwargs,
    ``prefix_varlen_kwargs``) is ONE ``flash_attn_varlen_func`` call over the layout's blocks
    with separate query and key boundaries, the keys and values gathered into
    ``[prompt; suffix]`` per block (the gather's copy of the prompt per suffix is the price,
    as on the SDPA path); a shared prompt is attended fully by each suffix, each block is
    causal (bottom right). ``query`` ``(1, H, M, D)``, ``key``/``value`` ``(1, H_kv, M, D)``
    (grouped-query heads: flash-attn reads them natively) -> ``(1, M, H, D)``. Any other call
    (generation, padded batches) is transformers' own flash attention under the original
    name. Runs on CUDA with flash-attn; on CPU only with ``flash_varlen_reference`` as its
    kernel (the tests)."""
    impl = module.config._attn_implementation.removeprefix(VARLEN_FLASH)
    if "paravt_key_index" not in kwargs:
        from transformers.integrations.flash_attention import flash_attention_forward

        module.config._attn_implementation = impl  # what transformers' flash import keys on
        try:
            return flash_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                **kwargs,
            )  # fmt: skip
        finally:
            module.config._attn_implementation = VARLEN_FLASH + impl
    index = kwargs["paravt_key_index"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (M, H, D), (M, H_kv, D)
    if index is not None:
        k, v = k.index_select(0, index), v.index_select(0, index)
    extra = {"dropout_p": dropout} if dropout else {}
    out = flash_varlen_kernel(impl)(
        q, k, v,
        cu_seqlens_q=kwargs["cu_seq_lens_q"], cu_seqlens_k=kwargs["cu_seq_lens_k"],
        max_seqlen_q=kwargs["max_length_q"], max_seqlen_k=kwargs["max_length_k"],
        softmax_scale=scaling, causal=True, **extra,
    )  # fmt: skip
    out = out[0] if isinstance(out, tuple) else out  # flash-attn 3 may return (out, lse)
    return out[None], None


# The attention implementations a shared layout runs under, by the language model's own
# (``_varlen_language_model`` switches a model to them for good).
_PACKED_IMPL = {
    "sdpa": VARLEN_SDPA,
    "flash_attention_2": VARLEN_FLASH + "flash_attention_2",
    "flash_attention_3": VARLEN_FLASH + "flash_attention_3",
}


def share_prefix_off_reason(attn_impl: str) -> str:
    """Why a language model with ``attn_impl`` (``model.attn_implementation``, or what
    ``_varlen_language_model`` switched it to) cannot run a shared layout; ``""`` when it
    can (sdpa and flash_attention_2/3: ``SHARING_IMPLS``)."""
    if attn_impl in SHARING_IMPLS:
        return ""
    if attn_impl == "eager":
        return (
            "eager attention (the debugging path) takes one additive N x N block-diagonal mask "
            "and runs every row whole"
        )
    return f"attention implementation '{attn_impl}' has no shared-prompt path"


# The implementations a shared layout runs under: the configured names and their packed twins.
SHARING_IMPLS = frozenset([*_PACKED_IMPL, *_PACKED_IMPL.values()])
_warned_off: set[str] = set()


def warn_if_sharing_off(attn_impl: str) -> bool:
    """Log ONE warning per implementation (per process) when ``algo.share_prefix`` is on but
    ``attn_impl`` cannot share (``share_prefix_off_reason``): the key, why, and the fix.
    Called by ``paravt.validate.validate_run`` before a run and by ``packed_forward`` when a
    batch asks for sharing. True when sharing is off."""
    why = share_prefix_off_reason(attn_impl)
    if why and attn_impl not in _warned_off:
        _warned_off.add(attn_impl)
        log.warning(
            "algo.share_prefix is on but model.attn_implementation='%s' turns it off: %s, so "
            "each group's prompt goes through the backbone G times (and micro-batches sized for "
            "shared rows hold more). Fix: model.attn_implementation=sdpa (or flash_attention_2 "
            "on CUDA with flash-attn), or algo.share_prefix=false to run unshared on purpose.",
            attn_impl,
            why,
        )
    return bool(why)


def _varlen_language_model(backbone: torch.nn.Module) -> str:
    """The language model's attention implementation for packed forwards. ``sdpa`` is
    switched to ``VARLEN_SDPA`` and ``flash_attention_2``/``_3`` to ``VARLEN_FLASH`` + its
    name (``varlen_flash_attention``), for good (registered with transformers on first use,
    with the original's mask function). The switch is permanent, not scoped to the packed
    forward: gradient checkpointing re-runs each layer during the backward, and the re-run
    must take the same attention path. Every call without paravt's packed kwargs
    (generation, padded batches, single sequences) is transformers' own implementation,
    mask and all, so nothing else changes. The vision tower keeps its own implementation (its
    own config). Anything else (eager) is returned unchanged."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask, sdpa_mask

    cfg = getattr(backbone, "language_model", backbone).config
    impl = str(getattr(cfg, "_attn_implementation", None) or "sdpa")
    packed = _PACKED_IMPL.get(impl)
    if packed is None:
        return impl
    if packed not in AttentionInterface._global_mapping:
        if packed == VARLEN_SDPA:
            AttentionInterface.register(packed, varlen_sdpa_attention)
            AttentionMaskInterface.register(packed, sdpa_mask)
        else:
            AttentionInterface.register(packed, varlen_flash_attention)
            AttentionMaskInterface.register(packed, flash_attention_mask)
    cfg._attn_implementation = packed
    return packed


def _packed_inputs(
    model: torch.nn.Module, batch: PackedBatch, seqs: Sequence[int], layout: SharedLayout
) -> dict[str, Any]:
    """Backbone keyword arguments for ONE forward over sequences ``seqs`` of ``batch`` laid
    out as ``layout`` (``paravt.models.prefix``: the unshared layout, or a group's prompt
    once). Token ids and ``mm_token_type_ids`` are the rows ``layout.src`` of the sequences'
    concatenation, ``(1, M)``; the visual features of every visual segment the rows hold come
    from ONE vision-tower call over their pixels (attention there is per frame, so a grid
    never sees another's patches), in the order of their placeholders in the rows (the
    backbone scatters them, and their deepstack features, by placeholder order); a shared
    prompt's segments are encoded once. Position ids are ``(4, 1, M)``: rows 1-3 the mrope
    ids of ``get_rope_index`` on each sequence ALONE (each restarts at 0; a suffix's continue
    from its prompt as in the whole sequence), row 0 the per-sequence text position
    ``0..L_i-1`` (what transformers reads as ``text_position_ids``; the rotary embedding uses
    rows 1-3 only). Only the grids of a member whose prompt is shared reach ``get_rope_index``
    (host-side, cheap); its pixels are not copied.
    """

    backbone, _ = backbone_and_head(model)
    p0 = next(model.parameters())
    dev = p0.device
    merge = int(model.config.vision_config.spatial_merge_size)
    mm_all = batch.token_types()
    cu = batch.cu_seqlens
    ids, mms, positions = [], [], []
    for i in seqs:
        a, b = int(cu[i]), int(cu[i + 1])
        v = batch.visuals[i]
        check_visual_tokens(mm_all[a:b].tolist(), v, merge)
        ids_i = batch.input_ids[a:b].to(dev).view(1, -1)
        mm_i = mm_all[a:b].to(device=dev, dtype=torch.int32).view(1, -1)
        rope: dict[str, Any] = {}
        if v is not None:
            rope[f"{v.kind}_grid_thw"] = v.grid_thw.to(dev)
            if v.second_per_grid_ts is not None:  # Qwen2.5-VL video
                rope["second_per_grid_ts"] = v.second_per_grid_ts.to(dev)
        mrope, _ = backbone.get_rope_index(ids_i, mm_token_type_ids=mm_i, **rope)  # (3, 1, L_i)
        text = torch.arange(b - a, device=mrope.device, dtype=mrope.dtype).view(1, 1, -1)
        positions.append(torch.cat([text, mrope], 0))
        ids.append(ids_i)
        mms.append(mm_i)
    src = layout.src.to(dev)
    seq_list = list(seqs)
    parts: dict[str, list[VisualInputs]] = {"video": [], "image": []}
    for k, s0, s1 in layout.visuals:
        piece = split_visuals(batch.visuals[seq_list[k]], s0, s1)
        if piece is not None:
            parts[piece.kind].append(piece)
    encoded: dict[str, Any] = {}
    img, vid = VisualInputs.concat(parts["image"]), VisualInputs.concat(parts["video"])
    if img is not None:
        encoded["image"] = backbone.get_image_features(
            img.pixel_values.to(dev, p0.dtype), img.grid_thw.to(dev), return_dict=True
        )
    if vid is not None:
        encoded["video"] = backbone.get_video_features(
            vid.pixel_values.to(dev, p0.dtype), vid.grid_thw.to(dev), return_dict=True
        )
    return {
        "input_ids": torch.cat(ids, 1).index_select(1, src),
        "mm_token_type_ids": torch.cat(mms, 1).index_select(1, src),
        "position_ids": torch.cat(positions, 2).index_select(2, src),
        "mm_encoder_outputs": encoded or None,
        "use_cache": False,
    }


def packed_forward(
    model: torch.nn.Module, batch: PackedBatch, seqs: Sequence[int], isolate: bool = True
) -> tuple[torch.Tensor, SharedLayout]:
    """ONE backbone forward over sequences ``seqs`` of ``batch``: the last hidden states of
    its rows ``(M, d)`` and their ``SharedLayout`` (``layout.row_of`` maps each position of
    the sequences' concatenation to its row). Under ``algo.share_prefix``
    (``PackedBatch.group_ids``) a group's common prompt is one block of rows
    (``paravt.models.prefix.prefix_groups``) under sdpa (``_prefix_block_attention``) and
    flash_attention_2/3 (``varlen_flash_attention``: one varlen call, separate query and key
    boundaries); eager runs the unshared layout and warns once (``warn_if_sharing_off``);
    else ``M = sum L_i`` and ``row_of`` is the identity. ``isolate=False`` drops the
    sequence-separating argument (plain causal attention over the whole row): only the tests
    use it, to show the separation is what makes the packed forward exact. No FSDP root
    wrapping: callers run it inside their own root forward (``as_root_forward``)."""

    backbone, _ = backbone_and_head(model)
    impl = _varlen_language_model(backbone) if isolate else "sdpa"
    share = isolate and impl in SHARING_IMPLS
    if isolate and batch.group_ids is not None and not share:
        warn_if_sharing_off(impl)
    groups = prefix_groups(batch, seqs) if share else []
    layout = shared_layout(batch, seqs, groups)
    kwargs = _packed_inputs(model, batch, seqs, layout)
    if not isolate:  # 3 mrope rows only: no text row, so transformers sees one causal sequence
        kwargs["position_ids"] = kwargs["position_ids"][1:]
        return backbone(**kwargs).last_hidden_state[0], layout
    device = kwargs["input_ids"].device
    if impl.startswith(VARLEN_FLASH):  # one flash-attn varlen call per layer, shared or not
        kwargs.update(prefix_varlen_kwargs(layout.blocks, device))
    else:
        lengths = [q1 - q0 for q0, q1, _, _ in layout.blocks]
        kwargs.update(
            packed_attention_kwargs(lengths, impl, device, next(model.parameters()).dtype)
        )
    if layout.shared and impl == VARLEN_SDPA:
        kwargs["paravt_blocks"] = layout.blocks
        kwargs["paravt_masks"] = {}  # one mask per suffix shape, shared by the layers
    if impl in SHARING_IMPLS:  # no text row: no N x N packed-sequence mask is built
        kwargs["position_ids"] = kwargs["position_ids"][1:]
    return backbone(**kwargs).last_hidden_state[0], layout


def packed_hidden(
    model: torch.nn.Module, batch: PackedBatch, seqs: Sequence[int], isolate: bool = True
) -> torch.Tensor:
    """The last hidden states ``(sum L_i, d)`` of sequences ``seqs`` in the unshared layout
    (each sequence's rows contiguous, in ``seqs`` order): ``packed_forward``'s rows, a shared
    prompt's rows repeated for each member. Callers that need a few rows only read them
    through ``packed_hidden_rows`` (no ``(sum L_i, d)`` copy)."""
    hidden, layout = packed_forward(model, batch, seqs, isolate)
    if not layout.shared:
        return hidden
    return hidden.index_select(0, layout.row_of.to(hidden.device))


def packed_hidden_rows(
    model: torch.nn.Module, batch: PackedBatch, seqs: Sequence[int], rows: torch.Tensor
) -> torch.Tensor:
    """The hidden states at positions ``rows`` ``(n,)`` of the sequences' concatenation (the
    unshared layout ``packed_hidden`` returns) from one ``packed_forward``: the rows that
    predict the trained tokens, read through ``layout.row_of``, so the trainer's passes
    (``paravt.algo.logprobs.packed_logprob_rows``, ``paravt.algo.loss.policy_part_loss``) and
    SFT see the same rows whichever layout ran; the gradient of a shared prompt row is the sum
    over the members that read it."""
    hidden, layout = packed_forward(model, batch, seqs)
    return hidden.index_select(0, layout.row_of.index_select(0, rows.cpu()).to(hidden.device))


def packed_hidden_states(
    model: torch.nn.Module, batch: PackedBatch, seqs: Sequence[int]
) -> torch.Tensor:
    """Last hidden states ``(sum L_i, d)`` of sequences ``seqs`` of ``batch`` (in that order,
    each sequence's rows contiguous) from ONE backbone forward over the packed row
    ``(1, sum L_i)``; equal to running each sequence alone (fp32: to ~1e-5; tested).

    No attention crosses a sequence boundary (``packed_attention_kwargs``: per-sequence
    attention for SDPA, flash-attn varlen ``cu_seqlens`` for flash_attention_2, an additive
    block-diagonal mask for eager); each sequence keeps its own mrope positions and visual
    features (``_packed_inputs``). For callers outside the trainer (which runs
    ``packed_hidden`` inside its own root forwards).
    Differentiable; runs as an FSDP2 root forward (``as_root_forward``), like
    ``paravt.algo.logprobs.sequence_logprobs``. Under FSDP2 the root's parameters (lm_head
    included) are resharded when this returns: a caller that applies the lm_head to these rows must do it inside its
    own root forward, ``as_root_forward(model, fn, ...)`` with ``fn`` calling
    ``packed_hidden`` (as ``paravt.algo.logprobs.packed_sequence_logprobs`` and
    ``paravt.algo.loss.policy_part_loss`` do).
    """
    return as_root_forward(model, packed_hidden, batch, list(seqs))
