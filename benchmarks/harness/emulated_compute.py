"""A model whose forward and backward are waits of a chosen length: real parameters, no arithmetic.

``EmulatedMLP`` has the parameters of ``common.build_mlp`` (same shapes, same order, so DDP and the
engine bucket it the same way) and runs them on a batch of a few rows, but after each ``Linear`` it
sleeps that layer's share of the step's compute, in forward and again in backward. Gradients appear in
the order and at the times a real backward would produce them, so DDP's bucket all-reduces and the
module front-end's per-bucket steps overlap the rest of backward as they would; the optimizer step,
the bytes and the collectives stay real. A sleep leaves the core free, so many ranks fit on few cores.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from benchmarks.harness.common import build_mlp

#: Rows of the batch the parameters actually see: enough for non-zero gradients, no noticeable CPU.
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
    """``build_mlp(inputs, width, depth, outputs)`` whose compute is ``compute_s`` seconds of sleep.

    A layer's share of the forward is proportional to its multiply-adds; of the backward, twice that,
    except for the first layer, which needs no gradient of its input (once). ``forward_fraction`` of
    ``compute_s`` is slept in forward, the rest in backward. Set ``compute_s`` before each step.
    """

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
                x = _Wait.apply(
                    x,
                    self.compute_s * self._forward_shares[layer],
                    self.compute_s * self._backward_shares[layer],
                )
                layer += 1
        return x
