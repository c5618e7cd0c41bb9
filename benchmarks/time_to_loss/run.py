"""Time to a loss: methods trained to a target loss on a fleet of emulated nodes, timed, against the planner.

    sudo uv run --group bench benchmarks/time_to_loss/run.py slow-link|scale-model [--json P]
    sudo uv run benchmarks/time_to_loss/run.py uneven --nodes 4 8 16 [--json P]
    uv run benchmarks/time_to_loss/run.py lm [--results LM_CONVERGENCE_JSON ...] [--reference JSON ...]

Each node runs ``rank.py``, one method at a time, which writes its parameters at fixed steps; the
replicas' average is evaluated afterwards. ``lm`` needs no cluster. Defaults: ``questions.py``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.harness import emulated_cluster as emu
from benchmarks.harness import uneven as fleet
from benchmarks.harness.interleaved import timed
from benchmarks.harness.lm_task import CONTEXT, make_lm_data, make_lm_model, validation_loss, windows
from benchmarks.harness.methods import optimizer_factory, parse_method
from benchmarks.harness.question_args import question_parser
from benchmarks.harness.report import cell, markdown_table, save
from benchmarks.time_to_loss.questions import QUESTIONS
from benchmarks.time_to_loss.rank import POWER_SGD, TORCHFT, train_step, wire_bytes
from decent_optim_wrapper import DecentOptimWrapper
from decent_optim_wrapper.engine.wire.compression import parse_compression
from decent_optim_wrapper.plan import ComputeTimes, Link, Network, predict
from decent_optim_wrapper.plan.recommend import recommend
from decent_optim_wrapper.plan.round_cost import measure_round_cost

RANK = Path(__file__).with_name("rank.py")
PREDICTION, THROUGHPUT, LOSS, PACED_SOONER = 0.15, 0.90, 1.02, 1.5  # the targets (and --sooner)
MTU_FRAME = 1514  # bytes of one Ethernet frame (--burst-frames)
Curve = list[tuple[int, float, float]]  # (step, training seconds, the average's validation loss)
Namespace = argparse.Namespace
_runs = itertools.count()  # a fresh port per run: the last run's may linger


# -- what every question shares: the model's step, a run on the cluster, its evaluation, the planner


def padding(q: Namespace, steps: int = 30) -> tuple[float, float]:
    """The model's own step here (median ms, one thread) and the sleep topping it up to ``--compute-ms``."""
    torch.set_num_threads(1)
    tokens, _ = make_lm_data(1, 0, "iid")
    model = make_lm_model(q.width, q.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=q.adam_lr)
    sampler, times = torch.Generator().manual_seed(0), []
    for _ in range(steps):
        x, y = windows(tokens, torch.randint(0, len(tokens) - CONTEXT - 1, (q.batch,), generator=sampler))
        times.append(timed(functools.partial(train_step, model, optimizer, x, y)))
    real_ms = 1e3 * statistics.median_high(times)
    print(f"the model's own step: {real_ms:.1f} ms here (batch {q.batch}); a step {q.compute_ms:g} ms")
    return real_ms, max(0.0, q.compute_ms - real_ms)


