"""Reading DCP's files without running code: a ``.metadata`` through
``_MetadataUnpickler`` (DCP's records only, ``read_dcp_metadata``) and its non-tensor items with
``torch.load(weights_only=True)`` (``safe_load_planner``). Used by every load of the sharded
state (``sharded.load_sharded``, ``read_train_state``), ``trust.verify_checkpoint`` and the SFT
state's check (``sft_state.read_sft_small``).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

#: What a DCP ``.metadata`` pickle may name: DCP's own records, ``torch.Size`` and dtypes,
#: the layout decoder, a path. ``_MetadataUnpickler`` refuses anything else before DCP reads
#: the file (``FileSystemReader.read_metadata`` is a plain ``pickle.load``).
_DCP_METADATA_NAMES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_METADATA_NAMES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"names {module}.{name}, which no checkpoint's metadata holds (code to run on load)"
        )


def read_dcp_metadata(path: str | Path) -> Any:
    """A DCP ``.metadata`` file read through ``_MetadataUnpickler`` (DCP's records only)."""
    with open(path, "rb") as f:
        return _MetadataUnpickler(f).load()


def checked_reader(path: str | Path) -> Any:
    """DCP's ``FileSystemReader`` whose metadata read is ``read_dcp_metadata`` (no code runs
    from a planted ``.metadata``). ``load_sharded`` and ``read_train_state`` read with it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            md = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return _Reader(str(path))


def safe_load_planner(empty: bool = False) -> Any:
    """DCP's default load planner (``empty``: the one that builds the state dict from the
    metadata, ``read_train_state``'s) with its non-tensor items (AdamW's param groups) read by
    ``torch.load(weights_only=True)``, not ``weights_only=False`` as DCP's own does."""
    import io

    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        _EmptyStateDictLoadPlanner,
    )
    from torch.distributed.checkpoint.planner import ReadItem

    class _Planner(_EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner):  # type: ignore[misc]
        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._nested_dict import set_element

            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _Planner()


def short_reason(e: BaseException) -> str:
    """An exception's first line, short (torch's weights-only refusal is a page long)."""
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    if "Weights only load failed" in first or "weights_only" in first:
        names = re.findall(r"GLOBAL ([\w.]+)", str(e))
        first = f"it names {names[0]}, code that only a trusted file may run" if names else first
    return f"{type(e).__name__}: {first[:200]}"
