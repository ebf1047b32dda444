"""``paravt_kernels.reference``, the face over the per-op torch references (issue 52 item 7).

The four ops' torch references live beside their Triton files (``<op>_reference.py``) and
``packing.py``; ``reference`` re-exports them so that ``paravt_kernels.reference.<name>`` keeps
working. Checked here: every name the one-file module exported is still there and IS the
owner's object (no copy that could drift), each name has exactly one owner that defines it,
a ``monkeypatch`` of a call-time constant on its owner reaches the code that reads it (the
torch and Triton row chunks of ``linear_policy_loss``) and is undone with the patch, and
paravt imports no name through the face (issue 64: the face no longer swaps its module class
to forward patches; paravt reads each name from its owner).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from paravt_kernels import linear_logprob_reference as llr
from paravt_kernels import linear_policy_loss_reference as lplr
from paravt_kernels import reference

# ``__all__`` of the one-file reference.py before the split, and the names its importers use
# (paravt.plan, paravt.algo.advantages, kernels/*.py, tests/, bench/).
OLD_PUBLIC = {
    "AGG_MODES", "KL_TYPES", "POLICY_STAT_NAMES", "broadcast_to_tokens", "group_advantage_torch",
    "kl_penalty", "linear_logprob_torch", "linear_policy_loss_fused", "linear_policy_loss_torch",
    "policy_loss_torch", "seq_ids_from_cu_seqlens",
    "LINEAR_POLICY_STAT_NAMES", "LPL_CHUNK_BYTES_CPU", "TORCH_VOCAB_TILE", "lpl_row_chunk",
    "K3_KL_CLAMP", "K3_LOG_RATIO_CLAMP", "LOG_RATIO_CLAMP", "covered_tokens",
    "linear_logprob_forward_torch", "linear_logprob_backward_torch", "inverse_temperature",
    "row_stats", "void_row_stand_ins", "zero_nonfinite_dead_rows", "policy_loss_fused_torch",
    "policy_loss_grad_torch", "policy_token_terms", "seq_coefficients",
    "linear_policy_loss_schema_args", "TorchRowChunks", "policy_token_scale", "policy_token_grad",
}  # fmt: skip


def test_face_reexports_the_owners_objects() -> None:
    missing = OLD_PUBLIC - set(reference.__all__)
    assert not missing, f"reference.py no longer exports {sorted(missing)}"
    for name in reference.__all__:
        owner = reference.OWNERS[name]
        assert getattr(reference, name) is owner.__dict__[name], name
        obj = owner.__dict__[name]
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__module__ == owner.__name__, f"{name} is defined in {obj.__module__}"


def test_each_op_reference_sits_beside_its_triton_file() -> None:
    """One op per file: each ``<op>_torch`` is owned by ``<op>_reference``."""
    for op in ("group_advantage", "linear_logprob", "policy_loss", "linear_policy_loss"):
        assert reference.OWNERS[f"{op}_torch"].__name__ == f"paravt_kernels.{op}_reference"


def test_owner_monkeypatch_reaches_the_row_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = 257
    h = torch.zeros(50, 8)
    w32, w16 = torch.zeros(vocab, 8), torch.zeros(vocab, 8, dtype=torch.bfloat16)
    default_rows = lplr.TorchRowChunks(h, w32, None, 1.0).rows
    with monkeypatch.context() as mp:
        mp.setattr(reference.OWNERS["LPL_CHUNK_BYTES_CPU"], "LPL_CHUNK_BYTES_CPU", 7 * 4 * vocab)
        mp.setattr(reference.OWNERS["TORCH_VOCAB_TILE"], "TORCH_VOCAB_TILE", 100)
        assert lplr.LPL_CHUNK_BYTES_CPU == 7 * 4 * vocab and llr.TORCH_VOCAB_TILE == 100
        assert lplr.TorchRowChunks(h, w32, None, 1.0).rows == 7
        assert lplr.TorchRowChunks(h, w16, None, 1.0).tiles == [(0, 100), (100, 200), (200, 257)]
        pytest.importorskip("triton")
        from paravt_kernels.linear_policy_loss_triton import TritonRowChunks

        assert TritonRowChunks(h, w32, None, 1.0).rows == 7
    # undone with the patch
    assert lplr.LPL_CHUNK_BYTES_CPU == reference.LPL_CHUNK_BYTES_CPU == 64 << 20
    assert llr.TORCH_VOCAB_TILE == reference.TORCH_VOCAB_TILE == 2048
    assert lplr.TorchRowChunks(h, w32, None, 1.0).rows == default_rows


def test_paravt_imports_no_name_through_the_face() -> None:
    """paravt, the benchmarks and the kernels' own modules import each name from its owner."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    users = [
        p
        for d in ("paravt", "bench", "kernels")
        for p in sorted((root / d).rglob("*.py"))
        if p.name != "reference.py"
        and (
            "paravt_kernels.reference" in p.read_text()
            or "from paravt_kernels import reference" in p.read_text()
            or (p.parent.name == "kernels" and "from . import reference" in p.read_text())
        )
    ]
    assert users == [], [str(p.relative_to(root)) for p in users]
    assert type(reference) is type(inspect)  # a plain module: no class swapped in
