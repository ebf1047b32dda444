"""The order in which training prompts are drawn: epoch-wise shuffles that resume exactly."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptSampler:
    """Epoch-wise shuffled prompts; the permutation is a pure function of (seed, epoch), so
    the sampler's whole state is ``(epoch, pos)`` and resumes exactly."""

    samples: list[Any]
    seed: int
    epoch: int = 0
    pos: int = 0
    _perm: list[int] = field(default_factory=list, repr=False)

    def _permutation(self) -> list[int]:
        perm = list(range(len(self.samples)))
        random.Random(f"paravt-data:{self.seed}:{self.epoch}").shuffle(perm)
        return perm

    def next(self, n: int) -> list[tuple[Any, int]]:
        """``n`` (sample, epoch) pairs; epochs roll over mid-batch."""
        out = []
        while len(out) < n:
            if not self._perm:
                self._perm = self._permutation()
            if self.pos >= len(self._perm):
                self.epoch, self.pos = self.epoch + 1, 0
                self._perm = self._permutation()
            out.append((self.samples[self._perm[self.pos]], self.epoch))
            self.pos += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._perm = self._permutation()
