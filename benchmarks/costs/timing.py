"""What every cost question shares: training steps timed interleaved (``harness/interleaved.py``) and
compared in pairs, a gossip round's own work, a measurement on local ranks, a report's tables."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.harness.common import collect_from_ranks
from benchmarks.harness.interleaved import Variant, interleave, ratio, timed
from benchmarks.harness.report import titled_table
from decent_optim_wrapper import DecentOptimWrapper, init_elastic
from decent_optim_wrapper.engine.exchange.gossip import Gossip
from decent_optim_wrapper.engine.exchange.guard import GuardLog
from decent_optim_wrapper.engine.fleet.comm import ProcessGroups, group_layout
from decent_optim_wrapper.engine.fleet.world import resolve_gossip_world
from decent_optim_wrapper.engine.wire.compression import CompressionPlan, resolve_compression

SECRET = "the-secret-of-the-cost-benchmark-0123"
RATIO_COLUMNS = ("ms", "ratio_of_medians", "median_paired_ratio")  # of ``ratio``'s result, in a table


def step_ratios(
    steps: Mapping[str, Callable[[], object]], pairs: str, iters: int, warmup: int
) -> dict[str, Any]:
    """Training steps timed interleaved: each one's median ms, the ratios of ``pairs`` (``"a/b c/d"``)."""
    times = interleave({name: lambda _, s=step: s() for name, step in steps.items()}, iters, warmup)
    wanted = [pair.split("/") for pair in pairs.split() if set(pair.split("/")) <= set(times)]
    ms = {name: 1e3 * statistics.median(seconds) for name, seconds in times.items()}
    return {"ms": ms, "ratios": {f"{a}/{b}": ratio(times, a, b) for a, b in wanted}}


def table(title: str, header: str, rows: list[list[Any]], spec: str = ".3f") -> dict[str, Any]:
    """A table of a report: ``title``, the columns (``"a|b|c"``), the rows (numbers shown with ``spec``)."""
    return {"title": title, "header": header.split("|"), "rows": rows, "spec": spec}


def render(tables: list[dict[str, Any]]) -> str:
    """The report: every table, titled."""
    return "\n\n".join(titled_table(t["title"], t["header"], t["rows"], t["spec"]) for t in tables)


def step_table(title: str, result: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`step_ratios`' result as a table: a row per ratio, then those of the runs compared with."""
    rows = [[*p.split("/"), *(r[c] for c in RATIO_COLUMNS)] for p, r in result["ratios"].items()]
    compared = {row[0] for row in rows}
    rows += [[name, None, ms, None, None] for name, ms in result["ms"].items() if name not in compared]
    return table(title, "run|against|ms per step (median)|ratio of medians|median paired ratio", rows)


def gossip_over(wrapper: DecentOptimWrapper, rank: int, world: int, wire: str | None, guard: bool) -> Gossip:
    """A ``Gossip`` over the wrapper's buckets, built from the engine's public parts as the engine builds
    its own (``guard=False``: this rank's non-finite guard off, as ``nonfinite_guard=False``)."""
    spec = resolve_compression(wire)
    plan = None if spec is None else CompressionPlan(wrapper.topology, spec)
    gossip_world = resolve_gossip_world(rank, world, None)  # the whole job, as the wrapper's
    groups = ProcessGroups(gossip_world, [group_layout(wrapper.topology, gossip_world)])
    extra = {} if guard else {"guard": GuardLog(rank, enabled=False)}
    return Gossip([b.data for b in wrapper.buckets], wrapper.topology, rank, groups, plan=plan, **extra)


def round_parts(gossip: Gossip) -> Variant:
    """A variant timing a round's own work: ``stage`` of every bucket (what ``launch`` does before it
    starts the collective), then, untimed, ``launch`` and ``wait`` (the network), then ``mix``."""
    buckets = range(gossip.num_buckets)

    def one_round(step: int) -> dict[str, float]:
        stage = sum(timed(lambda b=b: gossip.stage(b, step)) for b in buckets)
        for b in buckets:
            gossip.launch(b, step)
        gossip.wait_all()
        return {"stage": stage, "mix": sum(timed(lambda b=b: gossip.mix(b)) for b in buckets)}

    return one_round


def on_ranks(world: int, measure: Callable[..., Any], args: Any, *extra: Any, **start: Any) -> dict[int, Any]:
    """``measure(rank, world, args, *extra)`` on ``world`` local ranks with ``args.threads`` torch threads
    each: one gloo group on loopback, or (``job=NAME``) the members of an elastic job around a store
    hosted here; ``before=fn``: ``fn()`` runs first in each rank. The results by rank."""
    job, before = start.get("job"), start.get("before")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if job else None

    def args_for(rank: int, port: int, results: Any) -> tuple[Any, ...]:
        return (rank, world, store.port if store else port, job, before, measure, args, extra, results)

    return collect_from_ranks(world, _rank, args_for, args.max_seconds, job or measure.__name__)


def _rank(rank, world, port, job, before, measure, args, extra, results) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(getattr(args, "threads", 1))
    if before is not None:
        before()
    if job is None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:
        timeout = timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        init_elastic(store, rank, world, job=job, secret=SECRET, timeout=timeout)
    try:
        results.put((rank, measure(rank, world, args, *extra)))
    finally:
        dist.destroy_process_group()


def environment() -> str:
    """A report's first line: torch, the machine, the checkout's commit (``+dirty``: uncommitted changes)."""
    git = ["git", "describe", "--always", "--dirty=+dirty"]
    commit = subprocess.run(git, cwd=os.path.dirname(__file__), capture_output=True, text=True).stdout.strip()
    return f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, commit {commit or '-'}"
