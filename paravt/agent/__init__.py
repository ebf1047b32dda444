"""The parallel agent: prompts, tool-call parser, the tool protocol and the crop tool,
sub-agents, context, encoder, the tool step, the episode loop."""

from paravt.agent.encoder import (
    AgentEncoder,
    encode_oracle_sub_trajectories,
    encode_oracle_trajectory,
)
from paravt.agent.loop import AgentRunner, stable_seed
from paravt.agent.parser import parse_call, parse_tool_calls

__all__ = [
    "AgentEncoder",
    "AgentRunner",
    "encode_oracle_sub_trajectories",
    "encode_oracle_trajectory",
    "parse_call",
    "parse_tool_calls",
    "stable_seed",
]
