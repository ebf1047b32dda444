"""Checkpoints that ``--resume`` can trust (issue 66 items 1 and 6, checkpoint files).

A real checkpoint of a small one-process trainer (``paravt.checkpoint.Checkpointer``: HF
export, ``trainer_state.pt``, DCP ``train_state/.metadata`` and ``__0_0.distcp``,
``manifest.json``), two steps of it, then each hostile input in turn, checked through
``resume_checkpoint`` (what ``paravt.train.build_trainer`` calls on ``--resume``):

* a planted pickle that would write a marker file, as ``trainer_state.pt`` or as the DCP
  ``.metadata`` (with the manifest rewritten to match, as someone holding the folder could):
  refused, and the marker is never written;
* shards or a whole checkpoint copied in from another run, a ``latest`` naming
  ``../../other/...`` or a ``step_*`` link out of the run: refused naming the file;
* the fuzz: every file of the checkpoint truncated, a byte flipped, deleted: each case one line
  (``CheckpointLoadError``) naming the step, the file and the newest intact checkpoint, and
  ``train.resume_fallback`` continues from that one;
* a torn SFT ``state.pt``: one line.

On today's main ``--resume`` takes ``latest_checkpoint`` and ``torch.load(weights_only=False)``:
the planted pickles run (the marker appears), the foreign shard and the damaged files load or
end in raw ``EOFError``/``SafetensorError``/``RuntimeError`` tracebacks; there is no
``resume_checkpoint`` to call.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_trainer import linear_trainer

from paravt import checkpoint as C
from paravt.checkpoint import CheckpointLoadError, resume_checkpoint
from paravt.distributed import DistContext
from paravt.trainer import Trainer


def _trainer(out: Path, seed: int = 0) -> Trainer:
    return linear_trainer(out, shape=(16, 8), rows=4, keep_last=3, seed=seed)[0]


def _run_with_two(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """A run folder with its id and checkpoints at steps 1 and 2 (``latest`` = step 2)."""
    C.run_id(out, create=True)
    tr = _trainer(out, seed)
    assert tr.checkpoint(1) and tr.checkpoint(2)
    root = out / C.CKPT_DIR
    return root / "step_000001", root / "step_000002"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pristine") / "run"
    _run_with_two(out)
    return out


def _copy(pristine: Path, tmp_path: Path) -> tuple[Path, Path, Path]:
    out = tmp_path / "run"
    shutil.copytree(pristine, out, symlinks=True)
    root = out / C.CKPT_DIR
    return out, root / "step_000001", root / "step_000002"


def _refusal(out: Path, **kw: Any) -> str:
    with pytest.raises(CheckpointLoadError) as e:
        resume_checkpoint(out, DistContext(), **kw)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


class _Marker:
    """Unpickling it writes a marker file (what a planted checkpoint would do, only louder)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (Path(self.path), "ran"))


def _rewrite_manifest(ckpt: Path, name: str) -> None:
    """What someone holding the folder can do: make the manifest match the file they planted."""
    man = json.loads((ckpt / C.MANIFEST).read_text())
    f = ckpt / name
    man["files"][name] = [f.stat().st_size, C.file_digest(f)]
    (ckpt / C.MANIFEST).write_text(json.dumps(man))


def test_the_run_resumes_from_its_own_intact_latest(pristine: Path, tmp_path: Path) -> None:
    out, _, two = _copy(pristine, tmp_path)
    assert resume_checkpoint(out, DistContext()) == two
    man = json.loads((two / C.MANIFEST).read_text())
    assert man["run_id"] == C.run_id(out) and man["step"] == 2
    assert {"trainer_state.pt", "model.safetensors", "train_state/.metadata"} <= set(man["files"])
    assert any(n.endswith(".distcp") for n in man["files"])


def test_a_planted_trainer_state_pickle_is_refused_without_running(
    pristine: Path, tmp_path: Path
) -> None:
    out, one, two = _copy(pristine, tmp_path)
    marker = tmp_path / "pwned"
    state = torch.load(two / C.STATE_FILE, weights_only=False)
    state["scheduler"] = _Marker(str(marker))
    torch.save(state, two / C.STATE_FILE)
    _rewrite_manifest(two, C.STATE_FILE)
    msg = _refusal(out)
    assert not marker.exists(), "the planted pickle ran"
    assert "step 2" in msg and C.STATE_FILE in msg and "without running code" in msg
    assert "step 1" in msg and str(one) in msg and "resume_fallback" in msg
    # The loader itself, called directly (load_trainer_state), refuses it too.
    with pytest.raises(Exception, match="Weights only load failed"):
        C.load_trainer_state(two)
    assert not marker.exists()


