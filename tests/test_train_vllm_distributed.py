"""torchrun --nproc-per-node 2 with ``rollout.engine=vllm`` on CPU (gloo, FSDP2): one vLLM
engine per rank, no HF replica, weights streamed from the FSDP2 shards after every update.

The check is the one that matters for PPO: on every rank and at every step, the behaviour
log-probs that rank's vLLM engine returned (``old_logprobs``) equal the trainer's proximal
log-probs (``prox_logprobs``: the sharded policy's no-grad forward, before the step's update)
on every trained token to 1e-4 (the untrained tiny model writes no valid tool call, so these
are main rows; tests/test_train_vllm.py covers vLLM-sampled sub-agent rows in one process). At step 1 that shows each engine
loaded the starting weights; at step 2 that the update reached each rank's engine through
``paravt.distributed.full_weights`` -> ``VLLMEngine.sync_weights``, and that the weights
moved (step 2's log-probs differ from what the step-1 weights give). The run must also exit
cleanly: vLLM shut down before the process group (``paravt.distributed.cleanup``).

Skipped loudly only where vLLM cannot be imported (see tests/vllm_required.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from assets_task import ASSETS_TASK
from torchrun import torchrun
from vllm_required import skip_without_vllm

from paravt.metrics import read_metrics

NO_VLLM, pytestmark = skip_without_vllm("the torchrun rollout.engine=vllm test")
TOL = 1e-4


def test_torchrun_vllm_engine_per_rank_follows_the_sharded_policy(
    assets, tiny32_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    overrides = [
        f"data.synth_dir={assets['data']}",
        *(f"{k}={v}" for k, v in ASSETS_TASK.items()),
        "data.synth_num_videos=2",
        f"model.path={tiny32_dir}",
        "rollout.engine=vllm",
        f"train.out_dir={out}",
        "train.steps=2",
        "train.prompts_per_step=2",
        "train.save_every=0",
        "train.eval_prompts=0",
        "train.progress=false",
        "train.summary_plot=false",
        "train.dump_batches=true",
        "rollout.group_size=2",
        "rollout.max_new_tokens=12",
        "rollout.sub_max_new_tokens=6",
        "agent.max_turns=2",
        "agent.max_tool_response_tokens=8",
        "video.frame_budgets=[2,4]",
        "sft.steps=0",
        "algo.adv_bias=0.1",  # non-zero advantages: the update moves the weights
        "algo.lr=1e-3",
        "algo.loss=decoupled",  # the proximal pass: the trainer's own log-probs, dumped
    ]
    proc = torchrun(2, "-m", "paravt.train", *overrides, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]  # vLLM's teardown included

    rows = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}
    assert sorted(rows) == [1, 2] and rows[1]["num_groups"] == 2.0

    worst = {1: 0.0, 2: 0.0}
    for step in (1, 2):
        for rank in (0, 1):
            dump = torch.load(out / "debug" / f"step{step}_rank{rank}.pt", weights_only=False)
            for b in dump["batches"]:
                m = b.loss_mask.bool()
                assert int(m.sum()) > 0
                diff = (b.old_logprobs[m] - b.prox_logprobs[m]).abs()
                worst[step] = max(worst[step], float(diff.max()))
    print(f"max |vLLM - policy| on trained tokens: step 1 {worst[1]:.1e}, step 2 {worst[2]:.1e}")
    assert worst[1] <= TOL and worst[2] <= TOL

    # The update moved the weights: step 2's samples scored by the step-1 weights differ.
    # (The proximal pass of step 2 IS the updated policy; recompute under the initial one.)
    from paravt.algo.logprobs import packed_logprobs
    from paravt.models import load_model

    model = load_model(tiny32_dir, device="cpu").model
    dump = torch.load(out / "debug" / "step2_rank0.pt", weights_only=False)
    b = dump["batches"][0]
    with torch.no_grad():
        lp, _ = packed_logprobs(model, b)
    m = b.loss_mask.bool()
    moved = float((lp[m] - b.old_logprobs[m]).abs().max())
    print(f"step-2 samples: |updated - initial weights| {moved:.1e}")
    assert moved > 100 * TOL
