"""One rank of a time-to-loss run: train the language model with one method on an emulated cluster.

Run by ``low_communication/time_to_loss_cluster.py`` and ``uneven_fleet/time_to_loss.py``, inside a
node's network namespace (``MASTER_ADDR``, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``, ``NODE_ADDR`` set).
Trains ``lm_task.py``'s transformer on this rank's iid windows, AdamW with the language-model
benchmark's learning rate and a cosine schedule over ``--steps`` (after ``--warmup`` steps of linear
warmup, ``runner.warmup_cosine``), for at most ``--stop-at`` steps, and
every ``--eval-every`` steps writes its parameters (one flat fp32 tensor) and the seconds of training so
far to ``--outdir``; the driver averages the ranks' files and evaluates them afterwards, so evaluating
costs the run nothing (writing the file is left out of the clock). With ``--gate``, a rank that has
built everything (process groups, the start-up broadcast) writes ``ready-{rank}`` to ``--outdir`` and
waits for the driver's ``go`` there before its first step, so that a driver may shape the links between
the two: start-up traffic is not what a run on a slow link measures. Each step starts with ``--pad-ms`` of
sleep: compute of a chosen length besides the model's own (few cores emulate many nodes; a sleep leaves
the core to the others; a driver emulates a slower worker by giving its rank a longer pad).

By rounds (``--rounds R``, low-communication methods only): every rank trains until ``R`` rounds are
launched, the learning rate a cosine over the rounds (constant within a round, the same on every rank
whatever its steps), and writes its parameters at the end of every ``--eval-rounds``-th round, where
every rank stands at the same round; the file is labelled with the samples it stands for, ``round x
sync_every`` steps of equal workers. ``--pacing measured`` adds paced rounds (``pacing="measured"``):
ranks then take different numbers of steps, so only rounds can end the run. Every step's wall-clock end
and every round's end are written too (``uneven_fleet.py``'s step-rate analysis reads them). Methods:

* ``nocomm``: AdamW alone (the compute and update a step costs without communication);
* ``ddp``, ``ddp-psgdR``: DDP, and DDP with torch's ``powerSGD_hook`` of rank ``R`` (error feedback
  and warm start, torch's defaults; compressing from the second step, the earliest torch allows);
* ``torchft~hH`` (``torchft~hHdD``: ``fragment_sync_delay=D``; ``torchft~hHdDaA``: and
  ``fragment_update_alpha=A``, the share of the inner steps taken during the exchange that the
  synced parameters keep, torchft's default 0 keeping none): torchft's ``DiLoCo``, outer SGD with
  ``--outer-lr`` and no momentum (the outer rule that trains this model best, see the driver);
* ours in ``methods.py``'s grammar (``ring~h8d1``, ``ring~h8d1@topk:0.03:int4``): ``DecentOptimWrapper``.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power_sgd

from benchmarks.harness.cluster_worker import COLLECTIVE_TIMEOUT, write_atomically
from benchmarks.harness.lm_task import CONTEXT, VOCAB, make_lm_data, make_lm_model, windows
from benchmarks.harness.methods import optimizer_factory, parse_method
from benchmarks.harness.runner import warmup_cosine
from benchmarks.harness.torchft_peer import TorchftDiLoCo
from decent_optim_wrapper import DecentOptimWrapper

POWER_SGD = re.compile(r"ddp-psgd(?P<rank>[1-9][0-9]*)")
TORCHFT = re.compile(
    r"torchft~h(?P<every>[1-9][0-9]*)(?:d(?P<delay>[0-9]+))?(?:a(?P<alpha>[01](?:\.[0-9]+)?))?"
)


def build(
    method: str, model: nn.Module, args: argparse.Namespace
) -> tuple[nn.Module, torch.optim.Optimizer, float, TorchftDiLoCo | None]:
    """The module to call, the optimizer to step, bytes this rank sends per step, and torchft's context."""
    params = list(model.named_parameters())
    adamw = optimizer_factory("adamw", 0.0, args.adam_lr)
    model_bytes = sum(p.numel() * 4 for _, p in params)
    allreduce = 2 * (args.world_size - 1) / args.world_size  # a ring all-reduce's models sent per rank
    if method == "nocomm":
        return model, adamw(params), 0.0, None
    if method == "ddp" or POWER_SGD.fullmatch(method):
        net = nn.parallel.DistributedDataParallel(model)
        sent = allreduce * model_bytes
        power = POWER_SGD.fullmatch(method)
        if power is not None:
            state = power_sgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=int(power["rank"]), start_powerSGD_iter=2
            )
            net.register_comm_hook(state, power_sgd.powerSGD_hook)
            sent = allreduce * 4 * power_sgd_numel(model, int(power["rank"]))
        return net, adamw(params), sent, None
    torchft = TORCHFT.fullmatch(method)
    if torchft is not None:
        every, delay = int(torchft["every"]), int(torchft["delay"] or 0)
        inner = adamw(params)
        outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=0.0)
        alpha = float(torchft["alpha"] or 0.0)
        timeout = timedelta(seconds=args.timeout_s)
        diloco = TorchftDiLoCo(model, inner, outer, every, delay, args.rank, args.world_size, alpha, timeout)
        return model, inner, allreduce * model_bytes / every, diloco
    spec = parse_method(method)
    if spec.paced:  # a fixed schedule of counts: measured pacing is --pacing measured
        raise ValueError(
            f"method {method!r}: fixed paced schedules ('p') are not timed here; pass the method without "
            "'p' and --pacing measured --rounds R"
        )
    options = spec.engine_options()
    if args.pacing != "none":
        options["pacing"] = args.pacing
    wrapper = DecentOptimWrapper(adamw(params), timeout=timedelta(seconds=args.timeout_s), **options)
    return model, wrapper, wrapper.engine.bytes_sent_per_step(), None


