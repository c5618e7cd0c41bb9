"""Where one rank's steps stand: :class:`StepProgress`, shared by the engine and the parts that move it.

The engine advances it a step at a time; a change of members (:mod:`~.member_changes`) restarts the
rounds from a step all members agree on; a checkpoint (:mod:`~.checkpointing`) saves and loads it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepProgress"]


@dataclass
class StepProgress:
    """The step counters of one rank.

    Attributes:
        step: completed steps; step ``t`` gossips in phase ``t % period``.
        in_step: whether a step has begun and not ended.
        updated: whether the current step has run a local update (a rank cannot donate its replica then).
        launch_from: after a change of the world, the step whose rounds all launch first.
        mixing_factor: ``a`` in ``x <- (1 - a) x + a sum_j W_ij x_j``.
    """

    step: int = 0
    in_step: bool = False
    updated: bool = False
    launch_from: int = 0
    mixing_factor: float = 1.0
