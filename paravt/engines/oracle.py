"""The oracle main agent: :class:`OracleMainEngine` replays the synthetic task's oracle turns
(``sft.jsonl``, read by :func:`load_oracle`) over a real engine.

Used by ``python -m paravt.episodes --main oracle``, ``bench/test_bench_vllm_engine.py`` and
the eval and viewer tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paravt.engines.engine import Engine, GenerationResult
from paravt.files import read_jsonl


class OracleMainEngine(Engine):
    """Main agents replay the synthetic task's oracle turns (``sft.jsonl``); sub-agents (and
    prompts without an oracle row) use the real ``engine``.

    For demos and benchmarks with an untrained model, which would never call a tool: the
    crops, sub-agent batching and rewards then run for real. Oracle tokens get log-prob 0.
    """

    def __init__(self, engine: Any, tokenizer: Any, records: dict[str, dict], think_prefix: str):
        self.engine = engine
        self.tok = tokenizer
        self.records = records
        self.prefix = think_prefix
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.turn: dict[str, int] = {}

    @staticmethod
    def sample_id(request_id: str) -> str | None:
        """Sample id of a main-agent request id ``'{group}:{sample id}:r{g}'`` (None for subs)."""
        head, _, rest = request_id.partition(":")
        sid, _, tail = rest.rpartition(":")
        if not head.isdigit() or not tail.startswith("r") or not tail[1:].isdigit():
            return None
        return sid

    def _oracle_text(self, request_id: str) -> str | None:
        rec = self.records.get(self.sample_id(request_id) or "")
        if rec is None:
            return None
        k = self.turn.get(request_id, 0)
        self.turn[request_id] = k + 1
        texts = [t["content"] for t in rec["turns"] if t["role"] == "assistant"]
        text = texts[min(k, len(texts) - 1)]
        return text[len(self.prefix) :] if text.startswith(self.prefix) else text

    def generate(self, requests: list[Any]) -> list[Any]:
        out: list[Any] = [None] * len(requests)
        real = []
        for i, r in enumerate(requests):
            text = self._oracle_text(r.request_id)
            if text is None:
                real.append(i)
                continue
            # An SFT-style target: tags as the model writes them, special tokens never parsed.
            ids = self.tok.encode(text, add_special_tokens=False, split_special_tokens=True)
            ids += [self.im_end]
            out[i] = GenerationResult(ids, [0.0] * len(ids), "stop", r.request_id, text)
        if real:
            for i, res in zip(real, self.engine.generate([requests[i] for i in real])):
                out[i] = res
        return out

    def sync_weights(self, model: object) -> None:
        self.engine.sync_weights(model)


def load_oracle(data: Path) -> dict[str, dict]:
    """``sft.jsonl`` rows of a dataset directory, one per sample id ({} if there is none).

    A sample may have one row per overview budget; the first row that calls the tool is kept
    (the oracle main agent is there to show real crops and sub-agents), else the first row."""

    f = data / "sft.jsonl" if data.is_dir() else data.parent / "sft.jsonl"
    if not f.is_file():
        return {}
    out: dict[str, dict] = {}
    for _, r in read_jsonl(f):
        old = out.get(r["sample_id"])
        if old is None or (len(old["turns"]) < 2 <= len(r["turns"])):
            out[r["sample_id"]] = r
    return out
