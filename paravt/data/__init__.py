"""Data: dataset readers (JSONL, ParaVT parquet) and the synthetic long-video task.

The synthetic-task names are imported lazily so ``python -m paravt.data.synth`` does not
import its own module twice (runpy warns when a package's ``__init__`` pre-imports it).
"""

from __future__ import annotations

from typing import Any

from paravt.data.readers import DatasetError, load_samples, read_samples

_SYNTH = ("generate", "read_frame_index", "write_index_clip", "write_video")

__all__ = ["DatasetError", "load_samples", "read_samples", *_SYNTH]


def __getattr__(name: str) -> Any:
    if name in _SYNTH:
        from paravt.data import synth

        return getattr(synth, name)
    raise AttributeError(f"module 'paravt.data' has no attribute '{name}'")
