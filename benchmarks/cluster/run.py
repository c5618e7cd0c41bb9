"""The emulated cluster's timing of methods on shaped links: one driver, one question per run.

    sudo uv run benchmarks/cluster/run.py QUESTION [--OPTION VALUE ...] [--json PATH] [--table PATH]

Each node is a network namespace (``harness/emulated_cluster.py``), each rank runs ``cluster/rank.py``
in its node and trains every method in turn, rounds interleaved, so that ratios compare runs made side
by side. Questions and defaults: ``cluster/questions.py``. Without root a question that needs the
cluster says so and exits 0; namespaces are removed on exit, error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
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

LOW_COMM_JUDGED, LOW_COMM_VS_NOCOMM, LOW_COMM_VS_DDP = ("ring~h8n@bf16", "ring~h8n"), 1.10, 5.0


def config(args: argparse.Namespace, **mode: Any) -> list[str]:
    """The ranks' ``--config``: every option of the question, and ``mode`` (``rank.py``)."""
    options = {k: v for k, v in vars(args).items() if k not in ("question", "json", "table")}
    return ["--config", json.dumps(options | {"mode": "timed"} | mode)]


def verdict_table(header: list[str], verdicts: list[dict[str, Any]]) -> str:
    """``verdicts`` (dicts whose last key is ``met``) as a table; "" when none."""
    rows = [[*list(v.values())[:-1], str(v["met"])] for v in verdicts]
    return "\n\n" + markdown_table(header, rows) if verdicts else ""


def busiest(per_rank: list[Any]) -> float | None:
    """The busiest rank's bytes (it sets the pace), None if any is missing."""
    return None if None in per_rank else max(per_rank)


def on_cluster(
    args: argparse.Namespace, rate: str, link_mb: float, port: int, **mode: Any
) -> tuple[dict[str, Any], Any]:
    """The question's timed ranks on links at ``rate`` (``mode``: see :func:`config`), and what the links
    and the machine did: one TCP stream's Mbit/s (None when ``link_mb`` is 0), the idle round trip, the
    run's wall and busy CPU seconds; exits if the ranks failed."""
    keys = [f"{s}/{m}" for s in mode.get("scenarios", []) for m in args.methods]
    with emu.Cluster(args.nodes) as cluster:
        cluster.shape(rate)
        probe = {"link_mbit_s": emu.measure_link(cluster, link_mb, port) if link_mb else None}
        probe["round_trip_ms"] = emu.round_trip_ms(cluster, port + 1)
        started, busy = time.monotonic(), emu.busy_cpu_seconds()
        runs = emu.run_workers(cluster, port + 2, args.run_seconds, args, config(args, **mode), keys)
        probe |= {"wall_s": time.monotonic() - started, "machine_busy_s": emu.busy_cpu_seconds() - busy}
    if runs is None:
        sys.exit("the ranks failed; see the log tail above")
    return probe, runs


# -- speed and accelerate: methods side by side at each link rate ---------------------------------


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
            checked = f"one TCP stream node1->node0 {link:.0f} Mbit/s" if link else "link not checked"
            print(f"{bandwidth}: {checked}", flush=True)
            load = os.getloadavg()[0]
            runs = emu.run_workers(cluster, port, min(left, args.run_seconds), args, config(args)) or {}
            loads = (load, os.getloadavg()[0])
            results[bandwidth] = {"link_mbit_s": link, "load_average_1min": loads, "methods": runs}
    params = next((r["params"] for e in results.values() for r in e["methods"].values()), 0)
    model_bytes = 4 * params
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
        exchange = None if bandwidth == "unlimited" else 1e3 * model_bytes * 8 / emu.rate_bits(bandwidth)
        summary[bandwidth] = {"relative": rel, "over": over, "bytes_sent_per_step": sent}
        summary[bandwidth] |= {"exchange_ms": exchange, "nocomm_ms": 1e3 * median["nocomm"]}
        for m in rel:
            ratios = [over.get(ref, {}).get(m) for ref in references]
            mb = None if sent[m] is None else sent[m] / 1e6
            rows.append([bandwidth, exchange, m, 1e3 * median[m], rel[m], *ratios, mb])
    header = ["link", "one model over one link (ms)", "method", "median ms", "/ nocomm"]
    header += [f"{ref} / it" for ref in references] + ["MB sent per step and rank"]
    text = (
        f"{args.nodes} nodes x {args.workers_per_node} ranks on {os.cpu_count()} cores (one torch thread "
        f"each), MLP of {params / 1e6:.2f}M params = {model_bytes / 1e6:.1f} MB, batch {args.batch}; medians "
        f"over {args.rounds} rounds x {args.iters} steps. / nocomm: median step over no communication's; "
        "REF / it: how many times faster than REF; MB sent: the busiest rank's (DDP: a ring all-reduce's "
        "2(n-1)/n gradients; gossip: the engine's bytes_sent_per_step())\n\n"
        + markdown_table(header, rows, ".3f")
    )
    targets = speed_targets(summary)
    text += verdict_table(["target", "link", "value", "bound", "met"], targets)
    return {"runs": results, "summary": summary, "targets": targets}, text


