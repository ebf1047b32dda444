"""The ``paravt-kernels`` distribution (``kernels/pyproject.toml``; issue 52 item 11).

What these tests prove, and what they do not:

* ``test_wheel_holds_only_paravt_kernels``: the wheel built from this checkout's ``kernels/``
  (a copy, so the tree gets no build folders) holds the package ``paravt_kernels`` with every
  module of ``kernels/`` and nothing else, and its metadata requires torch and nothing more
  (triton only under the ``triton`` extra): a ``pip install paravt-kernels`` pulls no
  transformers, PyAV, OmegaConf.
* ``test_paravt_depends_on_paravt_kernels``: the ``paravt`` distribution's metadata (from the
  root ``setup.py``/``pyproject.toml``, as a wheel build prepares it) requires exactly this
  version of ``paravt-kernels`` and no longer ships ``paravt_kernels`` itself (one owner of
  those files; ``make install`` installs both editable).
* ``test_installed_wheel_runs_alone``: the wheel, installed with ``pip --target`` into an empty
  folder, runs its ops in a separate interpreter (``python -I -S``: no site-packages, no
  ``PYTHON*`` variables) whose path is the standard library, that folder, and a folder of
  links to torch's own distributions only (torch and what its metadata requires, resolved
  from this venv; no download): transformers, av, omegaconf, paravt, ... are asserted NOT
  importable there. Without triton the ops run their torch path (``PARAVT_IMPL=auto`` on CPU);
  with triton's distribution added (and numpy, which Triton's CPU interpreter imports without
  declaring it), the Triton kernels run under that interpreter. It does not
  prove that pip would resolve torch from PyPI for the wheel (no network is used), nor test
  on GPU.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
# the version in kernels/pyproject.toml ([project] holds the only `version = ` line there)
KERNELS_VERSION = re.search(
    r'^version = "([^"]+)"$', (KERNELS / "pyproject.toml").read_text(), re.M
)[1]
# paravt's own dependencies (pyproject.toml) and neighbours: none may be importable beside the
# installed kernels wheel
NOT_THERE = ["paravt", "transformers", "av", "omegaconf", "tokenizers", "safetensors", "PIL",
             "pyarrow", "tqdm", "yaml", "matplotlib", "tensorboard", "liger_kernel", "vllm"]  # fmt: skip


def _pip(*args: str, cwd: Path | None = None) -> None:
    """``python -m pip`` of this venv, offline (``--no-index``); fails the test with pip's output."""
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``paravt-kernels`` wheel built offline from a copy of ``kernels/``."""
    tmp = tmp_path_factory.mktemp("kernels_dist")
    src = tmp / "kernels"
    shutil.copytree(
        KERNELS, src, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    )
    _pip("wheel", "-q", "--no-deps", "--no-index", "--no-build-isolation", "-w", str(tmp), str(src))
    (whl,) = tmp.glob("paravt_kernels-*.whl")
    return whl


def _metadata(whl: Path) -> tuple[list[str], str]:
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        return names, z.read(meta).decode()


def test_wheel_holds_only_paravt_kernels(wheel: Path) -> None:
    names, meta = _metadata(wheel)
    version = KERNELS_VERSION
    info = f"paravt_kernels-{version}.dist-info/"
    stray = [n for n in names if not (n.startswith(("paravt_kernels/", info)))]
    assert not stray, f"the wheel holds files outside paravt_kernels: {stray}"
    modules = {n.removeprefix("paravt_kernels/") for n in names if n.startswith("paravt_kernels/")}
    assert modules == {p.name for p in KERNELS.glob("*.py")}, "the wheel is not kernels/*.py"
    assert re.search(r"^Name: paravt-kernels$", meta, re.M)
    assert re.search(rf"^Version: {re.escape(version)}$", meta, re.M)
    reqs = [Requirement(r) for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M)]
    plain = {r.name for r in reqs if r.marker is None}
    extra = {r.name for r in reqs if r.marker is not None}
    assert plain == {"torch"}, f"paravt-kernels must require torch only, requires {plain}"
    assert extra == {"triton"}, extra
    (tri,) = [r for r in reqs if r.name == "triton"]
    assert tri.marker.evaluate({"extra": "triton"}) and not tri.marker.evaluate({"extra": ""})


def test_paravt_depends_on_paravt_kernels(tmp_path: Path) -> None:
    code = (
        "import sys; from setuptools import build_meta; "
        "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    env = {**os.environ, "PARAVT_SKIP_EXT": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    info = tmp_path / out.stdout.strip().splitlines()[-1]
    meta = (info / "METADATA").read_text()
    pins = [
        Requirement(r)
        for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M)
        if Requirement(r).name == "paravt-kernels"
    ]
    assert [str(p.specifier) for p in pins] == [f"=={KERNELS_VERSION}"], pins
    top = set((info / "top_level.txt").read_text().split())
    assert "paravt" in top and "paravt_kernels" not in top, top


def _dist_closure(names: list[str]) -> list[md.Distribution]:
    """The installed distributions ``names`` and, recursively, what their metadata requires
    (markers evaluated for this interpreter, no extras); a requirement not installed here is
    left out (its absence then shows as an import error in the subprocess)."""
    env = {**default_environment(), "extra": ""}
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[name] = dist
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return list(seen.values())


def _link_dists(dists: list[md.Distribution], into: Path) -> None:
    """Symlink each distribution's top-level files and folders (and its .dist-info) into ``into``."""
    into.mkdir(exist_ok=True)
    for dist in dists:
        for f in dist.files or []:
            first = f.parts[0]
            if first in ("..", "__pycache__") or (into / first).exists():
                continue
            (into / first).symlink_to(Path(dist.locate_file(first)))


