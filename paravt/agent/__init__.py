"""The parallel agent: prompts, tool-call parser, crop tool, sub-agents, context, loop."""

from paravt.agent.loop import (
    AgentRunner,
    encode_oracle_sub_trajectories,
    encode_oracle_trajectory,
    stable_seed,
)
from paravt.agent.parser import parse_call, parse_tool_calls

__all__ = [
    "AgentRunner",
    "encode_oracle_sub_trajectories",
    "encode_oracle_trajectory",
    "parse_call",
    "parse_tool_calls",
    "stable_seed",
]
