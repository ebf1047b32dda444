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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from paravt.models.loader import ModelBundle
from paravt.models.sampling import sampling_logprobs
from paravt.rollout.engine import GenerationRequest, GenerationResult, row_seed, unwrap_module
from paravt.types import VisualInputs
from paravt.vision.preprocess import check_visual_tokens, mm_token_types

# Tokens decoded to look for a stop string: enough to span any stop string the agent uses
# (``</tool_call>``-length) even when byte-level tokens are single characters.
_STOP_TAIL_TOKENS = 24


def _merge_size(model: Any) -> int:
    return int(model.config.vision_config.spatial_merge_size)


class HFEngine:
    """Batched generation with transformers models (implements ``paravt.rollout.engine.Engine``).

    Args:
        bundle: the loaded model (``paravt.models.load_model``).
        max_batch_size: most sequences per forward (0 = the whole call in one batch). Larger
            calls are split into chunks of similar prompt length (less padding).
        seed: engine seed; a request without ``sampling.seed`` gets a generator seeded from
            (seed, call counter, its index in the call). A request with a seed is reproducible
            on its own, whatever it is batched with.
        max_model_len: context length the agent loop keeps requests within (default: the
            model's ``max_position_embeddings``; 0 = no limit). Not enforced here.
    """

    def __init__(
        self,
        bundle: ModelBundle,
        *,
        max_batch_size: int = 0,
        seed: int = 0,
        max_model_len: int | None = None,
    ):
        if max_batch_size < 0:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 0 (0 = no limit)")
        self.bundle = bundle
        self.model = bundle.model
        text_cfg = getattr(self.model.config, "text_config", self.model.config)
        #: Prompt + new tokens one request may span (``paravt.rollout.engine.context_limit``):
        #: the model's ``max_position_embeddings`` unless given; the agent loop keeps to it.
        self.max_model_len = int(
            max_model_len
            if max_model_len is not None
            else getattr(text_cfg, "max_position_embeddings", 0) or 0
        )
        self.tokenizer = bundle.tokenizer
        self.max_batch_size = max_batch_size
        self.seed = seed
        self.calls = 0
        self.stats = {
            "prefill_tokens": 0,
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
            # Similar lengths together: less padding. Results are per-request (own generator),
            # so the grouping changes nothing but speed.
            order.sort(key=lambda i: len(requests[i].prompt_ids))
        results: list[GenerationResult | None] = [None] * len(requests)
        for start in range(0, len(order), bs):
            idx = order[start : start + bs]
            outs = self._generate_batch([requests[i] for i in idx], [gens[i] for i in idx])
            for i, o in zip(idx, outs):
                results[i] = o
        return results  # type: ignore[return-value]

    # ---------------------------------------------------------------------------- internal
    def _prefill_inputs(self, reqs: list[GenerationRequest]) -> dict[str, Any]:
        """Left-padded batch: ids, mask, (4, B, L) positions, concatenated visual inputs."""
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
            shared = self._shared_video_features(videos)
            if shared is not None:
                kw["mm_encoder_outputs"] = {"video": shared}
            else:
                kw["pixel_values_videos"] = vid.pixel_values.to(dev, dtype)
                self.stats["vision_patches"] += int(vid.pixel_values.shape[0])
            if vid.second_per_grid_ts is not None:  # Qwen2.5-VL
                kw["second_per_grid_ts"] = vid.second_per_grid_ts.to(dev)
        if img is not None:
            kw["pixel_values"] = img.pixel_values.to(dev, dtype)
            kw["image_grid_thw"] = img.grid_thw.to(dev)
        # Text row: what generate() uses (cumsum of the mask, pads at 0); M-RoPE rows: the
        # model's own rule over the unpadded tokens of each row.
        text_pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        if vid is None and img is None:
            rope = text_pos.unsqueeze(0).expand(3, -1, -1)
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

    def _shared_video_features(self, videos: list[VisualInputs]) -> Any | None:
        """Encode each distinct clip once when requests share a ``VisualInputs`` object.

        The G rollouts of a prompt carry the same overview clip (the same object), so a batch
        of G main-agent requests would run the vision tower G times on identical pixels. Here
        each distinct object (by identity: hashing pixels would cost more than it saves) is
        encoded once and its features, deepstack levels included, are repeated in request
        order as the model's ``mm_encoder_outputs``. Vision attention is per segment, so a
        segment's features do not depend on its batch-mates. Returns None (encode as usual)
        when no object repeats.
        """
        uniq: dict[int, VisualInputs] = {}
        for v in videos:
            uniq.setdefault(id(v), v)
        if len(uniq) == len(videos):
            return None
        dev, dtype = self.bundle.device, next(self.model.parameters()).dtype
        u = VisualInputs.concat(list(uniq.values()))
        assert u is not None
        feats = self.model.model.get_video_features(
            u.pixel_values.to(dev, dtype), u.grid_thw.to(dev), return_dict=True
        )
        self.stats["vision_patches"] += int(u.pixel_values.shape[0])
        first_seg: dict[int, int] = {}
        k = 0
        for key, v in uniq.items():
            first_seg[key] = k
            k += v.num_segments
        order = [first_seg[id(v)] + j for v in videos for j in range(v.num_segments)]
        feats.pooler_output = tuple(feats.pooler_output[i] for i in order)
        if getattr(feats, "deepstack_features", None) is not None:  # Qwen3-VL
            feats.deepstack_features = [
                tuple(level[i] for i in order) for level in feats.deepstack_features
            ]
        return feats

    def _generate_batch(
        self, reqs: list[GenerationRequest], gens: list[torch.Generator]
    ) -> list[GenerationResult]:
        from transformers import DynamicCache

        model, tok = self.model, self.tokenizer
        dev = self.bundle.device
        kw = self._prefill_inputs(reqs)
        B = len(reqs)
        self.stats["prefill_tokens"] += int(kw["attention_mask"].sum())
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
        logits = model(**kw, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        mask, pos = kw["attention_mask"], kw["position_ids"]
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
    """The engine ``rollout.engine=hf`` builds (``paravt.rollout.make_engine``)."""
    return HFEngine(bundle, max_batch_size=cfg.rollout.max_batch_size, seed=cfg.train.seed)
