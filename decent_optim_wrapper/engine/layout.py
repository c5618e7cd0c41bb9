"""What one rank builds from the engine's options before its first collective: :func:`build_parts`.

The topology, the flat buckets (with the sharded parameters' layout), low-communication gossip's
state, the compression and the second-moment rule, and the :class:`~.options.LocalLayout` every rank
must agree on. The engine builds these inside its cross-rank agreement, so that bad input on one
rank is an error on every rank instead of a hang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.exchange.buckets import Bucket, build_buckets, check_named_params
from decent_optim_wrapper.engine.exchange.clipping import ClippedGossipSpec, resolve_clipped_gossip
from decent_optim_wrapper.engine.exchange.shards import ShardLayout
from decent_optim_wrapper.engine.fleet.admission import SignatureEntry
from decent_optim_wrapper.engine.fleet.comm import group_layout
from decent_optim_wrapper.engine.fleet.world import GossipWorld
from decent_optim_wrapper.engine.options import (
    LocalLayout,
    TopologySpec,
    check_on_peer_failure,
    resolve_host_staging,
    resolve_topology,
)
from decent_optim_wrapper.engine.rules.local_steps import LocalSteps, OuterFactory, resolve_local_steps
from decent_optim_wrapper.engine.rules.pacing import PacingSpec, resolve_pacing
from decent_optim_wrapper.engine.rules.second_moment import SecondMomentRule
from decent_optim_wrapper.engine.wire.compression import (
    CompressionSpec,
    GossipCompression,
    resolve_compression,
)
from decent_optim_wrapper.topo import Topology

__all__ = [
    "EngineParts",
    "NamedParams",
    "build_parts",
    "check_pacing_composes",
    "check_tracking_composes",
    "join_signature",
    "parameter_entries",
    "signatures",
]

#: ``(name, parameter)`` pairs, or a function returning them (run inside the agreement).
NamedParams = Sequence[tuple[str, torch.Tensor]] | Callable[[], Sequence[tuple[str, torch.Tensor]]]


@dataclass
class EngineParts:
    """One rank's engine before any communication."""

    topology: Topology
    buckets: list[Bucket]
    shards: ShardLayout
    local: LocalSteps | None
    compression: GossipCompression | None
    second_moment: SecondMomentRule
    layout: LocalLayout


def join_signature(layout: LocalLayout) -> tuple[tuple[str, object], ...]:
    """What a worker joining a running job must share with its members, field by field (not the
    topology's schedule or groups: those follow the world size). The parameters come before the
    buckets they are laid out in, so that a model that differs is named by its first parameter."""
    return (
        ("topology", layout.topology[0]),
        ("parameters", layout.parameters),
        ("buckets", layout.buckets),
        ("compression", layout.compression),
        ("gradient_tracking", layout.gradient_tracking),
        ("low_communication", layout.local_steps),
        ("second_moment", layout.second_moment),
        ("host_staging", layout.host_staging),
        ("clipped_gossip", layout.clipped_gossip),
    )


