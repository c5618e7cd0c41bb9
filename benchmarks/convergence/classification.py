"""``classification``: the averaged model's accuracy for every method against DDP's and its twins' (the
same uncompressed, untracked or unpaced; added if missing). On the skewed split only tracked methods are
judged against DDP: the untracked gap, gossip's heterogeneity term, is only reported.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch

from benchmarks.harness.methods import Method, parse_method
from benchmarks.harness.report import markdown_table
from benchmarks.harness.runner import Result, on_local_ranks, run
from benchmarks.harness.synthetic_task import split_label
from decent_optim_wrapper.engine.wire.compression import codec, resolve_compression

ADAM_OPTIMIZERS = ("adamw", "accum-adamw", "muon")
JUDGED_SYNC_EVERY = 8  # low-communication methods with more local steps per round are reported only
TARGET_VS_DDP, TARGET_VS_UNTRACKED = 0.5, 0.1  # points; vs DDP on dirichlet for tracked methods only
TARGET_VS_UNCOMPRESSED, TARGET_SPARSE_VS_UNCOMPRESSED = 0.3, 0.5
TRACKED_ON_SKEW = ("ring", "one-peer-exp")  # topologies whose tracked methods are judged on dirichlet


def twin(method: str, part: str) -> str | None:
    """``method`` without its ``part`` (``compression``, ``tracking``, ``paced``), None if it has none."""
    spec = parse_method(method)
    if not getattr(spec, part):
        return None
    return replace(spec, **{part: None if part == "compression" else False}).name


def ddp_reference(method: str) -> str:
    return "ddp+adamw" if parse_method(method).optimizer in ADAM_OPTIMIZERS else "ddp"


def with_references(methods: list[str]) -> list[str]:
    """``methods``, then each missing DDP run and twin they (and their twins) are compared with."""
    wanted = list(methods)
    for method in wanted:  # the list grows as the loop goes: added references are visited in turn
        twins = [twin(method, part) for part in ("compression", "tracking", "paced")]
        wanted += [m for m in dict.fromkeys([ddp_reference(method), *twins]) if m and m not in wanted]
    return wanted


def paced_lines(
    results: list[Any], reference: Callable[[Any], Any], versus: Callable[[Any, Any], str]
) -> list[str]:
    """The lines under a table for its paced methods: inner steps, ``versus`` DDP and the unpaced twin."""
    by_name = {r.method: r for r in results}
    lines = []
    for r in (r for r in results if parse_method(r.method).paced):
        steps, unpaced = r.steps_per_rank, by_name.get(twin(r.method, "paced") or "")
        spread = ""
        if steps:
            spread = f"inner steps per worker {min(steps)} to {max(steps)}, {sum(steps):,} in all; "
        lines.append(f"  {r.method}: {spread}{versus(r, reference(r))}")
        lines[-1] += "" if unpaced is None else f", {versus(r, unpaced)}"
    head = "Paced rounds (the first half of the workers 2x faster), at DDP's samples:"
    return [head, *lines] if lines else []


def job(config: dict[str, Any]) -> list[dict] | None:
    """Every split, seed and method in turn, on every rank; rank 0's results."""
    results: list[Result] = []
    for split in config["splits"]:
        for seed in config["seeds"]:
            results += run(
                config["methods"], config["steps"], config["batch_size"], config["lr"], config["steps"],
                config["adam_lr"], split, config["alpha"], config["task"], seed,
            )  # fmt: skip
    return [asdict(r) for r in results] if config["rank"] == 0 else None


def mean_over_seeds(results: list[Result]) -> list[Result]:
    """One result per method, in the order they ran: the means over its seeds (each in ``accuracies``)."""
    by_method: dict[str, list[Result]] = {}
    for r in results:
        by_method.setdefault(r.method, []).append(r)
    merged = []
    for runs in by_method.values():
        accuracies = [r.accuracy for r in runs]
        loss, accuracy = sum(r.final_loss for r in runs) / len(runs), sum(accuracies) / len(runs)
        merged.append(replace(runs[0], final_loss=loss, accuracy=accuracy, accuracies=accuracies))
    return merged


