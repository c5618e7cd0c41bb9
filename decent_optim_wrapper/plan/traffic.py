"""Bytes per step of a topology's gossip: ``python -m decent_optim_wrapper.plan bytes NAME --world-size N``.

Prints the bytes per fp32 parameter a rank sends per step (mean over the ranks and one period of the
schedule) for a registered topology, uncompressed and with each compressed wire format, from the
engine's own cost rule (:meth:`~decent_optim_wrapper.engine.GossipEngine.bytes_sent_per_step`): a ring
all-reduce in a group of ``k`` sends ``2 (k - 1) / k`` models per member, a compressed round gathers
``k - 1`` payloads. A group's first compressed round (exact) is left out: it happens once per group.
It sits above the engine, so the topologies' own command line (``python -m decent_optim_wrapper.topo``)
stays free of it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from decent_optim_wrapper.engine.wire.compression import (
    WIRE_FORMATS,
    CompressionPlan,
    GossipCompression,
    parse_compression,
)
from decent_optim_wrapper.topo import Topology
from decent_optim_wrapper.topo.cli import add_topology_arguments, topology_from_arguments
from decent_optim_wrapper.topo.mixing import allreduce_models_sent

__all__ = ["bytes_main", "bytes_per_parameter"]

_NUMEL = 1 << 20  # large, so that int8's per-block scales count in proportion


def bytes_per_parameter(topology: Topology, compression: GossipCompression | None = None) -> float:
    """Bytes per fp32 parameter a rank sends per step, averaged over the ranks and one period."""
    plan = None if compression is None else CompressionPlan(topology, compression)
    total = 0.0
    for rank in range(topology.world_size):
        for step in range(topology.period):
            group = topology.group(rank, step)
            if plan is not None:
                total += plan.bytes_sent(group, _NUMEL, torch.float32, 4)
            else:
                total += allreduce_models_sent(group.size) * _NUMEL * 4
    return total / (topology.world_size * topology.period * _NUMEL)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m decent_optim_wrapper.plan bytes",
        description="Print the bytes per fp32 parameter a rank sends per step with a topology's gossip, "
        "uncompressed and compressed.",
    )
    add_topology_arguments(parser)
    parser.add_argument(
        "--compression",
        "-c",
        nargs="+",
        default=None,
        metavar="FORMAT",
        help="only these wire formats: bf16, fp16, int8, int4, int2, or sparse ones such as topk:0.01:int2 "
        "(default: every dense one)",
    )
    parser.add_argument(
        "--max-references",
        type=int,
        default=4,
        help="groups per rank that keep a compression reference (default: 4)",
    )
    return parser


def bytes_main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argument errors exit with status 2)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.max_references < 1:
        parser.error(f"--max-references must be >= 1, got {args.max_references}")
    try:
        options = [parse_compression(name, args.max_references) for name in args.compression or WIRE_FORMATS]
    except ValueError as err:
        parser.error(str(err))
    topology = topology_from_arguments(parser, args)
    plain = bytes_per_parameter(topology)
    print(f"{topology.name}: world_size={topology.world_size}, local_world_size={topology.local_world_size}")
    print(f"bytes per fp32 parameter per rank/step uncompressed: {plain:.4f}")
    for option in options:
        compressed = bytes_per_parameter(topology, option)
        print(
            f"bytes per fp32 parameter per rank/step with {option.name} compression: {compressed:.4f} "
            f"(uncompressed {plain:.4f}; x{compressed / plain if plain else 1.0:.3f})"
        )
    return 0
