"""Pieces the benchmark scripts share (each script runs with this folder on sys.path)."""

from __future__ import annotations

import itertools
import socket

from torch import nn


def build_mlp(inputs: int, width: int, depth: int, outputs: int) -> nn.Sequential:
    """``depth`` Linear layers, ``inputs -> width -> ... -> outputs``, ReLUs between them (fp32)."""
    sizes = [inputs] + [width] * (depth - 1) + [outputs]
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for a local rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
