"""The source folder ``kernels/`` imported as a bare ``kernels`` (the repository root on
sys.path, as under ``python -m``) must alias the installed ``paravt_kernels`` instead of
registering the ``paravt::`` ops a second time (that crashed ``policy_loss`` after a model load,
because transformers imports ``kernels`` while probing for PyPI's package)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
import paravt_kernels
from transformers.utils import import_utils
import kernels
assert kernels is paravt_kernels, kernels
assert not import_utils.is_kernels_available()
n = 11
cu = torch.tensor([0, 4, 11])
for agg in ("token-mean", "seq-mean-token-mean"):
    lp = torch.randn(n, requires_grad=True)
    loss, _ = paravt_kernels.policy_loss(lp, torch.randn(n), torch.randn(n), torch.ones(n),
                                         cu_seqlens=cu, agg=agg)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
print("alias-ok")
"""


def test_bare_kernels_import_is_the_installed_package():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(root=str(ROOT))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "alias-ok" in out.stdout
