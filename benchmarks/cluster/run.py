"""The emulated cluster's timing of methods on shaped links: one driver, one question per run.

    sudo uv run benchmarks/cluster/run.py QUESTION [--OPTION VALUE ...] [--json PATH] [--table PATH]

Each rank runs ``cluster/rank.py`` in its node's namespace (``harness/emulated_cluster.py``); questions
and defaults are in ``cluster/questions.py``. Without root a question that needs the cluster exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cluster import hsdp as hsdp_parts
from benchmarks.cluster import scaling_report
from benchmarks.cluster.questions import QUESTIONS
from benchmarks.cluster.rank import SHARING_GROUPS
from benchmarks.harness import emulated_cluster as emu
from benchmarks.harness import uneven as fleet
from benchmarks.harness.common import build_mlp, free_port
from benchmarks.harness.question_args import question_parser
from benchmarks.harness.report import markdown_table, save
from decent_optim_wrapper.plan import ComputeTimes, Link, Network, SharingModel, predict, transfer_seconds
from decent_optim_wrapper.topo.group import Group


def config(args: argparse.Namespace, **mode: Any) -> list[str]:
    """The ranks' ``--config``: every option of the question, and ``mode`` (``rank.py``)."""
    options = {k: v for k, v in vars(args).items() if k not in ("question", "json", "table")}
    return ["--config", json.dumps(options | {"mode": "timed"} | mode)]


def busiest(per_rank: list[Any]) -> float | None:
    """The busiest rank's bytes (it sets the pace), None if any is missing."""
    return None if None in per_rank else max(per_rank)


def on_cluster(
    args: argparse.Namespace, rate: str, link_mb: float, port: int, rtt: bool = False, **mode: Any
) -> tuple[dict[str, Any], Any]:
    """The question's timed ranks on links at ``rate`` (``mode``: see :func:`config`), one TCP stream's
    Mbit/s (None when ``link_mb`` is 0) and, with ``rtt``, the idle round trip; exits if the ranks failed."""
    keys = [f"{s}/{m}" for s in mode.get("scenarios", []) for m in args.methods]
    with emu.Cluster(args.nodes) as cluster:
        cluster.shape(rate)
        probe = {"link_mbit_s": emu.measure_link(cluster, link_mb, port) if link_mb else None}
        if rtt:
            probe["round_trip_ms"] = emu.round_trip_ms(cluster, port + 1)
        runs = emu.run_workers(cluster, port + 2, args.run_seconds, args, config(args, **mode), keys)
    if runs is None:
        sys.exit("the ranks failed; see the log tail above")
    return probe, runs


