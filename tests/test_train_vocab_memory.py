"""``python -m paravt.train`` with Qwen3-VL's real vocabulary (151,936) on a CPU.

The tiny checkpoint is rebuilt with its embeddings and lm_head resized (``model.tiny_vocab``)
and two RL steps run in a fresh process each, next to the same run with the 4,096-row
vocabulary. The vocabulary adds parameters that any trainer must hold: for the policy its
weights, gradients and two AdamW moments, and a frozen reference copy (``algo.kl_coef != 0``)
— 5 x 4 bytes per added parameter, computed here from the checkpoints. Everything else must
NOT grow with the vocabulary: no ``(tokens, vocab)`` logits in any log-prob pass (the
materialised path held several float32 ``(L, 151936)`` tensors per sequence, 0.6 GB each at
L = 1,000). The check: peak RSS(151,936) <= peak RSS(4,096) + that parameter state
+ 0.3 x peak RSS(4,096).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from assets_task import ASSETS_TASK
from safetensors import safe_open

from paravt.metrics import read_metrics

RUN = """
import resource, sys
from paravt.train import main
rc = main(sys.argv[1:])
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(rc)
"""


def _params(model_dir: Path) -> int:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _run(assets: dict[str, str], root: Path, vocab: int) -> tuple[int, Path]:
    from paravt.models import build_tiny_checkpoint

    model = build_tiny_checkpoint(root / f"tiny{vocab}", seed=0, vocab=vocab)
    overrides = {
        "data.synth_dir": assets["data"],
        **ASSETS_TASK,  # that folder's own task
        "data.synth_num_videos": 2,
        "model.tiny_dir": str(model),
        "model.tiny_vocab": vocab,
        "train.out_dir": str(root / f"run{vocab}"),
        "train.prompts_per_step": 2,
        "train.steps": 2,
        "train.save_every": 0,
        "train.eval_prompts": 0,
        "train.progress": False,
        "train.summary_plot": False,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 48,
        "rollout.sub_max_new_tokens": 16,
        "agent.max_turns": 1,
        "video.frame_budgets": [4, 8],
        "sft.steps": 1,
        "sft.batch_size": 2,
        "algo.adv_bias": 0.1,
    }
    argv = [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in overrides.items()]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(
        [sys.executable, "-c", RUN, *argv], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = [int(x.split()[1]) for x in proc.stdout.splitlines() if x.startswith("PEAK_RSS_KB")]
    assert peak, proc.stdout[-2000:]
    rows = read_metrics(root / f"run{vocab}" / "metrics.jsonl")
    assert sorted(r["step"] for r in rows if r["kind"] == "train") == [1, 2]
    return peak[0] * 1024, model


def test_real_vocabulary_costs_only_its_parameter_state(assets, tmp_path):
    small_rss, small = _run(assets, tmp_path, 4096)
    big_rss, big = _run(assets, tmp_path, 151_936)
    added = _params(big) - _params(small)
    assert added == (151_936 - 4096) * 64 * 2  # embeddings + untied lm_head, hidden 64
    state = 5 * 4 * added  # fp32 weights, grads, 2 AdamW moments; the reference copy
    extra = big_rss - small_rss - state
    print(
        f"\npeak RSS 4096: {small_rss / 2**20:.0f} MiB, 151936: {big_rss / 2**20:.0f} MiB "
        f"(x{big_rss / small_rss:.2f}); parameter state added {state / 2**20:.0f} MiB; "
        f"beyond it: {extra / 2**20:.0f} MiB (x{(small_rss + extra) / small_rss:.2f})"
    )
    assert extra <= 0.3 * small_rss, (small_rss, big_rss, state)