#: (exchange / compute where judged, target, method, against (None: nocomm), bound, at most?): uncompressed
#: gossip's targets at the shaped rate where one exchange takes closest to one step's compute,
#: compressed gossip's where it takes closest to 1.2x (200 Mbit/s for this workload).
SPEED_TARGETS = [
    (1.0, "ring / nocomm", "ring", None, 1.15, True),
    (1.0, "DDP / ring", "ring", "ddp", 1.5, False),
    (1.0, "ring-module / ring", "ring-module", "ring", 1.0, True),
    (1.0, "DDP / ring-module", "ring-module", "ddp", 1.5, False),
    (1.2, "ring@bf16 / nocomm", "ring@bf16", None, 1.12, True),
    (1.2, "DDP / ring@bf16", "ring@bf16", "ddp", 2.0, False),
    (1.2, "ddp-bf16 / ring@bf16", "ring@bf16", "ddp-bf16", 1.5, False),
]


def speed_targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of ``SPEED_TARGETS`` at its rate: a time ratio (at most) or how many times faster (at least)."""
    verdicts = []
    balance = {b: s["exchange_ms"] / s["nocomm_ms"] for b, s in summary.items() if s["exchange_ms"]}
    for ratio, name, method, against, bound, at_most in SPEED_TARGETS:
        judged = "ring" if ratio == 1.0 else "ring@bf16"
        shaped = [b for b in balance if judged in summary[b]["relative"]]
        if not shaped:
            continue
        at = min(shaped, key=lambda b, r=ratio: abs(math.log(balance[b] / r)))
        rel = {**summary[at]["relative"], None: 1.0}
        value = None
        if method in rel and against in rel:
            value = rel[method] / rel[against] if at_most else rel[against] / rel[method]
        met = None if value is None else (value <= bound if at_most else value >= bound)
        bound_text = f"{'<=' if at_most else '>='} {bound}"
        verdicts.append({"target": name, "bandwidth": at, "value": value, "bound": bound_text, "met": met})
    return verdicts


# -- low_comm: a link where one exchange takes several steps' compute ---------------------------------


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
    over it, bytes sent; targets on ``LOW_COMM_JUDGED``."""
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
    verdicts = []
    for m in (m for m in LOW_COMM_JUDGED if m in rel):
        checks = [(f"<= {LOW_COMM_VS_NOCOMM}x no-comm", rel[m] <= LOW_COMM_VS_NOCOMM)]
        faster = "ddp" in rel and rel["ddp"] / rel[m] >= LOW_COMM_VS_DDP
        checks.append((f">= {LOW_COMM_VS_DDP}x faster than DDP", faster))
        peers = [p for p in ("avg~h8", "torchft~h8", "torchft~h8d7") if p in rel]
        checks += [(f"faster than {p}", rel[m] < rel[p]) for p in peers]
        verdicts += [{"method": m, "target": name, "met": met} for name, met in checks]
    text = (
        f"{args.nodes} nodes x 1 worker, link {rate} (measured {link:.0f} Mbit/s): one fp32 model exchange "
        f"{1e3 * exchange_s:.0f} ms = {exchange_s / step_s:.1f}x one step's compute ({1e3 * step_s:.0f} ms "
        f"calibrated; no-comm step in the run {1e3 * runs['nocomm']['mean_s']:.0f} ms)\n\n"
        + markdown_table(["method", "mean ms", "/ nocomm", "DDP / it", "MB sent/step/rank"], rows)
    )
    text += verdict_table(["method", "target", "met"], verdicts)
    results = {"rate": rate, "step_s": step_s, "exchange_s": exchange_s, "link_mbit_s": link, "runs": runs}
    return results | {"relative": rel, "verdicts": verdicts}, text


# -- uneven: the fleet's rate with workers of unequal speed ---------------------------------------------


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


# -- scaling: one cluster size of sleeping compute -------------------------------------------------------


