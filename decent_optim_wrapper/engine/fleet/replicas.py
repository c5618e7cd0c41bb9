r"""The groups that cross nodes in a decentralized-HSDP elastic job, built from the job's store.

In a job started with ``init_elastic(..., shards=k)`` the ``k`` processes of a node form the default
process group, and FSDP2 shards each replica over it (:func:`~decent_optim_wrapper.node_mesh`).
Everything that crosses nodes belongs to the engine: for each shard index ``s`` a *shard world*
holds rank ``s`` of every node, numbered by node, and the ranks of one shard world gossip together
(the parameters they hold are the same slice of every replica). Its groups are standalone gloo
process groups that only their members build, from keys of their own in the store:

- torch's default group is never re-formed when the job changes, so the groups FSDP2 shards over
  (and the device meshes that name them) stay valid: re-forming the default group would shut
  every group of the process down and hand their names to new ones;
- a group of a few nodes forms without the rest of the job (``torch.distributed.new_group`` is a
  collective of the whole default group, which here is one node).

Forming a group waits for its members to arrive, so a rank builds the groups it belongs to in one
order that every rank shares (ascending ranks): the first group nobody has formed yet has all its
members waiting on it, so nothing deadlocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]

__all__ = ["ReplicaWorld", "form_group"]


def form_group(store: Store, name: str, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A gloo process group of ``size`` ranks meeting under ``name`` in ``store``; a collective of
    its members (all must call it with the same ``name``)."""
    # A gloo backend object, which torch.distributed's collectives take as group= like a process
    # group. Unknown to the default group's registry (get_rank, get_backend, get_process_group_ranks
    # refuse it), so the engine asks a group itself for its rank, size and backend name.
    group = dist.ProcessGroupGloo(PrefixStore(name, store), rank, size, timeout)
    return cast(dist.ProcessGroup, group)


@dataclass
class ReplicaWorld:
    """This rank's shard world: where its groups form, who it is, and the group spanning it.

    Attributes:
        store: the store, under a prefix of this job's start and shard index.
        shards: processes per node (ranks per replica).
        shard: this process's index inside its node (its rank in the default group).
        node: this node's rank among the job's nodes (this rank's rank in its shard world).
        nodes: how many nodes (replicas) the job has.
        timeout: the groups' timeout.
        token: names the job's start in the store, the same on every rank of every shard world.
        group: a group spanning the shard world, for the engine's agreements (not gossip).
        node_group: a gloo group over this node's processes, for the engine's agreements inside the
            node (whether a node goes on or joins whole): the default group is the node too, but on
            GPU nodes it is NCCL's, which moves device memory only and cannot time a wait out.
    """

    store: Store
    shards: int
    shard: int
    node: int
    nodes: int
    timeout: timedelta
    token: str
    group: dist.ProcessGroup
    node_group: dist.ProcessGroup | None = None

    @classmethod
    def form(
        cls,
        store: Store,
        shards: int,
        shard: int,
        node: int,
        nodes: int,
        timeout: timedelta,
        token: str,
        node_group: dist.ProcessGroup | None = None,
    ) -> ReplicaWorld:
        """Form the shard world's spanning group; a collective of its ``nodes`` members."""
        group = form_group(store, "world", node, nodes, timeout)
        return cls(store, shards, shard, node, nodes, timeout, token, group, node_group)

    def reformed(self, store: Store, node: int, nodes: int) -> ReplicaWorld:
        """This shard world after a change of the job: ``nodes`` nodes, this one ``node``-th, its
        groups under ``store`` (the generation's keys); a collective of its new members. The node's
        own group stays: the node is the same."""
        keys = PrefixStore(f"shard/{self.shard}", store)
        return ReplicaWorld.form(
            keys, self.shards, self.shard, node, nodes, self.timeout, self.token, self.node_group
        )

    def new_group(self, ranks: tuple[int, ...], timeout: timedelta | None = None) -> dist.ProcessGroup:
        """A group over shard-world ``ranks`` (ascending, this node among them); a collective of them.

        Groups named by the same ranks form under keys of their own each time (a counter per name),
        so that the engine can build a world's groups again after a change.
        """
        name = "-".join(str(r) for r in ranks)
        instance = int(self.store.add(f"instances/{name}/{self.node}", 1))
        return form_group(
            self.store, f"g/{name}/{instance}", ranks.index(self.node), len(ranks), timeout or self.timeout
        )
