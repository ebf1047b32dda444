"""A real engine whose main agents' first turn is scripted (shared by training tests).

Not a test module (no ``test_`` prefix): tests import it by name, as pytest puts ``tests/`` on
``sys.path``.
"""

from __future__ import annotations

from collections.abc import Callable

from paravt.rollout.engine import GenerationRequest, GenerationResult


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