def scaling(args: argparse.Namespace) -> tuple[Any, str]:
    """Per scenario: each method's mean step (over the ranks of their mean), over nocomm's, DDP's over
    it, the ranks' own and the machine's busy CPU in the same windows."""
    if args.workers_per_node > 1 and "hierarchical" not in args.methods:
        args.methods.append("hierarchical")
    scenarios = args.scenarios if args.compute == "emulated" else []
    probe, runs = on_cluster(args, args.bandwidth, args.link_check_mb, 29690, scenarios=scenarios)
    link, rtt, wall, busy = (probe[k] for k in ("link_mbit_s", "round_trip_ms", "wall_s", "machine_busy_s"))
    cores = os.cpu_count() or 1
    summary, rows = {}, []
    for prefix in [f"{s}/" for s in scenarios] or [""]:
        if prefix + "nocomm" not in runs:
            continue
        timed = [m for m in args.methods if prefix + m in runs]
        mean = {m: 1e3 * statistics.fmean(runs[prefix + m]["rank_means_s"]) for m in timed}
        for method, ms in mean.items():
            run = runs[prefix + method]
            window = len(run["round_medians_s"]) * args.iters * ms / 1e3  # seconds of timed steps per rank
            cpu = sum(sum(per_rank) for per_rank in run["measured"].get("cpu_s", []))
            entry = {"mean_ms": ms, "relative": ms / mean["nocomm"]}
            entry["ranks_cpu_fraction"] = cpu / window / cores
            entry["ddp_over"] = mean["ddp"] / ms if "ddp" in mean else None
            entry["bytes_sent_per_step"] = max(run["bytes_sent_per_step"] or [0])
            entry["machine_cpu_fraction"] = sum(run["measured"].get("busy_s", [[]])[0]) / window / cores
            if "compute_s" in run["measured"]:  # real compute: to calibrate the sleeps
                for name in ("compute", "forward"):
                    steps = [t for per_rank in run["measured"][f"{name}_s"] for r in per_rank for t in r]
                    entry[f"{name}_ms"] = 1e3 * statistics.fmean(steps)
            summary[prefix + method] = entry
            cpu_cells = [f"{100 * entry[k]:.1f}%" for k in ("ranks_cpu_fraction", "machine_cpu_fraction")]
            row = [prefix.rstrip("/") or "real compute", method, ms, entry["relative"], entry["ddp_over"]]
            rows.append([*row, *cpu_cells, entry.get("compute_ms"), entry.get("forward_ms")])
    header = ["scenario", "method", "mean ms", "/ nocomm", "DDP / it", "rank CPU", "machine"]
    header += ["compute ms", "forward ms"]
    text = (
        f"{args.nodes} nodes x {args.workers_per_node} at {args.bandwidth}: one TCP stream "
        f"{link or math.nan:.1f} Mbit/s, round trip {rtt:.3f} ms; {wall:.0f} s, the machine's CPU "
        f"{100 * busy / wall / cores:.0f}% busy. mean ms: mean over the ranks of their mean timed step; "
        f"rank CPU: the ranks' own CPU / ({cores} cores x wall); machine: all busy CPU of the machine in "
        "the same windows\n\n" + markdown_table(header, rows, ".3f")
    )
    return {"cores": cores, **probe, "summary": summary, "runs": runs}, text


def report(args: argparse.Namespace) -> tuple[Any, str]:
    return scaling_report.report(Path(args.results), Path(args.figure), args.sigma, args.predict_nodes)


# -- link_sharing: two all-reduces on one link ---------------------------------------------------------

DOUBLINGS = (0.0, 0.025, 0.05, 0.1, 0.2)
HEAD_STARTS = (0.0, 0.025, 0.05, 0.1, 0.15)
SEEDS = 100  # head starts are random: the prediction is a mean over this many seeds


def link_sharing(args: argparse.Namespace) -> tuple[Any, str]:
    """Groups A and B (``SHARING_GROUPS``) all-reduce one model over the same link, B ``delta``
    after A; every ``SharingModel`` of a grid predicts each group's duration, the best fit is what
    ``report`` replays with. ``--fit PATH`` fits a stored run again (no root)."""
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


# -- hsdp: memory per rank and step time -----------------------------------------------------------------


