"""One rank of ``time_to_loss_cluster.py``: train the language model with one method on a slow link.

Started inside a node's network namespace (``MASTER_ADDR``, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``,
``NODE_ADDR`` set). Trains ``lm_task.py``'s transformer on this rank's iid windows, AdamW with the
language-model benchmark's learning rate and a cosine schedule over ``--steps``, for at most
``--stop-at`` steps, and every ``--eval-every`` steps writes its parameters (one flat fp32 tensor) and
the seconds of training so far to ``--outdir``; the driver averages the ranks' files and evaluates
them afterwards, so evaluating costs the run nothing (writing the file is left out of the clock).
Each step starts with ``--pad-ms`` of sleep: compute of a chosen length besides the model's own
(few cores emulate many nodes; a sleep leaves the core to the others). Methods:

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
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power_sgd

from benchmarks.harness.cluster_worker import COLLECTIVE_TIMEOUT, write_atomically
from benchmarks.harness.lm_task import CONTEXT, VOCAB, make_lm_data, make_lm_model, windows
from benchmarks.harness.methods import optimizer_factory, parse_method
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
        diloco = TorchftDiLoCo(model, inner, outer, every, delay, args.rank, args.world_size, alpha)
        return model, inner, allreduce * model_bytes / every, diloco
    spec = parse_method(method)
    if spec.paced:  # this worker counts steps; paced ranks take different numbers of them
        raise ValueError(
            f"method {method!r}: paced rounds ('p') are not timed here; see benchmarks/uneven_fleet/"
        )
    wrapper = DecentOptimWrapper(adamw(params), timeout=COLLECTIVE_TIMEOUT, **spec.engine_options())
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


def train(args: argparse.Namespace) -> None:
    rank = args.rank
    tokens, _ = make_lm_data(args.world_size, rank, "iid")
    model = make_lm_model(args.width, args.depth, seed=0)
    net, optimizer, sent, diloco = build(args.method, model, args)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    sampler = torch.Generator().manual_seed(100 + rank)
    outdir = Path(args.outdir)
    points: list[tuple[int, float]] = []
    losses: list[float] = []
    dist.barrier()
    clock, resumed = 0.0, time.perf_counter()
    for step in range(args.stop_at):
        x, y = windows(tokens, torch.randint(0, len(tokens) - CONTEXT - 1, (args.batch,), generator=sampler))
        time.sleep(args.pad_ms / 1e3)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.stop_at:
            clock += time.perf_counter() - resumed
            flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
            torch.save(flat, outdir / f"rank{rank}-step{step + 1}.pt")
            points.append((step + 1, clock))
            resumed = time.perf_counter()
    if diloco is not None:
        diloco.close()
    dist.barrier()
    write_atomically(
        str(outdir / f"rank{rank}.json"),
        {"rank": rank, "points": points, "bytes_sent_per_step": sent, "train_losses": losses},
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--steps", type=int, default=600, help="the cosine schedule's length")
    parser.add_argument("--stop-at", type=int, default=600, help="steps actually taken")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--adam-lr", type=float, default=3e-3)
    parser.add_argument("--outer-lr", type=float, default=0.8)
    parser.add_argument("--pad-ms", type=float, default=0.0)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--outdir", required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        train(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
