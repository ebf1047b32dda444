"""The transformers engine: batched KV-cache decoding with behaviour log-probs, CPU or GPU.

``HFEngine.generate`` runs its own decode loop over the model's ``forward`` (not
``model.generate``) because PPO needs things ``generate`` does not give together:

- per-request sampling parameters in one batch (temperature, top-p, stops, token caps);
- per-request ``torch.Generator`` s, so a request's sample depends on its seed only — not on
  which other requests share its batch — and a run is reproducible from ``seed``;
- the log-prob of every sampled token under the distribution it was actually drawn from:
  ``log_softmax(top_p(logits / T))`` in float32 (greedy, ``T == 0``: ``log_softmax(logits)``;
  ``paravt.models.sampling``, shared with the trainer's log-prob passes);
- finished rows dropped from the batch and the KV cache as soon as they stop;
- a clip shared by several requests (the same ``VisualInputs`` object: a group's overview)
  encoded by the vision tower once per call, not once per request.

One call = one batched prefill (prompts left-padded; all requests' ``pixel_values`` and
``grid_thw`` concatenated in request order, so the vision tower runs once) + one decode step
per new token. M-RoPE positions are computed once per batch with the model's own
``get_rope_index`` on the left-padded ids and attention mask (padding is skipped, exactly as
``generate`` does), and each decode step advances every position row by one. With this,
left-padded batched decoding reproduces unpadded single-request decoding and the trainer's
teacher-forced ``paravt.algo.logprobs.sequence_logprobs`` (the project's one log-prob function:
backbone hidden states through the fused ``paravt_kernels.linear_logprob``, no full logits)
to float rounding (tests check 1e-4), for Qwen3-VL and
Qwen2.5-VL (whose video rows also carry ``second_per_grid_ts``). A batch may mix requests
with and without visuals, with any prompt lengths and patch counts.

Shared prefixes (``share_prefix``, ``rollout.share_prefix``, default on). The G requests of a
GRPO group carry one prompt (system text, overview clip, question); in a later turn their
contexts still share it and differ after. ``_share_plan`` sorts a batch's prompts, measures
what neighbours share (ids and token types equal, visual segments equal by object or by
pixels, never a segment cut in two, at least one token left to each request) and picks
clusters that maximise the tokens saved. The prefill then runs in two phases
(``_prefill_shared``): each cluster's prefix once, the KV cache forked to the cluster's rows,
then every request's own suffix (in a first turn: its last token) on top. Positions are the
one-shot path's, sliced; a segment in a shared prefix is encoded by the vision tower once.
Tokens and log-probs equal the one-shot path's to float rounding (tests: 1e-4, seen ~1e-6,
same tokens). Counted: ``stats["prefill_tokens"]`` (run) and ``["prefill_tokens_shared"]``
(not run). A batch where nothing is shared, or where the two padded phases would hold as many
token slots as one, takes the one-shot path.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paravt.engines.engine import (
    Engine,
    GenerationRequest,
    GenerationResult,
    row_seed,
    unwrap_module,
)
from paravt.models.loader import ModelBundle
from paravt.models.prefix import clean_cut, common_prefix, split_visuals
from paravt.models.sampling import sampling_logprobs
from paravt.types import VisualInputs
from paravt.vision.preprocess import check_visual_tokens, mm_token_types

# Tokens decoded to look for a stop string: enough to span any stop string the agent uses
# (``</tool_call>``-length) even when byte-level tokens are single characters.
_STOP_TAIL_TOKENS = 24


def _merge_size(model: Any) -> int:
    return int(model.config.vision_config.spatial_merge_size)


# --------------------------------------------------------------------------- shared prefixes
@dataclass
class _SharePlan:
    """Which rows of a batch prefill a common prefix once (``HFEngine._prefill_shared``).

    ``clusters[c]``: the batch rows of cluster ``c`` (its first row stands for the prefix);
    ``prefix[c]``: prompt tokens the cluster shares (always < each member's prompt length,
    and never inside a visual segment); ``split[c]``: visual segments inside that prefix;
    ``cluster_of[b]`` / ``split_of[b]``: the same per row.
    """

    clusters: list[list[int]]
    prefix: list[int]
    split: list[int]
    cluster_of: list[int]
    split_of: list[int]


class _Layout:
    """One request's prompt as ``paravt.models.prefix`` reads it: ids, modality types,
    visuals (what ``_share_plan`` compares and cuts at a segment boundary)."""

    def __init__(self, r: GenerationRequest, special: Any):
        self.ids = torch.tensor(r.prompt_ids, dtype=torch.long)
        self.types = torch.tensor(
            mm_token_types(
                r.extras.get("mm_token_type_ids"), r.prompt_ids, special,
                who=f"request {r.request_id!r}",
            )
        )  # fmt: skip
        self.visuals = r.visuals

    def clean_cut(self, p: int) -> tuple[int, int]:
        """``(p', k)``: the largest ``p' <= p`` not inside a segment, and the number ``k`` of
        segments wholly before ``p'`` (``paravt.models.prefix.clean_cut``)."""
        return clean_cut(self.types, self.visuals, p)


def _shareable(a: _Layout, b: _Layout) -> int:
    """Prompt tokens ``a`` and ``b`` can prefill once (``paravt.models.prefix.common_prefix``,
    the trainer's rule too), leaving each at least one token of its own (its logits start the
    decode)."""
    limit = min(len(a.ids), len(b.ids)) - 1
    return common_prefix(a.ids, a.types, a.visuals, b.ids, b.types, b.visuals, limit)[0]


def _share_plan(reqs: list[GenerationRequest], bundle: ModelBundle) -> _SharePlan | None:
    """Group a batch's requests into clusters that prefill a common prefix once.

    Requests are sorted by prompt ids, so that a shared prefix makes a contiguous run; ``s_i``
    is what neighbours ``i`` and ``i + 1`` can share (``_shareable``), and a run's common
    prefix is the minimum of its ``s_i``. The runs are chosen by dynamic programming to
    maximise the prefill tokens saved, ``sum_c (n_c - 1) * p_c`` (O(B^2), trivial next to one
    forward). A GRPO group's first turn (G identical prompts) is one run sharing all but the
    last token; a later turn's G contexts share the prompt up to the first sampled token.

    Returns None — prefill as one left-padded batch — when nothing is shared or when the two
    padded phases would push at least as many token slots through the model as one
    (``U * P + B * S >= B * L``).
    """
    B = len(reqs)
    lay = [_Layout(r, bundle.special) for r in reqs]
    order = sorted(range(B), key=lambda i: (list(reqs[i].prompt_ids), i))
    s = [_shareable(lay[order[i]], lay[order[i + 1]]) for i in range(B - 1)]
    # best[j]: most tokens saved over the first j requests of `order`; cut[j]: its last run's
    # start.
    best, cut = [0] * (B + 1), [0] * (B + 1)
    for j in range(1, B + 1):
        best[j], cut[j] = best[j - 1], j - 1  # request j-1 on its own
        run_min = None
        for i in range(j - 2, -1, -1):  # the run order[i .. j-1]
            run_min = s[i] if run_min is None else min(run_min, s[i])
            if run_min == 0:
                break  # longer runs share nothing either
            gain = best[i] + (j - 1 - i) * run_min
            if gain > best[j]:
                best[j], cut[j] = gain, i
    if best[B] == 0:
        return None
    runs, j = [], B
    while j > 0:
        runs.append(order[cut[j] : j])
        j = cut[j]
    runs.reverse()
    clusters, prefix, split = [], [], []
    cluster_of, split_of = [0] * B, [0] * B
    for c, run in enumerate(runs):
        a = lay[run[0]]
        if len(run) > 1:
            p = min(s[order.index(run[0]) + i] for i in range(len(run) - 1))
        else:  # alone: all but its last token in the prefix phase, as the others
            p = len(a.ids) - 1
        p, k = a.clean_cut(p)
        clusters.append(sorted(run))
        prefix.append(p)
        split.append(k)
        for b in run:
            cluster_of[b], split_of[b] = c, k
    lens = [len(r.prompt_ids) for r in reqs]
    P = max(prefix)
    S = max(n - prefix[c] for n, c in zip(lens, cluster_of))
    if len(clusters) * P + B * S >= B * max(lens):
        return None
    return _SharePlan(clusters, prefix, split, cluster_of, split_of)


class HFEngine(Engine):
    """Batched generation with transformers models (implements ``paravt.engines.engine.Engine``).

    Args:
        bundle: the loaded model (``paravt.models.load_model``).
        max_batch_size: most sequences per forward (0 = the whole call in one batch). Larger
            calls are split into chunks of similar prompt length (less padding).
        seed: engine seed; a request without ``sampling.seed`` gets a generator seeded from
            (seed, call counter, its index in the call). A request with a seed is reproducible
            on its own, whatever it is batched with.
        max_model_len: context length the agent loop keeps requests within (default: the
            model's ``max_position_embeddings``; 0 = no limit). Not enforced here.
        share_prefix: prefill a prompt prefix that several requests of a call share once and
            fork its KV cache to them (``rollout.share_prefix``; see the module docstring).
            False: one left-padded prefill of every request, as before.
    """

    def __init__(
        self,
        bundle: ModelBundle,
        *,
        max_batch_size: int = 0,
        seed: int = 0,
        max_model_len: int | None = None,
        share_prefix: bool = True,
    ):
        if max_batch_size < 0:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 0 (0 = no limit)")
        self.bundle = bundle
        self.model = bundle.model
        text_cfg = getattr(self.model.config, "text_config", self.model.config)
        #: Prompt + new tokens one request may span (``paravt.engines.engine.context_limit``):
        #: the model's ``max_position_embeddings`` unless given; the agent loop keeps to it.
        self.max_model_len = int(
            max_model_len
            if max_model_len is not None
            else getattr(text_cfg, "max_position_embeddings", 0) or 0
        )
        self.tokenizer = bundle.tokenizer
        self.max_batch_size = max_batch_size
        self.seed = seed
        self.share_prefix = share_prefix
        self.calls = 0
        self.stats = {
            "prefill_tokens": 0,  # prompt tokens run through the model
            "prefill_tokens_shared": 0,  # prompt tokens not run: a shared prefix's repeats
            "decode_steps": 0,
            "generated_tokens": 0,
            "vision_patches": 0,  # patches through the vision tower (after de-duplication)
        }

    # ----------------------------------------------------------------------------- public
    def sync_weights(self, model: Any) -> None:
        """Use ``model``'s weights from now on.

        ``model`` may be the same module (CPU, colocated: nothing to do), another module with
        the same parameter names (DDP/compiled wrappers are unwrapped), a state dict, or an
        iterable of ``(name, tensor)`` pairs (under FSDP2 the trainer streams
        ``paravt.distributed.full_weights`` into this engine's replica, copied in place one
        tensor at a time). Every entry of the engine's state dict must be given; a name it
        does not have raises.
        """
        src = unwrap_module(model)
        if src is self.model:
            return
        if isinstance(src, torch.nn.Module):
            src = src.state_dict()
        own = self.model.state_dict()
        seen: set[str] = set()
        unexpected: list[str] = []
        with torch.no_grad():
            for name, t in src.items() if isinstance(src, dict) else src:
                if name not in own:
                    unexpected.append(name)
                    continue
                own[name].copy_(t)
                seen.add(name)
        missing = [k for k in own if k not in seen]
        if missing or unexpected:
            raise ValueError(
                f"sync_weights: policy and rollout model differ: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}; pass the unwrapped policy module"
            )

    def loaded_weights(self) -> dict[str, torch.Tensor]:
        """The engine's own weights by name (its module's state dict, no copy): what
        ``paravt.weight_sync.verify_engine`` reads back after a weight sync."""
        return self.model.state_dict()

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate for every request; results in request order (see the module docstring)."""
        # The engine may share its module with the trainer (CPU, colocated). Decode in eval
        # mode: with gradient checkpointing, a module in train mode silently turns the KV
        # cache off, which would make every decode step see only its newest token.
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                return self._generate(requests)
        finally:
            self.model.train(was_training)

    def _generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        call = self.calls
        self.calls += 1
        if not requests:
            return []
        gens = []
        dev = self.bundle.device
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError(f"request {i} ({r.request_id!r}) has an empty prompt")
            if r.sampling.max_new_tokens < 1:
                raise ValueError(
                    f"request {i} ({r.request_id!r}): max_new_tokens="
                    f"{r.sampling.max_new_tokens} must be >= 1"
                )
            s = r.sampling.seed if r.sampling.seed is not None else row_seed(self.seed, call, i)
            g = torch.Generator(device=dev)
            g.manual_seed(int(s) & ((1 << 63) - 1))
            gens.append(g)
        order = list(range(len(requests)))
        bs = self.max_batch_size or len(requests)
        if bs < len(requests):
            # Similar lengths together: less padding; or, sharing prefixes, prompts in id order,
            # which keeps those that share a prefix (a GRPO group's) in one chunk. Results are
            # per-request (own generator), so the grouping changes nothing but speed.
            if self.share_prefix:
                order.sort(key=lambda i: list(requests[i].prompt_ids))
            else:
                order.sort(key=lambda i: len(requests[i].prompt_ids))
        results: list[GenerationResult | None] = [None] * len(requests)
        for start in range(0, len(order), bs):
            idx = order[start : start + bs]
            outs = self._generate_batch([requests[i] for i in idx], [gens[i] for i in idx])
            for i, o in zip(idx, outs):
                results[i] = o
        return results  # type: ignore[return-value]

    # ---------------------------------------------------------------------------- internal
    def _prefill_inputs(self, reqs: list[GenerationRequest], encode: bool = True) -> dict[str, Any]:
        """Left-padded batch: ids, mask, (4, B, L) positions, concatenated visual inputs.

        ``encode=False`` (the shared-prefix path, which encodes per segment itself) leaves the
        pixels out: only the grids the M-RoPE positions need are set."""
        model, sp = self.model, self.bundle.special
        dev = self.bundle.device
        dtype = next(model.parameters()).dtype
        B, L = len(reqs), max(len(r.prompt_ids) for r in reqs)
        ids = torch.full((B, L), sp.pad, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        mm = torch.zeros((B, L), dtype=torch.int32)
        videos: list[VisualInputs] = []
        images: list[VisualInputs] = []
        for b, r in enumerate(reqs):
            n = len(r.prompt_ids)
            types = mm_token_types(
                r.extras.get("mm_token_type_ids"), r.prompt_ids, sp, who=f"request {r.request_id!r}"
            )
            check_visual_tokens(types, r.visuals, _merge_size(model))
            ids[b, L - n :] = torch.tensor(r.prompt_ids, dtype=torch.long)
            mask[b, L - n :] = 1
            mm[b, L - n :] = torch.tensor(types, dtype=torch.int32)
            if r.visuals is not None:
                (videos if r.visuals.kind == "video" else images).append(r.visuals)
        ids, mask, mm = ids.to(dev), mask.to(dev), mm.to(dev)
        kw: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": mm}
        vid, img = VisualInputs.concat(videos), VisualInputs.concat(images)
        if vid is not None:
            kw["video_grid_thw"] = vid.grid_thw.to(dev)
            shared = self._shared_video_features(videos) if encode else None
            if shared is not None:
                kw["mm_encoder_outputs"] = {"video": shared}
            elif encode:
                kw["pixel_values_videos"] = vid.pixel_values.to(dev, dtype)
                self.stats["vision_patches"] += int(vid.pixel_values.shape[0])
            if vid.second_per_grid_ts is not None:  # Qwen2.5-VL
                kw["second_per_grid_ts"] = vid.second_per_grid_ts.to(dev)
        if img is not None:
            if encode:
                kw["pixel_values"] = img.pixel_values.to(dev, dtype)
                self.stats["vision_patches"] += int(img.pixel_values.shape[0])
            kw["image_grid_thw"] = img.grid_thw.to(dev)
        # Text row: what generate() uses (cumsum of the mask, pads at 0); M-RoPE rows: the
        # model's own rule over the unpadded tokens of each row.
        text_pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        if vid is None and img is None:
            rope = text_pos.unsqueeze(0).expand(3, -1, -1)
        elif not encode:
            rope = self._distinct_rope_index(reqs, ids, mm, mask)
        else:
            rope, _ = model.model.get_rope_index(
                ids,
                mm_token_type_ids=mm,
                image_grid_thw=kw.get("image_grid_thw"),
                video_grid_thw=kw.get("video_grid_thw"),
                second_per_grid_ts=kw.get("second_per_grid_ts"),  # Qwen2.5-VL only
                attention_mask=mask,
            )
        kw["position_ids"] = torch.cat([text_pos.unsqueeze(0), rope.to(text_pos)], dim=0)
        return kw

    def _distinct_rope_index(
        self,
        reqs: list[GenerationRequest],
        ids: torch.Tensor,
        mm: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """``get_rope_index`` over the distinct prompts only (shared-prefix path), ``(3, B, L)``.

        M-RoPE positions are integers fixed by a row's ids, token types and grids, and the
        model's rule loops over rows in Python (on the tiny model it cost a third of a G = 8
        group's shared prefill): a group's G equal prompts are computed once and repeated."""
        first: dict[Any, int] = {}
        inverse = []
        for r in reqs:
            v = r.visuals
            key = (
                tuple(r.prompt_ids),
                tuple(r.extras.get("mm_token_type_ids") or ()),
                None if v is None else (v.kind, tuple(v.grid_thw.flatten().tolist())),
                None
                if v is None or v.second_per_grid_ts is None
                else tuple(v.second_per_grid_ts.tolist()),
            )
            inverse.append(first.setdefault(key, len(first)))
        rows = [inverse.index(u) for u in range(len(first))]
        vis = [reqs[b].visuals for b in rows]
        vid = VisualInputs.concat([v for v in vis if v is not None and v.kind == "video"])
        img = VisualInputs.concat([v for v in vis if v is not None and v.kind == "image"])
        dev = ids.device
        sel = torch.tensor(rows, device=dev)
        rope, _ = self.model.model.get_rope_index(
            ids[sel],
            mm_token_type_ids=mm[sel],
            image_grid_thw=None if img is None else img.grid_thw.to(dev),
            video_grid_thw=None if vid is None else vid.grid_thw.to(dev),
            second_per_grid_ts=None  # Qwen2.5-VL only
            if vid is None or vid.second_per_grid_ts is None
            else vid.second_per_grid_ts.to(dev),
            attention_mask=mask[sel],
        )
        return rope[:, torch.tensor(inverse, device=dev)]

    def _shared_video_features(self, videos: list[VisualInputs]) -> Any | None:
        """Encode each distinct clip once when requests share a ``VisualInputs`` object.

        The G rollouts of a prompt carry the same overview clip (the same object), so a batch
        of G main-agent requests would run the vision tower G times on identical pixels. Here
        each distinct object (by identity: hashing pixels would cost more than it saves) is
        encoded once and its features, deepstack levels included, are repeated in request
        order as the model's ``mm_encoder_outputs``. Vision attention is per segment, so a
        segment's features do not depend on its batch-mates. Returns None (encode as usual)
        when no object repeats. The same mechanism as the shared-prefix prefill's
        (``_segment_features``: each distinct segment once, features in row order).
        """
        if len({id(v) for v in videos}) == len(videos):
            return None
        rows = [(v, 0, v.num_segments) for v in videos]
        return self._segment_features([rows])[0]["mm_encoder_outputs"]["video"]

    def _generate_batch(
        self, reqs: list[GenerationRequest], gens: list[torch.Generator]
    ) -> list[GenerationResult]:
        from transformers import DynamicCache

        model, tok = self.model, self.tokenizer
        dev = self.bundle.device
        B = len(reqs)
        plan = _share_plan(reqs, self.bundle) if self.share_prefix and B > 1 else None
        kw = self._prefill_inputs(reqs, encode=plan is None)
        temps = torch.tensor([r.sampling.temperature for r in reqs], device=dev)
        # A sort over the vocabulary per step is the top-p price: pay it only when used.
        any_top_p = any(r.sampling.top_p < 1.0 for r in reqs)
        top_ps = torch.tensor([r.sampling.top_p for r in reqs], device=dev)
        default_stops = set(self.bundle.special.stop_ids)
        stop_ids = [default_stops | set(r.sampling.stop_token_ids) for r in reqs]
        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lps: list[list[float]] = [[] for _ in range(B)]
        finish = [""] * B
        active = list(range(B))  # original row of each live batch row

        cache = DynamicCache(config=model.config)
        if plan is None:
            self.stats["prefill_tokens"] += int(kw["attention_mask"].sum())
            logits = model(**kw, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            mask, pos = kw["attention_mask"], kw["position_ids"]
        else:
            logits, mask, pos = self._prefill_shared(reqs, kw, plan, cache)
        logits = logits[:, -1]
        while True:
            t_act = temps[active]
            p_act = top_ps[active] if any_top_p else 1.0
            lp = sampling_logprobs(logits, t_act, p_act)  # (b, V) float32
            nxt = lp.argmax(-1)  # greedy rows keep this
            sampled = [j for j, b in enumerate(active) if reqs[b].sampling.temperature > 0]
            if sampled:
                nxt[sampled] = self._draw(lp[sampled], [gens[active[j]] for j in sampled])
            chosen = lp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1).tolist()
            nxt_list = nxt.tolist()
            keep: list[int] = []
            for j, b in enumerate(active):
                t = nxt_list[j]
                out_ids[b].append(t)
                out_lps[b].append(float(chosen[j]))
                sp = reqs[b].sampling
                if t in stop_ids[b] or self._hit_stop_string(out_ids[b], sp.stop_strings):
                    finish[b] = "stop"
                elif len(out_ids[b]) >= sp.max_new_tokens:
                    finish[b] = "length"
                else:
                    keep.append(j)
            self.stats["decode_steps"] += 1
            if not keep:
                break
            if len(keep) < len(active):
                # Drop finished rows from every per-row tensor and from the KV cache.
                sel = torch.tensor(keep, device=dev)
                cache.batch_select_indices(sel)
                mask, pos, nxt = mask[sel], pos[:, sel], nxt[sel]
                active = [active[j] for j in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            pos = pos[:, :, -1:] + 1  # every M-RoPE row advances by one per text token
            logits = model(
                input_ids=nxt.unsqueeze(-1),
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
        self.stats["generated_tokens"] += sum(len(o) for o in out_ids)
        return [
            GenerationResult(
                token_ids=out_ids[b],
                logprobs=out_lps[b],
                finish_reason=finish[b],
                request_id=reqs[b].request_id,
                text=tok.decode(out_ids[b], skip_special_tokens=True),
            )
            for b in range(B)
        ]

    def _prefill_shared(
        self,
        reqs: list[GenerationRequest],
        kw: dict[str, Any],
        plan: _SharePlan,
        cache: Any,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prefill each cluster's common prefix once, fork the cache, prefill the suffixes.

        Phase 1 runs one row per cluster: the first ``plan.prefix[c]`` tokens of its first
        request, left-padded to the longest such prefix ``P``. The cache's rows are then
        repeated to the batch's rows (``batch_select_indices`` with repeated indices: every
        layer's keys and values). Phase 2 runs every request's remaining tokens (at least one),
        left-padded to ``S``, over the forked cache; its attention mask is the cluster's prefix
        mask followed by the suffix mask, so the padding between the two is masked. Positions
        (text row and M-RoPE rows) are sliced from the full left-padded batch's, computed by
        the model's own ``get_rope_index`` exactly as the unshared path does, so decoding goes
        on from ``pos[..., -1] + 1`` as before. Returns (phase-2 logits of the last column,
        the ``(B, P + S)`` mask, the ``(4, B, S)`` positions).
        """
        model, sp = self.model, self.bundle.special
        dev = self.bundle.device
        ids, mask, mm, pos = (
            kw[k] for k in ("input_ids", "attention_mask", "mm_token_type_ids", "position_ids")
        )
        L = ids.shape[1]
        lens = [len(r.prompt_ids) for r in reqs]
        B, U = len(reqs), len(plan.clusters)
        P = max(plan.prefix)
        S = max(n - plan.prefix[c] for n, c in zip(lens, plan.cluster_of))

        def layout(n_rows: int, width: int) -> tuple[torch.Tensor, ...]:
            # Padding: id pad, mask 0, text position 0, M-RoPE 1 (get_rope_index's fill).
            p_ids = ids.new_full((n_rows, width), sp.pad)
            p_pos = pos.new_ones((4, n_rows, width))
            p_pos[0] = 0
            return p_ids, mask.new_zeros((n_rows, width)), mm.new_zeros((n_rows, width)), p_pos

        ids1, mask1, mm1, pos1 = layout(U, P)
        items1 = []
        for c, rows in enumerate(plan.clusters):
            b, p = rows[0], plan.prefix[c]
            src = slice(L - lens[b], L - lens[b] + p)
            ids1[c, P - p :], mask1[c, P - p :], mm1[c, P - p :] = ids[b, src], 1, mm[b, src]
            pos1[:, c, P - p :] = pos[:, b, src]
            items1.append((reqs[b].visuals, 0, plan.split[c]))
        ids2, mask2, mm2, pos2 = layout(B, S)
        items2 = []
        for b, c in enumerate(plan.cluster_of):
            n = lens[b] - plan.prefix[c]
            src = slice(L - n, L)
            ids2[b, S - n :], mask2[b, S - n :], mm2[b, S - n :] = ids[b, src], 1, mm[b, src]
            pos2[:, b, S - n :] = pos[:, b, src]
            v = reqs[b].visuals
            items2.append((v, plan.split_of[b], 0 if v is None else v.num_segments))
        vis1, vis2 = self._segment_features([items1, items2])
        self.stats["prefill_tokens"] += int(mask1.sum()) + int(mask2.sum())
        self.stats["prefill_tokens_shared"] += sum(
            (len(rows) - 1) * p for rows, p in zip(plan.clusters, plan.prefix)
        )
        model(
            input_ids=ids1,
            attention_mask=mask1,
            mm_token_type_ids=mm1,
            position_ids=pos1,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **vis1,
        )
        fork = torch.tensor(plan.cluster_of, device=dev)
        cache.batch_select_indices(fork)
        full_mask = torch.cat([mask1[fork], mask2], dim=1)
        logits = model(
            input_ids=ids2,
            attention_mask=full_mask,
            mm_token_type_ids=mm2,
            position_ids=pos2,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **vis2,
        ).logits
        return logits, full_mask, pos2

    def _segment_features(
        self, phases: list[list[tuple[VisualInputs | None, int, int]]]
    ) -> list[dict[str, Any]]:
        """Vision features for segments ``[k0, k1)`` of each row's visuals, per phase.

        Every distinct segment (by its ``VisualInputs`` object and index) of all phases runs
        through the vision tower once, in one call per kind; each phase gets its rows'
        segments in row order as the model's ``mm_encoder_outputs`` (plus the grids), which is
        the order its placeholders appear in. A request's segments that lie in its cluster's
        shared prefix are never encoded: the cluster's first request stands for them.
        """
        dev, dtype = self.bundle.device, next(self.model.parameters()).dtype
        uniq: dict[str, dict[tuple[int, int], VisualInputs]] = {"video": {}, "image": {}}
        for items in phases:
            for v, k0, k1 in items:
                for k in range(k0, k1):
                    assert v is not None
                    uniq[v.kind].setdefault((id(v), k), split_visuals(v, k, k + 1))
        feats: dict[str, Any] = {}
        index: dict[str, dict[tuple[int, int], int]] = {}
        for kind, segs in uniq.items():
            if not segs:
                continue
            u = VisualInputs.concat(list(segs.values()))
            assert u is not None
            enc = (
                self.model.model.get_video_features
                if kind == "video"
                else self.model.model.get_image_features
            )
            feats[kind] = enc(u.pixel_values.to(dev, dtype), u.grid_thw.to(dev), return_dict=True)
            self.stats["vision_patches"] += int(u.pixel_values.shape[0])
            index[kind] = {key: i for i, key in enumerate(segs)}
        out = []
        for items in phases:
            kw: dict[str, Any] = {}
            enc_out: dict[str, Any] = {}
            for kind in feats:
                keys = [
                    (id(v), k)
                    for v, k0, k1 in items
                    if v is not None and v.kind == kind
                    for k in range(k0, k1)
                ]
                if not keys:
                    continue
                order = [index[kind][key] for key in keys]
                f = feats[kind]
                sel = copy.copy(f)
                sel.pooler_output = tuple(f.pooler_output[i] for i in order)
                if getattr(f, "deepstack_features", None) is not None:  # Qwen3-VL
                    sel.deepstack_features = [
                        tuple(level[i] for i in order) for level in f.deepstack_features
                    ]
                enc_out[kind] = sel
                segs = [uniq[kind][key] for key in keys]
                grid = torch.cat([g.grid_thw for g in segs]).to(dev)
                kw["video_grid_thw" if kind == "video" else "image_grid_thw"] = grid
            if enc_out:
                kw["mm_encoder_outputs"] = enc_out
            out.append(kw)
        return out

    @staticmethod
    def _draw(logprobs: torch.Tensor, gens: list[torch.Generator]) -> torch.Tensor:
        """One token per row by inverse-CDF sampling, ``(b, V)`` -> ``(b,)``.

        Each row takes ONE uniform from its own generator, so a request's sample never depends
        on what else is in the batch; the CDF search is batched (4-5x cheaper on the CPU than
        one ``torch.multinomial`` per row). ``right=True`` skips zero-probability tokens
        (outside the top-p nucleus) even for ``u == 0``.
        """
        dev = logprobs.device
        u = torch.stack([torch.rand((), generator=g, device=dev) for g in gens])
        cdf = logprobs.exp().cumsum(-1)  # (b, V); the last entry is the row's total (~1)
        idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        return idx.clamp_(max=logprobs.shape[-1] - 1)

    def _hit_stop_string(self, ids: list[int], stops: Sequence[str]) -> bool:
        """True when the newest token completed one of ``stops`` (decoded tail of the output).

        Checked after every token, so a stop string found in the tail was completed by the
        newest token: generation stops on it, the stop string included.
        """
        if not stops:
            return False
        n = max(_STOP_TAIL_TOKENS, max(len(s) for s in stops) + 2)  # >= 1 char per token
        tail = self.tokenizer.decode(ids[-n:], skip_special_tokens=False)
        return any(s in tail for s in stops)


def from_config(cfg: Any, bundle: ModelBundle) -> HFEngine:
    """The engine ``rollout.engine=hf`` builds (``paravt.engines.make_engine``)."""
    return HFEngine(
        bundle,
        max_batch_size=cfg.rollout.max_batch_size,
        seed=cfg.train.seed,
        share_prefix=cfg.rollout.share_prefix,
    )