def planner_predictions(
    methods: list[str], shard_bytes: float, args: Any, overhead_ms: float = 0.0
) -> dict[str, float]:
    """The planner's step (ms) per method on the shard at the rank's share of the link (torch's HSDP as
    its DDP, fsdp as its no-communication step)."""
    gossip = [m.partition("@") for m in methods if m not in hsdp_parts.PLANNER_NAMES]
    compute = ComputeTimes(args.compute_ms / 1e3, "none")
    network = Network(Link(emu.rate_bits(args.bandwidth) / args.shards))
    topologies = sorted({t for t, _, _ in gossip}) or None
    compressions = sorted({c for _, _, c in gossip if c})
    overheads = {"overhead_s": overhead_ms / 1e3, "forward_fraction": args.forward_fraction}
    predictions = predict(shard_bytes, compute, network, args.nodes, topologies, compressions, **overheads)
    by_name = {p.method: 1e3 * p.step_s for p in predictions}
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
            held = [r[k] / 1e6 for k in hsdp_parts.HELD_COLUMNS]
            tensors, peak = (r[k] / base[k] if base else None for k in ("total", "peak_rss_growth"))
            rss = [r[k] / 1e6 for k in ("rss_growth", "peak_rss_growth")]
            table.append([c, str(r["ranks"]), *held, tensors, *rss, peak])
        header = ["config", "ranks", "params", "grads", "opt state", "engine copy", "gossip buf", "tensors"]
        header += ["/ whole", "RSS after", "RSS peak", "/ whole"]
        params = next((r[0]["params"] for r in results.values()), 0)
        text.append(
            f"memory per rank, MB (largest rank; model {params / 1e6:.2f}M params = "
            f"{4 * params / 1e6:.1f} MB fp32, {args.mem_steps} AdamW steps of batch {args.mem_batch}, gloo "
            "on loopback; RSS after / peak: resident size after the last step / ru_maxrss over that after a "
            "warm-up run of a tiny model)\n\n" + markdown_table(header, table, ".3f")
        )
        record["memory"] = {"rows": rows, "ranks": results}
    if args.part in ("all", "cluster") and emu.ready_to_emulate():
        args.workers_per_node = args.shards
        probe, runs = on_cluster(args, args.bandwidth, args.link_check_mb, 29701)
        link = probe["link_mbit_s"]
        rows = hsdp_parts.cluster_rows(runs, args.shards, args.iters)
        shard = max(row["shard_bytes"] or 0 for row in rows.values())
        predicted = planner_predictions(list(runs), shard, args)
        # A step's cost besides the sleeps and the replicas' traffic (FSDP2 on loopback, the optimizer)
        excess = max(0.0, rows["fsdp"]["median_ms"] - args.compute_ms) if "fsdp" in rows else None  # type: ignore[operator]
        with_fsdp = {} if excess is None else planner_predictions(list(runs), shard, args, excess)
        base = rows.get("torch-hsdp", {}).get("median_ms")
        table = []
        for m, r in rows.items():
            link_mb = None if r["link_bytes"] is None else r["link_bytes"] / 1e6
            times = [r["median_ms"], base / r["median_ms"] if base else None, r["cpu_ms"]]  # type: ignore[operator]
            table.append([m, *times, r["counted_bytes"] / 1e6, link_mb, predicted.get(m), with_fsdp.get(m)])  # type: ignore[operator]
        header = ["method", "median ms", "torch-hsdp / it", "CPU ms", "MB counted", "MB on link", "plan ms"]
        header += ["plan+fsdp ms"]
        per_rank = emu.rate_bits(args.bandwidth) / args.shards / 1e6
        topologies = sorted({m.partition("@")[0] for m in runs if m not in hsdp_parts.PLANNER_NAMES})
        text.append(
            f"step time, {args.nodes} nodes x {args.shards} ranks at {args.bandwidth} (one TCP stream "
            f"{link or math.nan:.1f} Mbit/s); shard {shard / 1e6:.2f} MB. MB counted: per rank and step over "
            "the slow link (gossip: the engine's; torch-hsdp: 2(R-1)/R x the rank's fp32 gradient shard); MB "
            f"on link: the node veths' tx_bytes per step / {args.shards} ranks, warm-up included; plan ms: "
            "the planner on the shard at the rank's share of the link; plan+fsdp ms: with fsdp's excess "
            f"({excess or 0:.1f} ms) as overhead. Planner: python -m decent_optim_wrapper.plan --model-bytes "
            f"{int(shard)} --compute-ms {args.compute_ms:g} --bandwidth {per_rank:g}mbit --nodes {args.nodes}"
            f" --forward-fraction {args.forward_fraction:g} --topologies {' '.join(topologies)}\n\n"
            + markdown_table(header, table, ".3f")
        )
        record["cluster"] = {"link_mbit_s": link, "rows": rows, "predicted_ms": predicted, "runs": runs}
        record["cluster"] |= {"predicted_with_fsdp_ms": with_fsdp, "fsdp_excess_ms": excess}
    return record, "\n\n".join(text)


# -- the command line ------------------------------------------------------------------------------------

#: Each question's driver: the one of its name (``accelerate`` times its loop as ``speed`` does).
MEASURES = {f.__name__: f for f in (speed, low_comm, uneven, scaling, report, link_sharing, hsdp)}
MEASURES["accelerate"] = speed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``QUESTION`` and its options, one ``--name`` per default in ``questions.py``."""
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
