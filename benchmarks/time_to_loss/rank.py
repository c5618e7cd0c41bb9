"""One rank of a time-to-loss run: the language model trained with one method, its parameters written.

By steps (``--stop-at`` of a ``--steps`` cosine) or by rounds (``--rounds``, ours only), writing its
parameters and training seconds every ``--eval-every`` steps (``--eval-rounds`` rounds); each step sleeps
``--pad-ms`` first. Methods: ``nocomm``, ``ddp``, ``ddp-psgdR`` (torch's ``powerSGD_hook``, rank R),
``torchft~hH[dD][aA]`` (torchft's DiLoCo, fragment sync delay D, update alpha A) and ours (``methods.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power_sgd

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
    params, timeout = list(model.named_parameters()), timedelta(seconds=args.timeout_s)
    adamw = optimizer_factory("adamw", 0.0, args.adam_lr)(params)
    if method == "nocomm":
        return model, adamw, 0.0, None
    if method == "ddp" or (power := POWER_SGD.fullmatch(method)):
        net = nn.parallel.DistributedDataParallel(model)
        if method != "ddp":
            rank = int(power["rank"])
            state = power_sgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
            net.register_comm_hook(state, power_sgd.powerSGD_hook)
        return net, adamw, wire_bytes(method, model, args.world_size), None
    if torchft := TORCHFT.fullmatch(method):
        every, delay, alpha = int(torchft["every"]), int(torchft["delay"] or 0), float(torchft["alpha"] or 0)
        outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=0.0)
        diloco = TorchftDiLoCo(model, adamw, outer, every, delay, args.rank, args.world_size, alpha, timeout)
        return model, adamw, wire_bytes(method, model, args.world_size), diloco
    spec = parse_method(method)
    if spec.paced:
        raise ValueError(
            f"method {method!r}: a fixed paced schedule ('p') is not timed; use --pacing measured"
        )
    options = spec.engine_options() | ({"pacing": args.pacing} if args.pacing != "none" else {})
    wrapper = DecentOptimWrapper(adamw, timeout=timeout, **options)
    return model, wrapper, wrapper.engine.bytes_sent_per_step(), None


def wire_bytes(method: str, model: nn.Module, nodes: int) -> float:
    """Bytes a rank sends per step with a baseline: a ring all-reduce's count."""
    allreduce, numel = 2 * (nodes - 1) / nodes * 4, sum(p.numel() for p in model.parameters())
    if (power := POWER_SGD.fullmatch(method)) is not None:
        return allreduce * power_sgd_numel(model, int(power["rank"]))
    torchft = TORCHFT.fullmatch(method)
    return allreduce * numel / (int(torchft["every"]) if torchft else 1)


def power_sgd_numel(model: nn.Module, rank: int) -> int:
    """Values PowerSGD all-reduces per step: ``(n + m) r`` for a tensor viewed as ``(n, m)`` where that is
    less than half of ``n m`` (torch's ``min_compression_rate=2``; a vector never is), the rest in full."""
    total = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if (n + m) * r * 2 < n * m else p.numel()
    return total


def round_lr(base: float, round_: int, rounds: int) -> float:
    """Round ``round_``'s learning rate of ``rounds``: a cosine from ``base`` to 0 (``CosineAnnealingLR``)."""
    return base * 0.5 * (1 + math.cos(math.pi * round_ / rounds))


