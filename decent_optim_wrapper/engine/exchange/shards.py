"""Sharded parameters (DTensor: FSDP2's ``fully_shard``, tensor parallelism): gossip their local shards.

Under decentralized HSDP a rank holds one shard of every parameter (a
:class:`~torch.distributed.tensor.DTensor` on the *shard* mesh), and gossips it with the ranks that hold
the same shard on the other nodes (the *gossip* world, :mod:`~.world`). Buckets therefore hold the
local shards, and everything the engine does to a bucket (mixing, averaging, compression, tracking)
acts on them as it acts on whole replicas: each shard's gossip is independent of the others', and the
union of the shards' updates is the whole model's.

A parameter's shard is its local tensor (``DTensor.to_local()``), a view of the storage FSDP2 keeps
and all-gathers from. It cannot become a view of a bucket (FSDP2 owns that storage), so buckets of
sharded parameters copy in and out (``params_as_views=False``).

Only sharded training imports :mod:`torch.distributed.tensor` (it pulls in sympy: seconds at start-up,
for every worker and every joiner). A tensor can be a DTensor only once that module is loaded, so
:func:`is_sharded` looks for it in ``sys.modules`` instead of importing it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from decent_optim_wrapper.engine.fleet.world import GossipWorld

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "load_local_module_state",
    "local_module_state",
    "ShardLayout",
    "is_sharded",
    "local_optimizer_state",
    "local_tensor",
    "placed_optimizer_state",
]


def is_sharded(tensor: object) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor (whose elements are spread over a device mesh).

    Imports nothing: without :mod:`torch.distributed.tensor` loaded, no DTensor exists.
    """
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's elements of ``tensor``: a DTensor's local shard (a view of its storage), else itself."""
    if is_sharded(tensor):
        with torch.no_grad():  # without autograd, to_local() is a view of the storage, not a copy
            return tensor.to_local()
    return tensor


class ShardLayout:
    """The device mesh the sharded parameters live on, checked against the gossip world.

    Every DTensor parameter must live on one mesh that meets the gossip world only in this rank:
    its other members hold the same shard of other replicas, never another part of this one.

    Args:
        params: the parameters, in order; plain tensors count as replicated over the mesh.
        names: their names, for error messages.
        world: this rank's gossip world.
    """

    def __init__(self, params: Sequence[torch.Tensor], names: Sequence[str], world: GossipWorld) -> None:
        self.mesh: DeviceMesh | None = None
        self._first = ""
        self._world = world
        self.add(params, names)

    def add(self, params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        """Check more parameters (``add_param_group``) against the mesh and the gossip world.

        Nothing changes if one of them is refused.
        """
        first, first_name = self.mesh, self._first
        for param, name in zip(params, names, strict=True):
            if not is_sharded(param):
                continue
            mesh = param.device_mesh
            if first is None:
                _check_apart(mesh, name, self._world)
                first, first_name = mesh, name
            elif mesh != first:
                raise ValueError(
                    f"{name} lives on device mesh {mesh} but {first_name} on {first}: every sharded "
                    "parameter the wrapper gossips must live on one device mesh (e.g. fully_shard every "
                    'block over mesh["shard"]). Build the model on one mesh, or give each mesh its own '
                    "optimizer and wrapper."
                )
        self.mesh, self._first = first, first_name

    @property
    def sharded(self) -> bool:
        """Whether any parameter is a DTensor."""
        return self.mesh is not None

    def replication(self, param: torch.Tensor) -> int:
        """How many ranks of the mesh hold the same elements as this rank's shard of ``param``."""
        if self.mesh is None:
            return 1
        if not is_sharded(param):
            return self.mesh.size()
        from torch.distributed.tensor import Replicate  # loaded already: param is a DTensor

        copies = 1
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, Replicate):
                copies *= self.mesh.size(dim)
        return copies

    def sum_over_mesh_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over every rank of the mesh, in place (nothing to do without sharding).

        .. warning:: A collective over the mesh: all its ranks must call it.
        """
        if self.mesh is None:
            return
        for dim in range(self.mesh.ndim):
            dist.all_reduce(tensor, group=self.mesh.get_group(dim))

    def max_over_mesh(self, value: float) -> float:
        """The largest ``value`` over every rank of the mesh (``value`` itself without sharding).

        .. warning:: A collective over the mesh: all its ranks must call it.
        """
        if self.mesh is None:
            return value
        tensor = torch.tensor([value], dtype=torch.float64, device=self.mesh.device_type)
        for dim in range(self.mesh.ndim):
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.mesh.get_group(dim))
        return float(tensor.item())


def _check_apart(mesh: DeviceMesh, name: str, world: GossipWorld) -> None:
    """Raise if the mesh of sharded parameter ``name`` contains another member of the gossip world."""
    if world.replicas is not None:
        return  # the default group is the node: no mesh reaches another replica
    mesh_ranks = {int(r) for r in mesh.mesh.flatten().tolist()}
    shared = sorted(mesh_ranks & set(world.ranks))
    if shared == [world.ranks[world.rank]]:
        return
    if not world.subgroup:
        raise ValueError(
            f"{name} is a DTensor on device mesh {mesh}, so its elements are spread over ranks "
            f"{sorted(mesh_ranks)}, but the wrapper gossips over the whole job. Pass device_mesh= the mesh "
            'dimension to gossip along, e.g. device_mesh=mesh["replicate"] for a model sharded with '
            'fully_shard(..., mesh=mesh["shard"]).'
        )
    raise ValueError(
        f"{name} is a DTensor on device mesh {mesh}, which contains ranks {shared} of the gossip group "
        f"{list(world.ranks)}: it is sharded or replicated along the dimension gossip runs on. Shard and "
        'replicate parameters on the other mesh dimensions (fully_shard(..., mesh=mesh["shard"])) and '
        'gossip along the remaining one (device_mesh=mesh["replicate"]).'
    )


def local_module_state(module: torch.nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` copied, with every DTensor replaced by (a copy of) its local shard.

    A rank's part of a checkpoint of a sharded replica: plain tensors, which load without the device
    mesh (:func:`load_local_module_state` puts them back).
    """
    return {
        key: local_tensor(value).clone() if isinstance(value, torch.Tensor) else value
        for key, value in module.state_dict().items()
    }