def engine_overhead_seconds(q: Namespace, method: str = "ring~h8d1", steps: int = 64) -> float:
    """Seconds our optimizer step adds to AdamW's in a world of one rank (the planner's ``overhead_s``)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        means = []
        for wrapped in (False, True):
            model = make_lm_model(q.width, q.depth)
            optimizer = optimizer_factory("adamw", 0.0, q.adam_lr)(list(model.named_parameters()))
            if wrapped:
                optimizer = DecentOptimWrapper(optimizer, **parse_method(method).engine_options())
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            for _ in range(8):  # untimed: buckets built, first allocations
                optimizer.step()
            means.append(timed(lambda opt=optimizer: [opt.step() for _ in range(steps)]) / steps)
    finally:
        dist.destroy_process_group()
    return max(0.0, means[1] - means[0])


def launch(
    cluster: emu.Cluster, q: Namespace, method: str, pads: list[float], deadline_s: float,
    shape: Callable[[], None] | None = None, **flags: object,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Train ``method`` on every node (``pads``: each rank's sleep): the ranks' records and the evaluated
    curve. With ``shape``, the ranks are built on fast links and wait at the gate until ``shape`` slows
    them (start-up is not what a run measures). Raises if a rank failed or ran out of time."""
    outdir, nodes = Path(tempfile.mkdtemp(prefix="dow-ttl-")), cluster.nodes
    shared = ("steps", "warmup", "batch", "adam_lr", "width", "depth", "timeout_s")
    flags |= {k: getattr(q, k) for k in shared} | {"world_size": nodes, "method": method, "outdir": outdir}
    port, procs, counted = 29681 + next(_runs) % 16, [], cluster.sent_bytes()
    for rank in range(nodes):
        mine = {**flags, "rank": rank, "pad_ms": pads[rank]}
        argv = [str(RANK), *[x for k, v in mine.items() for x in (f"--{k.replace('_', '-')}", str(v))]]
        env, log = emu.node_env(cluster, rank, port), outdir / f"rank{rank}.log"
        procs.append(emu.start_in_node(cluster, rank, argv + ["--gate"] * bool(shape), env, log))
    gated = shape is None

    def open_gate() -> None:  # once every rank is built: shape the links, count from here, let them go
        nonlocal counted, gated
        if shape and not gated and all((outdir / f"ready-{r}").exists() for r in range(nodes)):
            shape()
            counted, gated = cluster.sent_bytes(), True
            (outdir / "go").touch()

    try:
        emu.wait_for(procs, deadline_s, open_gate)
    finally:
        emu.stop(procs)
        if shape is not None:
            cluster.shape(None)  # the next run starts on fast links again, also after a failed one
    try:
        missing = [r for r in range(nodes) if not (outdir / f"rank{r}.json").exists()]
        if missing:
            tail = (outdir / f"rank{missing[0]}.log").read_text()[-2000:]
            raise RuntimeError(f"{method}: rank {missing[0]} failed or timed out; its log ends:\n{tail}")
        records = [json.loads((outdir / f"rank{r}.json").read_text()) for r in range(nodes)]
        result = evaluate(outdir, records, q)
        if shape is not None:  # the run's whole traffic per node and step, headers and the store's too
            result["wire_bytes_per_step"] = (cluster.sent_bytes() - counted) / nodes / len(records[0]["ends"])
    finally:
        shutil.rmtree(outdir, ignore_errors=True)
    return records, result


def evaluate(outdir: Path, records: list[dict[str, Any]], q: Namespace) -> dict[str, Any]:
    """The average model's validation loss at every written step, and when every rank had passed it."""
    _, validation = make_lm_data(1, 0, "iid")
    model, curve = make_lm_model(q.width, q.depth), []
    for i, (step, _) in enumerate(records[0]["points"]):
        flats = [torch.load(outdir / f"rank{r}-step{step}.pt") for r in range(len(records))]
        torch.nn.utils.vector_to_parameters(torch.stack(flats).mean(0), model.parameters())
        curve.append((step, max(r["points"][i][1] for r in records), validation_loss(model, validation)))
    out = {"curve": curve, "steps": curve[-1][0], "step_ms": 1e3 * curve[-1][1] / curve[-1][0]}
    return out | {"bytes_sent_per_step": max(r["bytes_sent_per_step"] for r in records)}


def reached(curve: Curve, target: float) -> tuple[int, float] | None:
    """The first (step, seconds) at which the average's validation loss is at most ``target``."""
    return next(((s, t) for s, t, loss in curve if loss <= target), None)


def ours(method: str) -> bool:
    """Whether ``method`` is one of ours (``methods.py``'s grammar) rather than a baseline."""
    return method != "nocomm" and not method.startswith(("ddp", "torchft"))


def delay(spec: Any) -> int:
    """The steps a round of ``spec`` is folded in late (unset: the library's default, a whole round)."""
    return spec.sync_every if spec.sync_delay is None else spec.sync_delay


def planner_label(method: str) -> str:
    """The planner's name for ``method``: ``ring~h8d1@int8``, ``ddp`` (for ``ddp+adamw``)."""
    if not ours(method):
        return "ddp" if method.partition("+")[0] == "ddp" else method
    spec = parse_method(method)
    wire = f"@{spec.compression}" if spec.compression else ""
    if spec.sync_every == 1:
        return f"{spec.topology}{wire}" + "~h1d0" * (spec.sync_delay == 0)
    return f"{spec.topology}~h{spec.sync_every}d{delay(spec)}{wire}"


