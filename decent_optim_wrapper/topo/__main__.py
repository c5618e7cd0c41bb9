"""Print a topology's schedule and figures: ``python -m decent_optim_wrapper.topo NAME --world-size N``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from decent_optim_wrapper.topo.analysis import TopologyStats, format_ranks, stats
from decent_optim_wrapper.topo.base import Topology
from decent_optim_wrapper.topo.cli import add_topology_arguments, topology_from_arguments
from decent_optim_wrapper.topo.group import Group

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m decent_optim_wrapper.topo",
        description="Print the gossip schedule of a registered topology and its figures of merit "
        "(process groups, models sent per step under a ring all-reduce cost model, consensus rate).",
    )
    add_topology_arguments(parser)
    parser.add_argument(
        "--steps", "-s", type=int, default=None, help="steps of the schedule to print (default: one period)"
    )
    return parser


def _describe_group(group: Group) -> str:
    ranks = "{" + ", ".join(map(str, group.ranks)) + "}"
    return ranks if group.is_uniform else f"{ranks} w={group.own_weight:.4g}"


def format_stats(s: TopologyStats) -> str:
    """The figures of one topology, one per line."""
    exact = "never (asymptotic)" if s.exact_consensus_steps is None else f"{s.exact_consensus_steps} steps"
    return "\n".join(
        [
            f"period:                    {s.period}",
            f"process groups:            {s.process_groups} (largest: {s.max_group_size} "
            f"rank{'s' if s.max_group_size != 1 else ''})",
            f"models sent per rank/step: {s.models_sent_mean:.4f} mean, {s.models_sent_max:.4f} max "
            "(ring all-reduce: 2(k-1)/k per member of a k-group)",
            f"consensus rate:            {s.rate_per_period:.4f} per period, {s.rate_per_step:.4f} per step "
            "(1 - ||P - J||_2)",
            f"exact consensus after:     {exact}",
        ]
    )


def _print_schedule(topology: Topology, steps: int) -> None:
    for step in range(steps):
        groups = [g for g in topology.phase(step) if g.size > 1]
        resting = [r for g in topology.phase(step) if g.size == 1 for r in g.ranks]
        line = "  ".join(_describe_group(g) for g in groups) or "(no communication)"
        if resting:
            line += f"  rest: {format_ranks(resting)}"
        print(f"step {step:>3} (phase {step % topology.period}): {line}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argument errors exit with status 2)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    topology = topology_from_arguments(parser, args)
    figures = stats(topology)
    print(
        f"{figures.name}: world_size={figures.world_size}, local_world_size={figures.local_world_size}, "
        f"{topology.num_nodes} node(s)"
    )
    _print_schedule(topology, figures.period if args.steps is None else args.steps)
    print(format_stats(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