def speed(args: argparse.Namespace) -> tuple[Any, str]:
    """Every method at every bandwidth within ``--max-seconds``: median step, its ratio to nocomm, how many
    times faster than each reference, bytes sent per step."""
    results: dict[str, Any] = {}
    stop_at = time.monotonic() + args.max_seconds
    with emu.Cluster(args.nodes) as cluster:
        for index, bandwidth in enumerate(args.bandwidths):
            port, left = 29611 + 2 * index, stop_at - time.monotonic()  # a fresh port: no TIME_WAIT
            if left < 20:
                print(f"{bandwidth}: skipped, --max-seconds reached", flush=True)
                continue
            cluster.shape(None if bandwidth == "unlimited" else bandwidth)
            link = emu.measure_link(cluster, args.link_check_mb, port + 1) if args.link_check_mb else None
            print(f"{bandwidth}: one TCP stream node1->node0 {link or math.nan:.0f} Mbit/s", flush=True)
            runs = emu.run_workers(cluster, port, min(left, args.run_seconds), args, config(args)) or {}
            results[bandwidth] = {"link_mbit_s": link, "methods": runs}
    params = next((r["params"] for e in results.values() for r in e["methods"].values()), 0)
    references = [m for m in ("ddp", "ddp-bf16", "local-sgd") if m in args.methods]
    rows, summary = [], {}
    for bandwidth, entry in results.items():
        runs = entry["methods"]
        if "nocomm" not in runs:
            continue
        median = {m: runs[m]["median_s"] for m in args.methods if m in runs}
        rel = {m: t / median["nocomm"] for m, t in median.items()}
        sent = {m: busiest(runs[m]["bytes_sent_per_step"]) for m in rel}
        over = {ref: {m: median[ref] / t for m, t in median.items()} for ref in references if ref in median}
        summary[bandwidth] = {"relative": rel, "over": over, "bytes_sent_per_step": sent}
        exchange = None if bandwidth == "unlimited" else 1e3 * 4 * params * 8 / emu.rate_bits(bandwidth)
        for m in rel:
            ratios = [over.get(ref, {}).get(m) for ref in references]
            mb = None if sent[m] is None else sent[m] / 1e6
            rows.append([bandwidth, exchange, m, 1e3 * median[m], rel[m], *ratios, mb])
    header = ["link", "one model over one link (ms)", "method", "median ms", "/ nocomm"]
    header += [f"{ref} / it" for ref in references] + ["MB sent per step and rank"]
    text = (
        f"{args.nodes} nodes x {args.workers_per_node} ranks, MLP of {params / 1e6:.2f}M params, batch "
        f"{args.batch}; medians over {args.rounds} rounds x {args.iters} steps. REF / it: how many times "
        "faster than REF; MB sent: the busiest rank's\n\n" + markdown_table(header, rows, ".3f")
    )
    return {"runs": results, "summary": summary}, text