def train_step(net: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One AdamW step of the language model on windows ``x`` (targets ``y``): its training loss."""
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss.item()


def train(args: argparse.Namespace) -> None:
    rank, outdir = args.rank, Path(args.outdir)
    tokens, _ = make_lm_data(args.world_size, rank, "iid")
    model = make_lm_model(args.width, args.depth, seed=0)
    net, optimizer, sent, diloco = build(args.method, model, args)
    wrapper = optimizer if isinstance(optimizer, DecentOptimWrapper) else None
    every = 1 if wrapper is None else parse_method(args.method).sync_every
    rounds = wrapper if args.rounds > 0 else None  # by rounds: ours, every rank to the same round
    if (args.rounds > 0 or args.pacing != "none") and every < 2:
        raise ValueError(f"method {args.method!r}: --rounds and --pacing need low-communication gossip")
    if args.pacing != "none" and rounds is None:
        raise ValueError("--pacing measured: ranks take different steps; train by --rounds")
    scheduler = None if rounds is not None else warmup_cosine(optimizer, args.steps, args.warmup)
    sampler = torch.Generator().manual_seed(100 + rank)
    points, losses, ends, round_ends = [], [], [], []
    if args.gate:  # built: wait for the driver's go
        (outdir / f"ready-{rank}").touch()
        deadline = time.monotonic() + args.timeout_s
        while not (outdir / "go").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: no 'go' in {outdir} within {args.timeout_s:.0f} s")
            time.sleep(0.1)
    dist.barrier()
    clock, resumed, start = 0.0, time.perf_counter(), time.time()
    while rounds.round_count < args.rounds if rounds is not None else len(ends) < args.stop_at:
        if rounds is not None:
            for group in optimizer.param_groups:
                group["lr"] = round_lr(args.adam_lr, rounds.round_count, args.rounds)
        x, y = windows(tokens, torch.randint(0, len(tokens) - CONTEXT - 1, (args.batch,), generator=sampler))
        time.sleep(args.pad_ms / 1e3)
        losses.append(train_step(net, optimizer, x, y))
        if scheduler is not None:
            scheduler.step()
        ends.append(time.time())
        round_ends += ends[-1:] if wrapper is not None and wrapper.round_ended else []
        if rounds is not None:  # labelled with the samples of that many steps of equal workers
            done, label = rounds.round_count, rounds.round_count * every
            write = rounds.round_ended and (done % args.eval_rounds == 0 or done == args.rounds)
        else:
            label = len(ends)
            write = label % args.eval_every == 0 or label == args.stop_at
        if write:
            clock += time.perf_counter() - resumed
            flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
            torch.save(flat, outdir / f"rank{rank}-step{label}.pt")
            points.append((label, clock))
            resumed = time.perf_counter()
    record = {"rank": rank, "points": points, "bytes_sent_per_step": sent, "train_losses": losses}
    record |= {"start": start, "ends": ends, "round_ends": round_ends}
    if (pace := None if wrapper is None else wrapper.pace_report()) is not None:
        record["pace"] = {"round_s": pace.round_seconds, "step_s": pace.step_seconds}
        record["pace"] |= {"waited_s": pace.waited_seconds}
    if rounds is not None:
        rounds.global_avg(may_revert=False)  # at a round's end: finishes the rounds in flight
    if diloco is not None:
        diloco.close()
    dist.barrier()
    (outdir / f"rank{rank}.json.partial").write_text(json.dumps(record))
    os.replace(outdir / f"rank{rank}.json.partial", outdir / f"rank{rank}.json")  # never half a file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, kind, default in [
        ("rank", int, None), ("world-size", int, None), ("method", str, None), ("outdir", str, None),
        ("steps", int, 600), ("warmup", int, 0), ("stop-at", int, 600), ("eval-every", int, 20),
        ("batch", int, 16), ("adam-lr", float, 3e-3), ("outer-lr", float, 0.8), ("pad-ms", float, 0.0),
        ("width", int, 64), ("depth", int, 2), ("rounds", int, 0), ("eval-rounds", int, 2),
        ("timeout-s", float, 120.0),
    ]:  # fmt: skip
        parser.add_argument(f"--{flag}", type=kind, default=default, required=default is None)
    parser.add_argument("--pacing", choices=("none", "measured"), default="none")
    parser.add_argument("--gate", action="store_true", help="wait for the driver's 'go' once built")
    args = parser.parse_args()
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
