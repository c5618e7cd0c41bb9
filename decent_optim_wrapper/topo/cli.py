"""The command-line arguments that name a topology, shared by the package's commands."""

from __future__ import annotations

import argparse

from decent_optim_wrapper.topo.base import Topology
from decent_optim_wrapper.topo.factory import TopologyFactory

__all__ = ["add_topology_arguments", "topology_from_arguments"]


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    """``NAME --world-size N [--local-world-size L]``."""
    parser.add_argument("name", help=f"registered topology: {', '.join(TopologyFactory.names())}")
    parser.add_argument("--world-size", "-n", type=int, required=True, help="number of ranks")
    parser.add_argument("--local-world-size", "-l", type=int, default=1, help="ranks per node (default: 1)")


def topology_from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Topology:
    """The topology the arguments name; a bad name or size exits with the parser's usage error."""
    if args.name not in TopologyFactory.names():
        parser.error(f"unknown topology {args.name!r}; registered: {', '.join(TopologyFactory.names())}")
    try:
        return TopologyFactory.create(args.name, args.world_size, args.local_world_size)
    except (TypeError, ValueError) as err:
        parser.error(str(err))
