"""Measurements: how far apart the replicas are, and the names of the counters a logger reads.

:func:`consensus_distance` is a collective over the replicas; the front-ends' ``metrics()`` is local
and returns the counters named in :data:`METRIC_NAMES` (name: what is counted, with its unit).
"""

from __future__ import annotations

from decent_optim_wrapper.engine import METRIC_NAMES, GossipEngine, tensors_consensus_distance
from decent_optim_wrapper.front_ends import DecentOptimWrapper, DecentralizedDataParallel

__all__ = ["METRIC_NAMES", "consensus_distance", "tensors_consensus_distance"]


def consensus_distance(replica: DecentOptimWrapper | DecentralizedDataParallel | GossipEngine) -> float:
    """Consensus distance of the parameters a front-end (or an engine) gossips.

    The root-mean-square distance of the replicas to their average, 0 when all agree; see
    :func:`~decent_optim_wrapper.engine.state.averaging.tensors_consensus_distance`. Gossip still in
    flight is not included: this measures the parameters as they are now.

    .. warning:: This is a collective: all ranks must call it.
    """
    if isinstance(replica, DecentOptimWrapper | DecentralizedDataParallel):
        return replica.engine.consensus_distance()
    if isinstance(replica, GossipEngine):
        return replica.consensus_distance()
    raise TypeError(
        f"consensus_distance() needs a DecentOptimWrapper, a DecentralizedDataParallel or a GossipEngine, "
        f"got {type(replica).__name__}; for other tensors use tensors_consensus_distance(tensors, group, "
        "world_size)."
    )
