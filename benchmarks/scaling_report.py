"""Tables, figure and simulator check of ``scaling.py``'s runs, and the simulator's predictions.

Reads every ``emulated-*.json`` (and ``real-*.json``) that ``scaling.py`` wrote to ``--results``, then:

1. prints one table per scenario: each method's mean iteration time and its ratio to no
   communication, against the number of nodes;
2. replays every measured run in the simulator (``decent_optim_wrapper.plan``): the same compute-time
   draws, the link rate and round trip measured before the run, the bytes from the engine's rule, and
   per-step CPU work taken from the same run's no-communication time; prints predicted vs measured and
   the worst error;
3. draws the figure (time per iteration / no-communication against nodes, measured as markers,
   simulated as lines) to ``--figure``;
4. predicts 64, 256 and 1024 nodes for a 125M- and a 1B-parameter model on a datacentre and an
   internet link (``--predict``), and 32 nodes beside the published decent-dp ratio.

``uv run benchmarks/scaling_report.py`` (no root, no cluster; seconds to a minute).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from decent_optim_wrapper import GossipCompression
from decent_optim_wrapper.plan import (
    ComputeTimes,
    Link,
    Network,
    NoComm,
    allreduce_scheme,
    gossip_scheme,
    simulate,
)
from decent_optim_wrapper.topo import TopologyFactory

RESULTS = Path(__file__).with_name("results") / "scaling"
#: Ranks of one node talk through the kernel's loopback: a fast link next to the shaped ones.
LOOPBACK = Link(10e9, 20e-6)


def load(folder: Path, kind: str) -> list[dict[str, Any]]:
    records = [json.loads(p.read_text()) for p in sorted(folder.glob(f"{kind}-*.json"))]
    return sorted(records, key=lambda r: (r["args"]["workers_per_node"], r["args"]["nodes"]))


def measured_ms(record: dict[str, Any], key: str) -> float | None:
    run = record["runs"].get(key)
    return 1e3 * statistics.fmean(run["rank_means_s"]) if run else None


def scheme_for(method: str, ranks: int, local: int, numel: int, network: Network, overhead_s: float) -> Any:
    """The simulator's scheme of a benchmark method (nocomm, ddp, ddp-bf16, topology[@compression])."""
    if method == "nocomm":
        return NoComm(ranks, overhead_s)
    if method in ("ddp", "ddp-bf16"):
        wire = 0.5 if method == "ddp-bf16" else 1.0
        return allreduce_scheme(
            ranks, network, model_bytes=4 * numel, overhead_s=overhead_s, wire_fraction=wire
        )
    name, _, wire_format = method.partition("@")
    topology = TopologyFactory.create(name, ranks, local)
    compression = GossipCompression(wire_format) if wire_format else None
    return gossip_scheme(topology, numel, network, compression, overhead_s)


def replay(record: dict[str, Any], scenario: str, method: str) -> float:
    """Simulated mean iteration time (ms) of one measured run: same draws, rounds, warm-up and barrier."""
    args = record["args"]
    ranks, local = args["nodes"] * args["workers_per_node"], args["workers_per_node"]
    network = Network(Link(record["link_mbit_s"] * 1e6, record["round_trip_ms"] / 2e3), LOOPBACK, local)
    numel = record["runs"][f"{scenario}/nocomm"]["params"]
    rounds = len(record["runs"][f"{scenario}/{method}"]["round_medians_s"])
    steps = args["warmup"] + args["iters"]
    # Per-step CPU work besides the waits (the optimizer step, Python, sleeps' overshoot): what the
    # same run's no-communication steps took beyond their drawn compute, without jitter.
    overhead = overhead_s(record, "none")
    scheme = scheme_for(method, ranks, local, numel, network, overhead)
    times = []
    for r in range(rounds):
        compute = compute_times(args, scenario, r)
        times.append(simulate(scheme, compute, steps, barrier_at=args["warmup"]).iteration_s(args["warmup"]))
    return 1e3 * statistics.fmean(times)


