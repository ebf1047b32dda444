"""A checkpoint folder's layout: the names, the step folders, the byte estimate and the
save's error (every path of the package reads them).

One directory per saved step, under ``<out_dir>/checkpoints``::

    step_000004/
      config.json, model.safetensors, tokenizer files ...   <- the exported model (``export``):
                                                              rank 0's model.safetensors, or
                                                              under several ranks a file per
                                                              rank and the index; what eval,
                                                              vLLM and --resume's model load read
      trainer_state.pt                                      <- rank 0, small (``small``):
                                                              "step", the trainer's
                                                              ``Trainer.state_dict`` (schedule,
                                                              sampler position "data", every
                                                              rank's RNG states "rng",
                                                              "world_size") and the layout's
                                                              flags ("format": 2, "train_state",
                                                              "optim_empty")
      train_state/                                          <- the training state, sharded
        .metadata                                              (``sharded``): AdamW's state
        __0_0.distcp, __1_0.distcp, ...                        ("optim") and the float32
                                                              masters ("model") under mixed
                                                              precision; each rank its own shards
      manifest.json                                         <- rank 0, last: the run id, the
                                                              step, every file's size and sha256
                                                              (``manifest``, ``trust``)
    latest                                                  <- text file: "step_000004"
  <out_dir>/run_id                                          <- the run's identity

Failed writes (disk full, quota, I/O errors): rank 0 first checks that the file system has
room for the estimated size (``checkpoint_bytes``: the whole checkpoint, every rank's shards
counted), then on any ``OSError``, on any rank, the save is undone (``commit``) and
``CheckpointSaveError`` is raised naming the path, the bytes needed and free, and the fix
(``save_error``). The previous checkpoint stays the newest and loadable
(``tests/test_checkpoint_disk_full.py``; ``tests/test_checkpoint_sharded.py`` a rank's shard
write).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from paravt.config import ConfigError

CKPT_DIR = "checkpoints"
STATE_FILE = "trainer_state.pt"
# The sharded training state's folder inside a checkpoint (torch.distributed.checkpoint), and
# the trainer_state.pt "format" that says it is there. Format 1 (no "format" key) held the
# full optimizer state and masters in trainer_state.pt itself.
TRAIN_STATE_DIR = "train_state"
SHARDED_FORMAT = 2
LATEST = "latest"
# Files of a source model directory that are not weights (copied so the checkpoint is a
# complete HF directory: tokenizer, chat template, processor configs).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json")


#: The run folder's identity (``run_id``: written once, when the folder's run is created)
#: and each checkpoint's record of it and of its files (``manifest.json``: the run id, the
#: step, every file's size and sha256, written at save; ``verify_checkpoint`` checks it).
RUN_ID_FILE = "run_id"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
STEP_NAME = re.compile(r"step_\d{6,}")


class CheckpointLoadError(RuntimeError):
    """A checkpoint (or the SFT state) that ``--resume`` refuses: damaged, not this run's, or
    holding code to run on load. The message is one line naming the step, the file and the
    newest intact checkpoint (``--resume train.resume_fallback=true`` continues from it)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, I/O error). The previous checkpoint
    is untouched; ``path`` is what failed, ``needed``/``free`` are bytes (estimate / free on the
    file system when the save gave up), ``cause`` the ``OSError``."""

    def __init__(
        self,
        message: str,
        *,
        path: str = "",
        needed: int = 0,
        free: int = -1,
        cause: OSError | None = None,
    ) -> None:
        super().__init__(message)
        self.path, self.needed, self.free, self.cause = path, needed, free, cause


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


# Headroom over the tensor bytes: safetensors/pickle headers, config and tokenizer JSON written
# by ``save_pretrained``, RNG states.
_SAVE_SLACK_BYTES = 1 << 20


def checkpoint_bytes(
    model_state: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
    source_dir: str | Path | None = None,
    *,
    export_bytes: int | None = None,
) -> int:
    """Estimated bytes of one checkpoint: every tensor of the weights (``export_bytes`` when
    given: a spread export's total, ``model_state`` being one rank's part) and the trainer
    state (optimizer moments dominate: 2x the weights for Adam), the copied non-weight files
    of ``source_dir`` (twice: the tokenizer is saved again), plus 1 MiB of headers and JSON."""
    extra = 0
    if source_dir is not None and Path(source_dir).is_dir():
        extra = 2 * sum(
            f.stat().st_size
            for f in Path(source_dir).iterdir()
            if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES)
        )
    weights = _tensor_bytes(model_state) if export_bytes is None else export_bytes
    return weights + _tensor_bytes(trainer_state) + extra + _SAVE_SLACK_BYTES


def free_bytes(path: Path) -> int:
    try:
        return int(shutil.disk_usage(path).free)
    except OSError:
        return -1


def save_error(
    step: int, root: Path, path: Path | str, needed: int, cause: OSError | None, prev: Path | None
) -> CheckpointSaveError:
    """``path``: what failed; the checkpoint's own directory is ``root/step_N``."""
    free = free_bytes(root)
    if cause is None:
        problem = "not enough free space for it"
    else:
        code = errno.errorcode.get(cause.errno, cause.errno) if cause.errno else "?"
        problem = f"{cause.strerror or cause} ({code})"
    kept = (
        f"The previous checkpoint {prev} is intact and is what --resume loads."
        if prev is not None
        else "There is no earlier checkpoint of this run."
    )
    msg = (
        f"checkpoint step {step} ({root / step_dirname(step)}) could not be written: {path}: "
        f"{problem}. A checkpoint needs "
        f"about {needed / 2**20:.1f} MiB ({needed} bytes); {free} bytes are free on the file "
        f"system of {root}. {kept} Fix: free space there (or lower train.keep_last, or point "
        "train.out_dir at a larger disk) and rerun with --resume; or set "
        "train.on_save_error=continue to train on without checkpoints until one fits."
    )
    return CheckpointSaveError(msg, path=str(path), needed=needed, free=free, cause=cause)