def predictions(
    methods: list[str], model_bytes: float, compute: ComputeTimes, link: Link, nodes: int, **options: Any
) -> dict[str, float]:
    """The planner's step seconds of DDP and of ours among ``methods``, by planner name."""
    specs = [parse_method(m) for m in methods if ours(m)]
    options["compressions"] = sorted({s.compression for s in specs if s.compression})
    options["local_steps"] = sorted({(s.sync_every, delay(s)) for s in specs if s.sync_every > 1})
    return {p.method: p.step_s for p in predict(model_bytes, compute, Network(link), nodes, **options)}


def measured_rounds(numel: int) -> Callable[..., Any]:
    """The planner's ``round_costs``: each wire format's round timed here for ``numel`` parameters, once."""
    return functools.cache(lambda compression, group_size: measure_round_cost(numel, group_size, compression))


def partial(q: Namespace, results: object) -> None:
    """Write what is measured so far to ``--json`` (``"partial": true``): not lost to a later failure."""
    if q.json:
        Path(q.json).write_text(
            json.dumps({"partial": True, "args": vars(q), "results": results}, default=str)
        )


# -- slow-link and scale-model: methods trained to a loss and timed on shaped links, against the planner


def recommended(q: Namespace, model_bytes: float, step_s: float, link: Link, nodes: int) -> str:
    """The planner's recommendation for this cluster, in the benchmarks' method grammar."""
    found = recommend(model_bytes, ComputeTimes(step_s), Network(link), nodes, q.topology)
    if not found.hides:
        raise RuntimeError(f"the planner hides no setting on {link.bandwidth / 1e3:.1f} kbit/s: pass --ours")
    return found.chosen.method.partition("+")[0]


def step_seconds(records: list[dict[str, Any]], skip: int) -> float:
    """Mean seconds per step on the slowest rank, leaving out the first ``skip`` steps."""
    steps = [[b - a for a, b in itertools.pairwise([r["start"], *r["ends"]])][skip:] for r in records]
    return max(statistics.fmean(s) for s in steps)


def timed_steps(method: str, q: Namespace) -> tuple[int, int]:
    """(steps to run, steps to leave out) when timing a baseline on the shaped links."""
    if POWER_SGD.fullmatch(method):
        return 2 + q.timed_steps, 2  # torch all-reduces the first two steps in full
    torchft = TORCHFT.fullmatch(method)
    return (int(torchft["every"]), 0) if torchft else (q.timed_steps, 0)  # torchft: one whole period


def on_links(q: Namespace) -> tuple[dict[str, Any], str]:
    """slow-link and scale-model, one node count after the other."""
    real_ms, pad_ms = padding(q)
    q.overhead_s = engine_overhead_seconds(q)
    results: dict[str, Any] = {"real_step_ms": real_ms, "overhead_s": q.overhead_s, "results": []}
    for nodes in q.nodes:
        results["results"].append({"nodes": nodes, "runs": {}})
        on_links_nodes(nodes, pad_ms, q, results)
    return results, "\n\n".join(links_report(r, q) for r in results["results"])


