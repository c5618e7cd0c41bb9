"""The engine's options: their checks, and what every rank must agree on before communicating.

Everything here runs before the first collective, so bad input is a clear error (on every rank,
through :func:`~.comm.agree`) instead of a hang.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper.checks import is_real
from decent_optim_wrapper.engine.fleet.comm import GroupLayout, check_identical
from decent_optim_wrapper.engine.fleet.signatures import SignatureEntry
from decent_optim_wrapper.engine.wire.compression import GossipCompression
from decent_optim_wrapper.topo import Topology, TopologyFactory

__all__ = [
    "DEFAULT_TIMEOUT",
    "LocalLayout",
    "TopologySpec",
    "PEER_FAILURE_MODES",
    "check_bucket_cap",
    "check_buckets_agree",
    "check_layouts_agree",
    "check_mixing_factor",
    "check_host_staging",
    "check_on_peer_failure",
    "check_peer_failure_mode",
    "check_timeout",
    "join_signature",
    "resolve_host_staging",
    "resolve_topology",
]

#: How long gossip and global averaging wait for a peer before raising, unless ``timeout`` says
#: otherwise. Well under gloo's 30 minutes, yet long enough for a peer's slow first step (compile).
DEFAULT_TIMEOUT = timedelta(minutes=10)

#: What a ``topology`` argument may be: a registered name, a Topology subclass, or an instance.
TopologySpec = str | type[Topology] | Topology


def _agreed(what: str, fix: str, *, join: str | None = None) -> dict[str, Any]:
    """The metadata of a field of :class:`LocalLayout` the ranks compare: ``what`` differs, and the fix;
    ``join``: the name a joiner's signature gives it (None: a joiner need not share it)."""
    return {"agree": (what, fix), "join": join}


@dataclass(frozen=True, kw_only=True)
class LocalLayout:
    """What every rank must agree on before the first collective, compared field by field.

    Each field says whether the ranks compare it (with the message naming what differs and the fix) and
    under which name a joiner must share it: :data:`AGREEMENT` and :func:`join_signature` are read from
    these fields, so a new option that ranks must agree on is one field here.
    """

    local_world_size: int = field(
        metadata=_agreed("local_world_size", "Pass the same local_world_size on every rank.")
    )
    # The topology's name and schedule fingerprint; a joiner shares the name (the schedule follows the size).
    topology: tuple[str, object] = field(
        metadata=_agreed("The topology", "Pass the same topology on every rank.", join="topology")
    )
    # Each parameter's name, shape and dtype, in the given order: named in a joiner's rejection, before the
    # buckets, so that a model that differs is named by its first parameter. Not compared across ranks (the
    # buckets are), so that names alone never make ranks disagree.
    parameters: tuple[SignatureEntry, ...] = field(default=(), metadata={"join": "parameters"})
    buckets: tuple[object, ...] = field(  # each bucket's signature
        metadata=_agreed(
            "The bucket layout (parameter shapes, dtypes, devices or bucket_cap_mb)",
            "Build the same model and optimizer (same param_groups order) with the same bucket_cap_mb on "
            "every rank.",
            join="buckets",
        )
    )
    compression: GossipCompression | None = field(
        default=None,
        metadata=_agreed(
            "compression", "Pass the same compression argument on every rank.", join="compression"
        ),
    )
    # sync_every, sync_delay, the outer optimizer's class, ...
    local_steps: tuple[object, ...] | None = field(
        default=None,
        metadata=_agreed(
            "Low-communication gossip (sync_every, sync_delay, the outer optimizer's class, groups, "
            "defaults)",
            "Pass the same sync_every, sync_delay and outer_optimizer on every rank.",
            join="low_communication",
        ),
    )
    on_peer_failure: str = field(
        default="raise", metadata=_agreed("on_peer_failure", "Pass the same on_peer_failure on every rank.")
    )
    # The gossip world's members and its topology's groups, in global ranks (compared by membership).
    groups: GroupLayout = ((), ())
    # Whether gossip goes through host buffers (its groups are formed apart): the whole job agrees on it.
    host_staging: bool = field(
        default=False,
        metadata=_agreed(
            "Host staging (host_staging, the buckets' devices and the backend)",
            "Pass the same host_staging, and put the model on the same kind of device, on every rank.",
            join="host_staging",
        ),
    )
    # The options the config marks as agreed (GossipConfig.agreed: gradient_tracking, second_moment,
    # clipped_gossip, ...), by name: each compared on its own, and shared by a joiner under its name.
    options: tuple[tuple[str, object], ...] = ()


