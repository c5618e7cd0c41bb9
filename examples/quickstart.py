"""Decentralized training on local CPU workers, compared with all-reduce (DDP).

    uv run examples/quickstart.py                          # starts 4 local gloo workers itself
    torchrun --nproc-per-node 4 examples/quickstart.py     # or let torchrun start them

Every worker trains its own replica of a small MLP on its own shard of a synthetic task, once per
topology (ring, one-peer-exp, complete) with DecentOptimWrapper, once with the module front-end
DecentralizedDataParallel on a ring (``ring-module``: the update happens inside backward), once on a
ring whose gossip is compressed to bf16 (``ring@bf16``: half the bytes), and once with PyTorch's
DistributedDataParallel as the all-reduce baseline, with the same seeds and hyper-parameters. Then
it prints a table (final training loss, test accuracy of the globally averaged model, consensus
distance, ms per iteration, bytes each rank sends per step) and writes a figure of loss and
consensus distance against step.

A method is named ``topology[-module][-gt][@compression][+optimizer]``, or ``ddp[+optimizer]``:

- ``-module``: the module front-end (DecentralizedDataParallel) instead of DecentOptimWrapper;
- ``-gt``: gradient tracking (``gradient_tracking=True`` of both front-ends), the remedy for
  label-skewed data: each rank gossips a tracker of the average gradient beside its parameters and
  steps with it, for twice the bytes. DDP takes none: it already steps with the exact average;
- ``@bf16``, ``@fp16``, ``@int8``: gossip compressed models (``compression=`` of both front-ends);
  DDP takes none;
- ``+adamw``, ``+accum-adamw`` (AccumAdamW, accum_iter 4): train with ``--adam-lr``; without one it is
  SGD with momentum at ``--lr``.

For example ``ring@bf16``, ``one-peer-exp@fp16``, ``ring-module@int8+accum-adamw``, ``ring-gt``,
``one-peer-exp-gt@bf16``, ``ring-module-gt+accum-adamw``, ``ddp+adamw``.

The task needs no download: 10 Gaussian clusters in 32 dimensions with overlapping classes
(generated from a fixed seed), 16384 training points split across workers and 8192 test points
(the same balanced test set for every split). ``--split iid`` (the default) deals the training
points out in turn (worker ``r`` gets points ``r, r + n, r + 2n, ...``); ``--split dirichlet`` skews
the labels: each class is divided among the workers in proportions drawn from Dirichlet(``--alpha``)
(Hsu et al., 2019, "Measuring the effects of non-identical data distribution", arXiv:1909.06335), so
with a small alpha most workers see mostly one or two classes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributions import Dirichlet
from torch.nn.parallel import DistributedDataParallel

from decent_optim_wrapper import AccumAdamW, DecentOptimWrapper, DecentralizedDataParallel, TopologyFactory

METHODS = ("ring", "ring-module", "ring@bf16", "one-peer-exp", "complete", "ddp")
MODULE_SUFFIX = "-module"  # a topology name + this suffix: the module front-end
TRACKING_SUFFIX = "-gt"  # after -module, if any: gradient tracking
COMPRESSIONS = ("bf16", "fp16", "int8")  # "topology@compression"; none when none is named
OPTIMIZERS = ("sgd", "adamw", "accum-adamw")  # "method+optimizer"; sgd when none is named
SPLITS = ("iid", "dirichlet")
MAX_DIRICHLET_DRAWS = 1000  # redraws of a label-skewed split before giving up (see dirichlet_split)
FEATURES, CLASSES = 32, 10


@dataclass
class Result:
    """What one method produced, as rank 0 reports it."""

    method: str
    losses: list[float]  # per step, averaged over ranks
    distance_steps: list[int] = field(default_factory=list)
    distances: list[float] = field(default_factory=list)
    final_loss: float = 0.0
    accuracy: float = 0.0
    final_distance: float = 0.0
    ms_per_iteration: float = 0.0
    bytes_per_step: float = 0.0
    split: str = "iid"
    alpha: float | None = None  # the Dirichlet concentration; None for the iid split


@dataclass(frozen=True)
class Method:
    """A method name taken apart.

    The grammar is ``topology[-module][-gt][@compression][+optimizer]`` or ``ddp[+optimizer]``.
    """

    topology: str | None  # None: all-reduce with DistributedDataParallel
    module: bool = False  # the module front-end (the update happens inside backward)
    tracking: bool = False  # gradient tracking (gossip a tracker of the average gradient too)
    compression: str | None = None
    optimizer: str | None = None  # None: SGD with momentum

    @property
    def name(self) -> str:
        """The method's name, as :func:`parse_method` reads it."""
        name = self.topology or "ddp"
        if self.module:
            name += MODULE_SUFFIX
        if self.tracking:
            name += TRACKING_SUFFIX
        if self.compression:
            name += f"@{self.compression}"
        if self.optimizer:
            name += f"+{self.optimizer}"
        return name


