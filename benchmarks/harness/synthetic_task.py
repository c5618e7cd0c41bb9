"""The synthetic classification task (the main job's; examples/quickstart.py keeps a copy the tests compare):
10 overlapping Gaussian clusters in 32 dimensions, a small MLP, and the ``iid`` or ``dirichlet`` (Hsu et al.,
2019, arXiv:1909.06335: each class divided in Dirichlet(alpha) proportions) split of its training set."""

import torch
from torch import nn
from torch.distributions import Dirichlet

from benchmarks.harness.common import build_mlp

FEATURES, CLASSES = 32, 10
TRAIN_POINTS, TEST_POINTS = 16384, 8192
SPLITS = ("iid", "dirichlet")
MAX_DIRICHLET_DRAWS = 1000  # redraws of a label-skewed split before giving up


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(CLASSES, FEATURES, generator=g) * 0.5
    labels = torch.randint(0, CLASSES, (TRAIN_POINTS + TEST_POINTS,), generator=g)
    points = centers[labels] + torch.randn(TRAIN_POINTS + TEST_POINTS, FEATURES, generator=g)
    return points[:TRAIN_POINTS], labels[:TRAIN_POINTS], points[TRAIN_POINTS:], labels[TRAIN_POINTS:]


def make_model(seed: int = 0) -> nn.Module:
    """The MLP every method starts from (32 -> 128 -> 128 -> 10, the same weights for a ``seed``)."""
    torch.manual_seed(seed)
    return build_mlp(FEATURES, 128, 3, CLASSES)


def split_data(
    labels: torch.Tensor, world: int, split: str = "iid", alpha: float = 0.1, min_size: int = 1, seed: int = 0
) -> list[torch.Tensor]:
    """The sorted indices of each worker's training points: ``iid`` deals them out in turn, ``dirichlet``
    divides each class in Dirichlet(``alpha``) proportions, redrawn until every worker holds ``min_size``
    points (the split conditioned on that, as Hsu et al.'s and FedMA's partitioners do)."""
    if split == "iid":
        return [torch.arange(rank, len(labels), world) for rank in range(world)]
    if split != "dirichlet":
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
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
    class_sizes = torch.tensor([len(i) for i in by_class])
    concentration = torch.full((len(class_sizes), world), float(alpha), dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):  # Dirichlet.sample() takes no generator
        torch.manual_seed(seed)
        for _ in range(MAX_DIRICHLET_DRAWS):
            shares = Dirichlet(concentration).sample()
            # rounding the running totals (not each share) keeps every class's counts summing to its size
            ends = (shares.cumsum(1) * class_sizes[:, None]).round().long()
            ends[:, -1] = class_sizes
            counts = ends.diff(dim=1, prepend=torch.zeros_like(ends[:, :1]))
            if (counts.sum(0) >= min_size).all():
                break
        else:
            raise ValueError(
                f"no Dirichlet(alpha={alpha}) split of {len(labels)} points in {MAX_DIRICHLET_DRAWS} draws "
                f"gave each of {world} workers at least {min_size} points; raise alpha, or lower the batch "
                "size or the number of workers."
            )
    g = torch.Generator().manual_seed(seed)  # shuffled within each class: a sorted dataset is dealt evenly
    shards: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for indices, row in zip(by_class, counts, strict=True):
        shuffled = indices[torch.randperm(len(indices), generator=g)]
        for rank, part in enumerate(shuffled.split(row.tolist())):
            shards[rank].append(part)
    return [torch.cat(parts).sort().values for parts in shards]


def describe_split(shards: list[torch.Tensor], labels: torch.Tensor) -> str:
    """Points per worker and the share of each worker's most frequent class (1/CLASSES when balanced)."""
    dominant = [torch.bincount(labels[s], minlength=CLASSES).max().item() / max(len(s), 1) for s in shards]
    sizes, shares = " ".join(str(len(s)) for s in shards), " ".join(f"{d:.2f}" for d in dominant)
    return f"points per worker {sizes}; largest class share per worker {shares}"


def split_label(split: str, alpha: float | None) -> str:
    """``iid`` or ``dirichlet(alpha=0.1)``: how a table names the split it was trained on."""
    return f"{split}(alpha={alpha:g})" if split == "dirichlet" else split
