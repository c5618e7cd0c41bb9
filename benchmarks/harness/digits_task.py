"""scikit-learn's handwritten digits as a second classification task for the convergence benchmark.

The task a new user tries first: 1797 images of 8x8 pixels (``sklearn.datasets.load_digits``, shipped
with scikit-learn: no download), 10 classes. A fixed stratified split keeps 360 images (20%) for the
test set; the pixels are scaled to [0, 1] (their range is 0-16). The model is an MLP of the synthetic
task's shape with 64 inputs (64 -> 128 -> 128 -> 10). Test accuracy moves in steps of 1/360 = 0.28
points, so differences of a few tenths of a point are one or two images: compare means over seeds.
"""

from __future__ import annotations

import torch
from torch import nn

FEATURES, CLASSES, TEST_FRACTION = 64, 10, 0.2


def make_digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test sets (identical on every rank): the same stratified split every time."""
    from sklearn.datasets import load_digits  # benchmark-only dependency (the bench and dev groups)
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    train_x, test_x, train_y, test_y = train_test_split(
        images, labels, test_size=TEST_FRACTION, stratify=labels, random_state=0
    )

    def features(x: object) -> torch.Tensor:
        return torch.as_tensor(x, dtype=torch.float32) / 16.0

    def targets(y: object) -> torch.Tensor:
        return torch.as_tensor(y, dtype=torch.int64)

    return features(train_x), targets(train_y), features(test_x), targets(test_y)


def make_digits_model(seed: int = 0, hidden: tuple[int, ...] = (128, 128)) -> nn.Module:
    """The MLP every method starts from for ``seed`` (the same weights for every method), of ``hidden``
    widths between its 64 inputs and 10 outputs (the robustness benchmark: one layer of 64)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for width_in, width_out in zip((FEATURES, *hidden), hidden, strict=False):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden[-1] if hidden else FEATURES, CLASSES))
