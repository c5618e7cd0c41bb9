"""ResNet-18 on CIFAR-10 with decentralized data parallelism: each rank trains its own replica and gossips.

    # 4 GPUs on one node (NCCL), downloading CIFAR-10 into ./data on the first run:
    torchrun --nproc-per-node 4 examples/cifar10.py --data-dir data --download
    # 2 nodes x 8 GPUs, the topology told about the nodes:
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/cifar10.py --data-dir data --topology hierarchical
    # checkpoint every epoch, and continue after an interruption (same world size and arguments):
    torchrun --nproc-per-node 4 examples/cifar10.py --data-dir data --checkpoint-dir ckpt
    torchrun --nproc-per-node 4 examples/cifar10.py --data-dir data --checkpoint-dir ckpt --resume
    # the module front-end: DecentralizedDataParallel with AccumAdamW, updating inside backward:
    torchrun --nproc-per-node 4 examples/cifar10.py --data-dir data --front-end module --accum-iter 4
    # a smoke test without GPUs or downloads (gloo on CPU, random images), with either front-end:
    torchrun --nproc-per-node 2 examples/cifar10.py --device cpu --fake-data --epochs 2 --max-steps 4
    torchrun --nproc-per-node 2 examples/cifar10.py --device cpu --fake-data --epochs 2 --max-steps 4 \\
        --front-end module

The recipe: ResNet-18 from torchvision with the usual CIFAR stem (3x3 convolution, stride 1, no max
pool), random crop and horizontal flip, mixed precision (bf16 by default on CUDA; fp16 uses a
GradScaler), and a linear warm-up (from 0.1 x the peak) followed by a cosine decay to 0, stepped every
iteration. Two front-ends train it (``--front-end``):

- ``optimizer`` (the default): SGD with Nesterov momentum 0.9 wrapped in ``DecentOptimWrapper``;
  ``backward()``, then ``step()`` mixes, takes the local step and launches gossip.
- ``module``: ``DecentralizedDataParallel`` with one ``AccumAdamW`` per bucket, whose moments move
  once per ``--accum-iter`` steps; the update happens inside ``backward()``, bucket by bucket, and
  the module itself steps the LR schedules and the GradScaler and zeroes the gradients.

``--lr`` is the peak learning rate for a global batch of 256 images (default 0.1 for SGD, 1e-3 for
AccumAdamW) and is scaled linearly with ``--batch-size`` x world size; for AdamW at a global batch of
a few thousand images, consider a smaller ``--lr``. ``--weight-decay`` defaults to 5e-4 (SGD, L2 on
all parameters) or 0.05 (AdamW, decoupled, on weights only: not on biases and BatchNorm).

Every rank reads its own shard of the training set. After each epoch the replicas are averaged
exactly (parameters and BatchNorm statistics) to evaluate the average model on the test set, then
every replica is restored bit for bit and training continues; rank 0 prints one line per epoch.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import transforms

from decent_optim_wrapper import (
    DecentOptimWrapper,
    DecentralizedDataParallel,
    lr_scheduler_fn_cosine_with_warmup,
    optim_fn_accum_adamw,
)

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
#: The arguments that shape the optimizer, the schedule and the data order; a resumed run must repeat
#: them (the optimizers' state dicts would silently restore the saved lr, weight decay and accum_iter).
RESUME_MUST_MATCH = (
    "front_end",
    "epochs",
    "batch_size",
    "lr",
    "weight_decay",
    "accum_iter",
    "warmup_epochs",
    "max_steps",
    "fake_data",
    "seed",
)
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}
#: Per front-end: (learning rate per 256 images, weight decay) when not given.
DEFAULT_LR_AND_WEIGHT_DECAY = {"optimizer": (0.1, 5e-4), "module": (1e-3, 0.05)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; ``argv=None`` reads ``sys.argv``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", default="data", help="where CIFAR-10 is (or is downloaded to)")
    parser.add_argument("--download", action="store_true", help="download CIFAR-10 if it is missing")
    parser.add_argument(
        "--fake-data",
        type=int,
        nargs="?",
        const=256,
        default=None,
        metavar="N",
        help="random images instead of CIFAR-10: N for training (default 256), N/2 for test",
    )
    parser.add_argument("--topology", default="ring", help="ring, complete, one-peer-exp, hierarchical, ...")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128, help="images per rank per step")
    parser.add_argument(
        "--front-end",
        choices=tuple(DEFAULT_LR_AND_WEIGHT_DECAY),
        default="optimizer",
        help="optimizer: DecentOptimWrapper around SGD; module: DecentralizedDataParallel with AccumAdamW",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate per 256 images of global batch (default: 0.1 SGD, 1e-3 AccumAdamW)",
    )
    parser.add_argument(
        "--weight-decay", type=float, default=None, help="default: 5e-4 for SGD, 0.05 for AccumAdamW"
    )
    parser.add_argument(
        "--accum-iter",
        type=int,
        default=None,
        help="--front-end module: AccumAdamW's steps per moment update (default 4)",
    )
    parser.add_argument("--warmup-epochs", type=float, default=1.0, help="linear warm-up length")
    parser.add_argument("--max-steps", type=int, default=None, help="at most this many steps per epoch")
    parser.add_argument(
        "--stop-after", type=int, default=None, help="end this run after N epochs; continue with --resume"
    )
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--amp",
        choices=tuple(AMP_DTYPES),
        default=None,
        help="autocast dtype (default: bf16 on CUDA, none on CPU)",
    )
    parser.add_argument("--num-workers", type=int, default=4, help="data loading processes per rank")
    parser.add_argument("--checkpoint-dir", default=None, help="save DIR/rank{r}.pt after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.fake_data is not None and args.fake_data < 1:
        parser.error(f"--fake-data takes a positive number of images, got {args.fake_data}")
    if args.max_steps is not None and args.max_steps < 1:
        parser.error(f"--max-steps must be at least 1, got {args.max_steps}")
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir, the directory the interrupted run saved to")
    if args.front_end == "module":
        args.accum_iter = 4 if args.accum_iter is None else args.accum_iter
        if args.accum_iter < 1:
            parser.error(f"--accum-iter must be at least 1, got {args.accum_iter}")
    elif args.accum_iter is not None:
        parser.error("--accum-iter is AccumAdamW's, which only --front-end module uses; SGD has no moments")
    # Resolved here, so that a checkpoint records the values trained with, defaults included.
    default_lr, default_weight_decay = DEFAULT_LR_AND_WEIGHT_DECAY[args.front_end]
    args.lr = default_lr if args.lr is None else args.lr
    args.weight_decay = default_weight_decay if args.weight_decay is None else args.weight_decay
    for name in ("lr", "weight_decay"):
        if not getattr(args, name) >= 0:
            parser.error(f"--{name.replace('_', '-')} must be at least 0, got {getattr(args, name)}")
    return args


class FrontEnd(Protocol):
    """What training, evaluation and checkpoints ask of a front-end; one class per ``--front-end``."""

    @property
    def step_count(self) -> int:
        """Completed iterations, restored by :meth:`load_state_dict`."""
        ...

    def summary(self) -> str:
        """Topology and peak learning rate, for the first line of the log."""
        ...

    def update(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` and take this rank's step: mix, update locally, launch gossip."""
        ...

    def global_avg(self) -> None:
        """Average parameters and BatchNorm statistics exactly over all ranks (a collective)."""
        ...

    def revert_global_avg(self) -> None:
        """Restore this replica as it was before :meth:`global_avg`, bit for bit."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """This rank's training state: the model's, the optimizers', the schedule's, the gossip's."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class OptimizerFrontEnd:
    """``--front-end optimizer``: SGD in a ``DecentOptimWrapper``, with a stock schedule and GradScaler."""

    model: nn.Module
    optimizer: DecentOptimWrapper
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # disabled unless fp16: then it passes steps through

    @property
    def step_count(self) -> int:
        return self.optimizer.step_count

    def summary(self) -> str:
        peak_lr = self.optimizer.param_groups[0]["initial_lr"]
        return f"topology {self.optimizer.topology.name}, SGD, peak lr {peak_lr:.4g}"

    def update(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)  # the wrapper: mix, local step, launch gossip
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad()  # after the step rather than before the forward: the same

    def global_avg(self) -> None:
        self.optimizer.global_avg(buffers=self.model)  # parameters and BatchNorm statistics

    def revert_global_avg(self) -> None:
        self.optimizer.revert_global_avg()

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),  # saved after the revert: this replica's own BatchNorm stats
            "optimizer": self.optimizer.state_dict(),  # includes the replica's parameters and gossip
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])