def on_links_nodes(nodes: int, pad_ms: float, q: Namespace, results: dict[str, Any]) -> None:
    """Into the last of ``results``: ``nocomm`` and the baselines on fast links (their loss), then on
    links shaped from the ``nocomm`` step the methods and ours trained, the baselines timed."""
    model = make_lm_model(q.width, q.depth)
    numel, result = sum(p.numel() for p in model.parameters()), results["results"][-1]
    runs, fast_s = result["runs"], q.steps * q.compute_ms / 1e3 * 4 + 900  # 16 starts on 2 cores are slow

    def train(method: str, stop_at: int, deadline_s: float, shape: Any = None) -> dict[str, Any]:
        began, flags = time.monotonic(), {"stop_at": stop_at, "eval_every": q.eval_every}
        records, r = launch(cluster, q, method, [pad_ms] * nodes, deadline_s, shape, **flags)
        r |= {"timed_s": step_seconds(records, timed_steps(method, q)[1]), "wall_s": time.monotonic() - began}
        print(f"  {nodes} nodes, {method}{' (shaped)' * bool(shape)}: {1e3 * r['timed_s']:.1f} ms/step")
        partial(q, results)
        return r

    def unhidden_s(method: str) -> float:  # a step with the method's bytes sent after the compute
        return nocomm_s + wire_bytes(method, model, nodes) * 8 / link.bandwidth

    with emu.Cluster(nodes) as cluster:
        runs["nocomm"] = train("nocomm", min(100, q.steps), fast_s)
        nocomm_s = runs["nocomm"]["step_ms"] / 1e3
        for method in q.baselines:  # their loss does not depend on the link: curves on fast links
            runs[method] = train(method, q.steps, fast_s)
        link_steps = q.link_steps or q.ddp_ratio * nodes / (2 * (nodes - 1))  # DDP's all-reduce: ddp_ratio
        rate = 4.0 * numel * 8 / (link_steps * nocomm_s)
        burst, latency = q.burst_frames * MTU_FRAME or None, f"{q.queue_s:g}s"
        shape = functools.partial(cluster.shape, f"{int(rate)}bit", burst=burst, latency=latency)
        shape()
        megabits = emu.measure_link(cluster, min(2.0, rate / 8 * 20 / 1e6), 29669, timeout_s=120)  # or 20 s
        message = q.message_bytes  # the link's cost per message beyond its payload; < 0: probe it
        if message < 0:  # with a round of what the link moves in a step, as a pair's all-reduce sends it
            payload, goodput = int(4 * numel / link_steps), megabits * 1e6 / rate
            message = emu.measure_message_bytes(cluster, payload, 29670, goodput)
        cluster.shape(None)
        print(f"  links {rate / 1e3:.1f} kbit/s ({megabits * 1e3:.1f} measured), {message:.0f} B a message")
        link = Link(megabits * 1e6, message_bytes=message)
        mine = recommended(q, 4.0 * numel, nocomm_s, link, nodes) if q.ours == "planner" else q.ours
        trained = [m for m in [*q.methods, mine] if m and m != "nocomm"]
        options = {"overhead_s": q.overhead_s, "round_costs": measured_rounds(numel)}
        options["topologies"] = sorted({str(parse_method(m).topology) for m in trained if ours(m)})
        planned = predictions(trained, 4.0 * numel, ComputeTimes(nocomm_s), link, nodes, **options)
        for method in trained:
            stop_at, deadline_s = q.steps, fast_s * 2
            if q.budget_s:  # at most the budget at the planned pace, or with nothing hidden
                pace = planned.get(planner_label(method)) or unhidden_s(method)
                stop_at = min(q.steps, max(q.eval_every, int(q.budget_s / pace)))
                stop_at, deadline_s = stop_at - stop_at % q.eval_every, q.budget_s * 1.5 + 60
            runs[method] = train(method, stop_at, deadline_s, shape)
        for baseline in q.baselines:
            steps = timed_steps(baseline, q)[0]
            try:
                timing = train(baseline, steps, steps * unhidden_s(baseline) * 3 + 900, shape)
                runs[baseline]["shaped_step_s"] = timing["timed_s"]
            except RuntimeError as err:  # its loss stands; a run that cannot be timed loses nothing else
                for key in ("step_ms", "timed_s", "wall_s"):  # its times on the fast links
                    runs[baseline].pop(key, None)
                runs[baseline]["not_timed"] = str(err).splitlines()[0]
    result |= {"parameters": numel, "rate_bits": rate, "megabits": megabits, "message_bytes": message}
    result |= {"planned": planned, "ours": mine or None}


def seconds_to(run: dict[str, Any], loss: float) -> tuple[int | None, float | None]:
    """The first evaluated step at ``loss`` or below and the seconds to it on the shaped links: a
    baseline's steps at its pace timed there, else the run's own clock (None: never, or no times)."""
    hit = reached(run["curve"], loss)
    if hit is None:
        return None, None
    if "shaped_step_s" in run:
        return hit[0], hit[0] * run["shaped_step_s"]
    return hit[0], (hit[1] if "step_ms" in run else None)


def is_sparse(method: str) -> bool:
    return ours(method) and "@" in method and parse_compression(method.partition("@")[2]).sparse


