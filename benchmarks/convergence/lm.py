"""``lm``: the language model's validation loss (the replicas' average) over DDP's, with AdamW, beside the
uncorrected (``-local``) and the uncompressed or unpaced twin. ``seeds``: the same over several runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.convergence.classification import ADAM_OPTIMIZERS, JUDGED_SYNC_EVERY, paced_lines, twin
from benchmarks.harness import lm_task
from benchmarks.harness.lm_task import CONTEXT
from benchmarks.harness.methods import LOCAL_MOMENT_SUFFIX, optimizer_factory, parse_method
from benchmarks.harness.report import markdown_table
from benchmarks.harness.runner import covers_multiple, make_task, on_average, on_local_ranks, train

TARGETS = {"per-step": 1.02, "local": 1.05, "paced": 1.02, "compressed": 1.02}


@dataclass
class LMResult:
    method: str
    split: str
    validation_loss: float
    final_train_loss: float
    bytes_per_step: float
    seconds: float
    curve: list[tuple[int, float]]  # (steps taken, validation loss of the average) every --eval-every
    workers: int = 0
    adam_lr: float = 0.0
    parameters: int = 0
    steps_per_rank: list[int] = field(default_factory=list)  # inner steps each rank took (paced: uneven)


def train_lm(method: str, split: str, config: dict[str, Any]) -> LMResult | None:
    """Train one method on every rank; rank 0 gets the result."""
    rank, world, eval_every = dist.get_rank(), dist.get_world_size(), config["eval_every"]
    spec, steps = parse_method(method), config["steps"]
    draws = torch.Generator().manual_seed(100 + rank + 1000 * config["seed"])
    size = dict(width=config["width"], depth=config["depth"])
    task = make_task("lm", rank, world, config["seed"], config["batch_size"], draws, split, **size)
    validation = lambda: task.evaluate(task.model)[0]  # noqa: E731
    curve: list[tuple[int, float]] = []

    def evaluate(taken: int, span: int, last: bool, loss: float, replicas: Any) -> None:
        if eval_every and not last and covers_multiple(taken - span + 1, taken, eval_every):
            curve.append((taken, on_average(replicas, validation)))

    make_optimizer = optimizer_factory(spec.optimizer or "adamw", lr=0.0, adam_lr=config["adam_lr"])
    trained, replicas = train(
        spec, task.model, make_optimizer, task.batch_loss, steps, evaluate, config["warmup"]
    )
    loss = on_average(replicas, validation)
    if rank != 0:
        return None
    parameters = sum(p.numel() for p in task.model.parameters())
    return LMResult(
        method, split, loss, trained.final_loss, trained.bytes_per_step, trained.seconds,
        [*curve, (steps, loss)], world, config["adam_lr"], parameters, trained.steps_per_rank,
    )  # fmt: skip


def job(config: dict[str, Any]) -> list[dict] | None:
    """Every (split, method) of ``config["runs"]`` in turn, on every rank; rank 0's results."""
    results = []
    for split, method in config["runs"]:
        if config["rank"] == 0:
            print(f"[{split}] {method}", flush=True)
        result = train_lm(method, split, config)
        if result is not None:
            results.append(asdict(result))
            print(f"    validation loss {result.validation_loss:.4f} ({result.seconds:.0f} s)", flush=True)
        dist.barrier()
    return results if config["rank"] == 0 else None


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, loss in curve if loss <= target), None)


def status(result: LMResult, ratio: float, plain: LMResult | None) -> str:
    """``met``/``MISSED`` against DDP and the uncompressed twin, ``-`` where nothing is judged."""
    spec, mark = parse_method(result.method), "-"
    if spec.topology is not None and spec.second_moment == "average":
        kind = "per-step" if spec.sync_every == 1 else "paced" if spec.paced else "local"
        if kind != "local" or spec.sync_every <= JUDGED_SYNC_EVERY:
            mark = "met" if ratio <= TARGETS[kind] else "MISSED"
    if plain is not None and result.validation_loss / plain.validation_loss > TARGETS["compressed"]:
        mark = "MISSED (vs uncompressed)" if mark != "MISSED" else "MISSED (both)"
    return mark


