"""Sub-agents: the same engine and weights summarise each crop; one batched call per turn.

A sub-agent sees the crop's frames (with timestamps), an instruction naming the window and,
when ``agent.sub_agent_include_question``, the user's question. Its summary (the generated
text, special tokens dropped) becomes the main agent's tool response. It is not filtered: the
main context tokenises it as plain text (``paravt.agent.context.add_tool_turn``), so whatever
it spells — ``</tool_response>``, ``<|video_pad|>`` — stays ordinary text, and it is cut there
to ``agent.max_tool_response_tokens`` tokens with a visible marker.

Failures never stop the rollout: if the batched engine call raises, each request is retried
alone so one bad request cannot fail its siblings; a request that still raises, returns no
tokens, or decodes to blank text becomes a ``sub_agent_error`` tool response.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from paravt.engines.engine import Engine, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)


@dataclass
class SubOutcome:
    """What came back for one sub-agent request."""

    result: GenerationResult | None
    summary: str  # decoded, stripped text ('' on failure)
    error: str  # '' on success


def _generate_isolated(
    engine: Engine, requests: list[GenerationRequest]
) -> list[GenerationResult | Exception]:
    """One batched call; on failure, one call per request so errors stay per request."""
    if not requests:
        return []
    try:
        res = engine.generate(requests)
        if len(res) != len(requests):
            raise RuntimeError(f"engine returned {len(res)} results for {len(requests)} requests")
        return list(res)
    except Exception as batch_error:  # noqa: BLE001 — isolate below, request by request
        # Said once here: when every retry succeeds the batch's error would leave no trace.
        log.warning(
            "a batch of %d sub-agent requests failed (%s: %s); retrying them one by one",
            len(requests), type(batch_error).__name__, batch_error,
        )  # fmt: skip
        out: list[GenerationResult | Exception] = []
        for r in requests:
            try:
                one = engine.generate([r])
                if len(one) != 1:
                    raise RuntimeError(f"engine returned {len(one)} results for 1 request")
                out.append(one[0])
            except Exception as e:  # noqa: BLE001
                out.append(e)
        return out


def run_sub_agents(
    engine: Engine,
    requests: list[GenerationRequest],
    tokenizer: Any,
    *,
    stop_ids: set[int],
) -> list[SubOutcome]:
    """Generate all sub-agent summaries of a turn (ONE engine call when nothing fails)."""
    outcomes: list[SubOutcome] = []
    for r in _generate_isolated(engine, requests):
        if isinstance(r, Exception):
            msg = f"{type(r).__name__}: {r}" if str(r) else type(r).__name__
            outcomes.append(SubOutcome(None, "", f"the sub-agent failed ({msg})"))
            continue
        ids = [t for t in r.token_ids if t not in stop_ids]
        summary = tokenizer.decode(ids, skip_special_tokens=True).strip()
        if not summary:
            outcomes.append(SubOutcome(r, "", "the sub-agent returned an empty summary"))
        else:
            outcomes.append(SubOutcome(r, summary, ""))
    return outcomes
