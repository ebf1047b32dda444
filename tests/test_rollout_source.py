"""The rollout source (``paravt.rollout_source``): the one prompt plan both sources use, and the
trainer's sampler living in its source (a script that narrows the prompts reaches the step)."""

from __future__ import annotations

from types import SimpleNamespace

from scripted_engine import own_score, scripted_trainer

from paravt.config import load_config
from paravt.data.sampler import PromptSampler
from paravt.distributed import DistContext
from paravt.rollout_source import LocalRollout, plan_prompts


def test_each_rank_plans_its_share_of_the_one_plan() -> None:
    """``plan_prompts`` with a rank's context is that rank's slice of the whole step's plan
    (what the asynchronous pipeline hands out on rank 0): same prompts, K and seed."""
    cfg = load_config(overrides=["train.prompts_per_step=4", "video.frame_budgets=[2,4,8]"])
    samples = [SimpleNamespace(id=f"s{i}") for i in range(10)]
    whole = plan_prompts(PromptSampler(samples, seed=3), cfg, step=5)
    assert len(whole.samples) == 4 and len(whole.budgets) == 4
    for rank in (0, 1):
        ctx = DistContext(rank=rank, world_size=2)
        mine = plan_prompts(PromptSampler(samples, seed=3), cfg, step=5, ctx=ctx)
        share = slice(2 * rank, 2 * rank + 2)  # contiguous, as the pipeline splits its groups
        assert [s.id for s in mine.samples] == [s.id for s in whole.samples[share]]
        assert mine.budgets == whole.budgets[share] and mine.seed == whole.seed
    assert plan_prompts(PromptSampler(samples, seed=3), cfg, step=6).seed != whole.seed


def test_a_sampler_set_on_the_trainer_is_the_one_the_step_draws_from(assets, tmp_path) -> None:
    tr = scripted_trainer(assets, str(tmp_path / "run"), own_score)
    assert isinstance(tr.source, LocalRollout) and tr.source.sampler is tr.sampler
    only = tr.sampler.samples[1]
    tr.sampler = PromptSampler([only], seed=0)  # e.g. scripts/gpu_real_size.py's narrowing
    assert tr.source.sampler is tr.sampler
    batch = tr.source.collect(1, None)
    assert batch is not None and {g.sample.id for g in batch.groups} == {only.id}
