"""Response lengths: long-tailed, correlated within a prompt, drifting upward over training.

A sample's ``n`` lengths are ``exp(mu + z_prompt + z_response)`` rounded and clipped to
``[1, response_length]``, with ``z_prompt ~ N(0, prompt_sigma)`` shared by the group (hard prompts
make every response long) and ``z_response ~ N(0, response_sigma)`` per response. ``mu`` is chosen
so the unclipped mean is the current mean, which moves linearly from ``mean_start`` (param
version 0) to ``mean_end`` (the last step's version), as responses grow in real math RL.
With both sigmas 0 the lengths are exactly ``round(mean)`` and no random number is drawn.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass
class ResponseLengths:
    """Draws the response lengths of one sample from the seeded ``rng``."""

    rng: random.Random
    n: int
    mean_start: float
    mean_end: float
    response_sigma: float
    prompt_sigma: float
    max_len: int
    last_version: int
    """Param version at which the mean reaches ``mean_end`` (the last step's)."""

    def mean(self, version: int) -> float:
        """Unclipped mean response length of samples started at ``version``."""
        frac = min(1.0, version / self.last_version) if self.last_version > 0 else 1.0
        return self.mean_start + (self.mean_end - self.mean_start) * frac

    def draw(self, version: int) -> list[int]:
        mean = self.mean(version)
        sp, sr = self.prompt_sigma, self.response_sigma
        if sp == 0.0 and sr == 0.0:
            return [min(self.max_len, max(1, round(mean)))] * self.n
        gauss = self.rng.gauss
        mu = math.log(mean) - (sp * sp + sr * sr) / 2 + (gauss(0.0, sp) if sp else 0.0)
        cap = self.max_len
        return [min(cap, max(1, round(math.exp(mu + gauss(0.0, sr) if sr else mu)))) for _ in range(self.n)]
