"""A real engine whose main agents' first turn is scripted (shared by training tests).

Not a test module (no ``test_`` prefix): tests import it by name, as pytest puts ``tests/`` on
``sys.path``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from assets_task import ASSETS_TASK

from paravt.engines.engine import GenerationRequest, GenerationResult

#: A first main turn of two parallel ``crop_video`` calls (5-9 s and 20-26 s).
TWO_CROPS = "x\n</think>\n" + "\n".join(
    "<tool_call>\n"
    + json.dumps({"name": "crop_video", "arguments": {"start_time": a, "end_time": b}})
    + "\n</tool_call>"
    for a, b in ((5, 9), (20, 26))
)


class ScriptedFirstTurn:
    """The real engine, except that each main agent's first turn is the fixed ``text`` (e.g. a
    parallel-crop call, so sub-agents run with an untrained model). Its behaviour log-probs
    are ``score(model, request, ids)``: one per scripted token, given the request's context
    ``ids = prompt + scripted tokens``. Later main turns and every sub-agent summary are
    sampled by the real engine."""

    def __init__(
        self,
        real,
        text: str,
        score: Callable[[object, GenerationRequest, list[int]], list[float]],
    ) -> None:
        self.real, self.score, self.seen = real, score, set()
        tok = real.tokenizer
        self.ids = tok.encode(text, add_special_tokens=False) + [
            tok.convert_tokens_to_ids("<|im_end|>")
        ]

    def generate(self, requests):
        out = []
        for r in requests:
            if ":t" in r.request_id or r.request_id in self.seen:
                out.extend(self.real.generate([r]))
                continue
            self.seen.add(r.request_id)
            lps = self.score(self.real.model, r, list(r.prompt_ids) + self.ids)
            out.append(GenerationResult(list(self.ids), lps, "stop", r.request_id))
        return out

    def sync_weights(self, model) -> None:
        self.real.sync_weights(model)


def own_score(model, r, ids) -> list[float]:
    """Behaviour log-probs of a scripted turn: the model's own teacher-forced log-probs under
    the request's sampling parameters."""
    import torch

    from paravt.algo.logprobs import sequence_logprobs

    mm = list(r.extras["mm_token_type_ids"]) + [0] * (len(ids) - len(r.prompt_ids))
    with torch.no_grad():
        lp, _ = sequence_logprobs(
            model, ids, mm, r.visuals,
            temperature=r.sampling.temperature, top_p=r.sampling.top_p,
        )  # fmt: skip
    return lp[len(r.prompt_ids) :].tolist()


# Main and sub-agent sampling temperatures of the scripted runs (different on purpose: each row
# must be re-scored at its own).
MAIN_T, SUB_T = 0.7, 0.3


def scripted_trainer(assets: dict[str, str], out_dir: str, score, **overrides: object):
    """A tiny-model ``Trainer`` (1 tool turn, G=2, 2 prompts, main T=0.7, sub T=0.3) whose
    engine makes every main agent's first turn two parallel crop calls (``ScriptedFirstTurn``
    with ``score``). ``overrides``: extra ``key=value`` config items (e.g. the algo ones)."""
    import json

    from paravt.config import load_config
    from paravt.distributed import init_distributed
    from paravt.train import build_trainer

    kv = {
        "data.synth_dir": assets["data"],
        **ASSETS_TASK,  # that folder's own task
        "data.synth_num_videos": 2,
        "model.tiny_dir": assets["model"],
        "model.device": "cpu",
        "train.out_dir": out_dir,
        "train.prompts_per_step": 2,
        "train.eval_prompts": 0,
        "train.progress": False,
        "train.log_trajectories": 0,
        "sft.steps": 0,
        "rollout.group_size": 2,
        "rollout.temperature": MAIN_T,
        "rollout.sub_temperature": SUB_T,
        "rollout.max_new_tokens": 6,
        "rollout.sub_max_new_tokens": 6,
        "agent.max_turns": 1,
        "agent.max_tool_response_tokens": 8,
        "video.frame_budgets": json.dumps([2, 4]),
        "video.crop_max_frames": 4,
        **overrides,
    }
    cfg = load_config(overrides=[f"{k}={v}" for k, v in kv.items()])
    tr = build_trainer(cfg, init_distributed("cpu"))
    calls = "\n".join(
        "<tool_call>\n"
        + json.dumps({"name": "crop_video", "arguments": {"start_time": s, "end_time": e}})
        + "\n</tool_call>"
        for s, e in ((5, 9), (20, 26))
    )
    tr.runner.engine = ScriptedFirstTurn(tr.engine, "x\n</think>\n" + calls, score)
    return tr


class _Captured(Exception):
    pass


def captured_update_batch(tr, step: int = 1):
    """The packed batch step ``step`` of trainer ``tr`` hands to the policy update
    (``paravt.algo.loss.minibatch_backward``), captured there; the update itself never runs."""
    import pytest

    import paravt.algo.loss as loss_mod
    from paravt.train import train_step

    rec = {}

    def capture(batch, *a, **kw):
        rec["batch"] = batch
        raise _Captured

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loss_mod, "minibatch_backward", capture)
        with pytest.raises(_Captured):
            train_step(tr, step)
    return rec["batch"]
