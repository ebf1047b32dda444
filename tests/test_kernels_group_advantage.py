"""group_advantage / broadcast_to_tokens: Triton kernel (CPU interpreter) and torch path vs a
per-group Python loop in float64 (the formulation in TRL/verl)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from paravt_kernels import broadcast_to_tokens, group_advantage  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
IMPLS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
]


def _loop_oracle(rewards, groups, normalize_std, eps, scale, bias):
    """verl-style: a Python loop over groups; unbiased std as torch.std (TRL)."""
    out = torch.zeros(len(rewards), dtype=torch.float64)
    r = rewards.double()
    for gid in set(groups.tolist()):
        idx = (groups == gid).nonzero().squeeze(1)
        if len(idx) == 1:
            continue  # no relative signal: 0
        x = r[idx]
        a = x - x.mean()
        if normalize_std:
            a = a / (x.std() + eps)
        out[idx] = a * scale + bias
    return out


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
@pytest.mark.parametrize("n,num_groups", [(1, 1), (7, 3), (83, 20), (1031, 129)])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_matches_loop(impl, n, num_groups, normalize_std):
    g = torch.Generator().manual_seed(n)
    # ragged groups in shuffled order, arbitrary (non-contiguous, large) ids
    groups = torch.randint(0, num_groups, (n,), generator=g) * 7919 + 123456789
    rewards = torch.randn(n, generator=g) * 2 + 50  # a common offset tests the variance pass
    got = group_advantage(
        rewards, groups, normalize_std=normalize_std, eps=1e-6, scale=1.5, bias=0.1
    )
    want = _loop_oracle(rewards, groups, normalize_std, 1e-6, 1.5, 0.1)
    # error budget: 2x that of the same computation in fp32 torch (the loop in fp32)
    want32 = _loop_oracle(rewards.float(), groups, normalize_std, 1e-6, 1.5, 0.1).float()
    budget = 2 * (want32.double() - want).abs().max() + 4 * torch.finfo(torch.float32).eps * (
        want.abs().max() + 1
    )
    assert got.dtype == torch.float32 and got.shape == (n,)
    assert (got.double() - want).abs().max() <= budget


@pytest.mark.parametrize("impl", IMPLS, indirect=True)
def test_singletons_and_equal_rewards(impl):
    groups = torch.tensor([5, 9, 9, 9, 2, 7, 7])
    rewards = torch.tensor([3.0, 1.0, 1.0, 1.0, -4.0, 0.0, 1.0])
    adv = group_advantage(rewards, groups, scale=2.0, bias=0.5)
    # size-1 groups (ids 5, 2): exactly 0, bias not applied
    assert adv[0] == 0 and adv[4] == 0
    # all-equal group: centred 0 -> the bias only, never NaN from 0/0
    torch.testing.assert_close(adv[1:4], torch.full((3,), 0.5))
    # two-member group: unbiased std of (0, 1) = 1/sqrt(2)
    s = (0.5**0.5) + 1e-6
    torch.testing.assert_close(adv[5:], torch.tensor([-0.5 / s * 2 + 0.5, 0.5 / s * 2 + 0.5]))


def test_broadcast_to_tokens_with_parents():
    values = torch.tensor([1.0, -2.0, 0.0, 0.0, 3.0])
    cu = torch.tensor([0, 2, 5, 6, 9, 10], dtype=torch.int32)
    parent = torch.tensor([-1, -1, 0, 1, -1])  # sequences 2, 3 are sub-agents of 0 and 1
    out = broadcast_to_tokens(values, cu, parent_index=parent)
    want = torch.tensor([1, 1, -2, -2, -2, 1, -2, -2, -2, 3], dtype=torch.float32)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(broadcast_to_tokens(values, cu, total_tokens=10)[:2], torch.ones(2))
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        broadcast_to_tokens(values, cu[:-1])


def test_errors():
    with pytest.raises(ValueError, match="group_index has 2 elements but rewards has 3"):
        group_advantage(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="group_index has dtype torch.float32"):
        group_advantage(torch.zeros(3), torch.zeros(3))
