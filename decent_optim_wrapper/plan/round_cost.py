"""What a gossip round costs a member's processor, measured on this machine: staging and encoding at
the launch, decoding and folding in when it is mixed.

The simulator charges these seconds to the step that launches a round and to the step that folds it
in (:class:`~.simulator.Gossip`'s ``encode_s`` and ``fold_s``). They depend on the wire format more
than on the link: uncompressed, a round stages a copy of the bucket and sums the members' copies;
compressed, it subtracts the shared reference, encodes (a quantization, or a top-k selection per
chunk), decodes every member's payload into the sum and updates replica and reference, the engine's
order of work (:mod:`decent_optim_wrapper.engine.exchange.gossip`). Timing it here rather than modelling it
per format keeps the prediction honest on whatever processor the user plans for.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from decent_optim_wrapper.engine.wire.compression import GossipCompression, codec, round_seed

__all__ = ["RoundCost", "measure_round_cost"]


@dataclass(frozen=True)
class RoundCost:
    """Median seconds of one round's work on a member: at its launch and at its fold."""

    encode_s: float
    fold_s: float


def measure_round_cost(
    numel: int,
    group_size: int,
    compression: GossipCompression | None = None,
    repeats: int = 5,
    device: torch.device | str = "cpu",
) -> RoundCost:
    """Time one round of ``numel`` fp32 values in a group of ``group_size`` members here.

    Launch: uncompressed, the copy the engine stages; compressed, the difference to the reference
    and its encoding. Fold: uncompressed, the weighted sum of the members' copies; compressed, the
    members' payloads decoded and summed, then replica and reference updated. The peers' payloads
    are the member's own (decoding costs the same whatever the values). Medians of ``repeats``
    after one untimed round (first calls allocate).
    """
    if numel < 1 or group_size < 2 or repeats < 1:
        raise ValueError(
            f"need numel >= 1, group_size >= 2 and repeats >= 1, got {numel}, {group_size}, {repeats}"
        )
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=generator).to(device)
    reference = x + 1e-3 * torch.randn(numel, generator=generator).to(device)
    total, scratch = torch.empty_like(x), torch.empty_like(x)
    weight = 1.0 / group_size
    launch: Callable[[int], None]
    fold: Callable[[int], None]
    if compression is None:
        staged = torch.empty(group_size, numel, device=device)

        def stage(_: int) -> None:
            staged[0].copy_(x)

        def average(_: int) -> None:
            torch.sum(staged, dim=0, out=total)
            torch.mul(total, weight, out=x)

        launch, fold = stage, average
    else:
        coder = codec(compression.name)
        payloads = torch.zeros(group_size, coder.payload_bytes(numel, torch.float32), dtype=torch.uint8)
        payloads = payloads.to(device)

        def encode(step: int) -> None:
            torch.sub(x, reference, out=scratch)
            coder.encode(scratch, payloads[0], round_seed(step, 0))
            payloads[1:].copy_(payloads[0].expand(group_size - 1, -1))  # what the network brings

        def decode_and_fold(step: int) -> None:
            seed = round_seed(step, 0)
            coder.decode_into(payloads[0], total, seed)
            for member in range(1, group_size):
                coder.add_into(payloads[member], total, scratch, seed)
            total.mul_(weight)
            coder.decode_into(payloads[0], scratch, seed)
            x.add_(total - scratch)  # the replica moves by the mixed change of the reference
            reference.add_(total)

        launch, fold = encode, decode_and_fold
    return RoundCost(_median(launch, repeats, device), _median(fold, repeats, device))


def _median(work: Callable[[int], None], repeats: int, device: torch.device) -> float:
    times = []
    for step in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])