# Run by `python -I -S` with argv: the wheel's install folder, the torch-only folder, whether
# triton is there. Checks the isolation first, then runs the ops against plain torch formulas.
_RUN = r"""
import importlib.util, os, sys
target, torch_only, with_triton = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
sys.path += [target, torch_only]
leaked = [m for m in sys.argv[4].split(",") if importlib.util.find_spec(m) is not None]
assert not leaked, f"importable beside the kernels wheel: {leaked}"
assert (importlib.util.find_spec("triton") is not None) == with_triton
import torch
import paravt_kernels as pk
assert pk.__file__.startswith(target), pk.__file__
from paravt_kernels.dispatch import resolve_impl
impl = resolve_impl(torch.device("cpu"), "policy_loss")
assert impl == ("triton" if with_triton else "torch"), impl
g = torch.Generator().manual_seed(0)
r = torch.randn(12, generator=g); gid = torch.arange(12) // 4
adv = pk.group_advantage(r, gid)
rg = r.view(3, 4)
want = ((rg - rg.mean(1, keepdim=True)) / (rg.std(1, keepdim=True) + 1e-6)).flatten()
torch.testing.assert_close(adv, want)
cu = torch.tensor([0, 5, 9, 16])
tok = pk.broadcast_to_tokens(adv[:3], cu, total_tokens=16)
n, d, v = 16, 24, 37
h = torch.randn(n, d, generator=g, requires_grad=True)
w = torch.randn(v, d, generator=g, requires_grad=True)
t = torch.randint(0, v, (n,), generator=g)
old = torch.randn(n, generator=g) * 0.1 - 3.0
mask = torch.ones(n)
loss, stats, lp, ent = pk.linear_policy_loss(
    h, w, t, old, tok, mask, temperature=0.7, clip_low=0.2, clip_high=0.28,
    agg="seq-mean-token-mean", cu_seqlens=cu)
loss.backward()
# the same loss from full logits and autograd
h0, w0 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
lp0 = torch.log_softmax(h0 @ w0.T / 0.7, -1).gather(1, t[:, None]).squeeze(1)
ratio = torch.exp(lp0 - old)
per = torch.maximum(-tok * ratio, -tok * ratio.clamp(0.8, 1.28))
seq = torch.repeat_interleave(torch.arange(3), cu.diff())
loss0 = sum(per[seq == s].mean() for s in range(3)) / 3
loss0.backward()
torch.testing.assert_close(lp, lp0.detach(), rtol=1e-4, atol=1e-4)
torch.testing.assert_close(loss, loss0, rtol=1e-4, atol=1e-5)
torch.testing.assert_close(h.grad, h0.grad, rtol=1e-4, atol=1e-5)
torch.testing.assert_close(w.grad, w0.grad, rtol=1e-4, atol=1e-5)
print("ran", impl)
"""


@pytest.mark.parametrize("with_triton", [False, True], ids=["torch-only", "with-triton"])
def test_installed_wheel_runs_alone(wheel: Path, tmp_path: Path, with_triton: bool) -> None:
    if with_triton and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed in this venv: the with-triton case cannot run")
    target = tmp_path / "site"
    _pip("install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel))
    # Triton's CPU interpreter imports numpy, which triton's metadata does not declare
    roots = ["torch", "triton", "numpy"] if with_triton else ["torch"]
    _link_dists(_dist_closure(roots), tmp_path / "torch_only")
    env = {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1", "PARAVT_IMPL": "auto"}
    if with_triton:
        env |= {"PARAVT_IMPL": "triton", "TRITON_INTERPRET": "1", "HOME": str(tmp_path)}
    args = [str(target), str(tmp_path / "torch_only"), "1" if with_triton else "0"]
    leak = ",".join(NOT_THERE)
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _RUN, *args, leak],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    assert out.stdout.strip().endswith("ran triton" if with_triton else "ran torch"), out.stdout
