"""``paravt.checkpoint.Checkpointer`` and the trainer's one small-state schema
(``Trainer.state_dict`` / ``load_state_dict``, issue 64 items 1 and 2), in one process:

* ``trainer_state.pt`` holds exactly the save's step, the checkpointer's layout keys and the
  trainer's ``TrainerState`` keys, and ``Checkpointer.load`` puts all of it back into a fresh
  trainer (whose weights come from the export, as ``build_trainer`` loads them): optimizer,
  schedule, the source's data position, the RNG, the start step;
* the checkpointer holds its background save and returns its phase times; it writes nothing
  into the trainer (``Trainer.checkpoint`` is what records them in ``times``);
* a state that disagrees about the step, or uses the layout's own keys, is refused before
  anything is written.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch
from ckpt_trainer import linear_trainer

from paravt import checkpoint as C
from paravt.trainer import Trainer, TrainerState


def _trainer(out: Path, seed: int, data: dict[str, int]) -> Trainer:
    return linear_trainer(out, shape=(8, 4), rows=3, keep_last=2, seed=seed, warmup=4, data=data)[0]


def test_the_small_state_is_the_trainers_schema_and_loads_back_whole(tmp_path: Path) -> None:
    tr = _trainer(tmp_path, 0, {"pos": 5})
    torch.manual_seed(1234)
    assert tr.checkpoint(3)
    after_save = torch.rand(4)  # what the saved RNG state draws next
    ckpt = C.latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.name == "step_000003"
    small = C.load_trainer_state(ckpt)
    trainer_keys = set(typing.get_type_hints(TrainerState))
    assert set(small) == {"step", *C.LAYOUT_KEYS} | trainer_keys
    assert small["step"] == 3 and small["data"] == {"pos": 5} and small["world_size"] == 1

    fresh = _trainer(tmp_path / "other", 7, {"pos": 0})
    assert not torch.equal(fresh.policy.weight, tr.policy.weight)
    # The weights come from the export (``build_trainer`` loads the policy from the
    # checkpoint folder; the sharded state holds masters only under mixed precision).
    fresh.policy.load_state_dict(C.load_model_state(ckpt))
    fresh.checkpointer.load(ckpt, small)
    assert fresh.start_step == fresh.step == 3
    assert fresh.source.loaded == ({"pos": 5}, 3)
    assert fresh.scheduler.state_dict() == tr.scheduler.state_dict()
    assert torch.equal(fresh.policy.weight, tr.policy.weight)
    for p, q in zip(fresh.policy.parameters(), tr.policy.parameters()):
        a, b = fresh.optimizer.state[p], tr.optimizer.state[q]
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["step"], b["step"])
    assert torch.equal(torch.rand(4), after_save)  # the RNG as it was saved


def test_the_checkpointer_holds_its_background_save_and_returns_its_times(
    tmp_path: Path,
) -> None:
    tr = _trainer(tmp_path, 0, {"pos": 1})
    ck = tr.checkpointer
    assert ck is not None
    tr.step = 1
    saved = ck.save(1, background=True)
    assert saved.ok and saved.step == 1 and saved.times == {}
    assert ck.pending is not None and tr.times == {}  # nothing written into the trainer
    done = ck.finish()
    assert done is not None and done.ok and done.step == 1
    assert done.times["time/checkpoint_write"] > 0 and tr.times == {}
    assert ck.pending is None and ck.finish() is None
    assert C.latest_checkpoint(tmp_path) == tmp_path / C.CKPT_DIR / "step_000001"
    # Through the trainer, the times land in its step's ``times``.
    assert tr.checkpoint(2, background=True) and tr.checkpoint_pending
    assert tr.finish_checkpoint() == (2, True)
    assert tr.times["time/checkpoint_write"] > 0 and not tr.checkpoint_pending


class _Stateful:
    def __init__(self, sd: dict[str, object]) -> None:
        self.sd = sd

    def state_dict(self) -> dict[str, object]:
        return dict(self.sd)

    def load_state_dict(self, state: typing.Mapping[str, object]) -> None:
        self.sd = dict(state)


@pytest.mark.parametrize(
    ("sd", "said"),
    [({"step": 4}, "at another step"), ({"format": 9}, "the checkpoint's own keys")],
)
def test_a_state_at_another_step_or_on_the_layouts_keys_is_refused(
    tmp_path: Path, sd: dict[str, object], said: str
) -> None:
    tr = _trainer(tmp_path, 0, {"pos": 1})
    ck = C.Checkpointer.from_config(
        tr.cfg, tr.ctx, tr.policy, tr.optimizer, states={"x": _Stateful(sd)}
    )
    with pytest.raises(ValueError, match=said):
        ck.save(3)
    assert C.latest_checkpoint(tmp_path) is None