def compressed_target(spec: Method) -> float:
    """Points a compressed method may lose to its uncompressed twin: more for at most 1/64 of fp32's bytes."""
    option = resolve_compression(spec.compression)
    assert option is not None
    tiny = codec(option.name).payload_bytes(1 << 20, torch.float32) <= 4 * (1 << 20) / 64
    return TARGET_SPARSE_VS_UNCOMPRESSED if tiny else TARGET_VS_UNCOMPRESSED


def verdict(
    split: str, spec: Method, vs_ddp: float, vs_uncompressed: float | None, vs_untracked: float | None
) -> str:
    """``met``, ``MISSED (...)`` naming the targets missed, or ``-`` where none is judged (points)."""
    judged = []
    tracked_on_skew = spec.tracking and spec.topology in TRACKED_ON_SKEW
    if spec.sync_every <= JUDGED_SYNC_EVERY and (split == "iid" or tracked_on_skew):
        judged.append(("vs DDP", abs(vs_ddp) <= TARGET_VS_DDP))
    if vs_uncompressed is not None:
        judged.append(("vs uncompressed", abs(vs_uncompressed) <= compressed_target(spec)))
    if split == "iid" and vs_untracked is not None:
        judged.append(("vs untracked", abs(vs_untracked) <= TARGET_VS_UNTRACKED))
    missed = [name for name, met in judged if not met]
    return "-" if not judged else f"MISSED ({', '.join(missed)})" if missed else "met"


def table(results: list[Any], world: int, args: Any) -> str:
    by_method = {r.method: r for r in results}
    split, seeds = results[0].split, len(results[0].accuracies) or 1
    rows = []
    for r in results:
        cells: list[Any] = [None, None, None, "-"]  # vs DDP, vs uncompressed, vs untracked, target
        if not r.method.startswith("ddp"):
            refs = (ddp_reference(r.method), twin(r.method, "compression"), twin(r.method, "tracking"))
            gaps = [None if ref is None else 100 * (r.accuracy - by_method[ref].accuracy) for ref in refs]
            cells = [*gaps, verdict(split, parse_method(r.method), *gaps)]
        spread = f"{100 * (max(r.accuracies) - min(r.accuracies)):.2f}" if len(r.accuracies) > 1 else None
        row = [r.method, f"{r.final_loss:.4f}", f"{r.accuracy:.4f}", spread, f"{r.bytes_per_step:,.0f}"]
        rows.append([*row, *cells])
    header = ["method", "final loss", "avg-model acc", "spread", "bytes/step", "vs DDP (points)"]
    judged = f"tracked {' and '.join(TRACKED_ON_SKEW)} within {TARGET_VS_DDP} points of DDP; "
    if split == "iid":
        judged = f"gossip within {TARGET_VS_DDP} points of DDP; tracked within {TARGET_VS_UNTRACKED} points "
        judged += "of untracked; "
    points_from = lambda r, other: f"{100 * (r.accuracy - other.accuracy):+.2f} points from {other.method}"  # noqa: E731
    return "\n".join([
        f"Convergence, {split_label(split, results[0].alpha)} split: {world} workers, {args.steps} steps, "
        f"batch {args.batch_size}/worker, lr {args.lr}, adam lr {args.adam_lr}; {args.task} task"
        + (f"; means over {seeds} seeds, spread = max - min accuracy (points)" if seeds > 1 else ""),
        "",
        markdown_table([*header, "vs uncompressed", "vs untracked", "target"], rows, "+.2f"),
        *paced_lines(results, lambda r: by_method[ddp_reference(r.method)], points_from),
        f"Targets: {judged}compressed within {TARGET_VS_UNCOMPRESSED} points of uncompressed "
        f"({TARGET_SPARSE_VS_UNCOMPRESSED} for formats sending at most 1/64 of fp32's bytes).",
    ])  # fmt: skip


def answer(args: argparse.Namespace) -> tuple[Any, str]:
    args.splits, args.seeds = list(dict.fromkeys(args.splits)), list(dict.fromkeys(args.seeds))
    results = on_local_ranks(job, vars(args), "classification")[0]
    tables = []
    for split in args.splits:
        merged = mean_over_seeds([Result(**r) for r in results if r["split"] == split])
        tables.append(table(merged, args.workers, args))
    return results, "\n\n".join(tables)
