"""The ranks one rank gossips with: the whole job (the default), or one dimension of a device mesh.

With ``device_mesh=`` (a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh`, e.g. ``mesh["replicate"]``)
or ``process_group=``, as :class:`~torch.nn.parallel.DistributedDataParallel` names them, a rank gossips
only with the members of that group: under decentralized HSDP, the ranks that hold the same shard of the
model on the other nodes. The topology is built for the group's size, and its rank ``i`` is the group's
``i``-th member. :class:`GossipWorld` holds that translation; every other part of the engine speaks in
ranks of the gossip world.

In a job started with ``init_elastic(..., shards=k)`` the gossip world is this rank's shard world
(:mod:`~.replicas`): rank ``s`` of every node, numbered by node, whatever the default group (the node).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist
from loguru import logger
from torch.distributed.device_mesh import DeviceMesh

from decent_optim_wrapper.checks import is_int
from decent_optim_wrapper.engine.fleet.jobs import current_job
from decent_optim_wrapper.engine.fleet.replicas import ReplicaWorld

__all__ = ["GossipWorld", "check_job_of_nodes", "members_per_node", "resolve_gossip_world"]


@dataclass(frozen=True)
class GossipWorld:
    """The members of this rank's gossip world, in its rank order, and where this rank stands.

    Attributes:
        ranks: the members' global ranks, ascending; the topology's rank ``i`` is ``ranks[i]``.
        rank: this process's rank inside the gossip world.
        local_world_size: members per node, along the gossip world.
        subgroup: whether the world is a ``device_mesh``/``process_group`` (False: the whole job).
        replicas: in a decentralized-HSDP elastic job, the shard world (ranks are its nodes).
    """

    ranks: tuple[int, ...]
    rank: int
    local_world_size: int
    subgroup: bool = False
    replicas: ReplicaWorld | None = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def global_ranks(self, ranks: tuple[int, ...]) -> tuple[int, ...]:
        """The global ranks of gossip-world ``ranks``."""
        return tuple(self.ranks[r] for r in ranks)


def resolve_gossip_world(
    rank: int | None,
    world_size: int | None,
    local_world_size: int | None,
    device_mesh: DeviceMesh | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> GossipWorld:
    """This rank's gossip world, with ``rank``, ``world_size`` and ``local_world_size`` checked against it.

    ``rank`` and ``world_size`` default to the gossip world's (the whole job's without a group);
    ``local_world_size`` defaults to how many members share a node, from torchrun's
    ``LOCAL_WORLD_SIZE`` (nodes hold consecutive global ranks), else 1.
    """
    if device_mesh is not None and process_group is not None:
        raise ValueError(
            "Pass device_mesh or process_group, not both: each names the group to gossip along "
            '(device_mesh=mesh["replicate"] is process_group=mesh["replicate"].get_group()); keep one.'
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized. Call torch.distributed.init_process_group() first "
            "(launch with torchrun, or set MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE)."
        )
    job = current_job()
    replicas = None if job is None else job.replicas
    if replicas is not None:
        check_job_of_nodes(replicas.shards, device_mesh, process_group, local_world_size)
        members, me, subgroup = tuple(range(replicas.nodes)), replicas.node, True
    else:
        group_members = _members(device_mesh, process_group)
        subgroup = group_members is not None
        members = group_members if group_members is not None else tuple(range(dist.get_world_size()))
        me = members.index(dist.get_rank())
    for name, given, actual in (("rank", rank, me), ("world_size", world_size, len(members))):
        if given is None:
            continue
        if not is_int(given):
            raise TypeError(f"{name} must be an int or None, got {given!r}.")
        if given != actual:
            where = "the gossip group (device_mesh/process_group)" if subgroup else "torch.distributed"
            where = "the job's replicas (init_elastic(..., shards=))" if replicas else where
            raise ValueError(
                f"{name}={given} disagrees with {where}, which gives {name}={actual}. "
                f"Pass {name}={actual} or leave it out."
            )
    if replicas is not None or (job is not None and job.joining and not subgroup):
        # A job of nodes gossips between nodes; a joiner is a world of one until admitted, whatever
        # LOCAL_WORLD_SIZE its launcher set (the members place it in their topology when it is).
        per_node = 1
    else:
        per_node = _local_world_size(local_world_size, members, subgroup)
    return GossipWorld(members, me, per_node, subgroup, replicas)


def check_job_of_nodes(
    shards: int, device_mesh: object, process_group: object, local_world_size: object
) -> None:
    """Refuse what a job of nodes (``init_elastic(..., shards=k)``) sets by itself: the gossip group and
    the members per node."""
    if device_mesh is not None or process_group is not None:
        given = "device_mesh" if device_mesh is not None else "process_group"
        raise ValueError(
            f"this job was started with init_elastic(..., shards={shards}), but {given}= was passed: the "
            "wrapper gossips along the job's replicas by itself (rank s of every node); leave device_mesh "
            "and process_group out, and shard the model over node_mesh()."
        )
    if local_world_size not in (None, 1):
        raise ValueError(
            f"local_world_size={local_world_size!r}: in a job started with init_elastic(..., "
            f"shards={shards}) each node holds one member of every shard world, so local_world_size is 1; "
            "leave it out."
        )


def _members(device_mesh: object, process_group: object) -> tuple[int, ...] | None:
    """The gossip group's global ranks in group order, or None for the whole job."""
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(
                f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got {device_mesh!r}."
            )
        if device_mesh.ndim != 1:
            raise ValueError(
                f"device_mesh must be 1-D (the one dimension to gossip along), got a {device_mesh.ndim}-D "
                f"mesh {device_mesh}, dimensions {device_mesh.mesh_dim_names}. Pass one dimension, e.g. "
                'device_mesh=mesh["replicate"].'
            )
        process_group = device_mesh.get_group()
    if process_group is None:
        return None
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got {process_group!r}.")
    # Ascending, as every group torch creates orders its members, so that the topology's groups and
    # their process groups list the members in the same order.
    ranks = tuple(sorted(dist.get_process_group_ranks(process_group)))
    if dist.get_rank() not in ranks:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of the gossip group {list(ranks)} "
            "(device_mesh/process_group); pass the group this rank belongs to."
        )
    return ranks