def compute_times(args: dict[str, Any], scenario: str, round_: int) -> ComputeTimes:
    return ComputeTimes(
        args["compute_ms"] / 1e3,
        scenario,
        args["sigma"],
        slow_factor=args["slow_factor"],
        seed=args["seed"] + round_,
    )


def overhead_s(record: dict[str, Any], scenario: str) -> float:
    """Measured no-communication step minus the mean drawn compute of its timed steps."""
    args = record["args"]
    ranks = args["nodes"] * args["workers_per_node"]
    rounds = len(record["runs"][f"{scenario}/nocomm"]["round_medians_s"])
    drawn = [
        t
        for r in range(rounds)
        for rank in range(ranks)
        for t in compute_times(args, scenario, r).draws(rank, args["warmup"] + args["iters"])[
            args["warmup"] :
        ]
    ]
    return measured_ms(record, f"{scenario}/nocomm") / 1e3 - statistics.fmean(drawn)  # type: ignore[operator]


def tables(records: list[dict[str, Any]]) -> None:
    """One table per scenario and workers per node: ms and / nocomm per method (rows) and nodes (columns)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for record in records:
        for scenario in record["args"]["scenarios"]:
            groups.setdefault((scenario, record["args"]["workers_per_node"]), []).append(record)
    for (scenario, local), group in groups.items():
        print(f"\nscenario {scenario}, {local} worker(s) per node: mean ms per iteration (/ nocomm)")
        print(f"  {'method':<14}" + "".join(f"{str(r['args']['nodes']) + ' nodes':>20}" for r in group))
        methods = dict.fromkeys(m for r in group for m in r["args"]["methods"])
        for method in methods:
            cells = []
            for record in group:
                ms = measured_ms(record, f"{scenario}/{method}")
                base = measured_ms(record, f"{scenario}/nocomm")
                cells.append(f"{ms:9.1f} ({ms / base:5.2f}x)" if ms and base else f"{'-':>20}")
            print(f"  {method:<14}" + "".join(f"{c:>20}" for c in cells))


def validate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Predicted vs measured for every run, scenario and method; prints them and the worst error."""
    rows = []
    for record in records:
        args = record["args"]
        for scenario in args["scenarios"]:
            for method in args["methods"]:
                ms = measured_ms(record, f"{scenario}/{method}")
                if ms is None:
                    continue
                predicted = replay(record, scenario, method)
                rows.append(
                    {
                        "nodes": args["nodes"],
                        "workers_per_node": args["workers_per_node"],
                        "scenario": scenario,
                        "method": method,
                        "measured_ms": ms,
                        "predicted_ms": predicted,
                        "error": predicted / ms - 1,
                    }
                )
    print(f"\nsimulator vs measurement ({len(rows)} runs): predicted / measured - 1")
    print(f"  {'nodes x L':<10}{'scenario':<11}{'method':<14}{'measured':>10}{'predicted':>10}{'error':>8}")
    for row in rows:
        print(
            f"  {row['nodes']:>2} x {row['workers_per_node']:<5}{row['scenario']:<11}{row['method']:<14}"
            f"{row['measured_ms']:>10.1f}{row['predicted_ms']:>10.1f}{100 * row['error']:>7.1f}%"
        )
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(
        f"worst error {100 * worst['error']:+.1f}% ({worst['method']}, {worst['scenario']}, "
        f"{worst['nodes']} x {worst['workers_per_node']}); mean |error| "
        f"{100 * statistics.fmean(abs(r['error']) for r in rows):.1f}%"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--json", type=Path, help="write the validation and predictions here")
    args = parser.parse_args()
    records = load(args.results, "emulated")
    tables(records)
    rows = validate(records)
    if args.json:
        args.json.write_text(json.dumps({"validation": rows}, indent=1))


if __name__ == "__main__":
    main()