def links_report(result: dict[str, Any], q: Namespace) -> str:
    """One row per method (step time, planned, bytes, final loss, the step and seconds to each target
    against ours), then the targets, met or MISSED."""
    runs, planned, nodes = result["runs"], result["planned"], result["nodes"]
    nocomm_ms = runs["nocomm"]["step_ms"]
    ddp_final = runs["ddp"]["curve"][-1][2] if "ddp" in runs else float("nan")
    finals = {m: r["curve"][-1][2] for m, r in runs.items() if m != "nocomm"}
    common = max(finals.values())  # the loss every method reaches
    goals = {f"{q.target_loss}": q.target_loss} if q.target_loss else {"DDP's loss": ddp_final}
    goals |= {} if q.target_loss else {f"every method's final loss, {common:.4f},": common}
    reach = {goal: {m: seconds_to(runs[m], loss) for m in finals} for goal, loss in goals.items()}
    first = next(iter(reach.values()))
    sparse = sorted((t, m) for m, (_, t) in first.items() if is_sparse(m) and t is not None)
    mine = result["ours"] or (sparse[0][1] if sparse else next((m for m in finals if is_sparse(m)), None))
    step_ms = {m: r.get("step_ms", float("nan")) for m, r in runs.items()}
    step_ms |= {m: 1e3 * r["shaped_step_s"] for m, r in runs.items() if "shaped_step_s" in r}
    rows = []
    for m, r in [(m, runs[m]) for m in finals]:  # every method but nocomm
        plan = planned.get(planner_label(m))
        row = [m, cell(r.get("steps"), "d"), step_ms[m], plan and 1e3 * plan, f"{nocomm_ms / step_ms[m]:.3f}"]
        row += [f"{r['bytes_sent_per_step']:.0f}"]
        row += [cell(r.get("wire_bytes_per_step"), ".0f"), f"{finals[m]:.4f}", f"{finals[m] / ddp_final:.4f}"]
        for times in reach.values():
            (step, seconds), theirs = times[m], times[mine][1] if mine else None
            ran = f">{r['curve'][-1][1]:.0f}" if "step_ms" in r and "shaped_step_s" not in r else "-"
            row += [cell(step, "d") if step else "never", ran if seconds is None else f"{seconds:.0f}"]
            row += [cell(seconds / theirs if seconds and theirs else None, ".2f")]
        rows.append(row)
    header = ["method", "steps", "ms/step", "planned", "/ nocomm", "B/step", "on wire", "final loss"]
    header += ["vs DDP"] + [c for goal in goals for c in (f"step to {goal}", f"s to {goal}", f"vs {mine}")]
    title = f"{nodes} nodes x 1 worker, {result['parameters']:,} parameters, links {result['megabits']:.3f}"
    title += f" Mbit/s ({result['message_bytes']:.0f} B a message): {nocomm_ms:.1f} ms/step without"
    lines = [f"{title} communication", markdown_table(header, rows, ".1f")]
    verdicts = result.setdefault("verdicts", [])

    def judge(name: str, met: bool) -> None:
        verdicts.append({"nodes": nodes, "target": name, "met": met})
        lines.append(f"target: {name}: {'met' if met else 'MISSED'}")

    if result["ours"]:  # one of ours chosen beforehand: as fast and as good as the targets ask?
        share, loss = nocomm_ms / step_ms[mine], finals[mine] / ddp_final
        judge(f"{mine} at least {THROUGHPUT:.2f} of no communication ({share:.3f})", share >= THROUGHPUT)
        judge(f"{mine} final loss at most {LOSS:.2f}x DDP's ({loss:.4f}x)", loss <= LOSS)
    for goal, times in reach.items() if mine else ():
        mine_s = times[mine][1]
        if q.target_loss:
            others = [t for m, (_, t) in times.items() if m != mine]
            first_ = mine_s is not None and all(t is None or t >= mine_s for t in others)
            judge(f"{mine} reaches {goal} first", first_)
        for family in ("ddp-psgd", "torchft"):
            theirs = [t for m, (_, t) in times.items() if m.startswith(family)]
            if theirs:
                best = min((t for t in theirs if t is not None), default=None)
                name = f"{mine} reaches {goal} {q.sooner:g}x sooner than the best {family} run"
                judge(name, mine_s is not None and (best is None or best >= q.sooner * mine_s))
    for m in (m for m in runs if ours(m) and "@" in m and planner_label(m) in planned):  # compressed ours
        error = 1e3 * planned[planner_label(m)] / step_ms[m] - 1
        judge(f"{m} step time predicted within {PREDICTION:.0%} ({error:+.1%})", abs(error) <= PREDICTION)
    return "\n".join(lines)


# -- uneven: paced rounds against synchronous gossip and DDP, one worker 3x slower (one3x)