def _local_world_size(given: int | None, members: tuple[int, ...], subgroup: bool) -> int:
    size = len(members)
    if given is not None:
        if not is_int(given):
            raise TypeError(f"local_world_size must be an int or None, got {given!r}.")
        if given < 1 or size % given != 0:
            along = " of the gossip group" if subgroup else ""
            raise ValueError(
                f"local_world_size={given} must be a positive divisor of world_size={size}{along} "
                "(processes per node, the same on every node)."
            )
        return given
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is None:
        return 1
    try:
        per_job_node = int(env)
    except ValueError:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={env!r} is not an integer; set it to the number of processes per "
            "node, or pass local_world_size."
        ) from None
    if not subgroup:
        return _local_world_size(per_job_node, members, subgroup)
    return members_per_node(members, per_job_node)


def members_per_node(members: tuple[int, ...], ranks_per_node: int) -> int:
    """How many members of a gossip group share a node, nodes holding ``ranks_per_node`` consecutive ranks.

    The members must lie on their nodes in equal runs, one run per node (as a mesh dimension does:
    ``(2, 2)`` mesh on 2 nodes of 2 ranks: 1 per node along ``"replicate"``, 2 along ``"shard"``);
    otherwise 1, so that a hierarchical topology treats every member as a node of its own.
    """
    size = len(members)
    if ranks_per_node < 1:
        return 1
    nodes = [r // ranks_per_node for r in members]
    for run_length in range(size, 0, -1):
        if size % run_length:
            continue
        runs = [nodes[i : i + run_length] for i in range(0, size, run_length)]
        if all(len(set(run)) == 1 for run in runs) and len({run[0] for run in runs}) == len(runs):
            return run_length
    logger.debug("gossip group {} does not lay evenly over nodes; local_world_size=1", list(members))
    return 1
