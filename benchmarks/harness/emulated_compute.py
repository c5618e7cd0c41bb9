"""A model whose forward and backward are waits of a chosen length: ``build_mlp``'s parameters on a few
rows, each ``Linear`` followed by its share of the compute as a sleep (in forward and in backward), so
gradients appear when a real backward would make them while a sleep leaves the core to other ranks.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from benchmarks.harness.common import build_mlp

#: Rows the parameters see: enough for non-zero gradients, no noticeable CPU.
ROWS = 8


class _Wait(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:  # type: ignore[override]
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        time.sleep(ctx.backward_s)
        return grad, None, None


class EmulatedMLP(nn.Module):
    """``build_mlp``'s model computing ``compute_s`` seconds of sleep (set before each step),
    ``forward_fraction`` in forward; a layer's share is its share of the multiply-adds, twice in backward
    (once for the first layer: no input grad)."""

    def __init__(self, inputs: int, width: int, depth: int, outputs: int, forward_fraction: float) -> None:
        super().__init__()
        self.net = build_mlp(inputs, width, depth, outputs)
        linears = [m for m in self.net if isinstance(m, nn.Linear)]
        fwd = [m.in_features * m.out_features for m in linears]
        bwd = [(1 if i == 0 else 2) * w for i, w in enumerate(fwd)]
        self._forward_shares = [forward_fraction * w / sum(fwd) for w in fwd]
        self._backward_shares = [(1 - forward_fraction) * w / sum(bwd) for w in bwd]
        self.compute_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = 0
        for module in self.net:
            x = module(x)
            if isinstance(module, nn.Linear):
                shares = self._forward_shares[layer], self._backward_shares[layer]
                x = _Wait.apply(x, *(self.compute_s * share for share in shares))
                layer += 1
        return x