def test_a_planted_dcp_metadata_pickle_is_refused_without_running(
    pristine: Path, tmp_path: Path
) -> None:
    out, one, two = _copy(pristine, tmp_path)
    marker = tmp_path / "pwned"
    meta = two / C.TRAIN_STATE_DIR / ".metadata"
    import pickle

    meta.write_bytes(pickle.dumps(_Marker(str(marker))))
    _rewrite_manifest(two, f"{C.TRAIN_STATE_DIR}/.metadata")
    msg = _refusal(out)
    assert not marker.exists(), "the planted pickle ran"
    assert "train_state/.metadata" in msg and "cannot be read safely" in msg
    assert "pathlib" in msg or "write_text" in msg
    assert "step 2" in msg and str(one) in msg
    # DCP's own reader path (load_sharded's _checked_reader) refuses it as well (DCP wraps
    # the reader's UnpicklingError in its CheckpointException, a BaseException).
    tr = _trainer(tmp_path / "other")
    with pytest.raises(BaseException, match="which no checkpoint's metadata holds"):
        C.load_sharded(two / C.TRAIN_STATE_DIR, tr.policy, tr.optimizer, masters=False)
    assert not marker.exists()


def test_shards_and_checkpoints_of_another_run_are_refused(pristine: Path, tmp_path: Path) -> None:
    out, one, two = _copy(pristine, tmp_path)
    other = tmp_path / "other"
    o1, o2 = _run_with_two(other, seed=1)
    shard = f"{C.TRAIN_STATE_DIR}/__0_0.distcp"
    # Another run's shard copied over this run's (its bytes differ: a different init).
    shutil.copy2(o2 / shard, two / shard)
    msg = _refusal(out)
    assert shard in msg and "digest" in msg and "step 2" in msg and str(one) in msg
    # A foreign shard added beside this run's.
    out, one, two = _copy(pristine, tmp_path / "b")
    shutil.copy2(o2 / shard, two / C.TRAIN_STATE_DIR / "__1_0.distcp")
    msg = _refusal(out)
    assert "train_state/__1_0.distcp" in msg and "not one of the files this run wrote" in msg
    # A whole checkpoint of another run, copied in as the newest.
    out, one, two = _copy(pristine, tmp_path / "c")
    shutil.copytree(o2, out / C.CKPT_DIR / "step_000003")
    (out / C.CKPT_DIR / "latest").write_text("step_000003")
    msg = _refusal(out)
    assert "step 3" in msg and "another run" in msg and C.run_id(other) in msg
    assert f"step 2 ({two})" in msg  # the newest intact one is offered


def test_a_latest_pointer_out_of_the_run_is_refused(pristine: Path, tmp_path: Path) -> None:
    out, one, two = _copy(pristine, tmp_path)
    other = tmp_path / "other"
    _, o2 = _run_with_two(other)
    latest = out / C.CKPT_DIR / "latest"
    latest.write_text("../../other/checkpoints/step_000002")
    msg = _refusal(out)
    assert str(latest) in msg and "../../other" in msg and f"step 2 ({two})" in msg
    assert resume_checkpoint(out, DistContext(), fallback=True) == two
    assert C.latest_checkpoint(out) == two  # never the other run's
    # A step_* link into the other run, named by latest.
    (out / C.CKPT_DIR / "step_000009").symlink_to(o2)
    latest.write_text("step_000009")
    msg = _refusal(out)
    assert "step_000009" in msg and str(o2) in msg and "link" in msg