#: (field, what differs, the fix) for each field of LocalLayout the ranks compare, in the order they are
#: checked (the fields' order).
AGREEMENT = tuple((f.name, *f.metadata["agree"]) for f in fields(LocalLayout) if "agree" in f.metadata)


def join_signature(layout: LocalLayout) -> tuple[tuple[str, object], ...]:
    """What a worker joining a running job must share with its members, field by field (not the
    topology's schedule or groups: those follow the world size)."""
    own = tuple(
        (f.metadata["join"], _joined_value(f.name, getattr(layout, f.name)))
        for f in fields(LocalLayout)
        if f.metadata.get("join") is not None
    )
    return (*own, *layout.options)


def _joined_value(name: str, value: object) -> object:
    # The topology's name only: its schedule and fingerprint follow the world size, which a join changes.
    return value[0] if name == "topology" else value  # type: ignore[index]


def _agreement(name: str) -> tuple[str, str, str]:
    return next(entry for entry in AGREEMENT if entry[0] == name)


def check_layouts_agree(reports: list[LocalLayout], members: tuple[int, ...]) -> None:
    """Raise a ``ValueError`` naming the field if the layouts of the gossip world ``members`` differ.

    ``reports`` holds every rank of the job's, in global rank order; every gossip world must hold
    exactly the ranks that name it (ranks passing device meshes or process groups that overlap
    would gossip in groups some members do not know of).
    """
    for rank, report in enumerate(reports):
        world = report.groups[0]
        if rank not in world or any(reports[other].groups[0] != world for other in world):
            raise ValueError(
                f"rank {rank} gossips over ranks {list(world)}, but "
                + (
                    "is not one of them"
                    if rank not in world
                    else f"ranks {[o for o in world if reports[o].groups[0] != world]} name other groups"
                )
                + ". Pass device_mesh= the same mesh dimension (or process_group= matching groups) on "
                "every rank, so that the gossip groups split the job."
            )
    for name, what, fix in AGREEMENT:
        check_identical(what, [getattr(reports[r], name) for r in members], fix)
    for position, (option, _) in enumerate(reports[members[0]].options):
        values = [reports[r].options[position][1] for r in members]
        check_identical(option, values, f"Pass the same {option} on every rank.")
    # Every gossip world's groups are created by the whole job, more of them when staging: the job agrees.
    _, what, fix = _agreement("host_staging")
    check_identical(what, [report.host_staging for report in reports], fix)


def check_buckets_agree(signatures: list[tuple[object, ...]]) -> None:
    """Raise the same ``ValueError`` on every rank if the ranks' new buckets differ."""
    _, what, fix = _agreement("buckets")
    check_identical(what, signatures, fix)


def check_mixing_factor(factor: object) -> float:
    """The mixing (adaptive) factor ``a`` in (0, 1], as a float; raises on anything else."""
    if not is_real(factor):
        raise TypeError(f"the mixing (adaptive) factor must be a number in (0, 1], got {factor!r}.")
    if not 0.0 < factor <= 1.0:
        raise ValueError(
            f"the mixing (adaptive) factor must lie in (0, 1], got {factor!r}: 1 mixes fully, smaller "
            "values keep part of the replica (x <- (1 - a) x + a W x); 0 would never mix."
        )
    return float(factor)


