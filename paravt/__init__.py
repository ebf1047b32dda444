"""paravt: reinforcement learning for video LLMs that call tools in parallel (PARA-GRPO)."""

__version__ = "0.1.0"