# The fuzz: every file of a real checkpoint, three ways each.
_FILES = [
    "trainer_state.pt",
    "model.safetensors",
    "manifest.json",
    "train_state/.metadata",
    "train_state/__0_0.distcp",
]


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: max(1, f.stat().st_size // 2)])


def _flip(f: Path) -> None:
    data = bytearray(f.read_bytes())
    for at in (len(data) // 3, len(data) - 1):
        data[at] ^= 0x5A
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip", "delete"])
@pytest.mark.parametrize("name", _FILES)
def test_fuzz_every_damaged_file_is_one_line_and_the_fallback_continues(
    pristine: Path, tmp_path: Path, name: str, how: str
) -> None:
    out, one, two = _copy(pristine, tmp_path)
    f = two / name
    assert f.is_file(), sorted(str(p.relative_to(two)) for p in two.rglob("*"))
    {"truncate": _truncate, "flip": _flip, "delete": Path.unlink}[how](f)
    msg = _refusal(out)
    assert msg.startswith("--resume refused: checkpoint step 2 ("), msg
    assert name in msg, msg
    assert f"The newest intact checkpoint is step 1 ({one})" in msg, msg
    assert "train.resume_fallback=true" in msg
    assert resume_checkpoint(out, DistContext(), fallback=True) == one
    # And what the fallback hands over loads (the state and the shards, no code run).
    state = C.load_trainer_state(one)
    tr = _trainer(tmp_path / "fresh")
    C.load_train_state(one, state, tr.policy, tr.optimizer, DistContext())


def test_no_intact_checkpoint_left_says_so(pristine: Path, tmp_path: Path) -> None:
    out, one, two = _copy(pristine, tmp_path)
    _truncate(one / "model.safetensors")
    (two / C.STATE_FILE).unlink()  # latest's folder, incomplete: damaged, not skipped
    msg = _refusal(out, fallback=True)
    assert "checkpoint step 2" in msg and "trainer_state.pt is missing" in msg
    assert "No other checkpoint of this run is intact" in msg


@pytest.mark.parametrize("how", ["truncate", "flip", "delete"])
@pytest.mark.parametrize(
    "name", ["state.pt", "manifest.json", "train_state/.metadata", "train_state/__0_0.distcp"]
)
def test_a_damaged_sft_state_is_one_line(tmp_path: Path, how: str, name: str) -> None:
    tr = _trainer(tmp_path)
    path = tmp_path / "sft.resume"
    C.save_sft_state(path, {"step": 3, "losses": [1.0]}, tr.policy, tr.optimizer, DistContext())
    folder = C.sft_state_folder(path)
    assert folder is not None and C.read_sft_small(folder)["step"] == 3
    f = folder / name
    {"truncate": _truncate, "flip": _flip, "delete": Path.unlink}[how](f)
    from paravt.sft import _read_sft_state  # the SFT's resume reads it so

    with pytest.raises(CheckpointLoadError) as e:
        _read_sft_state(path)
    msg = str(e.value)
    assert "\n" not in msg and name in msg and str(folder) in msg and "Remove" in msg


def test_a_planted_sft_metadata_is_refused_without_running(tmp_path: Path) -> None:
    import pickle

    tr = _trainer(tmp_path)
    path = tmp_path / "sft.resume"
    C.save_sft_state(path, {"step": 3}, tr.policy, tr.optimizer, DistContext())
    marker = tmp_path / "pwned"
    (path / "train_state/.metadata").write_bytes(pickle.dumps(_Marker(str(marker))))
    _rewrite_manifest(path, "train_state/.metadata")
    with pytest.raises(CheckpointLoadError, match="train_state/.metadata cannot be read safely"):
        C.read_sft_small(path)
    assert not marker.exists()


def test_a_torn_legacy_sft_file_is_one_line(tmp_path: Path) -> None:
    legacy = tmp_path / "sft.resume.pt"
    torch.save({"step": 1, "model": {"w": torch.ones(64)}}, legacy)
    _truncate(legacy)
    with pytest.raises(CheckpointLoadError, match="sft.resume.pt") as e:
        C.read_sft_small(legacy)
    assert "\n" not in str(e.value)


def test_a_real_resume_refuses_a_damaged_latest_and_falls_back_when_asked(
    assets: dict[str, str], tmp_path: Path
) -> None:
    """The main path: ``python -m paravt.train --resume`` (``build_trainer`` picks the
    checkpoint through ``resume_checkpoint``) on a run whose newest checkpoint's export was
    cut short exits 1 with the one line, no traceback; ``train.resume_fallback=true``
    continues from the step before, bitwise the first run's next row. On main the same
    resume died in a raw ``SafetensorError`` traceback."""
    import subprocess
    import sys

    from test_train_resume import tiny_overrides
    from train_runs import ROOT, assert_same_row, train_rows

    out = tmp_path / "run"
    over = [*tiny_overrides(assets, out, 4), "train.save_every=2", "train.keep_last=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "paravt.train", *extra, *over]
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    first = train()
    assert first.returncode == 0, first.stderr[-3000:]
    rows = train_rows(out)
    root = out / C.CKPT_DIR
    assert (root / "latest").read_text().strip() == "step_000004"
    _truncate(root / "step_000004" / "model.safetensors")

    refused = train("--resume")
    assert refused.returncode == 1, refused.stderr[-3000:]
    said = refused.stdout + refused.stderr
    assert "Traceback" not in said, said[-3000:]
    line = next(x for x in said.splitlines() if "--resume refused" in x)
    assert "checkpoint step 4" in line and "model.safetensors" in line
    assert f"step 2 ({root / 'step_000002'})" in line and "resume_fallback=true" in line

    fell_back = train("--resume", "train.resume_fallback=true")
    assert fell_back.returncode == 0, fell_back.stderr[-3000:]
    assert "resuming from the newest intact checkpoint, step 2" in (
        fell_back.stdout + fell_back.stderr
    )
    again = train_rows(out)
    assert sorted(again) == [1, 2, 3, 4]
    assert_same_row(3, rows[3], again[3], "resumed from the intact step 2")
