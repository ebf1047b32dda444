"""The hostile-turn fuzz of tests/test_agent_budget.py against the real vLLM engine: every
request goes to vLLM with a small ``max_model_len``, none fails, none passes the context."""

from __future__ import annotations

import json
import random

from test_agent_budget import FUZZ_SETTINGS, _fuzz_turn
from test_agent_hostile import IdEngine, _cfg
from vllm_required import skip_without_vllm

from paravt.agent import AgentRunner
from paravt.agent.context import TextCache
from paravt.models import load_model
from paravt.models.tiny import QWEN_SPECIAL, TAG_TOKENS
from paravt.types import RolloutStats, Sample
from paravt.video import DecodePlanner

NO_VLLM, pytestmark = skip_without_vllm("the agent's context-limit tests against vLLM")


class HostileOverVLLM:
    """Sends every request to the real vLLM engine (which fails any it cannot hold), then
    replaces each main agent's output by a hostile scripted turn, cut to the request's
    ``max_new_tokens`` as vLLM would; sub-agents keep vLLM's own summaries."""

    def __init__(self, real, script) -> None:
        self.real, self.script = real, script
        self.max_model_len = real.max_model_len
        self.requests = []
        im_end = real.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.im_end = im_end

    def generate(self, requests):
        outs = self.real.generate(requests)
        for r, o in zip(requests, outs):
            self.requests.append(r)
            if IdEngine.is_sub(r):
                continue
            ids = list(self.script())
            length = bool(ids) and ids[-1] is None
            ids = ids[:-1] if length else ids + [self.im_end]
            cap = r.sampling.max_new_tokens
            if len(ids) > cap:
                ids, length = ids[:cap], True
            o.token_ids, o.logprobs = ids, [-0.1] * len(ids)
            o.finish_reason = "length" if length else "stop"
        return outs

    def sync_weights(self, model) -> None:
        return None


def test_hostile_turns_never_fail_vllm(tiny32_dir, make_clip) -> None:
    from paravt.engines.vllm import VLLMEngine

    bundle = load_model(tiny32_dir, device="cpu", dtype="float32")
    tok = bundle.tokenizer
    text = TextCache(tok)
    tag = {s: tok.convert_tokens_to_ids(s) for s in QWEN_SPECIAL + TAG_TOKENS}
    video = make_clip(duration=20.0, size=(64, 64), fps=2.0)
    cfg = _cfg(**FUZZ_SETTINGS)
    samples = [Sample("qa", video, "Which shape?", "B", "mcq", options=["a", "b"]),
               Sample("qb", video, "When?", "2-4", "tvg")]  # fmt: skip
    probe = AgentRunner(IdEngine(tok, lambda u, t: [], lambda r: []), bundle, cfg)
    prompt = max(len(c.tokens) for c in probe.encode_overviews(samples, [2, 4]))
    limit = prompt + 3 * cfg.rollout.max_new_tokens + 150
    real = VLLMEngine(bundle, dtype="float32", max_model_len=limit, max_num_seqs=64, seed=0)
    rng = random.Random(7)
    eng = HostileOverVLLM(real, lambda: _fuzz_turn(rng, text, tag))
    runner = AgentRunner(eng, bundle, cfg, planner=DecodePlanner("pyav", cache_frames=512))
    totals = RolloutStats()
    main_turns, step = 0, 0
    while main_turns < 120:
        n_req = len(eng.requests)
        done = runner.rollout(samples, [2, 4], group_size=8, seed=step)  # must not raise
        step += 1
        new = eng.requests[n_req:]
        main_turns += sum(not IdEngine.is_sub(r) for r in new)
        for r in new:
            assert len(r.prompt_ids) + r.sampling.max_new_tokens <= limit, r.request_id
        totals = totals + done.stats
    keys = ("context_forced_answers", "context_cut_answers", "context_ended")
    print(f"vLLM fuzz: {main_turns} main turns, limit {limit}, "
          + json.dumps({k: getattr(totals, k) for k in keys}))  # fmt: skip
    assert totals.context_forced_answers > 0 and totals.context_ended > 0
    assert totals.sub_engine_calls > 0  # sub-agents ran on vLLM too
    real.close()