def gossip_rounds(q: Namespace) -> int:
    """Rounds of the gossip methods: ``--budget`` times DDP's samples."""
    return int(q.budget * q.steps) // q.sync_every


def uneven_flags(method: str, q: Namespace) -> tuple[str, dict[str, object]]:
    """``rank.py``'s method for ``method`` (nocomm, ddp, sync or paced), and its flags besides launch's."""
    if method in ("nocomm", "ddp"):
        steps = q.nocomm_steps if method == "nocomm" else q.steps
        return method, {"stop_at": steps, "eval_every": q.eval_every if method == "ddp" else steps}
    flags = {"rounds": gossip_rounds(q), "eval_rounds": max(1, q.eval_every // q.sync_every)}
    return q.gossip, flags | {"pacing": "measured" if method == "paced" else "none"}


def uneven_rates(records: dict[str, list[dict[str, Any]]], nodes: int, megabits: float, q: Namespace) -> dict:
    """Measured fleet steps per second of ddp, sync and paced, the planner's and its errors
    (``harness/uneven.py``: ``o`` from ``nocomm``, the planner over at most 30 rounds)."""
    rounds = min(gossip_rounds(q), 30)
    args = Namespace(compute_ms=q.compute_ms, shift_s=0.0, sync_every=q.sync_every, rounds=rounds)
    o = fleet.overhead_seconds([{"one3x/nocomm": r} for r in records["nocomm"]], "one3x", args)
    model_bytes = 4.0 * sum(p.numel() for p in make_lm_model(q.width, q.depth).parameters())
    late = delay(parse_method(q.gossip))
    planned = fleet.planned_rates("one3x", nodes, megabits, o, args, model_bytes, late)
    methods = [m for m in ("ddp", "sync", "paced") if m in records]
    measured = {m: fleet.fleet_rate([{m: r} for r in records[m]], m, m, args)["steps_per_s"] for m in methods}
    errors = {m: planned[m] / rate - 1 for m, rate in measured.items() if planned.get(m)}
    return {"overhead_s": o, "measured": measured, "planned": planned, "planner_error": errors}


def time_to_target(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """DDP's final loss and each method's (step, seconds) to it, or None; the ratio synchronous / paced
    (a lower bound, ``sync_reached`` False, when sync never reached it: its last evaluation's seconds)."""
    target = runs["ddp"]["curve"][-1][2]
    hits = {m: reached(r["curve"], target) for m, r in runs.items() if m != "nocomm"}
    hits["ddp"] = (runs["ddp"]["curve"][-1][0], runs["ddp"]["curve"][-1][1])
    out: dict[str, Any] = {"target": target, "hits": hits, "sync_over_paced": None, "sync_reached": None}
    if "sync" in hits and hits.get("paced") is not None:
        sync = hits["sync"]
        sync_s = sync[1] if sync is not None else runs["sync"]["curve"][-1][1]
        out |= {"sync_reached": sync is not None, "sync_over_paced": sync_s / hits["paced"][1]}
    return out


def uneven_verdicts(row: dict[str, Any]) -> dict[str, bool]:
    """The two targets of one node count and scenario: paced 1.5x sooner, the planner within 15%."""
    ratio, errors = row["sync_over_paced"], row["planner_error"]
    planner = bool(errors) and all(abs(e) <= fleet.PLANNER_TARGET for e in errors.values())
    return {"sooner": ratio is not None and ratio >= PACED_SOONER, "planner": planner}


def uneven(q: Namespace) -> tuple[dict[str, Any], str]:
    real_ms, _ = padding(q)
    results: dict[str, Any] = {"real_step_ms": real_ms, "results": []}
    text = []
    for nodes in q.nodes:
        with emu.Cluster(nodes) as cluster:
            cluster.shape(q.bandwidth)
            megabits = emu.measure_link(cluster, 4, 29669)
            factors = [fleet.speed_factor("one3x", r, nodes, 0.0, 0.0) for r in range(nodes)]
            pads = [max(0.0, q.compute_ms * factor - real_ms) for factor in factors]
            records, runs = {}, {}
            for method in q.methods:
                name, flags = uneven_flags(method, q)
                records[method], runs[method] = launch(cluster, q, name, pads, q.deadline_s, **flags)
                print(f"  {nodes} nodes, {method}: {runs[method]['curve'][-1][2]:.4f}")
            row = time_to_target(runs) | uneven_rates(records, nodes, megabits, q) | {"runs": runs}
            row["steps_per_rank"] = {m: [len(r["ends"]) for r in rs] for m, rs in records.items()}
            row["verdicts"] = uneven_verdicts(row)
            results["results"].append({"nodes": nodes, "megabits": megabits, "scenarios": {"one3x": row}})
            text.append(uneven_report(nodes, megabits, row, q))
            partial(q, results)
    return results, "\n\n".join(text)


def uneven_report(nodes: int, megabits: float, row: dict[str, Any], q: Namespace) -> str:
    hits, runs, table = row["hits"], row["runs"], []
    for method in (m for m in ("ddp", "sync", "paced") if m in runs):
        curve = runs[method]["curve"]
        at_ddp = next((loss for step, _, loss in curve if step >= q.steps), None)  # after DDP's samples
        when = f"{hits[method][1]:.1f}" if hits[method] else f">{curve[-1][1]:.0f} (not reached)"
        table.append([method, f"{curve[-1][2]:.4f}", cell(at_ddp, ".4f"), when, row["measured"].get(method)])
        table[-1] += [row["planned"].get(method), cell(row["planner_error"].get(method), "+.1%")]
    ratio, met = row["sync_over_paced"], row["verdicts"]
    bound = "" if row["sync_reached"] else " (at least: sync did not reach it)"
    header = ["method", "final loss", "loss at DDP's samples", "s to target", "steps/s", "planned", "error"]
    title = f"{nodes} nodes, one3x, links {q.bandwidth} ({megabits:.0f} Mbit/s measured)"
    return "\n".join([
        f"{title}: DDP's final loss {row['target']:.4f}; o = {1e3 * row['overhead_s']:.1f} ms/step",
        markdown_table(header, table, ".2f"),
        f"sync / paced time to DDP's loss: {cell(ratio, '.2f')}x{bound} (target {PACED_SOONER}x: "
        f"{'met' if met['sooner'] else 'MISSED'}); planner within {PREDICTION:.0%}: "
        + ("met" if met["planner"] else "MISSED"),
    ])  # fmt: skip


# -- lm: steps to DDP's loss (convergence/run.py lm --eval-every results) times the planner's step time


def merged_runs(paths: list[str]) -> list[list[dict[str, Any]]]:
    """The ``iid`` results of ``paths``, one list per run: files with the same DDP result (as
    ``convergence/run.py lm --reuse`` copies it) merged, first file first."""
    runs: dict[tuple[int, float], dict[str, dict[str, Any]]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())  # report.save's JSON (its "results"), or a bare list
        results = [r for r in (data["results"] if isinstance(data, dict) else data) if r["split"] == "iid"]
        reference = next((r for r in results if r["method"] == "ddp+adamw"), None)
        if reference is None:
            raise SystemExit(f"{path} has no ddp+adamw result to compare with")
        run = runs.setdefault((reference["workers"], reference["validation_loss"]), {})
        for r in results:
            run.setdefault(r["method"], r)
    return [list(run.values()) for run in runs.values()]


LM_COLUMNS = {"step_ms": ".1f", "time_s": ".1f", "vs_ddp": ".2f", "vs_limit": ".2f"}


def lm(q: Namespace) -> tuple[list[dict[str, Any]], str]:
    """Per run, each method's first evaluation within ``--tolerance`` of DDP's final loss (the run's own,
    or the lowest of ``--reference``'s at its worker count: DDP at its best learning rate) times the
    planner's step time, over DDP's own time to it and over the limit: DDP's steps to it at the step
    without communication (DDP on a network that costs nothing)."""
    out, text = [], []
    references = [r for run in merged_runs(q.reference) for r in run if r["method"] == "ddp+adamw"]
    for results in merged_runs(q.results):
        reference = next(r for r in results if r["method"] == "ddp+adamw")
        if q.reference:
            found = [r for r in references if r["workers"] == reference["workers"]]
            if not found:
                workers, paths = reference["workers"], ", ".join(q.reference)
                raise SystemExit(f"--reference: no ddp+adamw run with {workers} workers in {paths}")
            best = min(found, key=lambda r: r["validation_loss"])
            results, reference = [best if r is reference else r for r in results], best
        workers, model_bytes = reference["workers"], 4.0 * reference["parameters"]
        compute_s, target = q.compute_ms / 1e3, reference["validation_loss"] * q.tolerance
        bandwidth = q.bandwidth or 8 * model_bytes / (compute_s * q.link_steps)  # a model per link_steps
        link, methods = Link(bandwidth, message_bytes=q.message_bytes), [r["method"] for r in results]
        times = predictions(methods, model_bytes, ComputeTimes(compute_s), link, workers, blocking=True)
        steps_to = {r["method"]: next((s for s, loss in r["curve"] if loss <= target), None) for r in results}
        ddp_steps = steps_to["ddp+adamw"] or 0
        ddp_s, limit_s = times["ddp"] * ddp_steps, compute_s * ddp_steps  # the limit: a free network
        rows, table = [], []
        for r in results:
            name = planner_label(r["method"])
            steps = steps_to[r["method"]] if name in times else None
            row = {"method": r["method"], "steps": steps, "horizon": r["curve"][-1][0]}
            if steps is not None:
                row |= {"step_ms": 1e3 * times[name], "time_s": steps * times[name]}
                row["vs_ddp"] = row["time_s"] / ddp_s if ddp_s else None
                row["vs_limit"] = row["time_s"] / limit_s if limit_s else None
            rows.append(row)
            cells = [cell(row.get(k), f) for k, f in LM_COLUMNS.items()]
            table.append([r["method"], str(row["horizon"]), "never" if steps is None else str(steps), *cells])
        header = ["method", "horizon", "steps", "ms/step", "time s", "vs DDP", "vs limit"]
        lrs = {f"{r['adam_lr']:g}" for r in results if r is not reference} or {f"{reference['adam_lr']:g}"}
        title = f"{workers} nodes, {reference['parameters']:,} parameters, lr {', '.join(sorted(lrs))}: DDP's"
        title += " (lr "
        title += f"{reference['adam_lr']:g}) final validation loss {reference['validation_loss']:.4f} "
        title += f"(target x{q.tolerance:g}: {target:.4f}); compute {q.compute_ms:g} ms/step, "
        text.append(f"{title}links {bandwidth / 1e6:.4g} Mbit/s\n{markdown_table(header, table)}")
        out.append({"workers": workers, "target": target, "bandwidth": bandwidth, "rows": rows})
    text.append(
        "('~h1d0': blocking per-step gossip; the limit: DDP's steps at the step without communication)"
    )
    return out, "\n\n".join(text)


# -- the command line: a question, its defaults as flags (questions.py)

RUN = {"slow-link": on_links, "scale-model": on_links, "uneven": uneven, "lm": lm}


def parse_args(argv: list[str] | None = None) -> Namespace:
    asked = {name: (d["help"], {k: v for k, v in d.items() if k != "help"}) for name, d in QUESTIONS.items()}
    parser = question_parser(__doc__, asked, empty_lists=True)
    q = parser.parse_args(argv)
    for key in ("methods", "baselines"):
        torchft = [m for m in vars(q).get(key, []) if m.startswith("torchft")]
        if torchft and importlib.util.find_spec("torchft") is None:
            print("torchft is not installed (uv run --group bench ...): skipping its methods")
            setattr(q, key, [m for m in getattr(q, key) if not m.startswith("torchft")])
    if q.question in ("slow-link", "scale-model"):  # nocomm first: the planner's input, the link's pace
        q.methods = ["nocomm", *[m for m in q.methods if m != "nocomm"]]
        for method in [m for m in [*q.methods, q.ours] if "@" in m]:  # a bad wire format fails here
            parse_compression(method.partition("@")[2])
        if q.ours not in ("", "planner") and not ours(q.ours):
            parser.error(f"--ours {q.ours!r}: 'planner', or ours in methods.py's grammar (ring~h2@int8)")
    if q.question == "uneven":
        spec = parse_method(q.gossip)
        if spec.topology is None or spec.sync_every < 2 or spec.paced:
            parser.error(f"--gossip: low-communication gossip without 'p' ('ring~h8d1'), not {q.gossip!r}")
        q.sync_every = spec.sync_every
        q.methods = [m for m in ("nocomm", "ddp", "sync", "paced") if m in {*q.methods, "nocomm", "ddp"}]
    return q


def main() -> None:
    q = parse_args()
    if q.question != "lm" and not emu.ready_to_emulate():
        return
    results, text = RUN[q.question](q)
    save(q, results, text)


if __name__ == "__main__":
    main()
