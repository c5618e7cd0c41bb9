"""Predicted step time of DDP and of every topology's gossip for one model, cluster and network."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from decent_optim_wrapper.engine.wire.compression import GossipCompression, parse_compression
from decent_optim_wrapper.plan.compute import ComputeTimes
from decent_optim_wrapper.plan.costs import HostCopy, Network, ddp_buckets
from decent_optim_wrapper.plan.round_cost import RoundCost
from decent_optim_wrapper.plan.schemes import allreduce_scheme, gossip_scheme
from decent_optim_wrapper.plan.simulator import UNPACED_ROUNDS, Gossip, NoComm, Scheme, simulate
from decent_optim_wrapper.plan.traffic import bytes_per_parameter
from decent_optim_wrapper.topo import Topology, TopologyFactory

__all__ = ["Prediction", "predict"]


@dataclass(frozen=True)
class Prediction:
    """One method's simulated mean step time and the bytes a rank sends per step.

    A paced method's ranks take different numbers of steps, so its ``step_s`` is the fleet's: the
    ranks over their steps per second together (a rank's mean step time when the ranks are equal).
    """

    method: str
    step_s: float
    sent_bytes: float


def predict(
    model_bytes: float,
    compute: ComputeTimes,
    network: Network,
    nodes: int,
    topologies: Sequence[str] | None = None,
    compressions: Sequence[str] = ("bf16", "int8"),
    steps: int = 40,
    warmup: int = 10,
    overhead_s: float = 0.0,
    forward_fraction: float = 1 / 3,
    blocking: bool = False,
    local_steps: Sequence[tuple[int, int]] = (),
    round_costs: Callable[[GossipCompression | None, int], RoundCost] | None = None,
    paced: bool = False,
    host_copy: HostCopy | None = None,
) -> list[Prediction]:
    """Simulate ``steps`` steps of no communication, DDP (fp32 and bf16 gradients) and gossip.

    Args:
        model_bytes: bytes of the fp32 parameters.
        compute: every rank's compute time per step.
        network: links and ranks per node.
        nodes: number of nodes (``nodes * network.local_world_size`` ranks).
        topologies: registered topology names (default: all that build at this size).
        compressions: wire formats to try on every topology besides uncompressed (any name
            ``compression=`` accepts: ``"int8"``, ``"topk:0.01:int2"``).
        steps, warmup: simulated steps; the mean over the last ``steps - warmup`` is reported.
        overhead_s: CPU seconds per step besides compute (optimizer step, staging and mixing).
        forward_fraction: share of the compute in forward (DDP starts all-reducing in backward).
        blocking: also each gossip method with blocking rounds (``sync_every=1, sync_delay=0``),
            named with ``~h1d0`` after the method (``ring~h1d0``, ``ring@bf16~h1d0``).
        local_steps: ``(sync_every, sync_delay)`` pairs: also each gossip method as low-communication
            gossip with a round every ``sync_every`` steps, named as the benchmarks do
            (``ring~h8d1``, ``ring~h8d1@int8``); its bytes per step are a round's over ``sync_every``.
        round_costs: a round's own processor time for a wire format (None: uncompressed) and a
            group size (the topology's largest group), for instance
            :func:`~decent_optim_wrapper.plan.round_cost.measure_round_cost` on this machine; none if
            not given.
        paced: also each low-communication method with paced rounds (the engine's
            ``pacing="measured"``), named with a ``p`` after its period (``ring~h8d1p``,
            ``ring~h8d1p@int8``); its step time is the fleet's (:class:`Prediction`), timed after the
            rounds that cover ``warmup`` and at least the unpaced first rounds.
        host_copy: the model is on GPUs and gossips over gloo, staging its rounds through host memory
            at this rate (:class:`~decent_optim_wrapper.plan.costs.HostCopy`); DDP is taken to run on
            NCCL, without the copies.
    """
    ranks = nodes * network.local_world_size
    numel = int(model_bytes // 4)
    buckets = ddp_buckets(model_bytes, forward_fraction)
    results = [Prediction("nocomm", _mean(NoComm(ranks, overhead_s), compute, steps, warmup), 0.0)]
    for name, wire in (("ddp", 1.0), ("ddp-bf16", 0.5)):
        scheme: Scheme = allreduce_scheme(ranks, network, buckets, overhead_s=overhead_s, wire_fraction=wire)
        sent = 2 * (ranks - 1) / ranks * model_bytes * wire
        results.append(Prediction(name, _mean(scheme, compute, steps, warmup), sent))
    for topology in _topologies(topologies, ranks, network.local_world_size):
        for wire_format in (None, *compressions):
            compression = None if wire_format is None else parse_compression(wire_format)
            sent = bytes_per_parameter(topology, compression) * numel
            name = topology.name + (f"@{wire_format}" if wire_format else "")
            largest = max(g.size for phase in topology.schedule for g in phase)
            cost = None if round_costs is None or largest < 2 else round_costs(compression, largest)
            for blocks in (False, True) if blocking else (False,):
                scheme = gossip_scheme(
                    topology,
                    numel,
                    network,
                    compression,
                    overhead_s,
                    blocking=blocks,
                    round_cost=cost,
                    host_copy=host_copy,
                )
                label = name + ("~h1d0" if blocks else "")
                results.append(Prediction(label, _mean(scheme, compute, steps, warmup), sent))
            for every, delay in local_steps:
                scheme = gossip_scheme(
                    topology,
                    numel,
                    network,
                    compression,
                    overhead_s,
                    sync_every=every,
                    sync_delay=delay,
                    round_cost=cost,
                    host_copy=host_copy,
                )
                suffix = f"@{wire_format}" if wire_format else ""
                label = f"{topology.name}~h{every}d{delay}"
                # enough rounds for a steady state whatever the period
                horizon = max(steps, warmup + 8 * every)
                results.append(
                    Prediction(label + suffix, _mean(scheme, compute, horizon, warmup), sent / every)
                )
                if paced:
                    step_s = _fleet_step_s(replace(scheme, pacing=True), compute, horizon, warmup)
                    results.append(Prediction(f"{label}p{suffix}", step_s, sent / every))
    return results


def _topologies(names: Sequence[str] | None, ranks: int, local: int) -> list[Topology]:
    built = []
    for name in names or TopologyFactory.names():
        try:
            built.append(TopologyFactory.create(name, ranks, local))
        except ValueError:
            if names:  # asked for by name: say why it does not fit
                raise
    return built


def _mean(scheme: Scheme, compute: ComputeTimes, steps: int, warmup: int) -> float:
    return simulate(scheme, compute, steps).iteration_s(warmup)


def _fleet_step_s(scheme: Gossip, compute: ComputeTimes, steps: int, warmup: int) -> float:
    """Ranks over steps per second of a paced run: the rounds covering ``warmup`` steps (at least the
    unpaced ones) left out, then at least 8 rounds timed."""
    every = scheme.sync_every
    skip = max(UNPACED_ROUNDS, math.ceil(warmup / every))
    rounds = max(steps // every, skip + 8)
    return scheme.world_size / simulate(scheme, compute, rounds * every).steps_per_second(skip)
