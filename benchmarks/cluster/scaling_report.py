"""The ``report`` question: the ``scaling`` runs' tables (``emulated-*.json`` in ``--results``) beside
the simulator's replay of each run, the figure, and predictions at ``--predict-nodes`` nodes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness.report import markdown_table, titled_table
from decent_optim_wrapper import GossipCompression
from decent_optim_wrapper.plan import ComputeTimes, Link, Network, NoComm, SharingModel, predict, simulate
from decent_optim_wrapper.plan.schemes import allreduce_scheme, gossip_scheme
from decent_optim_wrapper.topo import TopologyFactory

RESULTS = Path(__file__).resolve().parents[1] / "results" / "scaling"
#: Ranks of one node talk through the kernel's loopback: a fast link next to the shaped ones.
LOOPBACK = Link(10e9, 20e-6)
#: How overlapping exchanges share a shaped link: ``link_sharing``'s best fit. TCP behind tbf's FIFO favours
#: the exchange already running; the loser of a race backs off rather than reclaiming at once.
EMULATED_SHARING = SharingModel(doubling_s=0.1, head_start_s=0.15, reclaim=False)
#: Draws of the race (head starts) per replayed round: who won is not recorded, so a replay is a mean.
RACE_DRAWS = 64
#: Prediction grid: fp32 models, compute per step on one accelerator, and two kinds of link.
MODELS = {"125M": (125e6 * 4, 0.10), "1B": (1e9 * 4, 0.80)}
LINKS = {"datacentre": Link(25e9, 10e-6), "internet": Link(1e9, 50e-3)}
TITLES = {
    "none": "constant compute",
    "lognormal": "transient jitter (log-normal)",
    "straggler": "one rank 1.5x slower",
}


def load(folder: Path) -> list[dict[str, Any]]:
    """The ``scaling`` runs in ``folder`` (``run.py`` keeps a run under ``results``), by ranks per node."""
    records = [json.loads(path.read_text()) for path in sorted(folder.glob("emulated-*.json"))]
    records = [{**record.pop("results", {}), **record} for record in records]
    return sorted(records, key=lambda r: (r["args"]["workers_per_node"], r["args"]["nodes"]))


def measured_ms(record: dict[str, Any], key: str) -> float | None:
    run = record["runs"].get(key)
    return 1e3 * statistics.fmean(run["rank_means_s"]) if run else None


def scheme_for(method: str, ranks: int, local: int, numel: int, network: Network, overhead_s: float) -> Any:
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


def compute_times(args: dict[str, Any], scenario: str, round_: int) -> ComputeTimes:
    slow = {"slow_factor": args["slow_factor"], "seed": args["seed"] + round_}
    return ComputeTimes(args["compute_ms"] / 1e3, scenario, args["sigma"], **slow)


def overhead_s(record: dict[str, Any], scenario: str) -> float:
    """Measured no-communication step minus the mean drawn compute of its timed steps."""
    args = record["args"]
    ranks = args["nodes"] * args["workers_per_node"]
    rounds = len(record["runs"][f"{scenario}/nocomm"]["round_medians_s"])
    warmup, steps, drawn = args["warmup"], args["warmup"] + args["iters"], []
    for r, rank in itertools.product(range(rounds), range(ranks)):
        drawn += compute_times(args, scenario, r).draws(rank, steps)[warmup:]
    return measured_ms(record, f"{scenario}/nocomm") / 1e3 - statistics.fmean(drawn)  # type: ignore[operator]


def replay(record: dict[str, Any], scenario: str, method: str) -> float:
    """Simulated mean iteration time (ms) of one measured run: same draws, rounds, warm-up and barrier."""
    args = record["args"]
    ranks, local = args["nodes"] * args["workers_per_node"], args["workers_per_node"]
    link = Link(record["link_mbit_s"] * 1e6, record["round_trip_ms"] / 2e3)
    numel = record["runs"][f"{scenario}/nocomm"]["params"]
    rounds = len(record["runs"][f"{scenario}/{method}"]["round_medians_s"])
    warmup, steps = args["warmup"], args["warmup"] + args["iters"]
    overhead = overhead_s(record, "none")  # per-step CPU work besides the waits, without jitter
    times = []
    for r in range(rounds):
        compute = compute_times(args, scenario, r)
        for draw in range(RACE_DRAWS):
            sharing = dataclasses.replace(EMULATED_SHARING, seed=(args["seed"] + r) * RACE_DRAWS + draw)
            network = Network(link, LOOPBACK, local, sharing=sharing)
            scheme = scheme_for(method, ranks, local, numel, network, overhead)
            times.append(simulate(scheme, compute, steps, barrier_at=warmup).iteration_s(warmup))
    return 1e3 * statistics.fmean(times)


def validate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for record in records:
        args = record["args"]
        for scenario in args["scenarios"]:
            for method in args["methods"]:
                ms = measured_ms(record, f"{scenario}/{method}")
                if ms is not None:
                    predicted = replay(record, scenario, method)
                    row = {"nodes": args["nodes"], "workers_per_node": args["workers_per_node"]}
                    row |= {"scenario": scenario, "method": method, "measured_ms": ms}
                    rows.append(row | {"predicted_ms": predicted, "error": predicted / ms - 1})
    return rows


def figure(records: list[dict[str, Any]], rows: list[dict[str, Any]], path: Path) -> None:
    """Time per iteration / no communication against nodes: one panel per scenario (1 rank per node)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single = [r for r in records if r["args"]["workers_per_node"] == 1]
    scenarios = list(dict.fromkeys(s for r in single for s in r["args"]["scenarios"]))
    methods = [m for m in dict.fromkeys(m for r in single for m in r["args"]["methods"]) if m != "nocomm"]
    single_rows = [r for r in rows if r["workers_per_node"] == 1]
    predicted = {(r["nodes"], r["scenario"], r["method"]): r["predicted_ms"] for r in single_rows}
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.8), sharey=True)
    for ax, scenario in zip(axes, scenarios, strict=True):
        for index, method in enumerate(methods):
            nodes, measured, simulated = [], [], []
            for record in single:
                ms, base = (measured_ms(record, f"{scenario}/{m}") for m in (method, "nocomm"))
                if ms and base:
                    n = record["args"]["nodes"]
                    nodes.append(n)
                    measured.append(ms / base)
                    simulated.append(predicted[(n, scenario, method)] / base)
            ax.plot(nodes, measured, "o-", color=f"C{index}", label=method)
            ax.plot(nodes, simulated, "x--", color=f"C{index}", alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["args"]["nodes"] for r in single], [str(r["args"]["nodes"]) for r in single])
        ax.set_title(TITLES.get(scenario, scenario))
        ax.set_xlabel("nodes (1 rank each)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("time per iteration / no communication")
    axes[0].legend(fontsize=8)
    title = "Emulated cluster, 20 Mbit/s links, exchange ~ compute: measured (o) and simulated (x)"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def predictions(sigma: float, node_counts: list[int]) -> list[dict[str, Any]]:
    """DDP and per-step gossip at ``node_counts`` nodes, simulated (about 17 s per model and link at 1024)."""
    out, topologies = [], ["ring", "one-peer-exp"]
    for model, link_name, nodes in itertools.product(MODELS, LINKS, node_counts):
        (model_bytes, compute_s), link = MODELS[model], LINKS[link_name]
        compute = ComputeTimes(compute_s, "lognormal", sigma)
        found = predict(model_bytes, compute, Network(link), nodes, topologies, ("bf16",), steps=30)
        ms = {p.method: 1e3 * p.step_s for p in found}
        # DDP with a tree all-reduce's latency (2 log2 N messages, as NCCL does at scale)
        tree = Network(link, tree_latency=True)
        ms["ddp-tree"] = 1e3 * predict(model_bytes, compute, tree, nodes, [], ())[1].step_s
        out.append({"model": model, "link": link_name, "nodes": nodes, "ms": ms})
    return out


def markdown(
    records: list[dict[str, Any]], rows: list[dict[str, Any]], predicted: list[dict[str, Any]]
) -> str:
    """The tables of docs/scaling.md: measured per scenario, simulator errors, predictions."""
    out = []
    errors = {(r["nodes"], r["workers_per_node"], r["scenario"], r["method"]): r["error"] for r in rows}
    for local in sorted({r["args"]["workers_per_node"] for r in records}):
        group = [r for r in records if r["args"]["workers_per_node"] == local]
        for scenario in dict.fromkeys(s for r in group for s in r["args"]["scenarios"]):
            table = []
            for method in dict.fromkeys(m for r in group for m in r["args"]["methods"]):
                table.append([method])
                for record in group:
                    ms = measured_ms(record, f"{scenario}/{method}")
                    base = measured_ms(record, f"{scenario}/nocomm")
                    err = errors.get((record["args"]["nodes"], local, scenario, method))
                    ok = ms and base and err is not None
                    table[-1].append(f"{ms:.0f} ({ms / base:.2f}x) [{100 * err:+.0f}%]" if ok else "-")  # type: ignore[operator]
            title = f"**{scenario}**, {local} rank(s) per node: ms per iteration (x no-communication) "
            header = ["method", *(f"{r['args']['nodes']} nodes" for r in group)]
            out.append(titled_table(title + "[simulator error]", header, table))
    columns = ["model", "link", "nodes", "no comm", "DDP (ring)", "DDP (tree latency)", "ddp-bf16", "ring"]
    columns += ["one-peer-exp", "ring@bf16", "DDP / one-peer-exp"]
    methods = ("nocomm", "ddp", "ddp-tree", "ddp-bf16", "ring", "one-peer-exp", "ring@bf16")
    table = []
    for row in predicted:
        ms, size = row["ms"], [row["model"], row["link"], str(row["nodes"])]
        table.append([*size, *(f"{ms[k]:,.0f}" for k in methods), ms["ddp"] / ms["one-peer-exp"]])
    return "\n\n".join([*out, markdown_table(columns, table, ".2f")]) + "\n"


def report(
    folder: Path, figure_path: Path, sigma: float, node_counts: list[int]
) -> tuple[dict[str, Any], str]:
    records = load(folder)
    rows = validate(records)
    figure(records, rows, figure_path)
    predicted = predictions(sigma, node_counts)
    lines = []
    for local in sorted({r["workers_per_node"] for r in rows}):
        group = [r for r in rows if r["workers_per_node"] == local]
        worst = max(group, key=lambda r: abs(r["error"]))
        mean = statistics.fmean(abs(r["error"]) for r in group)
        where = f"{worst['method']}, {worst['scenario']}, {worst['nodes']} nodes"
        lines.append(
            f"{local} rank(s) per node: worst simulator error {100 * worst['error']:+.1f}% ({where}); "
            f"mean |error| {100 * mean:.1f}% over {len(group)} runs"
        )
    text = markdown(records, rows, predicted) + "\n" + "\n".join(lines)
    return {"validation": rows, "predictions": predicted}, text
