"""paravt: reinforcement learning for video LLMs that call tools in parallel (PARA-GRPO)."""

from paravt._compat import fix_cuda_torchvision_on_cpu_torch

__version__ = "0.1.0"

fix_cuda_torchvision_on_cpu_torch()