def parse_method(method: str) -> Method:
    """Read a method name (see the module docstring); ``ValueError`` names the part that is wrong."""
    front, plus, optimizer = method.partition("+")
    if plus and optimizer not in OPTIMIZERS:
        raise ValueError(
            f"method {method!r}: unknown optimizer {optimizer!r} after '+'; "
            f"choose one of {', '.join(OPTIMIZERS)}"
        )
    base, at, compression = front.partition("@")
    if at and base == "ddp":
        raise ValueError(
            f"method {method!r}: ddp takes no compression, got {compression!r}; all-reduce sends "
            f"full-precision gradients. Drop '@{compression}', or compress a gossip topology, "
            f"e.g. 'ring@{compression}'."
        )
    if at and compression not in COMPRESSIONS:
        raise ValueError(
            f"method {method!r}: unknown compression {compression!r} after '@'; choose one of "
            f"{', '.join(COMPRESSIONS)} (or leave out '@' for none)"
        )
    stem = base.removesuffix(TRACKING_SUFFIX)
    if stem == "ddp" and stem != base:
        raise ValueError(
            f"method {method!r}: ddp takes no gradient tracking; all-reduce already steps every rank "
            f"with the exact average gradient. Drop '{TRACKING_SUFFIX}', or track on a gossip "
            f"topology, e.g. 'ring{TRACKING_SUFFIX}'."
        )
    if base.endswith(TRACKING_SUFFIX + MODULE_SUFFIX):
        reordered = base.removesuffix(TRACKING_SUFFIX + MODULE_SUFFIX) + MODULE_SUFFIX + TRACKING_SUFFIX
        raise ValueError(
            f"method {method!r}: '{TRACKING_SUFFIX}' comes after '{MODULE_SUFFIX}'; write "
            f"{reordered + method[len(base) :]!r}"
        )
    if base == "ddp":
        return Method(topology=None, optimizer=optimizer or None)
    topology = stem.removesuffix(MODULE_SUFFIX)
    try:  # an unknown name fails here, before any worker starts training
        TopologyFactory.get(topology)
    except ValueError as error:
        raise ValueError(f"method {method!r}: {error}") from None
    return Method(
        topology=topology,
        module=stem.endswith(MODULE_SUFFIX),
        tracking=stem != base,
        compression=compression or None,
        optimizer=optimizer or None,
    )


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test sets of the synthetic task (identical on every rank)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 0.5
    n_train, n_test = 16384, 8192
    labels = torch.randint(0, CLASSES, (n_train + n_test,), generator=g)
    points = centers[labels] + torch.randn(n_train + n_test, FEATURES, generator=g)
    return points[:n_train], labels[:n_train], points[n_train:], labels[n_train:]


def split_data(
    labels: torch.Tensor, world: int, split: str = "iid", alpha: float = 0.1, min_size: int = 1, seed: int = 0
) -> list[torch.Tensor]:
    """The indices of each worker's training points: ``split_data(...)[rank]``, sorted.

    ``"iid"`` deals the points out in turn (rank ``r`` gets ``r, r + world, ...``);
    ``"dirichlet"`` skews the labels (see :func:`dirichlet_split`). Every rank computes the same
    partition, with no communication. ``min_size`` applies to the Dirichlet split (the iid one
    is as even as can be).
    """
    if split == "iid":
        return [torch.arange(rank, len(labels), world) for rank in range(world)]
    if split == "dirichlet":
        return dirichlet_split(labels, world, alpha, min_size, seed)
    raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")


