"""Decentralized data-parallel training for PyTorch: wrap any optimizer, gossip instead of all-reduce.

Layout (dependencies point up this list, never down):

* :mod:`~decent_optim_wrapper.topo` -- topologies: which ranks average together at each step (pure logic).
* :mod:`~decent_optim_wrapper.engine` -- the engine: buckets, process groups, per-bucket gossip, global
  averaging and its snapshot, checkpoint state; :class:`~decent_optim_wrapper.engine.GossipEngine`.
* :mod:`~decent_optim_wrapper.optimizer_protocol` -- running an inner optimizer's step as torch expects
  (GradScaler, global step hooks).
* :mod:`~decent_optim_wrapper.wrapper` -- :class:`DecentOptimWrapper`, the optimizer front-end.
* :mod:`~decent_optim_wrapper.data_parallel` -- :class:`DecentralizedDataParallel`, the module front-end
  (decent-dp's API): each bucket is updated and gossiped inside backward.
* :mod:`~decent_optim_wrapper.metrics` -- measurements over the replicas (consensus distance).
"""

from loguru import logger

from decent_optim_wrapper.data_parallel import DecentralizedDataParallel
from decent_optim_wrapper.engine import DecentError, GlobalAverageError, GossipEngine, GossipError
from decent_optim_wrapper.metrics import consensus_distance
from decent_optim_wrapper.topo import Group, Topology, TopologyFactory
from decent_optim_wrapper.wrapper import DecentOptimWrapper

# Libraries stay silent unless the user opts in: logger.enable("decent_optim_wrapper").
logger.disable("decent_optim_wrapper")

__all__ = [
    "DecentError",
    "DecentOptimWrapper",
    "DecentralizedDataParallel",
    "GlobalAverageError",
    "GossipEngine",
    "GossipError",
    "Group",
    "Topology",
    "TopologyFactory",
    "consensus_distance",
]
