"""Decentralized data-parallel training for PyTorch: wrap any optimizer, gossip instead of all-reduce."""

from loguru import logger

from decent_optim_wrapper.topo import Group, Topology, TopologyFactory

# Libraries stay silent unless the user opts in: logger.enable("decent_optim_wrapper").
logger.disable("decent_optim_wrapper")

__all__ = ["Group", "Topology", "TopologyFactory"]