def table(results: list[LMResult], args: Any, world: int) -> str:
    reference = next(r for r in results if r.method == "ddp+adamw")
    by_name = {r.method: r for r in results}
    rows = []
    for r in results:
        ratio, spec = r.validation_loss / reference.validation_loss, parse_method(r.method)
        plain = by_name.get(twin(r.method, "compression") or "")
        local = by_name.get(r.method + LOCAL_MOMENT_SUFFIX) if spec.second_moment == "average" else None
        reached = steps_to_reach(r.curve, reference.validation_loss)
        to_ddp = None if len(r.curve) <= 1 else "not reached" if reached is None else str(reached)
        rows.append([
            r.method, r.validation_loss, r.final_train_loss, f"{r.bytes_per_step:,.0f}", ratio,
            local and local.validation_loss / reference.validation_loss,
            plain and r.validation_loss / plain.validation_loss, to_ddp, status(r, ratio, plain),
        ])  # fmt: skip
    header = ["method", "val loss", "train loss", "bytes/step", "vs DDP", "uncorrected", "vs uncompr."]
    title = f"Language model ({lm_task.describe_corpus()}), {results[0].split} split: {world} workers, "
    title += f"{args.steps} steps, batch {args.batch_size} x {CONTEXT} bytes/worker, AdamW lr {args.adam_lr}"
    title += f", {reference.parameters:,} parameters" + (f", seed {args.seed}" if args.seed else "")
    versus = lambda r, other: f"{r.validation_loss / other.validation_loss:.4f}x {other.method}'s"  # noqa: E731
    return "\n".join([
        title + (f", {args.warmup} warmup steps" if args.warmup else ""),
        "",
        markdown_table([*header, "steps to DDP", "target"], rows, ".4f"),
        *paced_lines(results, lambda r: reference, versus),
        f"Targets: per-step gossip within {TARGETS['per-step']:.2f}x DDP's validation loss, sync_every 2 to "
        f"{JUDGED_SYNC_EVERY} within {TARGETS['local']:.2f}x, paced within {TARGETS['paced']:.2f}x, "
        f"compressed within {TARGETS['compressed']:.2f}x its uncompressed twin ('vs uncompr.'); "
        "'uncorrected': the same method with second_moment='local'.",
    ])  # fmt: skip


def with_twins(methods: list[str]) -> list[str]:
    """``ddp+adamw``, ``methods``, then each compressed or paced method's missing twin."""
    wanted = list(dict.fromkeys(["ddp+adamw", *methods]))
    for method in wanted:  # the list grows as the loop goes: a twin's twin is added too
        if parse_method(method).optimizer not in ADAM_OPTIMIZERS:
            raise ValueError(f"method {method!r}: the language model trains with Adam or Muon: add '+adamw'")
        twins = (twin(method, "compression"), twin(method, "paced"))
        wanted += [m for m in dict.fromkeys(twins) if m and m not in wanted]
    return wanted


def results_of(path: Path) -> list[dict[str, Any]]:
    """A saved run's results (a bare list: older runs)."""
    data = json.loads(Path(path).read_text())
    return data["results"] if isinstance(data, dict) else data


def lm_result(fields: dict[str, Any]) -> LMResult:
    return LMResult(**{**fields, "curve": [(int(step), loss) for step, loss in fields["curve"]]})


def reused(args: argparse.Namespace) -> dict[tuple[str, str], LMResult]:
    """``--reuse JSON METHOD``: earlier results by (split, method), of the same flags only."""
    found: dict[tuple[str, str], LMResult] = {}
    for path, method in args.reuse:
        results = [lm_result(r) for r in results_of(path) if r["method"] == method]
        if not results:
            raise ValueError(f"--reuse: {path} has no result for {method!r}")
        for r in results:
            if (r.workers, r.adam_lr) != (args.workers, args.adam_lr):
                raise ValueError(
                    f"--reuse: {path}'s {method} ran with {r.workers} workers and lr {r.adam_lr}, this run "
                    f"has {args.workers} and {args.adam_lr}; reuse only a run of the same flags"
                )
            found[r.split, method] = r
    return found


def answer(args: argparse.Namespace) -> tuple[Any, str]:
    kept, every = reused(args), [(s, m) for s in args.splits for m in args.methods]
    runs = [run for run in every if run not in kept]
    trained = iter(on_local_ranks(job, {**vars(args), "runs": runs}, "lm")[0] if runs else [])
    results = [kept.get(run) or lm_result(next(trained)) for run in every]
    tables = [table([r for r in results if r.split == s], args, args.workers) for s in args.splits]
    return [asdict(r) for r in results], "\n\n".join(tables)


def seeds(args: argparse.Namespace) -> tuple[Any, str]:
    """Each method's loss over its own run's DDP loss (files with the same DDP result are one run)."""
    runs: dict[tuple[int, float], dict[str, float]] = {}
    for path in args.paths:
        results = [r for r in results_of(path) if r["split"] == "iid"]
        ddp = next((r for r in results if r["method"] == "ddp+adamw"), None)
        if ddp is None:
            raise ValueError(f"{path} has no ddp+adamw result to compare with")
        one_run = runs.setdefault((ddp["workers"], ddp["validation_loss"]), {})
        for r in results:
            one_run.setdefault(r["method"], r["validation_loss"] / ddp["validation_loss"])
    ratios: dict[str, list[float]] = {}
    for one_run in runs.values():
        for method, ratio in one_run.items():
            ratios.setdefault(method, []).append(ratio)
    rows = []
    for method, values in ratios.items():
        if method != "ddp+adamw" and not method.endswith(LOCAL_MOMENT_SUFFIX):
            local = ratios.get(method + LOCAL_MOMENT_SUFFIX)
            within = f"{sum(v <= args.target for v in values)} of {len(values)}"
            each, worst, mean = " ".join(f"{v:.3f}" for v in values), max(values), statistics.mean(values)
            rows.append([method, each, mean, worst, within, local and statistics.mean(local)])
    header = ["method", "runs", "mean", "worst", f"within {args.target:g}", "uncorrected"]
    title = f"{len(runs)} runs; each method's validation loss over its own run's DDP loss"
    return ratios, f"{title}\n\n{markdown_table(header, rows)}"
