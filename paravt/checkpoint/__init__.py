"""Checkpoints: HF-format safetensors weights + everything needed to resume a killed run.

The face is ``Checkpointer`` (``checkpointer``): built from the policy, its optimizer and
``states={"trainer": trainer}`` (anything with ``state_dict`` / ``load_state_dict``), it saves
and loads them (torchtitan's ``CheckpointManager`` contract). The package, by concern:

* ``layout``: the folder's names, step folders, the size estimate, ``CheckpointSaveError``;
* ``commit``: the atomic commit, ``keep_last`` pruning, a reader's pin, ``save_checkpoint``;
* ``small``: ``trainer_state.pt`` (written, read without running code), the RNG states;
* ``sharded``: every rank's shards of the masters and AdamW's state (DCP), their load;
* ``safe_load``: DCP's metadata and items read without running code;
* ``export``: the HF export (``save_model_dir``), ``load_model_state``, fingerprints;
* ``background``: the background write of ``train.async_save``;
* ``manifest``: the run id and each checkpoint's ``manifest.json``;
* ``trust``: ``verify_checkpoint`` and ``resume_checkpoint`` (``--resume``'s pick);
* ``sft_state``: the cold-start SFT's resumable state (``paravt.sft``);
* ``resolve``: which model folder ``python -m paravt.eval`` / ``paravt.episodes`` read.

Every name the rest of paravt, the tests and the benchmarks use is re-exported here
(``from paravt.checkpoint import ...``).
"""

from __future__ import annotations

from paravt.checkpoint.background import AsyncSave, SaveJob, start_background
from paravt.checkpoint.checkpointer import LAYOUT_KEYS, Checkpointer, Saved, Stateful
from paravt.checkpoint.commit import pin_checkpoint, save_checkpoint
from paravt.checkpoint.export import (
    EXPORT_INDEX,
    load_model_state,
    save_model_dir,
    weights_fingerprint,
)
from paravt.checkpoint.layout import (
    CKPT_DIR,
    LATEST,
    MANIFEST,
    MANIFEST_FORMAT,
    RUN_ID_FILE,
    SHARDED_FORMAT,
    STATE_FILE,
    TRAIN_STATE_DIR,
    CheckpointGone,
    CheckpointLoadError,
    CheckpointSaveError,
    checkpoint_bytes,
    latest_checkpoint,
    list_checkpoints,
    sft_save_error,
    step_dirname,
)
from paravt.checkpoint.manifest import file_digest, run_id
from paravt.checkpoint.resolve import resolve_and_pin, resolve_model_path, run_config
from paravt.checkpoint.safe_load import read_dcp_metadata
from paravt.checkpoint.sft_state import (
    SFT_STATE_FILE,
    load_sft_state,
    read_sft_small,
    save_sft_state,
    sft_state_folder,
)
from paravt.checkpoint.sharded import (
    load_sharded,
    load_train_state,
    read_train_state,
    save_sharded,
)
from paravt.checkpoint.small import (
    load_trainer_state,
    rng_state,
    safe_torch_load,
    set_rng_state,
)
from paravt.checkpoint.trust import resume_checkpoint, verify_checkpoint
from paravt.log import get_logger

#: What every module of the package logs through (``commit``, ``trust``, ``checkpointer``).
log = get_logger(__name__)

__all__ = [
    "CKPT_DIR", "EXPORT_INDEX", "LATEST", "LAYOUT_KEYS", "MANIFEST", "MANIFEST_FORMAT", "RUN_ID_FILE",
    "SFT_STATE_FILE", "SHARDED_FORMAT", "STATE_FILE", "TRAIN_STATE_DIR", "AsyncSave",
    "CheckpointGone", "CheckpointLoadError", "CheckpointSaveError", "Checkpointer", "SaveJob",
    "Saved", "Stateful", "checkpoint_bytes", "file_digest", "latest_checkpoint",
    "list_checkpoints", "load_model_state", "load_sft_state", "load_sharded",
    "load_train_state", "load_trainer_state", "pin_checkpoint", "read_dcp_metadata",
    "read_sft_small", "read_train_state", "resolve_and_pin", "resolve_model_path",
    "resume_checkpoint", "rng_state", "run_config", "run_id", "safe_torch_load",
    "save_checkpoint", "save_model_dir", "save_sft_state", "save_sharded", "set_rng_state",
    "sft_save_error", "sft_state_folder", "start_background", "step_dirname",
    "verify_checkpoint", "weights_fingerprint",
]  # fmt: skip