def build_parts(
    named_params: NamedParams,
    world: GossipWorld,
    *,
    topology: TopologySpec,
    bucket_cap_bytes: int,
    params_as_views: bool,
    compression: CompressionSpec,
    gradient_tracking: bool,
    sync_every: int,
    sync_delay: int | None,
    outer_optimizer: OuterFactory | None,
    on_peer_failure: str,
    second_moment: str,
    pacing: PacingSpec = None,
    reverse_buckets: bool = False,
    host_staging: bool | None = None,
    clipped_gossip: ClippedGossipSpec = None,
) -> EngineParts:
    """Check the options and build the parts (the engine's docstring describes each option).

    Each option is checked alone first, then the combinations that are refused, each by the check that
    names its cause (:func:`check_tracking_composes`, :func:`check_pacing_composes`).
    """
    check_on_peer_failure(on_peer_failure, topology, world.subgroup, world.replicas is not None)
    clipped = resolve_clipped_gossip(clipped_gossip)
    rule = SecondMomentRule(second_moment)
    wire = resolve_compression(compression)
    topo = resolve_topology(topology, world.world_size, world.local_world_size)
    paced = resolve_pacing(pacing)
    spec = resolve_local_steps(sync_every, sync_delay, outer_optimizer, paced)
    check_tracking_composes(gradient_tracking, pacing, sync_every, sync_delay, outer_optimizer)
    params, names = check_named_params(named_params() if callable(named_params) else named_params)
    shards = ShardLayout(params, names, world)
    if paced is not None:
        check_pacing_composes(pacing, on_peer_failure, shards.sharded or world.replicas is not None)
    buckets = build_buckets(params, names, bucket_cap_bytes, params_as_views, reverse=reverse_buckets)
    local = None if spec is None else LocalSteps(buckets, spec, shards.max_over_mesh)
    # The engine's own groups between nodes are gloo's; the others are the default group's backend.
    backend = "gloo" if world.replicas is not None else dist.get_backend()
    staged = resolve_host_staging(host_staging, [b.data.device for b in buckets], backend)
    layout = LocalLayout(
        world.local_world_size,
        (topo.name, topo.fingerprint()),
        signatures(buckets),
        wire,
        gradient_tracking,
        None if local is None else local.agreement(),
        on_peer_failure,
        second_moment,
        group_layout(topo, world),
        parameter_entries(params, names),
        staged,
        clipped,
    )
    return EngineParts(topo, buckets, shards, local, wire, rule, layout)


def check_tracking_composes(
    gradient_tracking: bool, pacing: object, sync_every: int, sync_delay: int | None, outer_optimizer: object
) -> None:
    """Refuse gradient tracking with paced rounds or low-communication gossip (options checked alone).

    The trackers are gossiped after every step; paced rounds and low-communication gossip exchange
    once per round. Paced rounds are named first: they use rounds whatever ``sync_every`` is.
    """
    if not gradient_tracking:
        return
    if pacing is not None:
        raise ValueError(
            f"pacing={pacing!r} cannot be combined with gradient_tracking=True: the trackers are gossiped "
            "after every step, but paced ranks take different numbers of steps per round. Pass "
            "pacing=None to track gradients, or gradient_tracking=False to pace the rounds."
        )
    rounds = [
        f"{name}={value!r}"
        for name, value, default in (
            ("sync_every", sync_every, 1),
            ("sync_delay", sync_delay, None),
            ("outer_optimizer", outer_optimizer, None),
        )
        if value != default
    ]
    if rounds:
        raise ValueError(
            f"gradient_tracking=True cannot be combined with low-communication gossip ({', '.join(rounds)}): "
            "the trackers are gossiped after every step, low-communication gossip once per round. Pass "
            "gradient_tracking=False to keep the rounds, or leave sync_every=1, sync_delay=None and "
            "outer_optimizer=None (the defaults) to track gradients."
        )


def check_pacing_composes(pacing: object, on_peer_failure: str, sharded: bool) -> None:
    """Refuse what paced rounds cannot be combined with (yet), on every rank before any collective."""
    if sharded and on_peer_failure != "raise":
        raise ValueError(
            f"pacing={pacing!r} with on_peer_failure={on_peer_failure!r} is not supported yet for sharded "
            "replicas (decentralized HSDP, or a job of nodes started with init_elastic(..., shards=k)): the "
            "ranks of a replica plan their rounds together, which a recovery does not re-form yet. Pass "
            "on_peer_failure='raise' (the default) with pacing there, or pacing=None."
        )


def parameter_entries(params: Sequence[torch.Tensor], names: Sequence[str]) -> tuple[SignatureEntry, ...]:
    """Each parameter's shape (a sharded one's whole shape) and dtype, labelled by its name."""
    return tuple(
        SignatureEntry(f"parameter {name}", (("shape", tuple(param.shape)), ("dtype", str(param.dtype))))
        for param, name in zip(params, names, strict=True)
    )


def signatures(buckets: Sequence[Bucket]) -> tuple[object, ...]:
    """What must agree across ranks and checkpoints: each bucket's dtype, device type and shapes."""
    return tuple(b.signature() for b in buckets)