def dirichlet_split(
    labels: torch.Tensor, world: int, alpha: float, min_size: int, seed: int = 0
) -> list[torch.Tensor]:
    """Divide each class among ``world`` workers in proportions drawn from Dirichlet(``alpha``).

    Every point goes to exactly one worker. A small ``alpha`` (0.1) gives most of a class to one or
    two workers; a large one (100) approaches an even split. The whole draw (all classes at once)
    is repeated until every worker holds at least ``min_size`` points, which samples the Dirichlet
    split conditioned on that event rather than moving points by hand afterwards (the rule of Hsu
    et al.'s and FedMA's partitioners). ``ValueError`` if ``MAX_DIRICHLET_DRAWS`` draws all fail:
    then ``alpha`` is too small for this many workers of that size.
    """
    if not (isinstance(alpha, int | float) and 0 < alpha < float("inf")):
        raise ValueError(
            f"alpha must be a positive number, got {alpha!r} (0.1: strong skew, 100: nearly iid)"
        )
    if world * min_size > len(labels):
        raise ValueError(
            f"{world} workers of at least {min_size} points need {world * min_size} points; there are "
            f"{len(labels)}. Lower the batch size or the number of workers."
        )
    by_class = [torch.nonzero(labels == c).flatten() for c in labels.unique()]
    counts = _dirichlet_counts(torch.tensor([len(i) for i in by_class]), world, alpha, min_size, seed)
    # which points of a class go to which worker: a seeded shuffle, so a dataset sorted by some
    # feature does not hand one worker the first points of every class
    g = torch.Generator().manual_seed(seed)
    shards: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for indices, row in zip(by_class, counts, strict=True):
        shuffled = indices[torch.randperm(len(indices), generator=g)]
        for rank, part in enumerate(shuffled.split(row.tolist())):
            shards[rank].append(part)
    return [torch.cat(parts).sort().values for parts in shards]


def _dirichlet_counts(
    class_sizes: torch.Tensor, world: int, alpha: float, min_size: int, seed: int
) -> torch.Tensor:
    """How many points of each class (rows) each worker (columns) gets, each worker ``min_size`` or more."""
    concentration = torch.full((len(class_sizes), world), float(alpha), dtype=torch.float64)
    # Dirichlet.sample() takes no generator: seed the global one inside fork_rng, so every rank
    # draws the same shares and the caller's random state is left as it was
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(MAX_DIRICHLET_DRAWS):
            shares = Dirichlet(concentration).sample()
            # rounding the running totals (not each share) keeps every class's counts summing to its size
            ends = (shares.cumsum(1) * class_sizes[:, None]).round().long()
            ends[:, -1] = class_sizes
            counts = ends.diff(dim=1, prepend=torch.zeros_like(ends[:, :1]))
            if (counts.sum(0) >= min_size).all():
                return counts
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) split of {int(class_sizes.sum())} points in {MAX_DIRICHLET_DRAWS} "
        f"draws gave each of {world} workers at least {min_size} points; raise alpha, or lower the batch "
        "size or the number of workers."
    )


def describe_split(shards: list[torch.Tensor], labels: torch.Tensor) -> str:
    """Points per worker and the share of each worker's most frequent class (1/CLASSES when balanced)."""
    sizes = [len(s) for s in shards]
    dominant = [torch.bincount(labels[s], minlength=CLASSES).max().item() / max(len(s), 1) for s in shards]
    return (
        f"points per worker {' '.join(map(str, sizes))}; "
        f"largest class share per worker {' '.join(f'{d:.2f}' for d in dominant)}"
    )


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model for every method
    return nn.Sequential(
        nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, CLASSES)
    )


