"""Per-rank, per-step compute times: constant, heavy-tailed jitter with the same mean, a slow rank, or
ranks of given speeds (an uneven fleet).

The same draws serve the emulated cluster (``benchmarks/cluster/rank.py`` sleeps them) and the
simulator (:mod:`.simulator`), so a simulated run can replay a measured one draw for draw: rank ``r``'s
draws come from a generator seeded with ``(seed, r)`` alone, whatever the world size.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from decent_optim_wrapper.checks import is_real

__all__ = ["JITTERS", "UNEVEN", "ComputeTimes"]

#: ``none``: every step takes ``mean_s``; ``lognormal``: ``mean_s * exp(sigma z - sigma^2 / 2)`` with
#: ``z`` standard normal (mean ``mean_s``, heavy right tail); ``straggler``: rank ``slow_rank`` takes
#: ``slow_factor * mean_s`` at every step, the others ``mean_s``. The scenarios a name alone sets
#: up (the benchmarks run each of them by name).
JITTERS = ("none", "lognormal", "straggler")

#: The jitter of a fleet of mixed hardware, where rank ``r`` takes ``mean_s * factors[r]`` at every
#: step (and ranks beyond ``factors`` take ``mean_s``). Not in :data:`JITTERS`, since it needs its
#: ``factors``.
UNEVEN = "uneven"


@dataclass(frozen=True)
class ComputeTimes:
    """Seconds of forward and backward for every rank and step.

    Args:
        mean_s: mean compute time of a step, in seconds (> 0).
        jitter: one of :data:`JITTERS`, or :data:`UNEVEN` with ``factors``.
        sigma: log-normal shape; the mean stays ``mean_s`` (``sigma = 0.5``: the slowest of 16 ranks
            takes about 2.1x the mean on a typical step).
        slow_rank: the persistently slow rank of ``straggler``.
        slow_factor: how many times slower it is.
        seed: seed of every rank's generator.
        factors: ``uneven`` only: rank ``r``'s step takes ``factors[r]`` times ``mean_s`` (each > 0;
            ranks beyond the tuple: 1.0), e.g. ``(2, 2, 1, 1)`` for two ranks of half the speed.
    """

    mean_s: float
    jitter: str = "none"
    sigma: float = 0.5
    slow_rank: int = 0
    slow_factor: float = 1.5
    seed: int = 0
    factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.mean_s > 0:
            raise ValueError(f"mean_s must be > 0 seconds, got {self.mean_s}")
        if self.jitter not in (*JITTERS, UNEVEN):
            raise ValueError(f"jitter must be one of {', '.join((*JITTERS, UNEVEN))}, got {self.jitter!r}")
        if self.sigma < 0 or self.slow_factor <= 0 or self.slow_rank < 0:
            raise ValueError(
                f"need sigma >= 0, slow_factor > 0 and slow_rank >= 0, got sigma={self.sigma}, "
                f"slow_factor={self.slow_factor}, slow_rank={self.slow_rank}"
            )
        factors = tuple(self.factors)
        object.__setattr__(self, "factors", factors)  # a list from a command line: hashable, like the rest
        if factors and self.jitter != UNEVEN:
            raise ValueError(
                f"factors={factors} are the per-rank slowdowns of jitter='uneven', but jitter="
                f"{self.jitter!r}; pass jitter='uneven' to use them, or leave factors out."
            )
        if self.jitter == UNEVEN and not factors:
            raise ValueError(
                "jitter='uneven' needs factors, rank r's step taking factors[r] * mean_s; e.g. "
                "factors=(2, 2, 1, 1) for two ranks of half the speed."
            )
        bad = [f for f in factors if not is_real(f) or not 0 < f < math.inf]
        if bad:
            raise ValueError(
                f"factors={factors} holds {bad[0]!r}; every factor must be a finite number > 0 (rank r's "
                "step takes factors[r] * mean_s; 1.0 is the nominal speed)."
            )

    def draws(self, rank: int, steps: int) -> list[float]:
        """Rank ``rank``'s compute seconds for steps ``0 .. steps - 1``."""
        if self.jitter == "none":
            return [self.mean_s] * steps
        if self.jitter == "straggler":
            return [self.mean_s * (self.slow_factor if rank == self.slow_rank else 1.0)] * steps
        if self.jitter == UNEVEN:
            return [self.mean_s * (self.factors[rank] if rank < len(self.factors) else 1.0)] * steps
        # A string seed is hashed with SHA-512: the same stream on every platform and Python version.
        rng = random.Random(f"{self.seed}/{rank}")
        shift = self.sigma * self.sigma / 2
        return [self.mean_s * math.exp(self.sigma * rng.gauss(0.0, 1.0) - shift) for _ in range(steps)]
