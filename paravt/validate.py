"""Checks of a run's configuration against this machine, before anything loads.

``paravt.config`` checks what a config says on its own (types, ranges, a preset's required
settings); ``validate_run`` checks what needs the world size or files on disk: the batch split
over ranks, the device, the attention implementation's package, the vLLM install, the run
folder of ``--resume``, the largest frame budget against the model's context, the
plug-ins (``agent.tools``, ``reward.extra_terms``: each ``module:attr`` imports) and the
``wandb`` package of ``train.wandb=true``. Each error
names the setting and the fix; all of them are raised at once (``ConfigError``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from paravt.agent.context import context_budget_errors
from paravt.agent.tools import load_tools
from paravt.config import Config, ConfigError
from paravt.distributed import resolve_device
from paravt.engines import engine_missing
from paravt.models.forward import warn_if_sharing_off
from paravt.models.tiny import model_dir_of
from paravt.rewards.compose import load_terms


def validate_run(cfg: Config, world_size: int) -> None:
    """Checks that need the world size or files on disk, run before anything loads."""
    errs: list[str] = []
    t, r, a = cfg.train, cfg.rollout, cfg.algo
    if t.steps < 1 and not t.eval_prompts:  # steps 0 with prompts: evaluate only
        errs.append(
            f"train.steps={t.steps} must be >= 1 (0 only evaluates, which needs "
            "train.eval_prompts >= 1)"
        )
    if r.workers > 0:  # asynchronous: the last r.workers ranks generate, the others train
        if world_size <= r.workers:
            errs.append(
                f"rollout.workers={r.workers} with {world_size} process(es) leaves no trainer "
                f"rank (asynchronous training runs the workers in their own processes); launch "
                f"torchrun --nproc-per-node {r.workers + 1} (or more) -m paravt.train, or set "
                "rollout.workers=0 for the synchronous loop"
            )
        elif r.dispatch == "static" and t.prompts_per_step % r.workers:
            # (dispatch=group: workers claim groups, any number per step)
            errs.append(
                f"train.prompts_per_step={t.prompts_per_step} is not divisible by "
                f"rollout.workers={r.workers}; under rollout.dispatch=static each worker rolls "
                f"out an equal share of a step's prompts (use a multiple of {r.workers}, or "
                "rollout.dispatch=group)"
            )
        world_size = max(world_size - r.workers, 1)  # the trainer ranks, from here on
    if t.prompts_per_step % world_size:
        errs.append(
            f"train.prompts_per_step={t.prompts_per_step} is not divisible by the world size "
            f"{world_size}; each rank rolls out whole groups (use a multiple of {world_size})"
        )
    else:
        per_rank = t.prompts_per_step // world_size
        if per_rank < a.minibatches:
            errs.append(
                f"algo.minibatches={a.minibatches} exceeds the {per_rank} prompt(s) each of the "
                f"{world_size} rank(s) gets per step; lower algo.minibatches"
            )
    if cfg.sft.steps > 0 and cfg.sft.batch_size < world_size:
        errs.append(
            f"sft.batch_size={cfg.sft.batch_size} is smaller than the world size {world_size}"
        )
    if cfg.sft.steps > 0 and cfg.data.path and not cfg.sft.data:  # own data, no records
        sft = Path(cfg.data.path) / "sft.jsonl"
        if not sft.is_file():
            errs.append(
                f"sft.steps={cfg.sft.steps}: the cold-start SFT trains on tool-use records, but "
                f"data.path={cfg.data.path} has no sft.jsonl. Either give them: sft.data=FILE.jsonl, one "
                'trajectory a line (ParaVT\'s {"id", "messages": [system, user, assistant, '
                'tool, ..., assistant]} or paravt\'s {"sample_id", "num_frames", "turns"}, '
                "joined to data.path's rows by id; docs in paravt/sft.py), or skip the cold "
                "start: sft.steps=0 (RL starts from model.path, which should already call the "
                "tool)"
            )
    if r.group_size < 2:
        errs.append(
            f"rollout.group_size={r.group_size}: GRPO's baseline is the group's mean, so one "
            "rollout per prompt has advantage r - mean(r) = 0 and the run trains on nothing; "
            "set rollout.group_size >= 2 (8 in the reference recipe)"
        )
    if not t.out_dir.strip():
        errs.append(
            f"train.out_dir is empty ({t.out_dir!r}): the run would write its checkpoints, "
            "metrics and run.json into the current directory; name a folder, e.g. "
            "train.out_dir=runs/train/default"
        )
    if r.temperature <= 0:
        errs.append(
            f"rollout.temperature={r.temperature}: RL needs sampling (> 0); greedy rollouts "
            "give identical group members and zero advantages"
        )
    if cfg.sft.data and not Path(cfg.sft.data).is_file():
        errs.append(f"sft.data='{cfg.sft.data}' does not exist")
    dev = None
    try:
        dev = resolve_device(cfg.model.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            errs.append(f"model.device='{cfg.model.device}' but CUDA is not available; use cpu")
    except RuntimeError as e:
        errs.append(f"model.device='{cfg.model.device}': {e}")
    errs += _attention_errors(cfg, dev)
    if a.share_prefix:  # a warning, not an error: the run is right, only slower
        warn_if_sharing_off(cfg.model.attn_implementation)
    why = engine_missing(r.engine)
    if why:
        errs.append(why)
    if t.resume and not Path(t.out_dir).is_dir():
        errs.append(f"--resume: train.out_dir='{t.out_dir}' does not exist (nothing to resume)")
    # The largest K must fit the model's context: estimate its prompt from the pixel budget.
    model_dir = Path(model_dir_of(cfg))
    if (model_dir / "config.json").is_file():
        errs += context_budget_errors(cfg, model_dir)
    errs += _plugin_errors(cfg)
    if t.wandb and importlib.util.find_spec("wandb") is None:  # else: after the model loads
        errs.append(
            "train.wandb=true, but the wandb package is not installed: pip install wandb (then "
            "wandb login, or WANDB_MODE=offline), or set train.wandb=false (metrics.jsonl and "
            "TensorBoard's tb/ are written either way)"
        )
    if errs:
        raise ConfigError("invalid configuration for this run:\n  - " + "\n  - ".join(errs))


# transformers' flash attention implementations: the module each imports, the package's name
# and how to install it.
_FLASH_PACKAGES = {
    "flash_attention_2": (
        "flash_attn",
        "flash-attn",
        "pip install flash-attn --no-build-isolation (builds against the CUDA toolkit)",
    ),
    "flash_attention_3": (
        "flash_attn_interface",
        "flash-attn 3 (flash_attn_interface)",
        "build flash-attention's hopper/ directory",
    ),
}


def _plugin_errors(cfg: Config) -> list[str]:
    """The plug-ins import and are what their keys need (``agent.tools``,
    ``reward.extra_terms``): found before anything loads, not at the first rollout."""
    errs = []
    try:
        load_tools(list(cfg.agent.tools))
    except ConfigError as e:
        errs.append(str(e))
    try:
        load_terms(cfg.reward)
    except ConfigError as e:
        errs.append(str(e))
    return errs


def _attention_errors(cfg: Config, dev: torch.device | None) -> list[str]:
    """``model.attn_implementation=flash_attention_*`` needs a CUDA device and its package;
    without them transformers fails the model load, after the data and any tiny model were
    built. ``dev``: the resolved ``model.device`` (None when it did not resolve)."""
    attn = cfg.model.attn_implementation
    if attn not in _FLASH_PACKAGES:
        return []
    module, package, install = _FLASH_PACKAGES[attn]
    other = "run with model.attn_implementation=sdpa (PyTorch's attention: any device, no package)"
    if dev is not None and dev.type != "cuda":
        return [
            f"model.attn_implementation='{attn}' needs CUDA, but model.device="
            f"'{cfg.model.device}' is {dev}{'' if torch.cuda.is_available() else ' (no CUDA)'}: "
            f"{other}, or use a CUDA device"
        ]
    if importlib.util.find_spec(module) is None:
        return [
            f"model.attn_implementation='{attn}' needs the {package} package, which is not "
            f"installed: {install}, or {other}"
        ]
    return []