def compute_seconds(args: argparse.Namespace, steps: int = 30) -> tuple[float, int]:
    """Median seconds of one training step (forward, backward, AdamW) here, and the model's bytes."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as the ranks do
    torch.manual_seed(0)
    model = build_mlp(args.inputs, args.width, args.depth, 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, args.inputs), torch.randint(0, 10, (args.batch,))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times), sum(p.numel() * p.element_size() for p in model.parameters())


def low_comm(args: argparse.Namespace) -> tuple[Any, str]:
    """Mean step (a round's exchange lands on one step in H: a median would hide it) over nocomm's, DDP's
    over it, bytes sent."""
    if importlib.util.find_spec("torchft") is None:
        print("torchft is not installed (uv run --group bench ...): skipping its methods")
        args.methods = [m for m in args.methods if not m.startswith("torchft")]
    args.methods = list(dict.fromkeys(["nocomm", *args.methods]))
    step_s, model_bytes = compute_seconds(args)
    rate = args.rate or f"{int(model_bytes * 8 / (args.exchange_steps * step_s)) // 1000}kbit"
    probe, runs = on_cluster(args, rate, 5, 29669)
    link = probe["link_mbit_s"]
    exchange_s = model_bytes * 8 / (link * 1e6)  # over the link as measured
    rel = {m: r["mean_s"] / runs["nocomm"]["mean_s"] for m, r in runs.items()}
    rows = []
    for m, r in runs.items():
        sent, ddp = busiest(r["bytes_sent_per_step"]), rel["ddp"] / rel[m] if "ddp" in rel else None
        rows.append([m, 1e3 * r["mean_s"], rel[m], ddp, None if sent is None else sent / 1e6])
    text = (
        f"{args.nodes} nodes x 1 worker, link {rate} (measured {link:.0f} Mbit/s): one fp32 model exchange "
        f"{1e3 * exchange_s:.0f} ms = {exchange_s / step_s:.1f}x one step's compute ({1e3 * step_s:.0f} ms "
        f"calibrated; no-comm step in the run {1e3 * runs['nocomm']['mean_s']:.0f} ms)\n\n"
        + markdown_table(["method", "mean ms", "/ nocomm", "DDP / it", "MB sent/step/rank"], rows)
    )
    results = {"rate": rate, "step_s": step_s, "exchange_s": exchange_s, "link_mbit_s": link, "runs": runs}
    return results | {"relative": rel}, text


def uneven(args: argparse.Namespace) -> tuple[Any, str]:
    """Per cluster size and scenario: each method's fleet steps/s over the sum of own rates and over
    n x the slowest, the planner's rate; paced rounds' target."""
    everything, text = [], []
    for nodes in args.nodes:
        with emu.Cluster(nodes) as cluster:
            cluster.shape(args.bandwidth)
            megabits = emu.measure_link(cluster, 4, 29669)
            fleet_config = config(args, mode="fleet")
            ranks = emu.run_ranks(cluster, 29701 + nodes, nodes, 1, args.run_seconds, fleet_config)
        if ranks is None:
            sys.exit(1)
        summary, rows, notes = {}, [], []
        for scenario in args.scenarios:
            o = fleet.overhead_seconds(ranks, scenario, args)
            planned = fleet.planned_rates(scenario, nodes, megabits, o, args)
            entries = {}
            for method in (m for m in args.methods if m != "nocomm"):
                entry = fleet.fleet_rate(ranks, f"{scenario}/{method}", method, args)
                ideal, today = fleet.own_rates(scenario, nodes, entry["window_s"], o, args)
                entry |= {"own_sum": ideal, "slowest_times_n": today, "of_own": entry["steps_per_s"] / ideal}
                entry |= {"of_today": entry["steps_per_s"] / today, "planned": planned.get(method)}
                entries[method] = entry
                window = "{:.1f}-{:.1f}".format(*entry["window_s"])
                steps = f"{min(entry['steps'])}-{max(entry['steps'])}"
                rates = [entry[k] for k in ("steps_per_s", "of_own", "of_today", "planned")]
                rows.append([scenario, 1e3 * o, method, *rates, window, steps])
            notes += paced_notes(scenario, entries)
            errors = {m: r["planned"] / r["steps_per_s"] - 1 for m, r in entries.items() if r["planned"]}
            if errors:
                verdict = "met" if max(map(abs, errors.values())) <= fleet.PLANNER_TARGET else "MISSED"
                got = ", ".join(f"{m} {100 * e:+.1f}%" for m, e in errors.items())
                notes.append(f"- {scenario}: planner vs measured {got} (within 15%: {verdict})")
            summary[scenario] = {"overhead_s": o, "methods": entries, "planner_error": errors}
        header = ["scenario", "o (ms)", "method", "steps/s", "/ own", "/ n*slowest", "planned", "window s"]
        caption = f"{nodes} nodes, links {args.bandwidth} ({megabits:.0f} Mbit/s measured), compute "
        caption += f"{args.compute_ms:.0f} ms x factor, H={args.sync_every}"
        table = markdown_table([*header, "steps per rank"], rows, ".3f")
        text.append("\n\n".join([caption, table, "\n".join(notes)]))
        everything.append({"nodes": nodes, "megabits": megabits, "summary": summary})
    return everything, "\n\n".join(text)


def paced_notes(scenario: str, entries: dict[str, Any]) -> list[str]:
    """Paced rounds against the target, synchronous gossip and DDP (``entries``: ``fleet_rate``'s)."""
    if "paced" not in entries:
        return []
    paced = entries["paced"]
    for ref in ("sync", "ddp"):
        if ref in entries:
            paced[f"over_{ref}"] = paced["steps_per_s"] / entries[ref]["steps_per_s"]
    met = "met" if paced["of_own"] >= fleet.TARGET else "MISSED"
    waited = max(paced.get("waited_fraction", [0.0]))
    return [
        f"- {scenario}: paced {100 * paced['of_own']:.1f}% of the own rates (target 90%: {met}), "
        f"{paced.get('over_sync', math.nan):.2f}x synchronous gossip, {paced.get('over_ddp', math.nan):.2f}x "
        f"DDP; most time a rank waited: {100 * waited:.1f}%"
    ]


def scaling(args: argparse.Namespace) -> tuple[Any, str]:
    """Per scenario: each method's mean step (over the ranks of their mean), over nocomm's, DDP's over it."""
    if args.workers_per_node > 1 and "hierarchical" not in args.methods:
        args.methods.append("hierarchical")
    scenarios = args.scenarios if args.compute == "emulated" else []
    probe, runs = on_cluster(args, args.bandwidth, args.link_check_mb, 29690, rtt=True, scenarios=scenarios)
    summary, rows, header = {}, [], ["scenario", "method", "mean ms", "/ nocomm", "DDP / it"]
    for prefix in [f"{s}/" for s in scenarios] or [""]:
        timed = [m for m in args.methods if prefix + m in runs]
        mean = {m: 1e3 * statistics.fmean(runs[prefix + m]["rank_means_s"]) for m in timed}
        for method, ms in mean.items() if "nocomm" in mean else ():
            entry = summary[prefix + method] = {"mean_ms": ms, "relative": ms / mean["nocomm"]}
            entry["ddp_over"] = mean["ddp"] / ms if "ddp" in mean else None
            for name, per_rank in runs[prefix + method]["measured"].items():  # real compute's
                entry[name.replace("_s", "_ms")] = 1e3 * statistics.fmean(t for r in per_rank for t in r)
            row = [prefix.rstrip("/") or "real compute", method, ms, entry["relative"], entry["ddp_over"]]
            rows.append([*row, entry.get("compute_ms"), entry.get("forward_ms")])
    text = (
        f"{args.nodes} nodes x {args.workers_per_node} at {args.bandwidth}: one TCP stream "
        f"{probe['link_mbit_s'] or math.nan:.1f} Mbit/s, round trip {probe['round_trip_ms']:.3f} ms; "
        "mean ms: over the ranks of their mean timed step\n\n"
        + markdown_table([*header, "compute ms", "forward ms"], rows, ".3f")
    )
    return {**probe, "summary": summary, "runs": runs}, text


def report(args: argparse.Namespace) -> tuple[Any, str]:
    return scaling_report.report(Path(args.results), Path(args.figure), args.sigma, args.predict_nodes)


DOUBLINGS = (0.0, 0.025, 0.05, 0.1, 0.2)
HEAD_STARTS = (0.0, 0.025, 0.05, 0.1, 0.15)
SEEDS = 100  # head starts are random: the prediction is a mean over this many seeds


def link_sharing(args: argparse.Namespace) -> tuple[Any, str]:
    """Groups A and B all-reduce one model over one link, B ``delta`` after A; the ``SharingModel`` of a
    grid that predicts their durations best is ``report``'s. ``--fit PATH``: a stored run (no root)."""
    if args.fit:
        record = json.loads(Path(args.fit).read_text())
        record = record.get("results", record)  # a file run.py wrote keeps the run under "results"
    else:
        if not emu.ready_to_emulate():
            sys.exit(0)
        with emu.Cluster(2) as cluster:
            cluster.shape(args.bandwidth)
            ranks = emu.run_ranks(cluster, 29655, 4, 2, args.run_seconds, config(args, mode="sharing"))
        if ranks is None:
            sys.exit(1)
        record = {"args": vars(args), "numel": args.numel}
        for name, (a, b) in SHARING_GROUPS.items():  # a group's duration: its members' mean
            pairs = {d: zip(ranks[a][d], ranks[b][d], strict=True) for d in ranks[a]}
            record[name] = {d: [statistics.fmean(pair) for pair in pairs[d]] for d in pairs}
    alone = statistics.median(record["A"]["-1.0"])
    model_bytes = 4 * record["numel"]
    rate = 8 * model_bytes / alone  # the link's rate seen by one transfer alone
    network = Network(Link(rate), Link(10e9), local_world_size=2)
    transfers = [network.transfer(Group(ranks), model_bytes) for ranks in ((0, 2), (1, 3))]
    delays = [d for d in record["A"] if float(d) >= 0]
    measured = {
        float(d): (statistics.fmean(record["A"][d]), statistics.fmean(record["B"][d])) for d in delays
    }
    pair = lambda ab: f"{1e3 * ab[0]:.0f}/{1e3 * ab[1]:.0f}"  # noqa: E731
    rows = [["measured", "", *map(pair, measured.values()), ""]]
    fits = []
    for doubling, head in itertools.product(DOUBLINGS, HEAD_STARTS):
        if head and not doubling:
            continue
        predicted, models = {}, [SharingModel(doubling, head, seed) for seed in range(SEEDS)]
        for d in measured:
            runs = [transfer_seconds(transfers, [0.0, d], model) for model in models]
            predicted[d] = tuple(statistics.fmean(r[i] for r in runs) for i in (0, 1))
        errors = [p / m - 1 for d in measured for p, m in zip(predicted[d], measured[d], strict=True)]
        fits.append((statistics.fmean(e * e for e in errors) ** 0.5, doubling, head, predicted))
    fits.sort(key=lambda f: -f[0])
    for rms, d, h, p in fits:
        rows.append([f"{1e3 * d:.0f}", f"{1e3 * h:.0f}", *map(pair, p.values()), f"{100 * rms:.1f}%"])
    rms, doubling, head, _ = fits[-1]
    header = ["doubling ms", "head start ms", *(f"A/B at delta {1e3 * d:.0f} ms" for d in measured)]
    header += ["rms error"]
    alone_text = f"one transfer alone: {1e3 * alone:.0f} ms ({rate / 1e6:.1f} Mbit/s)"
    best = f"best fit: SharingModel(doubling_s={doubling}, head_start_s={head}), rms error {100 * rms:.1f}%"
    return record, "\n\n".join([alone_text, markdown_table(header, rows), best])


def planner_predictions(methods: list[str], shard_bytes: float, args: Any) -> dict[str, float]:
    """The planner's step (ms) per method on the shard at the rank's share of the link (torch's HSDP as
    its DDP, fsdp as its no-communication step)."""
    gossip = [m.partition("@") for m in methods if m not in hsdp_parts.PLANNER_NAMES]
    compute = ComputeTimes(args.compute_ms / 1e3, "none")
    network = Network(Link(emu.rate_bits(args.bandwidth) / args.shards))
    topologies = sorted({t for t, _, _ in gossip}) or None
    compressions = sorted({c for _, _, c in gossip if c})
    found = predict(
        shard_bytes,
        compute,
        network,
        args.nodes,
        topologies,
        compressions,
        forward_fraction=args.forward_fraction,
    )
    by_name = {p.method: 1e3 * p.step_s for p in found}
    return {m: by_name[hsdp_parts.PLANNER_NAMES.get(m, m)] for m in methods}


def hsdp(args: argparse.Namespace) -> tuple[Any, str]:
    """``--part memory`` (loopback), ``cluster`` (root) or ``all``."""
    record, text = {}, []
    if args.part in ("all", "memory"):
        results = {}
        for name in args.memory_configs:
            world = args.replicas * (1 if name.startswith("whole") else args.shards)  # ranks of a replica
            env = {"MALLOC_MMAP_THRESHOLD_": str(hsdp_parts.MMAP_THRESHOLD)}  # RSS follows the tensors
            extra = config(args, mode="memory", config=name)
            ranks = emu.run_ranks(None, free_port(), world, world, args.memory_seconds, extra, env=env)
            if ranks is not None:
                results[name] = ranks
        rows = hsdp_parts.memory_rows(results)
        base = rows.get("whole")
        table = []
        for c, r in rows.items():
            total, peak = (r[k] / base[k] if base else None for k in ("total", "peak_rss_growth"))
            table.append([c, str(r["ranks"]), r["total"] / 1e6, total, r["peak_rss_growth"] / 1e6, peak])
        header = ["config", "ranks", "tensors MB", "/ whole", "peak RSS MB", "/ whole"]
        params = next((r[0]["params"] for r in results.values()), 0)
        text.append(
            f"memory per rank, MB (largest rank; model {params / 1e6:.2f}M params, {args.mem_steps} AdamW "
            f"steps of batch {args.mem_batch} on loopback; peak RSS: ru_maxrss over that after a warm-up run "
            "of a tiny model)\n\n" + markdown_table(header, table, ".3f")
        )
        record["memory"] = {"rows": rows, "ranks": results}
    if args.part in ("all", "cluster") and emu.ready_to_emulate():
        args.workers_per_node = args.shards
        probe, runs = on_cluster(args, args.bandwidth, args.link_check_mb, 29701)
        link = probe["link_mbit_s"]
        rows = hsdp_parts.cluster_rows(runs, args.shards)
        shard = max(row["shard_bytes"] or 0 for row in rows.values())
        predicted = planner_predictions(list(runs), shard, args)
        base = rows.get("torch-hsdp", {}).get("median_ms")
        table = []
        for m, r in rows.items():
            link_mb = None if r["link_bytes"] is None else r["link_bytes"] / 1e6
            ratio = base / r["median_ms"] if base else None  # type: ignore[operator]
            table.append([m, r["median_ms"], ratio, r["counted_bytes"] / 1e6, link_mb, predicted.get(m)])  # type: ignore[operator]
        header = ["method", "median ms", "torch-hsdp / it", "MB counted", "MB on link", "plan ms"]
        per_rank = emu.rate_bits(args.bandwidth) / args.shards / 1e6
        topologies = sorted({m.partition("@")[0] for m in runs if m not in hsdp_parts.PLANNER_NAMES})
        text.append(
            f"step time, {args.nodes} nodes x {args.shards} ranks at {args.bandwidth} (one TCP stream "
            f"{link or math.nan:.1f} Mbit/s); shard {shard / 1e6:.2f} MB. MB counted / on link: per rank "
            "and step over the slow link, counted by the method / the node veths' tx_bytes over its ranks; "
            f"plan ms: python -m decent_optim_wrapper.plan --model-bytes {int(shard)} --compute-ms "
            f"{args.compute_ms:g} --bandwidth {per_rank:g}mbit --nodes {args.nodes} --forward-fraction "
            f"{args.forward_fraction:g} --topologies {' '.join(topologies)}\n\n"
            + markdown_table(header, table, ".3f")
        )
        record["cluster"] = {"link_mbit_s": link, "rows": rows, "predicted_ms": predicted, "runs": runs}
    return record, "\n\n".join(text)


#: Each question's driver: the one of its name (``accelerate`` times its loop as ``speed`` does).
MEASURES = {f.__name__: f for f in (speed, low_comm, uneven, scaling, report, link_sharing, hsdp)}
MEASURES["accelerate"] = speed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    asked = {name: (q.help, q.defaults) for name, q in QUESTIONS.items()}
    parser = question_parser(__doc__.split("\n")[0], asked)
    args = parser.parse_args(argv)
    methods = getattr(args, "methods", [])
    if args.question in ("speed", "accelerate", "scaling", "uneven") and "nocomm" not in methods:
        parser.error("--methods must include nocomm: every ratio is to its step time")
    if len(set(methods)) != len(methods):
        parser.error(f"--methods names a method twice: {' '.join(methods)}")
    for rate in [*getattr(args, "bandwidths", []), getattr(args, "bandwidth", "unlimited")]:
        if rate != "unlimited":
            try:
                emu.rate_bits(rate)
            except ValueError as err:
                parser.error(str(err))
    if getattr(args, "loop", None) == "accelerate" and (args.iters % args.every or args.warmup % args.every):
        parser.error(f"--iters and --warmup must be multiples of --every ({args.every})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if QUESTIONS[args.question].root and not emu.ready_to_emulate():
        return
    results, text = MEASURES[args.question](args)
    save(args, results, text)


if __name__ == "__main__":
    main()