def model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def optimizer_factory(name: str, lr: float, adam_lr: float):
    """Builds the optimizer ``name`` from (name, parameter) pairs (the module front-end's optim_fn)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")

    def build(named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
        params = [p for _, p in named]
        if name == "adamw":
            return torch.optim.AdamW(params, lr=adam_lr, weight_decay=0.0)
        if name == "accum-adamw":  # moments move once per 4 steps, from the mean gradient
            return AccumAdamW(params, lr=adam_lr, weight_decay=0.0, accum_iter=4)
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    return build


def train_one_method(
    method: str,
    steps: int,
    batch_size: int,
    lr: float,
    log_every: int,
    adam_lr: float = 3e-3,
    split: str = "iid",
    alpha: float = 0.1,
) -> Result | None:
    """Train from scratch with ``method``; every rank calls this; rank 0 gets the Result.

    Each rank trains on its part of the ``split`` of the training set (:func:`split_data`); a
    Dirichlet split gives every worker at least ``batch_size`` points, so no batch repeats a point
    for want of data.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = parse_method(method)
    make_optimizer = optimizer_factory(spec.optimizer or "sgd", lr, adam_lr)
    train_x, train_y, test_x, test_y = make_data()
    shard = split_data(train_y, world, split, alpha, min_size=batch_size)[rank]
    shard_x, shard_y = train_x[shard], train_y[shard]
    model = make_model()
    optimizer: torch.optim.Optimizer | None = None
    replicas: DecentOptimWrapper | DecentralizedDataParallel | None = None  # what gossips
    if spec.topology is None:
        net: nn.Module = DistributedDataParallel(model)
        optimizer = make_optimizer(list(model.named_parameters()))
    elif spec.module:  # the update happens inside backward, one optimizer per bucket
        net = replicas = DecentralizedDataParallel(
            model,
            make_optimizer,
            lr_scheduler_fn=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps),
            topology=spec.topology,
            compression=spec.compression,
            gradient_tracking=spec.tracking,
        )
    else:
        net = model
        optimizer = replicas = DecentOptimWrapper(
            make_optimizer(list(model.named_parameters())),
            topology=spec.topology,
            compression=spec.compression,
            gradient_tracking=spec.tracking,
        )
    scheduler = None
    if optimizer is not None:  # the module front-end steps its own per-bucket schedulers
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    loss_fn = nn.CrossEntropyLoss()
    sampler = torch.Generator().manual_seed(100 + rank)
    losses = torch.zeros(steps, dtype=torch.float64)
    distance_steps, distances = [], []
    train_seconds = 0.0
    for step in range(steps):
        start = time.perf_counter()
        idx = torch.randint(0, len(shard_x), (batch_size,), generator=sampler)
        if optimizer is not None:
            optimizer.zero_grad()
        loss = loss_fn(net(shard_x[idx]), shard_y[idx])
        loss.backward()  # the module front-end updates here
        if optimizer is not None and scheduler is not None:
            optimizer.step()
            scheduler.step()
        train_seconds += time.perf_counter() - start
        losses[step] = loss.item()
        if step % log_every == 0 or step == steps - 1:  # measuring is a collective: kept out of the timing
            distance = replicas.consensus_distance() if replicas is not None else 0.0
            distance_steps.append(step)
            distances.append(distance)
            if rank == 0:
                print(
                    f"  {method:>13}  step {step:4d}/{steps}  loss {loss.item():.4f}  "
                    f"consensus distance {distance:.2e}",
                    flush=True,
                )

    if replicas is not None:
        replicas.global_avg()  # evaluate the average of the replicas ...
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    if replicas is not None:
        replicas.revert_global_avg()  # ... and leave each replica as it was

    dist.all_reduce(losses)
    losses /= world
    timing = torch.tensor([train_seconds], dtype=torch.float64)
    dist.all_reduce(timing)
    if replicas is None:
        # ring all-reduce of the gradients: every rank sends 2(n-1)/n gradient-sized messages
        bytes_per_step = 2 * (world - 1) / world * model_bytes(model)
    else:  # the engine's own count: the topology's period, buckets and compression included
        bytes_per_step = replicas.engine.bytes_sent_per_step()
    if rank != 0:
        return None
    tail = max(1, steps // 20)
    return Result(
        method=method,
        losses=losses.tolist(),
        distance_steps=distance_steps,
        distances=distances,
        final_loss=losses[-tail:].mean().item(),
        accuracy=accuracy,
        final_distance=distances[-1],
        ms_per_iteration=1000 * timing.item() / world / steps,
        bytes_per_step=bytes_per_step,
        split=split,
        alpha=alpha if split == "dirichlet" else None,
    )


def run(
    methods: list[str],
    steps: int,
    batch_size: int,
    lr: float,
    log_every: int,
    adam_lr: float = 3e-3,
    split: str = "iid",
    alpha: float = 0.1,
) -> list[Result]:
    """Train every method in turn on the ``split`` of the data (all ranks); rank 0 returns the results."""
    for method in methods:  # a misspelt method fails now, not after the ones before it have trained
        parse_method(method)
    world = dist.get_world_size()
    if dist.get_rank() == 0:
        labels = make_data()[1]
        shards = split_data(labels, world, split, alpha, min_size=batch_size)
        print(f"Split {split_label(split, alpha)}: {describe_split(shards, labels)}", flush=True)
    results = []
    for method in methods:
        if dist.get_rank() == 0:
            print(f"[{method}] training {steps} steps on {world} workers", flush=True)
        result = train_one_method(method, steps, batch_size, lr, log_every, adam_lr, split, alpha)
        if result is not None:
            results.append(result)
        dist.barrier()
    return results


def split_label(split: str, alpha: float | None) -> str:
    """``iid`` or ``dirichlet(alpha=0.1)``: how a table names the split it was trained on."""
    return f"{split}(alpha={alpha:g})" if split == "dirichlet" else split


def print_table(results: list[Result], world: int) -> None:
    splits = sorted({split_label(r.split, r.alpha) for r in results})
    print(
        f"\nResults ({world} workers, gloo on CPU, {', '.join(splits)} split; bytes: gossip as the engine "
        "counts them, compression and gradient tracking included; DDP by the ring all-reduce cost model):"
    )
    width = max([13, *(len(r.method) for r in results)])
    header = (
        f"{'method':>{width}} | {'final loss':>10} | {'avg-model acc':>13} | {'consensus dist':>14} | "
        f"{'ms/iter':>8} | {'bytes sent/rank/step':>20}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.method:>{width}} | {r.final_loss:>10.4f} | {r.accuracy:>13.4f} | "
            f"{r.final_distance:>14.3e} | {r.ms_per_iteration:>8.2f} | {r.bytes_per_step:>20,.0f}"
        )


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        window = max(1, len(r.losses) // 40)
        smooth = torch.tensor(r.losses).unfold(0, window, 1).mean(1)
        left.plot(range(window - 1, len(r.losses)), smooth, label=r.method)
        if not r.method.startswith("ddp"):  # DDP replicas are identical: distance 0
            right.semilogy(r.distance_steps, [max(d, 1e-12) for d in r.distances], marker=".", label=r.method)
    left.set(xlabel="step", ylabel="training loss (mean over workers)", title="Training loss")
    right.set(xlabel="step", ylabel="consensus distance", title="Distance of replicas to their average")
    left.legend()
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main_on_rank(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    results = run(
        args.methods,
        args.steps,
        args.batch_size,
        args.lr,
        args.log_every,
        args.adam_lr,
        split=args.split,
        alpha=args.alpha,
    )
    if dist.get_rank() == 0:
        print_table(results, dist.get_world_size())
        plot(results, Path(args.figure))
        print(f"\nFigure written to {args.figure}")
        if args.json:
            Path(args.json).write_text(json.dumps([asdict(r) for r in results]))


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        main_on_rank(args)
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=4, help="local gloo workers to start (default 4)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=f"default: {' '.join(METHODS)}")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate")
    parser.add_argument("--adam-lr", type=float, default=3e-3, help="learning rate of +adamw, +accum-adamw")
    parser.add_argument("--split", choices=SPLITS, default="iid", help="how the training set is divided")
    parser.add_argument(
        "--alpha",
        type=float,
        default=0.1,
        help="Dirichlet concentration of --split dirichlet; smaller is more skewed (default 0.1)",
    )
    parser.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    parser.add_argument("--figure", default="runs/quickstart.png")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    for method in args.methods:  # one clear message here rather than a traceback from every worker
        try:
            parse_method(method)
        except ValueError as error:
            parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            main_on_rank(args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(args.workers, port, args), nprocs=args.workers)


if __name__ == "__main__":
    main()
