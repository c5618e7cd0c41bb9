"""Print the figures table of docs/topologies.md: ``uv run python docs/make_topology_table.py``."""

from __future__ import annotations

import argparse

from decent_optim_wrapper.topo import TopologyFactory
from decent_optim_wrapper.topo.analysis import stats

BUILTINS = ["complete", "ring", "one-peer-exp", "alternating-exp-ring", "hierarchical"]
HIERARCHICAL = {"alternating-exp-ring", "hierarchical"}


def table(world_sizes: list[int], local_world_size: int, names: list[str] = BUILTINS) -> str:
    """One markdown row per (built-in, world size); hierarchical ones use ``local_world_size``."""
    lines = [
        "| topology | n | L | period | groups/phase (max size) | models sent/rank/step (mean, max) "
        "| consensus rate per period | per step | exact after |",
        "|---|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for name in names:
        for n in world_sizes:
            lws = local_world_size if name in HIERARCHICAL else 1
            topo = TopologyFactory.create(name, n, lws)
            s = stats(topo)
            per_phase = [sum(g.size > 1 for g in phase) for phase in topo.schedule]
            groups = (
                f"{min(per_phase)}-{max(per_phase)}"
                if min(per_phase) != max(per_phase)
                else str(per_phase[0])
            )
            exact = "-" if s.exact_consensus_steps is None else str(s.exact_consensus_steps)
            lines.append(
                f"| {name} | {n} | {lws} | {s.period} | {groups} ({s.max_group_size}) "
                f"| {s.models_sent_mean:.3f}, {s.models_sent_max:.3f} | {s.rate_per_period:.4f} "
                f"| {s.rate_per_step:.4f} | {exact} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--local-world-size", type=int, default=4)
    parser.add_argument("--names", nargs="+", default=BUILTINS, choices=TopologyFactory.names())
    args = parser.parse_args()
    print(table(args.world_sizes, args.local_world_size, args.names))


if __name__ == "__main__":
    main()