def power_sgd_numel(model: nn.Module, rank: int) -> int:
    """Values PowerSGD all-reduces per step: ``P`` and ``Q`` of every matrix it compresses (``(n + m) r``
    where that is less than half of ``n m``, torch's ``min_compression_rate=2``; a tensor is viewed
    as ``(shape[0], -1)``, so a vector never is), the rest in full."""
    total = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * 2 < n * m else p.numel()
    return total


def round_lr(base: float, round_: int, rounds: int) -> float:
    """The learning rate of round ``round_`` of ``rounds``: a cosine from ``base`` down to 0, as
    ``CosineAnnealingLR`` over the rounds."""
    return base * 0.5 * (1 + math.cos(math.pi * round_ / rounds))


def train(args: argparse.Namespace) -> None:
    rank = args.rank
    tokens, _ = make_lm_data(args.world_size, rank, "iid")
    model = make_lm_model(args.width, args.depth, seed=0)
    net, optimizer, sent, diloco = build(args.method, model, args)
    wrapper = optimizer if isinstance(optimizer, DecentOptimWrapper) else None
    by_rounds = args.rounds > 0
    every = 1 if wrapper is None else parse_method(args.method).sync_every
    if (by_rounds or args.pacing != "none") and every < 2:
        raise ValueError(
            f"method {args.method!r}: --rounds and --pacing need low-communication gossip ('~hH', H >= 2)"
        )
    if args.pacing != "none" and not by_rounds:
        raise ValueError("--pacing measured: ranks take different steps; train by --rounds")
    scheduler = None if by_rounds else warmup_cosine(optimizer, args.steps, args.warmup)
    sampler = torch.Generator().manual_seed(100 + rank)
    outdir = Path(args.outdir)
    points: list[tuple[int, float]] = []
    losses: list[float] = []
    ends: list[float] = []
    round_ends: list[float] = []

    def running() -> bool:
        if wrapper is not None and by_rounds:
            return wrapper.round_count < args.rounds
        return len(ends) < args.stop_at

    def snapshot(label: int) -> None:
        flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
        torch.save(flat, outdir / f"rank{rank}-step{label}.pt")
        points.append((label, clock))

    if args.gate:
        wait_at_the_gate(outdir, rank, args.timeout_s)
    dist.barrier()
    clock, resumed = 0.0, time.perf_counter()
    start = time.time()
    while running():
        if wrapper is not None and by_rounds:
            for group in optimizer.param_groups:
                group["lr"] = round_lr(args.adam_lr, wrapper.round_count, args.rounds)
        x, y = windows(tokens, torch.randint(0, len(tokens) - CONTEXT - 1, (args.batch,), generator=sampler))
        time.sleep(args.pad_ms / 1e3)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        ends.append(time.time())
        losses.append(loss.item())
        step = len(ends)
        if wrapper is not None and wrapper.round_ended:
            round_ends.append(ends[-1])
        if by_rounds:
            assert wrapper is not None
            done = wrapper.round_count
            write = wrapper.round_ended and (done % args.eval_rounds == 0 or done == args.rounds)
            label = done * every  # the samples of that many steps of equal workers
        else:
            write, label = step % args.eval_every == 0 or step == args.stop_at, step
        if write:
            clock += time.perf_counter() - resumed
            snapshot(label)
            resumed = time.perf_counter()
    segment: dict[str, object] = {"start": start, "ends": ends, "round_ends": round_ends}
    if wrapper is not None:
        report = wrapper.pace_report()
        if report is not None:
            segment["pace"] = {
                "round_s": report.round_seconds,
                "step_s": report.step_seconds,
                "waited_s": report.waited_seconds,
            }
        if by_rounds:
            wrapper.global_avg(may_revert=False)  # at a round's end: finishes the rounds in flight
    if diloco is not None:
        diloco.close()
    dist.barrier()
    write_atomically(
        str(outdir / f"rank{rank}.json"),
        {
            "rank": rank,
            "points": points,
            "bytes_sent_per_step": sent,
            "train_losses": losses,
            **segment,
        },
    )


def wait_at_the_gate(outdir: Path, rank: int, timeout_s: float) -> None:
    """Tell the driver this rank is built, then wait for its ``go`` (at most ``timeout_s``)."""
    (outdir / f"ready-{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while not (outdir / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no 'go' from the driver in {outdir} within {timeout_s:.0f} s")
        time.sleep(0.1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--steps", type=int, default=600, help="the cosine schedule's length")
    parser.add_argument("--warmup", type=int, default=0, help="linear warmup steps before the cosine")
    parser.add_argument("--stop-at", type=int, default=600, help="steps actually taken")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--adam-lr", type=float, default=3e-3)
    parser.add_argument("--outer-lr", type=float, default=0.8)
    parser.add_argument("--pad-ms", type=float, default=0.0)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=0, help="train by rounds (0: by --stop-at steps)")
    parser.add_argument("--eval-rounds", type=int, default=2, help="with --rounds: write every so many")
    parser.add_argument("--pacing", choices=("none", "measured"), default="none")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=COLLECTIVE_TIMEOUT.total_seconds(),
        help="collectives' timeout: raise it where one exchange takes minutes (a very slow link)",
    )
    parser.add_argument(
        "--gate", action="store_true", help="wait for the driver's 'go' in --outdir once built (see above)"
    )
    parser.add_argument("--outdir", required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size, timeout=timeout)
    try:
        train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
