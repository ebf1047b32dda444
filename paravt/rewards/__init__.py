"""PARA-GRPO rewards: accuracy, format (+ anchoring), tool; ``score`` composes them."""

from paravt.answers import extract_answer, extract_choice, parse_window
from paravt.rewards.accuracy import accuracy, temporal_iou, token_f1
from paravt.rewards.compose import full_text, score, score_groups
from paravt.rewards.format import analyse_turn, format_reward
from paravt.rewards.tool import call_counts, tool_reward

__all__ = [
    "accuracy",
    "analyse_turn",
    "call_counts",
    "extract_answer",
    "extract_choice",
    "format_reward",
    "full_text",
    "parse_window",
    "score",
    "score_groups",
    "temporal_iou",
    "token_f1",
    "tool_reward",
]