@dataclass
class ModuleFrontEnd:
    """``--front-end module``: a ``DecentralizedDataParallel`` that updates inside ``backward()``.

    The module owns the bucket optimizers, their schedules and the GradScaler (unscaling, stepping,
    updating it and zeroing the gradients itself); the loop only scales the loss.
    """

    model: DecentralizedDataParallel
    scaler: torch.amp.GradScaler  # the one the module was given if enabled (fp16), else a no-op

    @property
    def step_count(self) -> int:
        return self.model.step_count

    def summary(self) -> str:
        peak_lr = self.model.optimizers[0].param_groups[0]["initial_lr"]
        accum_iter = self.model.optimizers[0].param_groups[0]["accum_iter"]
        return (
            f"topology {self.model.engine.topology.name}, AccumAdamW (accum_iter {accum_iter}), "
            f"peak lr {peak_lr:.4g}"
        )

    def update(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()  # mixes, steps and launches gossip, bucket by bucket

    def global_avg(self) -> None:
        self.model.global_avg()  # BatchNorm statistics too: built with sync_buffer_in_global_avg

    def revert_global_avg(self) -> None:
        self.model.revert_global_avg()

    def state_dict(self) -> dict[str, Any]:
        # the model, bucket optimizers, schedules, scaler, this replica's parameters and its gossip
        return {"training_state": self.model.training_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_training_state_dict(state["training_state"])


@dataclass
class Recipe:
    """Everything one rank trains with."""

    model: nn.Module  # what the loop calls: the ResNet, or the DecentralizedDataParallel around it
    front_end: FrontEnd
    train_loader: DataLoader
    train_sampler: DistributedSampler
    test_loader: DataLoader
    device: torch.device
    amp_dtype: torch.dtype | None
    steps_per_epoch: int


def resnet18_cifar() -> nn.Module:
    """torchvision's ResNet-18 with a CIFAR stem: 32x32 inputs keep their resolution into layer1."""
    model = torchvision.models.resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def datasets(args: argparse.Namespace, rank: int) -> tuple[Any, Any]:
    """The training and test sets with their transforms (random crop and flip for training)."""
    normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
    train_tf = transforms.Compose(
        [
            transforms.RandomCrop(32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            normalize,
        ]
    )
    test_tf = transforms.Compose([transforms.ToTensor(), normalize])
    if args.fake_data is not None:  # torchvision's FakeData: random images, made on the fly
        size, shape = args.fake_data, (3, 32, 32)
        train = torchvision.datasets.FakeData(size, shape, 10, train_tf, random_offset=0)
        test = torchvision.datasets.FakeData(max(1, size // 2), shape, 10, test_tf, random_offset=size)
        return train, test
    if args.download:
        # One rank per node downloads, the others wait, so no two processes write the same files.
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if local_rank == 0:
            torchvision.datasets.CIFAR10(args.data_dir, train=True, download=True)
            torchvision.datasets.CIFAR10(args.data_dir, train=False, download=True)
        dist.barrier()
    train = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=train_tf)
    test = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=test_tf)
    return train, test


def resolve_device(name: str) -> torch.device:
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available; use --device cpu.")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


@dataclass(frozen=True)
class Schedule:
    """The peak learning rate (scaled to the global batch) and the schedule's length in iterations."""

    lr: float
    total: int
    warmup: int  # linear warm-up iterations, then a cosine decay over the other total - warmup


def optimizer_front_end(
    args: argparse.Namespace, model: nn.Module, schedule: Schedule, scaler: torch.amp.GradScaler
) -> tuple[FrontEnd, nn.Module]:
    """SGD wrapped in ``DecentOptimWrapper`` with torch's schedulers; returns it and the model to call."""
    inner = torch.optim.SGD(
        model.parameters(), lr=schedule.lr, momentum=0.9, nesterov=True, weight_decay=args.weight_decay
    )
    optimizer = DecentOptimWrapper(
        inner, topology=args.topology, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    )
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=schedule.total - schedule.warmup)
    scheduler: torch.optim.lr_scheduler.LRScheduler = cosine
    if schedule.warmup > 0:
        linear = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=schedule.warmup)
        scheduler = torch.optim.lr_scheduler.SequentialLR(
            optimizer, [linear, cosine], milestones=[schedule.warmup]
        )
    return OptimizerFrontEnd(model, optimizer, scheduler, scaler), model


def module_front_end(
    args: argparse.Namespace, model: nn.Module, schedule: Schedule, scaler: torch.amp.GradScaler
) -> tuple[FrontEnd, nn.Module]:
    """``DecentralizedDataParallel`` with AccumAdamW per bucket; returns it and the module to call."""
    ddp = DecentralizedDataParallel(
        model,
        optim_fn=partial(
            optim_fn_accum_adamw, lr=schedule.lr, weight_decay=args.weight_decay, accum_iter=args.accum_iter
        ),
        # the same shape as the optimizer front-end's: from 0.1 x the peak, cosine down to 0
        lr_scheduler_fn=partial(
            lr_scheduler_fn_cosine_with_warmup,
            t_max=schedule.total - schedule.warmup,
            t_warmup=schedule.warmup,
            cosine_eta_min=0.0,
            warmup_decay=0.1,
        ),
        topology=args.topology,
        scaler=scaler if scaler.is_enabled() else None,  # unscaled, stepped and updated inside backward
        sync_buffer_in_global_avg=True,  # global_avg() averages BatchNorm statistics too
        _local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
    )
    return ModuleFrontEnd(ddp, scaler), ddp


def build(args: argparse.Namespace, device: torch.device) -> Recipe:
    """Data, model and front-end (optimizers, LR schedule, grad scaler) for this rank.

    .. warning:: A collective (the front-end's construction): all ranks must call it.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train_set, test_set = datasets(args, rank)
    train_sampler = DistributedSampler(
        train_set, world_size, rank, shuffle=True, seed=args.seed, drop_last=True
    )
    # A strided shard, not a DistributedSampler: that one pads with repeats, which would bias accuracy.
    test_shard = Subset(test_set, range(rank, len(test_set), world_size))
    pin = device.type == "cuda"
    train_loader = DataLoader(
        train_set,
        args.batch_size,
        sampler=train_sampler,
        num_workers=args.num_workers,
        pin_memory=pin,
        drop_last=True,
    )
    test_loader = DataLoader(test_shard, 2 * args.batch_size, num_workers=args.num_workers, pin_memory=pin)
    steps_per_epoch = len(train_loader)
    if args.max_steps is not None:
        steps_per_epoch = min(steps_per_epoch, args.max_steps)
    if steps_per_epoch == 0:
        raise ValueError(
            f"--batch-size {args.batch_size} x {world_size} ranks exceeds the {len(train_set)} training "
            "images: no full batch per rank; use a smaller --batch-size."
        )

    torch.manual_seed(args.seed)  # the wrapper broadcasts rank 0's parameters anyway
    # channels_last lets cuDNN use tensor cores without transposes; the wrapper's buckets keep it.
    memory_format = torch.channels_last if device.type == "cuda" else torch.preserve_format
    model = resnet18_cifar().to(device, memory_format=memory_format)  # move before wrapping
    amp = args.amp or ("bf16" if device.type == "cuda" else "none")
    amp_dtype = AMP_DTYPES[amp]
    # bf16 has fp32's range, so only fp16 needs loss scaling; a disabled scaler passes steps through.
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    total = args.epochs * steps_per_epoch
    warmup = min(round(args.warmup_epochs * steps_per_epoch), total - 1)
    schedule = Schedule(lr=args.lr * args.batch_size * world_size / 256, total=total, warmup=warmup)
    build_front_end = module_front_end if args.front_end == "module" else optimizer_front_end
    front_end, net = build_front_end(args, model, schedule, scaler)
    return Recipe(
        net,
        front_end,
        train_loader,
        train_sampler,
        test_loader,
        device,
        amp_dtype,
        steps_per_epoch,
    )


def _autocast(recipe: Recipe) -> torch.autocast:
    dtype = recipe.amp_dtype
    return torch.autocast(recipe.device.type, dtype=dtype, enabled=dtype is not None)


def _to_device(recipe: Recipe, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if recipe.device.type == "cuda":
        x = x.to(recipe.device, non_blocking=True, memory_format=torch.channels_last)
        y = y.to(recipe.device, non_blocking=True)
    return x, y


def train_one_epoch(recipe: Recipe, epoch: int, seed: int) -> float:
    """Train this rank's replica for one epoch; return the training loss averaged over all ranks.

    .. warning:: A collective: all ranks must call it and take the same number of steps.
    """
    recipe.model.train()
    recipe.train_sampler.set_epoch(epoch)
    # Augmentation draws from the global generator (or from worker seeds drawn from it): seeding it
    # per (epoch, rank) gives a resumed run the same crops and flips as an uninterrupted one.
    torch.manual_seed(seed + 1_000_003 * (epoch + 1) + dist.get_rank())
    loss_sum = torch.zeros((), device=recipe.device)
    steps = 0
    for x, y in recipe.train_loader:
        if steps == recipe.steps_per_epoch:
            break
        x, y = _to_device(recipe, x, y)
        with _autocast(recipe):
            loss = nn.functional.cross_entropy(recipe.model(x), y)
        recipe.front_end.update(loss)
        loss_sum += loss.detach().float()
        steps += 1
    loss_sum /= steps
    dist.all_reduce(loss_sum)
    return loss_sum.item() / dist.get_world_size()


@torch.no_grad()
def evaluate(recipe: Recipe) -> float:
    """Accuracy of the current model on the test set, each rank scoring its shard.

    .. warning:: A collective: all ranks must call it.
    """
    recipe.model.eval()
    counts = torch.zeros(2, dtype=torch.int64, device=recipe.device)  # correct, total
    for x, y in recipe.test_loader:
        x, y = _to_device(recipe, x, y)
        with _autocast(recipe):
            logits = recipe.model(x)
        counts[0] += (logits.argmax(1) == y).sum()
        counts[1] += y.numel()
    dist.all_reduce(counts)
    recipe.model.train()
    return counts[0].item() / max(1, counts[1].item())


def checkpoint_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.pt"


def save_checkpoint(recipe: Recipe, args: argparse.Namespace, epochs_done: int) -> None:
    """Write this rank's state to ``DIR/rank{r}.pt`` (atomically: a crash leaves the previous file)."""
    rank = dist.get_rank()
    path = checkpoint_path(args.checkpoint_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        **recipe.front_end.state_dict(),  # saved after the revert: this replica's own parameters
        "epoch": epochs_done,  # the next epoch to run
        "sampler_epoch": recipe.train_sampler.epoch,
        "config": {name: getattr(args, name) for name in RESUME_MUST_MATCH},
        "world_size": dist.get_world_size(),
    }
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(recipe: Recipe, args: argparse.Namespace) -> int:
    """Restore this rank's state from ``--checkpoint-dir``; return the epoch to continue with.

    .. warning:: A collective (ranks check that they resume from the same epoch): all ranks must call it.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path = checkpoint_path(args.checkpoint_dir, rank)
    if not path.exists():
        raise FileNotFoundError(
            f"--resume: {path} does not exist; point --checkpoint-dir at the directory of a run with "
            f"{world_size} ranks, or drop --resume to start afresh."
        )
    state = torch.load(path, map_location=recipe.device, weights_only=True)
    if state["world_size"] != world_size:
        raise ValueError(
            f"{path} was saved by a run with {state['world_size']} ranks but this run has {world_size}; "
            "resume with the same number of processes."
        )
    # Checkpoints of the recipe before --front-end existed: SGD with its fixed weight decay, no accum_iter.
    saved = {"front_end": "optimizer", "weight_decay": 5e-4, "accum_iter": None, **state["config"]}
    changed = {k: (saved[k], getattr(args, k)) for k in RESUME_MUST_MATCH if saved.get(k) != getattr(args, k)}
    if changed:
        listed = ", ".join(f"--{k.replace('_', '-')} {old} (now {new})" for k, (old, new) in changed.items())
        raise ValueError(f"{path} was saved by a run with {listed}; resume with the same arguments.")
    recipe.front_end.load_state_dict(state)
    recipe.train_sampler.set_epoch(state["sampler_epoch"])
    # A run killed while saving can leave ranks one epoch apart; training on would mix epochs silently.
    epochs = torch.tensor([state["epoch"], -state["epoch"]], device=recipe.device)
    dist.all_reduce(epochs, op=dist.ReduceOp.MAX)
    if epochs[0].item() != -epochs[1].item():
        raise ValueError(
            f"the checkpoints in {args.checkpoint_dir} are from different epochs "
            f"({-epochs[1].item()} to {epochs[0].item()}); the save was interrupted. Restore a complete set."
        )
    return int(state["epoch"])


def _init_distributed(device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" not in os.environ:  # plain `python examples/cifar10.py`: a world of one
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train, evaluating the averaged model every epoch; return the metrics (the same on every rank).

    Uses the default process group if one exists (and leaves it alone); otherwise creates one (NCCL
    on CUDA, gloo on CPU) from torchrun's environment, and destroys it at the end.
    """
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    created = not dist.is_initialized()
    if created:
        _init_distributed(device)
    try:
        return _run(args, device)
    finally:
        if created:
            dist.destroy_process_group()


def _run(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    rank = dist.get_rank()
    recipe = build(args, device)
    start_epoch = load_checkpoint(recipe, args) if args.resume else 0
    stop_epoch = args.epochs
    if args.stop_after is not None:
        stop_epoch = min(stop_epoch, start_epoch + args.stop_after)
    if rank == 0:
        print(
            f"{dist.get_world_size()} ranks on {device.type}, --front-end {args.front_end}, "
            f"{recipe.front_end.summary()}, {recipe.steps_per_epoch} steps/epoch, "
            f"epochs {start_epoch}..{stop_epoch - 1}",
            flush=True,
        )
    history = []
    for epoch in range(start_epoch, stop_epoch):
        started = time.perf_counter()
        train_loss = train_one_epoch(recipe, epoch, args.seed)
        recipe.front_end.global_avg()  # parameters and BatchNorm statistics
        accuracy = evaluate(recipe)
        recipe.front_end.revert_global_avg()  # every replica exactly as before
        if args.checkpoint_dir is not None:
            save_checkpoint(recipe, args, epoch + 1)
        seconds = time.perf_counter() - started
        history.append(
            {"epoch": epoch, "train_loss": train_loss, "test_accuracy": accuracy, "seconds": seconds}
        )
        if rank == 0:
            print(
                f"epoch {epoch + 1:3d}/{args.epochs}  train loss {train_loss:.4f}  "
                f"test acc {accuracy:.4f}  time {seconds:.1f}s",
                flush=True,
            )
    last = history[-1] if history else {"train_loss": math.nan, "test_accuracy": math.nan}
    return {
        "start_epoch": start_epoch,
        "epochs_done": stop_epoch,
        "steps": recipe.front_end.step_count,
        "train_loss": last["train_loss"],
        "test_accuracy": last["test_accuracy"],
        "history": history,
    }


if __name__ == "__main__":
    main()
