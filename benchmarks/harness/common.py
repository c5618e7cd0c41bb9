"""Small pieces the benchmark scripts share: an MLP, a free port, results gathered from local ranks."""

import itertools
import multiprocessing as mp
import queue
import socket
import time
from collections.abc import Callable
from typing import Any

from torch import nn

#: What the fork server of :func:`local_ranks` imports once, before it forks any rank; ``__main__`` last,
#: the script itself, so that a rank's target (a function of the script) is found.
PRELOAD = ["torch", "torch.distributed", "decent_optim_wrapper", "__main__"]


def build_mlp(inputs: int, width: int, depth: int, outputs: int) -> nn.Sequential:
    """``depth`` Linear layers, ``inputs -> width -> ... -> outputs``, ReLUs between them (fp32)."""
    sizes = [inputs] + [width] * (depth - 1) + [outputs]
    layers = [layer for a, b in itertools.pairwise(sizes) for layer in (nn.ReLU(), nn.Linear(a, b))]
    return nn.Sequential(*layers[1:])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_ranks() -> Any:
    """``forkserver`` with :data:`PRELOAD`: a rank starts in milliseconds with torch imported (a spawned one
    imports it again, about 4 s here), yet with no process group, thread or CUDA context."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first rank)
    return ctx


def collect_from_ranks(
    world_size: int, target: Callable[..., None], args_for: Callable[[int, int, Any], tuple[Any, ...]],
    max_seconds: float, what: str,
) -> dict[int, Any]:  # fmt: skip
    """``target(*args_for(rank, port, results))`` on ``world_size`` local ranks, each putting ``(rank,
    value)`` on ``results``: the values by rank, or raises if a rank fails or ``max_seconds`` pass."""
    ctx = local_ranks()
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=args_for(rank, port, results)) for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + max_seconds
    out: dict[int, Any] = {}
    try:
        while len(out) < world_size:
            try:
                rank, value = results.get(timeout=1.0)
                out[rank] = value
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: no result within {max_seconds} s") from None
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"{what}: a rank failed") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return out
