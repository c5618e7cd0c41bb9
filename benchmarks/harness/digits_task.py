"""scikit-learn's handwritten digits (shipped with it): 1797 8x8 images, a fixed stratified 20% (360) for
the test set (accuracy moves in steps of 0.28 points: compare means over seeds), an MLP of 64 inputs."""

import itertools

import torch
from torch import nn

FEATURES, CLASSES, TEST_FRACTION = 64, 10, 0.2


def make_digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test sets (identical on every rank), pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits  # benchmark-only dependency (the bench and dev groups)
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=TEST_FRACTION, stratify=labels, random_state=0
    )
    features = [torch.as_tensor(x, dtype=torch.float32) / 16.0 for x in (train_x, test_x)]
    targets = [torch.as_tensor(y, dtype=torch.int64) for y in (train_y, test_y)]
    return features[0], targets[0], features[1], targets[1]


def make_digits_model(seed: int = 0, hidden: tuple[int, ...] = (128, 128)) -> nn.Module:
    """The MLP every method starts from for ``seed``: ``hidden`` widths between 64 inputs and 10 outputs."""
    torch.manual_seed(seed)
    sizes = (FEATURES, *hidden, CLASSES)
    layers = [layer for a, b in itertools.pairwise(sizes) for layer in (nn.Linear(a, b), nn.ReLU())]
    return nn.Sequential(*layers[:-1])