@torch.no_grad()
def load_local_module_state(module: torch.nn.Module, state: dict[str, Any]) -> None:
    """Undo :func:`local_module_state`: copy each saved tensor into the matching entry of ``module``
    (into a DTensor's local shard), bit for bit; a missing, extra or misshapen entry is a ``ValueError``."""
    targets = module.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(targets) - set(state)), sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"the saved replica does not match the model: missing {missing}, unexpected {unexpected}; "
            "resume with the model (and the sharding) that saved it."
        )
    for key, target in targets.items():
        local, saved = local_tensor(target), state[key]
        if local.shape != saved.shape:
            raise ValueError(
                f"the saved {key} has shape {tuple(saved.shape)} but this rank's part of it has shape "
                f"{tuple(local.shape)}; resume with the sharding (shard size) that saved it."
            )
        local.copy_(saved)


def local_optimizer_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict()`` with every DTensor in its ``"state"`` replaced by its local shard.

    What a per-rank checkpoint of a sharded model holds: plain tensors, which load in any process
    and at any world size (a DTensor would pickle its device mesh). :func:`placed_optimizer_state`
    undoes it for the parameters of the run that loads it.
    """
    state = {
        index: {key: local_tensor(value) if is_sharded(value) else value for key, value in entry.items()}
        for index, entry in state_dict["state"].items()
    }
    return {**state_dict, "state": state}


def placed_optimizer_state(state_dict: dict[str, Any], params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Undo :func:`local_optimizer_state` for ``params`` (the optimizer's, in its state-dict order).

    A plain tensor saved for a sharded parameter, shaped like that parameter's local shard (Adam's
    moments, momentum buffers), becomes a DTensor placed like the parameter; the rest (Adam's scalar
    ``step``) is left as it is.
    """
    state: dict[Any, Any] = {}
    for index, entry in state_dict["state"].items():
        param = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
        if not is_sharded(param):
            state[index] = entry
            continue
        from torch.distributed.tensor import DTensor  # loaded already: param is a DTensor

        shard = param.to_local()
        state[index] = {
            key: DTensor.from_local(
                value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
            )
            if isinstance(value, torch.Tensor) and not is_sharded(value) and value.shape == shard.shape
            else value
            for key, value in entry.items()
        }
    return {**state_dict, "state": state}
