"""What one rank builds from its :class:`~.config.GossipConfig` before its first collective.

The topology, the flat buckets (with the sharded parameters' layout), low-communication gossip's
state, the compression and the second-moment rule, and the :class:`~.options.LocalLayout` every rank
must agree on. The engine builds these inside its cross-rank agreement, so that bad input on one
rank is an error on every rank instead of a hang (:func:`agree_on_parts`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.config import GossipConfig, GossipOptions, Placement
from decent_optim_wrapper.engine.exchange.buckets import Bucket, build_buckets, check_named_params
from decent_optim_wrapper.engine.exchange.shards import ShardLayout
from decent_optim_wrapper.engine.fleet.comm import agree, group_layout
from decent_optim_wrapper.engine.fleet.signatures import SignatureEntry
from decent_optim_wrapper.engine.fleet.world import GossipWorld, resolve_gossip_world
from decent_optim_wrapper.engine.options import (
    LocalLayout,
    check_layouts_agree,
    check_on_peer_failure,
    join_signature,
    resolve_host_staging,
    resolve_topology,
)
from decent_optim_wrapper.engine.rules.local_steps import LocalSteps, resolve_local_steps
from decent_optim_wrapper.engine.rules.pacing import resolve_pacing
from decent_optim_wrapper.engine.rules.second_moment import SecondMomentRule
from decent_optim_wrapper.engine.wire.compression import GossipCompression, resolve_compression
from decent_optim_wrapper.topo import Topology

__all__ = [
    "AgreedParts",
    "EngineParts",
    "NamedParams",
    "agree_on_parts",
    "build_parts",
    "check_pacing_composes",
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


def build_parts(
    named_params: NamedParams,
    world: GossipWorld,
    config: GossipConfig,
    *,
    params_as_views: bool,
    reverse_buckets: bool = False,
) -> EngineParts:
    """Check the options against the world and build the parts (:class:`~.config.GossipConfig` describes
    each option).

    Each part of ``config`` checked itself when it was built; here are the rules that need the world or
    combine parts, each by the check that names its cause (:func:`~.options.check_on_peer_failure`,
    :func:`check_pacing_composes`, :func:`~.options.resolve_host_staging`).
    """
    rounds, transport, elasticity = config.rounds, config.transport, config.elasticity
    check_on_peer_failure(
        elasticity.on_peer_failure, config.topology, world.subgroup, world.replicas is not None
    )
    rule = SecondMomentRule(config.second_moment)
    wire = resolve_compression(transport.compression)
    topo = resolve_topology(config.topology, world.world_size, world.local_world_size)
    paced = resolve_pacing(rounds.pacing)
    spec = resolve_local_steps(rounds.sync_every, rounds.sync_delay, rounds.outer_optimizer, paced)
    params, names = check_named_params(named_params() if callable(named_params) else named_params)
    shards = ShardLayout(params, names, world)
    if paced is not None:
        check_pacing_composes(
            rounds.pacing, elasticity.on_peer_failure, shards.sharded or world.replicas is not None
        )
    buckets = build_buckets(
        params, names, transport.bucket_cap_bytes, params_as_views, reverse=reverse_buckets
    )
    local = None if spec is None else LocalSteps(buckets, spec, shards.max_over_mesh)
    # The engine's own groups between nodes are gloo's; the others are the default group's backend.
    backend = "gloo" if world.replicas is not None else dist.get_backend()
    staged = resolve_host_staging(transport.host_staging, [b.data.device for b in buckets], backend)
    layout = LocalLayout(
        local_world_size=world.local_world_size,
        topology=(topo.name, topo.fingerprint()),
        parameters=parameter_entries(params, names),
        buckets=signatures(buckets),
        compression=wire,
        local_steps=None if local is None else local.agreement(),
        on_peer_failure=elasticity.on_peer_failure,
        groups=group_layout(topo, world),
        host_staging=staged,
        options=config.agreed(),
    )
    return EngineParts(topo, buckets, shards, local, wire, rule, layout)


@dataclass
class AgreedParts:
    """What every rank of a gossip world agreed on: the options, the world, each rank's layout, and
    this rank's parts."""

    config: GossipConfig
    world: GossipWorld
    reports: list[LocalLayout]
    parts: EngineParts


def agree_on_parts(
    named_params: NamedParams,
    given: GossipConfig | None,
    options: GossipOptions,
    *,
    context: str,
    params_as_views: bool,
    reverse_buckets: bool,
) -> AgreedParts:
    """Merge ``options`` into ``given``, build this rank's parts and agree on their layouts.

    Every rank of the job reaches the agreement's gather even if its own input is bad, so a refusal is
    an error everywhere rather than a hang; layouts are compared, per gossip world, before anything is
    broadcast.
    """
    try:
        config: GossipConfig | None = GossipConfig.merge(given, options)
        refused: BaseException | None = None
    except (TypeError, ValueError) as error:
        if not dist.is_initialized():
            raise
        # Refused on this rank only, perhaps: the agreement raises it here and names it on the others,
        # rather than leaving them waiting. The world is the one the options name, if any.
        config, refused = None, error
    placement = _placement(config if config is not None else given, options)
    world = resolve_gossip_world(
        placement.rank,
        placement.world_size,
        placement.local_world_size,
        placement.device_mesh,
        placement.process_group,
    )
    parts: list[EngineParts] = []

    def local_layout() -> LocalLayout:
        if refused is not None:
            raise refused
        assert config is not None
        built = build_parts(
            named_params, world, config, params_as_views=params_as_views, reverse_buckets=reverse_buckets
        )
        parts.append(built)
        return built.layout

    reports = agree(f"Building {context}", local_layout)
    check_layouts_agree(reports, world.ranks)
    assert config is not None
    return AgreedParts(config, world, reports, parts[0])


def _placement(config: GossipConfig | None, options: GossipOptions) -> Placement:
    """Where this rank gossips: the config's, or (when the options were refused) what they name of it."""
    if config is not None:
        return config.placement
    names = {f.name for f in fields(Placement)}
    return Placement(**{name: value for name, value in options.items() if name in names})  # type: ignore[arg-type]


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
