"""Simulator schemes built from what a user knows: model size, topology, compression and network."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch

from decent_optim_wrapper.engine.wire.compression import CompressionPlan, GossipCompression
from decent_optim_wrapper.plan.costs import HostCopy, Network, ddp_buckets, gossip_round_bytes
from decent_optim_wrapper.plan.round_cost import RoundCost
from decent_optim_wrapper.plan.sharing import Transfer
from decent_optim_wrapper.plan.simulator import AllReduce, Gossip
from decent_optim_wrapper.topo import Topology
from decent_optim_wrapper.topo.group import Group
from decent_optim_wrapper.topo.mixing import allreduce_models_sent

__all__ = ["allreduce_scheme", "gossip_scheme"]


def gossip_scheme(
    topology: Topology,
    numel: int,
    network: Network,
    compression: GossipCompression | None = None,
    overhead_s: float = 0.0,
    dtype: torch.dtype = torch.float32,
    blocking: bool = False,
    sync_every: int = 1,
    sync_delay: int = 1,
    round_cost: RoundCost | None = None,
    pacing: bool = False,
    host_copy: HostCopy | None = None,
) -> Gossip:
    """Gossip on ``topology`` of a model of ``numel`` parameters of ``dtype``: a round every
    ``sync_every`` steps, folded in ``sync_delay`` steps later; ``blocking``: each round mixed in
    before the next forward (``sync_delay=0``); ``round_cost``: a round's own processor time on a
    member (:func:`~decent_optim_wrapper.plan.round_cost.measure_round_cost`), none if not given;
    ``pacing``: paced rounds, each rank taking as many steps per round as its speed allows (the
    engine's ``pacing="measured"``); ``host_copy``: the model is on a GPU and its rounds are staged
    through host memory at that rate (the largest group of the schedule sets the copies' seconds)."""
    if network.local_world_size != topology.local_world_size:
        raise ValueError(
            f"network.local_world_size={network.local_world_size} differs from the topology's "
            f"local_world_size={topology.local_world_size}; build both with the same ranks per node"
        )
    plan = None if compression is None else CompressionPlan(topology, compression)

    @cache
    def phase_rounds(index: int) -> tuple[Transfer, ...]:
        return tuple(
            network.transfer(group, gossip_round_bytes(group, numel, plan, dtype))
            for group in topology.schedule[index]
        )

    stage_out_s = stage_in_s = 0.0
    if host_copy is not None:
        largest = max((g for phase in topology.schedule for g in phase), key=lambda g: g.size)
        stage_out_s, stage_in_s = host_copy.staged_seconds(largest, numel, plan, dtype)
    return Gossip(
        world_size=topology.world_size,
        phase=topology.phase,
        rounds=lambda step: phase_rounds(step % topology.period),
        overhead_s=overhead_s,
        sharing=network.sharing,
        blocking=blocking,
        sync_every=sync_every,
        sync_delay=sync_delay,
        encode_s=0.0 if round_cost is None else round_cost.encode_s,
        fold_s=0.0 if round_cost is None else round_cost.fold_s,
        pacing=pacing,
        stage_out_s=stage_out_s,
        stage_in_s=stage_in_s,
    )


def allreduce_scheme(
    world_size: int,
    network: Network,
    buckets: Sequence[tuple[float, float]] | None = None,
    model_bytes: float = 0.0,
    overhead_s: float = 0.0,
    wire_fraction: float = 1.0,
) -> AllReduce:
    """DDP on ``world_size`` ranks; ``buckets``: ``(bytes, ready_fraction)``, else DDP's own.

    ``wire_fraction``: bytes on the wire per gradient byte (0.5 with torch's ``bf16_compress_hook`` on
    fp32 gradients).
    """
    if buckets is None:
        buckets = ddp_buckets(model_bytes)
    world = Group(tuple(range(world_size)))
    sent = allreduce_models_sent(world_size) * wire_fraction
    seconds = [(network.allreduce_seconds([world], [sent * nbytes])[0], f) for nbytes, f in buckets]
    return AllReduce(world_size=world_size, buckets=seconds, overhead_s=overhead_s)
