"""What one exchange costs on a network: links, the ring all-reduce, and the bytes the engine sends.

Cost model (every assumption of the planner and the simulator about the network is here):

* Every node has one full-duplex link to a non-blocking switch (:class:`Link`: bandwidth per direction,
  a latency per message and the bytes a message costs beyond its payload); ranks of the same node
  talk over ``Network.intra`` (shared memory or loopback). Each direction of a node's link is shared
  by the transfers crossing it while they run (max-min fair shares, recomputed whenever one starts or
  ends: :mod:`.sharing`).
* An all-reduce among ``k`` ranks is a ring (what gloo runs): every member sends ``2 (k - 1) / k``
  of the payload to the next member in rank order, the hops running in parallel, in ``2 (k - 1)``
  messages one after another. It takes ``sent / rate`` of its slowest hop plus ``2 (k - 1)``
  latencies. With ``tree`` latency (what NCCL does at scale) the messages are ``2 ceil(log2 k)``.
  Every message adds the link's ``message_bytes`` to what the hop carries (the transport's and the
  collective's own traffic: tiny rounds pay more for it than for their payload).
* Bytes come from the engine's own rule: :func:`~decent_optim_wrapper.topo.mixing.allreduce_models_sent`
  for an uncompressed round and
  :meth:`~decent_optim_wrapper.engine.wire.compression.CompressionPlan.bytes_sent` for a compressed
  one (a compressed pair exchanges its two payloads in one all-reduce, so the hop carries one payload).
* A model on a GPU gossiping over gloo stages every round through pinned host memory
  (:class:`HostCopy`): the payload is copied out on a side stream after the launch (the round starts
  that much later; the compute does not wait), and what arrives is copied back on the compute stream
  before the mix (added to the fold, like decoding).
* DDP all-reduces its gradient buckets (25 MB, the first 1 MB) in the order backward fills them,
  one after another, each as soon as every rank has filled it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from decent_optim_wrapper.engine.fleet.comm import reduction_dtype
from decent_optim_wrapper.engine.wire.compression import CompressionPlan, codec
from decent_optim_wrapper.plan.sharing import SharedLink, SharingModel, Transfer, transfer_seconds
from decent_optim_wrapper.topo.group import Group
from decent_optim_wrapper.topo.mixing import allreduce_models_sent

__all__ = [
    "DDP_BUCKET_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "HostCopy",
    "Link",
    "Network",
    "ddp_buckets",
    "gossip_round_bytes",
]

#: ``DistributedDataParallel``'s defaults: ``bucket_cap_mb=25`` and a first bucket of 1 MiB.
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True)
class HostCopy:
    """Copies between a GPU and pinned host memory at ``bytes_per_s`` (each direction; PCIe 4.0 x16
    moves about 25e9, 5.0 about 50e9: measure it with ``benchmarks/gpu/fleet_figures.py``)."""

    bytes_per_s: float

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"a host copy needs bytes_per_s > 0, got {self.bytes_per_s}")

    def staged_seconds(
        self, group: Group, numel: int, plan: CompressionPlan | None, dtype: torch.dtype = torch.float32
    ) -> tuple[float, float]:
        """Seconds to copy a member's part of ``group``'s round out, and what arrives back in.

        Uncompressed, the staged sum buffer both ways (fp32 for 16-bit buckets); compressed, the
        member's own payload out and every member's back (the engine gathers them all).
        """
        if plan is not None and plan.compresses(group, dtype):
            payload = codec(plan.codec.name).payload_bytes(numel, dtype)
            return payload / self.bytes_per_s, group.size * payload / self.bytes_per_s
        staged = numel * reduction_dtype(dtype).itemsize / self.bytes_per_s
        return staged, staged


@dataclass(frozen=True)
class Link:
    """One direction of a link.

    Args:
        bandwidth: bits per second a long transfer's payload moves at (its goodput: what a bulk
            transfer measures, headers of full packets already paid).
        latency_s: seconds per message, after its last byte.
        message_bytes: bytes each message costs on the link beyond its payload at ``bandwidth``: the
            transport's headers and acknowledgements and the collective library's own control
            messages. Negligible for megabyte messages, it is most of a small one's cost: gloo over
            TCP on the project's emulated cluster pays 700 to 900 bytes per message of an all-reduce
            (``benchmarks/harness/emulated_cluster.py``'s ``measure_message_bytes`` measures it).
    """

    bandwidth: float
    latency_s: float = 0.0
    message_bytes: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency_s < 0 or self.message_bytes < 0:
            raise ValueError(
                f"a link needs bandwidth > 0 bit/s, latency >= 0 s and message_bytes >= 0, got "
                f"bandwidth={self.bandwidth}, latency_s={self.latency_s}, message_bytes={self.message_bytes}"
            )

    def seconds(self, nbytes: float, messages: int, sharing: int = 1) -> float:
        """Time to send ``nbytes`` in ``messages`` sequential messages, the rate split ``sharing`` ways."""
        wire = nbytes + messages * self.message_bytes
        return 8.0 * wire * sharing / self.bandwidth + messages * self.latency_s


@dataclass(frozen=True)
class Network:
    """Nodes of ``local_world_size`` ranks; ``inter`` links nodes, ``intra`` ranks of one node.

    ``tree_latency``: all-reduces pay ``2 ceil(log2 k)`` latencies instead of a ring's ``2 (k - 1)``;
    ``sharing``: how transfers that overlap on a node's link split it.
    """

    inter: Link
    intra: Link = Link(100e9, 0.0)
    local_world_size: int = 1
    tree_latency: bool = False
    sharing: SharingModel = field(default_factory=SharingModel)

    def node(self, rank: int) -> int:
        return rank // self.local_world_size

    def messages(self, group_size: int) -> int:
        """Sequential messages of an all-reduce among ``group_size`` ranks."""
        if group_size <= 1:
            return 0
        if self.tree_latency:
            return 2 * math.ceil(math.log2(group_size))
        return 2 * (group_size - 1)

    def transfer(self, group: Group, sent: float) -> Transfer:
        """The ring all-reduce of ``group`` in which every member sends ``sent`` bytes, as a transfer.

        Its hops (member to the next in rank order) run in lock step; a hop between nodes crosses the
        sender's outgoing and the receiver's incoming link (:meth:`links`), a hop inside a node only
        the node's own ``intra`` link, which nothing else is taken to share. Each of the all-reduce's
        messages adds its link's ``message_bytes`` to the hop.
        """
        ranks = group.ranks
        hops = list(zip(ranks, ranks[1:] + ranks[:1], strict=True)) if group.size > 1 else []
        crossings: dict[SharedLink, int] = {}
        inside = not hops
        for a, b in hops:
            if self.node(a) == self.node(b):
                inside = True
                continue
            out, into = self.links(self.node(a))[0], self.links(self.node(b))[1]
            crossings[out] = crossings.get(out, 0) + 1
            crossings[into] = crossings.get(into, 0) + 1
        cap = self.intra.bandwidth if inside else math.inf
        link = self.inter if crossings else self.intra
        if crossings:
            cap = min(cap, self.inter.bandwidth)
        messages = self.messages(group.size)
        wire = sent + messages * link.message_bytes if sent else 0.0
        return Transfer(wire, tuple(crossings.items()), cap, messages * link.latency_s)

    def links(self, node: int) -> tuple[SharedLink, SharedLink]:
        """Node ``node``'s outgoing and incoming directions of its link to the switch."""
        return (
            SharedLink(("out", node), self.inter.bandwidth),
            SharedLink(("in", node), self.inter.bandwidth),
        )

    def allreduce_seconds(self, groups: Sequence[Group], sent: Sequence[float]) -> list[float]:
        """Seconds of each group's ring all-reduce when all of ``groups`` start at once.

        ``sent[i]``: bytes each member of ``groups[i]`` sends. Hops that leave or enter a node share its
        link while they run (:mod:`.sharing`).
        """
        transfers = [self.transfer(g, s) for g, s in zip(groups, sent, strict=True)]
        return transfer_seconds(transfers, model=self.sharing)


def gossip_round_bytes(
    group: Group, numel: int, plan: CompressionPlan | None = None, dtype: torch.dtype = torch.float32
) -> float:
    """Bytes a member of ``group`` sends in one round of ``numel`` parameters (the engine's rule).

    ``plan``: the topology's :class:`~decent_optim_wrapper.engine.wire.compression.CompressionPlan` when
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
