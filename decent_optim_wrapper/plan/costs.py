"""What one exchange costs on a network: links, the ring all-reduce, and the bytes the engine sends.

Cost model (every assumption of the planner and the simulator about the network is here):

* Every node has one full-duplex link to a non-blocking switch (:class:`Link`: bandwidth per direction
  and a latency per message); ranks of the same node talk over ``Network.intra`` (shared memory or
  loopback). A node's link is shared equally by all its ranks that send to other nodes at once.
* An all-reduce among ``k`` ranks is a ring (what gloo runs): every member sends ``2 (k - 1) / k``
  of the payload to the next member in rank order, the hops running in parallel, in ``2 (k - 1)``
  messages one after another. It takes ``sent / rate`` of its slowest hop plus ``2 (k - 1)``
  latencies. With ``tree`` latency (what NCCL does at scale) the messages are ``2 ceil(log2 k)``.
* Bytes come from the engine's own rule: :func:`~decent_optim_wrapper.topo.mixing.allreduce_models_sent`
  for an uncompressed round and :meth:`~decent_optim_wrapper.engine.compression.CompressionPlan.bytes_sent`
  for a compressed one (a compressed pair exchanges its two payloads in one all-reduce, so the hop
  carries one payload).
* DDP all-reduces its gradient buckets (25 MB, the first 1 MB) in the order backward fills them,
  one after another, each as soon as every rank has filled it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decent_optim_wrapper.engine.compression import CompressionPlan
from decent_optim_wrapper.topo.group import Group
from decent_optim_wrapper.topo.mixing import allreduce_models_sent

__all__ = [
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "Link",
    "Network",
    "ddp_buckets",
    "gossip_round_bytes",
]

#: ``DistributedDataParallel``'s defaults: ``bucket_cap_mb=25`` and a first bucket of 1 MiB.
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Link:
    """One direction of a link: ``bandwidth`` in bits per second, ``latency_s`` per message."""

    bandwidth: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency_s < 0:
            raise ValueError(
                f"a link needs bandwidth > 0 bit/s and latency >= 0 s, got bandwidth={self.bandwidth}, "
                f"latency_s={self.latency_s}"
            )

    def seconds(self, nbytes: float, messages: int, sharing: int = 1) -> float:
        """Time to send ``nbytes`` in ``messages`` sequential messages, the rate split ``sharing`` ways."""
        return 8.0 * nbytes * sharing / self.bandwidth + messages * self.latency_s


@dataclass(frozen=True)
class Network:
    """Nodes of ``local_world_size`` ranks; ``inter`` links nodes, ``intra`` ranks of one node.

    ``tree_latency``: all-reduces pay ``2 ceil(log2 k)`` latencies instead of a ring's ``2 (k - 1)``.
    """

    inter: Link
    intra: Link = Link(100e9, 0.0)
    local_world_size: int = 1
    tree_latency: bool = False

    def node(self, rank: int) -> int:
        return rank // self.local_world_size

    def messages(self, group_size: int) -> int:
        """Sequential messages of an all-reduce among ``group_size`` ranks."""
        if group_size <= 1:
            return 0
        if self.tree_latency:
            return 2 * math.ceil(math.log2(group_size))
        return 2 * (group_size - 1)

    def allreduce_seconds(self, groups: Sequence[Group], sent: Sequence[float]) -> list[float]:
        """Seconds of each group's ring all-reduce when all of ``groups`` run at once.

        ``sent[i]``: bytes each member of ``groups[i]`` sends. A hop between nodes shares its node's
        link with every other hop leaving that node in ``groups``.
        """
        leaving: dict[int, int] = {}
        hops = [
            list(zip(g.ranks, g.ranks[1:] + g.ranks[:1], strict=True)) if g.size > 1 else [] for g in groups
        ]
        for group_hops in hops:
            for a, b in group_hops:
                if self.node(a) != self.node(b):
                    leaving[self.node(a)] = leaving.get(self.node(a), 0) + 1
        seconds = []
        for group, group_hops, nbytes in zip(groups, hops, sent, strict=True):
            crossing = [a for a, b in group_hops if self.node(a) != self.node(b)]
            if crossing:
                share = max(leaving[self.node(a)] for a in crossing)
                seconds.append(self.inter.seconds(nbytes, self.messages(group.size), share))
            else:
                seconds.append(self.intra.seconds(nbytes, self.messages(group.size)))
        return seconds


def gossip_round_bytes(
    group: Group, numel: int, plan: CompressionPlan | None = None, dtype: torch.dtype = torch.float32
) -> float:
    """Bytes a member of ``group`` sends in one round of ``numel`` parameters (the engine's rule).

    ``plan``: the topology's :class:`~decent_optim_wrapper.engine.compression.CompressionPlan` when
    compressing, None otherwise.
    """
    if plan is None:
        return allreduce_models_sent(group.size) * numel * dtype.itemsize
    return plan.bytes_sent(group, numel, dtype, dtype.itemsize)


def ddp_buckets(
    model_bytes: float,
    forward_fraction: float = 1 / 3,
    bucket_bytes: float = DDP_BUCKET_BYTES,
    first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
) -> list[tuple[float, float]]:
    """DDP's buckets as ``(bytes, fraction of the compute after which every gradient in it is ready)``.

    Backward (the last ``1 - forward_fraction`` of the compute) is taken to produce gradient bytes at a
    steady rate, last layer first, the way DDP fills its buckets.
    """
    if not 0 <= forward_fraction < 1:
        raise ValueError(f"forward_fraction must be in [0, 1), got {forward_fraction}")
    buckets: list[tuple[float, float]] = []
    done, cap = 0.0, first_bucket_bytes
    while done < model_bytes:
        size = min(cap, model_bytes - done)
        done += size
        buckets.append((size, forward_fraction + (1 - forward_fraction) * done / model_bytes))
        cap = bucket_bytes
    return buckets
