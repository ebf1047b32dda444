"""Group advantages over main trajectories; sub-agents inherit them with weight 1/n."""

from __future__ import annotations

import pytest
import torch

from paravt.algo.advantages import build_units, group_advantages
from paravt.algo.packing import pack_units, split_units
from paravt.config import AlgoConfig
from paravt.types import Group, Sample, Trajectory


def _traj(uid: str, n: int, gen: int, reward: float = 0.0, parent: str | None = None):
    mask = [0] * (n - gen) + [1] * gen
    return Trajectory(
        uid=uid,
        role="sub" if parent else "main",
        sample_id=uid.split(":")[0],
        group_id=0,
        tokens=list(range(1, n + 1)),
        loss_mask=mask,
        logprobs=[-0.5 * m for m in mask],
        prompt_len=n - gen,
        parent=parent,
        reward=reward,
    )


def _groups() -> list[Group]:
    g0 = Group(
        Sample("a", "a.mp4", "q", "A"),
        0,
        8,
        [_traj("a:r0", 5, 2, 1.0), _traj("a:r1", 6, 3, 0.0), _traj("a:r2", 4, 1, 0.5)],
        [_traj("a:r0:s0", 3, 1, parent="a:r0"), _traj("a:r0:s1", 4, 2, parent="a:r0")],
    )
    g1 = Group(
        Sample("b", "b.mp4", "q", "B"),
        1,
        16,
        [_traj("b:r0", 5, 2, 2.0), _traj("b:r1", 5, 2, 2.0)],
        [_traj("b:r1:s0", 3, 2, parent="b:r1")],
    )
    return [g0, g1]


def test_group_advantage_matches_formula() -> None:
    adv = group_advantages(_groups(), AlgoConfig(adv_scale=2.0, adv_bias=0.1))
    r = torch.tensor([1.0, 0.0, 0.5])
    expected = (r - r.mean()) / (r.std() + 1e-6) * 2.0 + 0.1  # unbiased std (torch.std)
    torch.testing.assert_close(adv[:3], expected)
    # Group b: equal rewards carry no relative signal; bias still applies to a group of > 1.
    torch.testing.assert_close(adv[3:], torch.tensor([0.1, 0.1]))


def test_dr_grpo_skips_std() -> None:
    adv = group_advantages(_groups(), AlgoConfig(normalize_std=False))
    torch.testing.assert_close(adv[:3], torch.tensor([0.5, -0.5, 0.0]))


def test_sub_agents_share_parent_advantage_with_weight_one_over_n() -> None:
    units = build_units(_groups(), AlgoConfig())
    assert [u.main.uid for u in units] == ["a:r0", "a:r1", "a:r2", "b:r0", "b:r1"]
    assert [len(u.subs) for u in units] == [2, 0, 0, 0, 1]
    batch = pack_units(units)
    assert batch.uids == ["a:r0", "a:r0:s0", "a:r0:s1", "a:r1", "a:r2", "b:r0", "b:r1", "b:r1:s0"]
    assert batch.cu_seqlens.tolist() == [0, 5, 8, 12, 18, 22, 27, 32, 35]
    assert batch.seq_weights.tolist() == [1.0, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    cu = batch.cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        seg = batch.advantages[cu[i] : cu[i + 1]]
        parent = {"a:r0:s0": 0, "a:r0:s1": 0, "b:r1:s0": 4}.get(batch.uids[i])
        want = units[parent].advantage if parent is not None else None
        if want is None:
            want = next(u.advantage for u in units if u.main.uid == batch.uids[i])
        assert torch.all(seg == want), batch.uids[i]
    assert batch.loss_mask.sum().item() == 2 + 1 + 2 + 3 + 1 + 2 + 2 + 2
    assert batch.input_ids.numel() == 35  # no padding anywhere


def test_sub_agents_excluded_when_not_trained() -> None:
    units = build_units(_groups(), AlgoConfig(train_sub_agents=False))
    assert all(not u.subs for u in units)
    assert pack_units(units).uids == ["a:r0", "a:r1", "a:r2", "b:r0", "b:r1"]


@pytest.mark.parametrize("n, sizes", [(1, [5]), (2, [3, 2]), (5, [1] * 5), (7, [1] * 5)])
def test_split_units_keeps_subs_with_parents(n: int, sizes: list[int]) -> None:
    units = build_units(_groups(), AlgoConfig())
    parts = split_units(units, n)
    assert [len(p) for p in parts] == sizes
    assert [u.main.uid for p in parts for u in p] == [u.main.uid for u in units]


def test_advantages_are_computed_on_the_trainers_device_through_the_op(monkeypatch) -> None:
    """``build_units(groups, algo, device)`` (``train_step`` passes ``ctx.device``) builds the
    rewards on that device and calls the ``paravt_kernels`` op there: on CUDA its Triton
    kernel (``test_cuda_advantages_run_the_triton_kernel``). On the CPU, the meta device shows
    the tensors are made where asked (the op's fake kernel answers) and the op is the one
    called."""
    import paravt_kernels

    algo = AlgoConfig()
    seen: list[torch.device] = []
    real = paravt_kernels.group_advantage

    def spy(rewards, index, **kw):
        seen.append(rewards.device)
        return real(rewards, index, **kw)

    monkeypatch.setattr(paravt_kernels, "group_advantage", spy)
    out = group_advantages(_groups(), algo, "meta")
    assert out.device.type == "meta" and out.shape == (5,)
    assert [d.type for d in seen] == ["meta"]
    units = build_units(_groups(), algo, "cpu")
    assert [d.type for d in seen] == ["meta", "cpu"]
    assert [u.advantage for u in units] == group_advantages(_groups(), algo).tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_advantages_run_the_triton_kernel() -> None:
    """On CUDA (PARAVT_IMPL=auto) the trainer's advantages run the Triton kernel and equal the
    CPU torch path's."""
    pytest.importorskip("triton")
    from paravt_kernels.dispatch import resolve_impl

    algo = AlgoConfig()
    assert resolve_impl(torch.device("cuda"), "group_advantage") == "triton"
    on_gpu = group_advantages(_groups(), algo, "cuda")
    assert on_gpu.device.type == "cuda"
    torch.testing.assert_close(on_gpu.cpu(), group_advantages(_groups(), algo, "cpu"))
    units = build_units(_groups(), algo, torch.device("cuda"))
    assert [u.advantage for u in units] == pytest.approx(on_gpu.tolist())
