"""The setting that hides the exchange on a given network: the planner's answer to "which options?".

Rule: among the candidate settings of one topology (per-step gossip and low-communication gossip
with a round every ``H`` steps, uncompressed and in the wire formats below), take the one that **sends
the most per step** whose predicted throughput is at least ``target`` of training without
communication. Sending more per step is the better loss on every measurement of the project's language
model and classification tasks: per-step before periodic, a short period before a long one,
fp32 before bf16 before int8 before sparse formats, and at one period a round folded one step late
(``sync_delay=1``) before a round overlapped whole (``sync_delay=H``, 1.22x DDP's loss against
1.10x with the language model at ``H = 8``). Ties in bytes go to the shorter period, then the shorter
delay. Step times come from the planner's simulation (:func:`~.simulator.simulate`, the cost model of
:mod:`.costs`); a candidate that cannot reach the target even with its exchange perfectly hidden
(its bytes over the node's link take longer than ``compute / target``) is not simulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from decent_optim_wrapper.engine.wire.compression import parse_compression
from decent_optim_wrapper.plan.compute import ComputeTimes
from decent_optim_wrapper.plan.costs import HostCopy, Network, ddp_buckets
from decent_optim_wrapper.plan.schemes import allreduce_scheme, gossip_scheme
from decent_optim_wrapper.plan.simulator import NoComm, Scheme, simulate
from decent_optim_wrapper.plan.traffic import bytes_per_parameter
from decent_optim_wrapper.topo import TopologyFactory

__all__ = ["FORMATS", "PERIODS", "Candidate", "Recommendation", "candidates", "recommend"]

#: Wire formats tried, uncompressed (None) first; the sparse ones send about 1/13 and 1/64 of fp32's
#: bytes (indices included).
FORMATS: tuple[str | None, ...] = (None, "bf16", "int8", "int4", "topk:0.05:int4", "topk:0.01:int2")
#: Periods tried (``sync_every``); 1 is per-step gossip.
PERIODS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Candidate:
    """One setting: gossip on ``topology`` in ``compression`` (None: fp32), a round every
    ``sync_every`` steps folded ``sync_delay`` steps after its launch."""

    topology: str
    compression: str | None
    sync_every: int
    sync_delay: int
    sent_bytes: float  # per rank and step

    @property
    def method(self) -> str:
        """Its name as the planner and the benchmarks write it (``ring``, ``ring~h8d1@int8``)."""
        period = "" if self.sync_every == 1 else f"~h{self.sync_every}d{self.sync_delay}"
        return f"{self.topology}{period}" + (f"@{self.compression}" if self.compression else "")

    def options(self) -> dict[str, Any]:
        """The keyword arguments of :class:`~decent_optim_wrapper.DecentOptimWrapper` (and of
        the module front-end) for this setting; the defaults are left out."""
        options: dict[str, Any] = {"topology": self.topology}
        if self.compression is not None:
            options["compression"] = self.compression
        if self.sync_every > 1:
            options["sync_every"] = self.sync_every
            if self.sync_delay != self.sync_every:  # the default delay is a whole round
                options["sync_delay"] = self.sync_delay
        return options


@dataclass(frozen=True)
class Recommendation:
    """What :func:`recommend` found.

    Attributes:
        chosen: the setting to use: the first of ``tried`` that reaches the target, else the fastest.
        hides: whether ``chosen`` reaches the target throughput.
        throughput: ``chosen``'s predicted throughput against no communication (1.0: all hidden).
        ddp_throughput: DDP's (fp32 gradients) on the same network, for comparison.
        tried: every simulated candidate with its throughput, in the rule's order.
        target: the throughput asked for.
        ruled_out: candidates not simulated: their bytes alone take longer than ``compute / target``
            on a node's link.
    """

    chosen: Candidate
    hides: bool
    throughput: float
    ddp_throughput: float
    tried: tuple[tuple[Candidate, float], ...]
    target: float
    ruled_out: int = 0


def candidates(topology: str, model_bytes: float, nodes: int, local_world_size: int = 1) -> list[Candidate]:
    """Every setting of ``topology`` the rule considers, most bytes per step first (see the module)."""
    built = TopologyFactory.create(topology, nodes * local_world_size, local_world_size)
    numel = int(model_bytes // 4)
    found = []
    for wire_format in FORMATS:
        compression = None if wire_format is None else parse_compression(wire_format)
        per_round = bytes_per_parameter(built, compression) * numel
        for every in PERIODS:
            for delay in sorted({1, every}):
                found.append(Candidate(topology, wire_format, every, delay, per_round / every))
    return sorted(found, key=lambda c: (-c.sent_bytes, c.sync_every, c.sync_delay))


def recommend(
    model_bytes: float,
    compute: ComputeTimes,
    network: Network,
    nodes: int,
    topology: str = "ring",
    target: float = 0.9,
    overhead_s: float = 0.0,
    host_copy: HostCopy | None = None,
    steps: int = 40,
    warmup: int = 10,
    formats: Sequence[str | None] | None = None,
) -> Recommendation:
    """The setting that sends the most per step while the exchange stays hidden (see the module).

    Args:
        model_bytes: bytes of the fp32 parameters.
        compute: every rank's compute time per step.
        network: links and ranks per node.
        nodes: number of nodes.
        topology: a registered topology's name.
        target: the throughput against no communication to reach, in ``(0, 1]``.
        overhead_s, host_copy: as for :func:`~.predict.predict`.
        steps, warmup: simulated steps (a low-communication candidate is simulated for at least 8
            rounds after ``warmup``); the mean over the steps after ``warmup`` is taken.
        formats: restrict the wire formats tried (None in it: uncompressed); default :data:`FORMATS`.
    """
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target must be in (0, 1] (a share of no communication's speed), got {target}")
    ranks = nodes * network.local_world_size
    nocomm_s = simulate(NoComm(ranks, overhead_s), compute, steps).iteration_s(warmup)
    ddp: Scheme = allreduce_scheme(ranks, network, ddp_buckets(model_bytes), overhead_s=overhead_s)
    ddp_throughput = nocomm_s / simulate(ddp, compute, steps).iteration_s(warmup)
    built = TopologyFactory.create(topology, ranks, network.local_world_size)
    allowed = FORMATS if formats is None else tuple(formats)
    considered = [
        c
        for c in candidates(topology, model_bytes, nodes, network.local_world_size)
        if c.compression in allowed
    ]
    if not considered:
        raise ValueError(f"formats={list(allowed)!r} names none of the formats tried: {list(FORMATS)!r}")

    def throughput_of(candidate: Candidate) -> float:
        compression = None if candidate.compression is None else parse_compression(candidate.compression)
        scheme = gossip_scheme(
            built,
            int(model_bytes // 4),
            network,
            compression,
            overhead_s,
            sync_every=candidate.sync_every,
            sync_delay=candidate.sync_delay,
            host_copy=host_copy,
        )
        horizon = max(steps, warmup + 8 * candidate.sync_every)
        return nocomm_s / simulate(scheme, compute, horizon).iteration_s(warmup)

    tried: list[tuple[Candidate, float]] = []
    ruled_out = 0
    for candidate in considered:
        # With one rank per node every round crosses the node's link, so its bytes take at least this
        # long there: a bound no simulation can beat.
        if network.local_world_size == 1 and 8 * candidate.sent_bytes / network.inter.bandwidth > (
            nocomm_s / target
        ):
            ruled_out += 1
            continue
        tried.append((candidate, throughput_of(candidate)))
        if tried[-1][1] >= target:
            return Recommendation(
                candidate, True, tried[-1][1], ddp_throughput, tuple(tried), target, ruled_out
            )
    if not tried:  # even the fewest bytes cannot be hidden: say how close they get
        fewest = min(considered, key=lambda c: (c.sent_bytes, -c.sync_delay))
        tried.append((fewest, throughput_of(fewest)))
    best, throughput = max(tried, key=lambda pair: pair[1])
    return Recommendation(best, False, throughput, ddp_throughput, tuple(tried), target, ruled_out)