def sft_save_error(
    out_dir: str | Path, state: dict[str, torch.Tensor], source_dir: str | Path, cause: OSError
) -> CheckpointSaveError:
    """The error for a cold-start SFT checkpoint that could not be written (``paravt.sft``)."""
    out = Path(out_dir)
    needed = checkpoint_bytes(state, {}, source_dir)
    free = free_bytes(out.parent)
    msg = (
        f"the SFT checkpoint {out} could not be written: {cause.filename or out}: "
        f"{cause.strerror or cause}. It needs about {needed / 2**20:.1f} MiB ({needed} bytes); "
        f"{free} bytes are free on the file system of {out.parent}. Free space there (or point "
        "train.out_dir at a larger disk) and rerun; nothing half-written was left behind."
    )
    return CheckpointSaveError(
        msg, path=str(cause.filename or out), needed=needed, free=free, cause=cause
    )


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def move_aside(path: Path) -> Path:
    """Rename ``path`` out of the ``step_*`` namespace (atomic); delete the result later."""
    aside = path.with_name(f".tmp-del-{path.name}")
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    return aside


class CheckpointGone(ConfigError):
    """The checkpoint folder a reader was about to pin was pruned first (``pin_checkpoint``)."""


def step_of(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1])


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``run_dir/checkpoints``, oldest first."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    dirs = [
        d
        for d in root.glob("step_*")
        if STEP_NAME.fullmatch(d.name)
        and d.is_dir()
        and not d.is_symlink()  # a link to another run's folder is none of this run's
        and (d / STATE_FILE).is_file()
    ]
    return sorted(dirs, key=lambda d: int(d.name.split("_")[1]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points to, else the newest complete one, else None. Only a
    ``step_N`` folder of this run's ``checkpoints/`` is ever returned: a pointer naming
    anything else (``../../other/step_000004``, a link) is not followed (``--resume`` refuses
    it, naming it: ``resume_checkpoint``)."""
    root = Path(run_dir) / CKPT_DIR
    pointer = root / LATEST
    found = list_checkpoints(run_dir)
    if pointer.is_file() and not pointer.is_symlink():
        try:
            name = pointer.read_text().strip()
        except (OSError, UnicodeDecodeError):
            name = ""
        if STEP_NAME.fullmatch(name) and root / name in found:
            return root / name
    return found[-1] if found else None
