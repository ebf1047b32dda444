"""A projection, not a measurement: what ``algo.share_prefix`` saves on the 8B recipe.

The shared-prefix figures of docs/shared_prefix.md are measured on the CPU with a small model. This script
projects them to a preset's real shapes: the prompt of a main row at overview budget K (the
memory plan's count, ``paravt.plan.context_tokens``: visual tokens at the preset's overview
resolution, 8 timestamp tokens per frame, 512 of text), a suffix of S tokens after it (turns and
tool responses: the mean ``tokens/main_suffix`` of a training run's steps, read from its
``metrics.jsonl``, or given), G rollouts per prompt, and the model's dimensions from its
architecture config (``paravt.plan.model_shape``). It prints, for one group:

* backbone rows, shared against unshared: ``(P + G S) / (G (P + S))``;
* text-backbone FLOPs of a forward (the backward scales the same): per row ``2 · params of the
  decoder layers``, per attended (query, key) pair ``4 · heads · head_dim`` per layer, causal
  pairs counted; the prompt's pairs once instead of G times;
* the vision tower's patches: the overview once instead of G times.

    python scripts/shared_prefix_projection.py --run runs/train/default
    python scripts/shared_prefix_projection.py --suffix 600 --frames 64 --group 8
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def mean_suffix(run: Path) -> float:
    """Mean ``tokens/main_suffix`` over the train rows of a run's ``metrics.jsonl``."""
    vals = [
        float(r["tokens/main_suffix"])
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if r.get("kind") == "train" and "tokens/main_suffix" in r
    ]
    if not vals:
        raise SystemExit(f"{run}/metrics.jsonl has no tokens/main_suffix: a run of this version")
    return sum(vals) / len(vals)


def project(preset: str, frames: int, group: int, suffix: float) -> dict[str, float]:
    from paravt.plan import load_plan_config, model_shape

    cfg = load_plan_config(preset, [], [])
    s = model_shape(cfg)
    v = cfg.video
    vis = int(frames * v.overview_max_pixels / float((s.patch * s.merge) ** 2) / s.tpatch)
    prompt = vis + 8 * frames + 512
    patches = vis * s.merge**2
    per_row = 2.0 * s.text_block * s.layers
    per_pair = 4.0 * s.heads * s.head_dim * s.layers
    p, n, g = float(prompt), float(suffix), float(group)
    whole_pairs = g * (p + n) * (p + n + 1) / 2
    shared_pairs = p * (p + 1) / 2 + g * (n * p + n * (n + 1) / 2)
    whole = g * (p + n) * per_row + whole_pairs * per_pair
    shared = (p + g * n) * per_row + shared_pairs * per_pair
    return {
        "prompt_tokens": p,
        "visual_tokens": float(vis),
        "suffix_tokens": n,
        "group": g,
        "rows_ratio": (p + g * n) / (g * (p + n)),
        "attention_share_unshared": whole_pairs * per_pair / whole,
        "text_flops_ratio": shared / whole,
        "vision_patches_ratio": 1.0 / g,
        "vision_patches_per_group_unshared": g * patches,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3vl_8b_paragrpo")
    ap.add_argument("--frames", type=int, default=64, help="overview budget K")
    ap.add_argument("--group", type=int, default=8, help="rollouts per prompt G")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", type=Path, help="a training run folder (its tokens/main_suffix)")
    src.add_argument("--suffix", type=float, help="tokens after the prompt of a main row")
    a = ap.parse_args()
    suffix = a.suffix if a.suffix is not None else mean_suffix(a.run)
    out = project(a.preset, a.frames, a.group, suffix)
    print(json.dumps({"preset": a.preset, "projection": True, **out}, indent=1))


if __name__ == "__main__":
    main()
