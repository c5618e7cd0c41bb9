"""Decentralized data-parallel training for PyTorch: wrap any optimizer, gossip instead of all-reduce.

Layout (engine first, front-end last):

* :mod:`~decent_optim_wrapper.topo` -- topologies: which ranks average together at each step.
* :mod:`~decent_optim_wrapper.buckets` -- flat parameter buckets that parameters become views of.
* :mod:`~decent_optim_wrapper.comm` -- checked world info, cross-rank agreement, process groups.
* :mod:`~decent_optim_wrapper.gossip` -- the asynchronous gossip that mixes buckets.
* :mod:`~decent_optim_wrapper.averaging` -- exact global averaging for evaluation.
* :mod:`~decent_optim_wrapper.metrics` -- measurements over the replicas (consensus distance).
* :mod:`~decent_optim_wrapper.wrapper` -- :class:`DecentOptimWrapper`, the optimizer front-end.
"""

from loguru import logger

from decent_optim_wrapper.metrics import consensus_distance
from decent_optim_wrapper.topo import Group, Topology, TopologyFactory
from decent_optim_wrapper.wrapper import DecentOptimWrapper

# Libraries stay silent unless the user opts in: logger.enable("decent_optim_wrapper").
logger.disable("decent_optim_wrapper")

__all__ = ["DecentOptimWrapper", "Group", "Topology", "TopologyFactory", "consensus_distance"]