def resolve_topology(topology: TopologySpec, world_size: int, local_world_size: int) -> Topology:
    """Build (or check) the topology for this run and validate its schedule, before any communication."""
    if isinstance(topology, str):
        topo = TopologyFactory.create(topology, world_size, local_world_size)
    elif isinstance(topology, type) and issubclass(topology, Topology):
        topo = topology(world_size, local_world_size)
    elif isinstance(topology, Topology):
        topo = topology
        if topo.world_size != world_size or topo.local_world_size != local_world_size:
            raise ValueError(
                f"topology {topo!r} was built for world_size={topo.world_size}, "
                f"local_world_size={topo.local_world_size}, but this run has world_size={world_size}, "
                f"local_world_size={local_world_size}; build it with the run's sizes or pass its name."
            )
    else:
        raise TypeError(
            f"topology must be a name, a Topology subclass or a Topology instance, got {topology!r}. "
            f"Registered names: {', '.join(TopologyFactory.names())}."
        )
    _ = topo.schedule  # validate now, before any communication
    return topo


def resolve_host_staging(requested: object, devices: Iterable[torch.device], backend: str) -> bool:
    """Whether gossip rounds go through host buffers (:mod:`~.exchange.staging`).

    ``None`` (default): when a bucket lives on an accelerator and the gossip groups are gloo's, which
    moves host memory; ``True`` forces it (also for CPU buckets: the same path, for comparison);
    ``False`` leaves device tensors to the backend.
    """
    check_host_staging(requested)
    if requested is None:
        return backend == "gloo" and any(device.type != "cpu" for device in devices)
    if requested and backend != "gloo":
        raise ValueError(
            f"host_staging=True stages gossip through host memory for gloo, but the gossip groups use "
            f"{backend!r}, which sends device memory itself; pass host_staging=None (the default)."
        )
    return bool(requested)


def check_host_staging(requested: object) -> None:
    if requested is not None and not isinstance(requested, bool):
        raise TypeError(
            f"host_staging must be None (stage device buckets over gloo), True or False, got {requested!r}."
        )


def check_bucket_cap(bucket_cap_mb: object) -> None:
    if not is_real(bucket_cap_mb):
        raise TypeError(f"bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r}; e.g. 25.")
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}; e.g. 25.")


def check_timeout(timeout: object) -> None:
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout must be a positive datetime.timedelta, got {timeout!r}; e.g. timedelta(minutes=5)."
        )
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout!r}; e.g. timedelta(minutes=5).")


#: What ``on_peer_failure`` may be: raise :class:`~.errors.GossipError` (the default), or go on with the
#: survivors.
PEER_FAILURE_MODES = ("raise", "continue")


def check_peer_failure_mode(mode: object) -> None:
    if mode not in PEER_FAILURE_MODES:
        raise ValueError(
            f'on_peer_failure must be "raise" (stop with an error, the default) or "continue" (go on with '
            f"the survivors), got {mode!r}."
        )


def check_on_peer_failure(
    mode: object,
    topology: object,
    subgroup: bool = False,
    replicas: bool = False,
    backend: str | None = None,
) -> None:
    """Check ``on_peer_failure``; "continue" needs the whole job as the gossip world (the survivors
    re-form the default group) or a job of nodes (``replicas``: they re-form their shard worlds), a
    topology that can be rebuilt at any size, and gloo (``backend``: the default process group's if
    None)."""
    check_peer_failure_mode(mode)
    if mode == "raise":
        return
    if subgroup and not replicas:  # a job of nodes re-forms its shard worlds, never the default group
        raise ValueError(
            'on_peer_failure="continue" re-forms the job\'s default process group over the survivors, '
            "which a device_mesh or process_group (and the sharding beside it) cannot follow; use "
            'on_peer_failure="raise" with device_mesh/process_group and resume from checkpoints.'
        )
    if isinstance(topology, Topology):
        raise ValueError(
            f'on_peer_failure="continue" rebuilds the topology for the survivors, but topology={topology!r} '
            "is an instance built for one world size; pass its registered name or its class instead."
        )
    if replicas:
        return  # a job of nodes: the groups between nodes are the engine's gloo groups; the node may be NCCL
    backend = dist.get_backend() if backend is None else backend
    if backend != "gloo":
        raise ValueError(
            f'on_peer_failure="continue" re-forms the default process group on gloo, but it uses '
            f"{backend!r}. On GPU nodes start the job with init_elastic (gloo between the processes, "
            "the model on its GPU; or shards=k: NCCL inside each node, gloo between nodes), or keep "
            'this group and use on_peer_failure="raise" with restarts from checkpoints.'
        )
