"""Data: dataset readers (JSONL, ParaVT parquet), SFT records (``sft_records``: ``SFTRecord``,
one ``sft.jsonl`` line), the synthetic long-video task and the collapse cold start's records
(``cold_start``).

The synthetic-task names are imported lazily so ``python -m paravt.data.synth`` does not
import its own module twice (runpy warns when a package's ``__init__`` pre-imports it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paravt.data.readers import DatasetError, load_samples, read_samples
from paravt.data.sft_records import SFTRecord, SFTTurn, read_sft_records, write_sft_records

_SYNTH = ("generate", "read_frame_index", "write_index_clip", "write_video")

__all__ = [
    "DatasetError",
    "SFTRecord",
    "SFTTurn",
    "load_samples",
    "read_samples",
    "read_sft_records",
    "resolve_data",
    "write_sft_records",
    *_SYNTH,
]


def resolve_data(cfg: Any) -> Path:
    """The dataset location of ``cfg`` (a ``paravt.config.Config``): ``data.path``, or the
    synthetic task (generated into ``data.synth_dir`` if absent). Used by
    ``python -m paravt.episodes`` and ``python -m paravt.eval --benchmark synth``."""
    if cfg.data.path:
        return Path(cfg.data.path)
    # lazy: PyAV, only when the synthetic task is read or generated
    from paravt.data.synth import generate_from_config

    return generate_from_config(cfg)


def __getattr__(name: str) -> Any:
    if name in _SYNTH:
        # lazy: PyAV, only when the synthetic task is read or generated
        from paravt.data import synth

        return getattr(synth, name)
    raise AttributeError(f"module 'paravt.data' has no attribute '{name}'")
