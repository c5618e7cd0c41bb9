"""Hierarchical topologies: exact averaging inside a node, one-peer exponential gossip between nodes.

Both built-ins run the node-level :func:`~decent_optim_wrapper.topo.exponential.exponential_plan` on
the ``m = world_size / local_world_size`` nodes (node ``a`` holds ranks ``a*L, ..., a*L + L - 1``) and
expand every node-level phase into two rank-level phases. Node means evolve exactly as the node-level
plan prescribes and intra-node averaging leaves them unchanged, so both reach exact consensus after
``2 T(m)`` steps, where ``T`` is the one-peer-exp phase count. With ``local_world_size = 1`` a node is
one rank and there is nothing to average inside it, so both are the one-peer-exp schedule itself.
"""

from __future__ import annotations

from decent_optim_wrapper.topo.base import Topology
from decent_optim_wrapper.topo.exponential import exponential_phases, exponential_plan, per_rank
from decent_optim_wrapper.topo.factory import TopologyFactory
from decent_optim_wrapper.topo.group import Group

__all__ = ["AlternatingExpRingTopology", "HierarchicalTopology"]


class _NodeExpTopology(Topology):
    """Shared part: the node-level plan, the intra-node groups and the ``L = 1`` / ``m = 1`` cases."""

    def _node(self, node: int) -> Group:
        lws = self._local_world_size
        return Group(tuple(range(node * lws, (node + 1) * lws)))

    def _expand(self, node_phase: list[Group], pairs_before: int) -> tuple[list[Group], list[Group]]:
        """The two rank-level phases of one node-level phase; ``pairs_before`` counts earlier node pairs."""
        raise NotImplementedError

    def assign_groups(self) -> list[list[Group]]:
        node_plan = exponential_plan(range(self._num_nodes))
        if self._local_world_size == 1:
            phases = node_plan or [[Group((0,))]]
        elif not node_plan:
            phases = [[self._node(0)]]
        else:
            phases = []
            pairs_before = 0
            for node_phase in node_plan:
                phases.extend(self._expand(sorted(node_phase, key=lambda g: g.ranks[0]), pairs_before))
                pairs_before += sum(1 for g in node_phase if g.size == 2)
        return per_rank(phases, self._world_size)

    def exact_consensus_steps(self) -> int | None:
        t = exponential_phases(self._num_nodes)
        if self._local_world_size == 1:
            return t
        return 1 if t == 0 else 2 * t


@TopologyFactory.register("alternating-exp-ring")
class AlternatingExpRingTopology(_NodeExpTopology):
    """decent-dp's hierarchical schedule: node pairs merge into one group while other nodes average inside.

    For every node-level phase of the one-peer exponential plan (node pair ``(a, b)`` with node weight
    :math:`w`, ``w = 1/2`` except on odd splits) there are two rank-level phases. In one, the
    :math:`2L` ranks of ``a`` and ``b`` form one group; in the other, ``a`` and ``b`` each average
    inside the node. Node pairs alternate which of the two phases carries the merge (the ``c``-th pair,
    counted over the whole plan, merges in the second phase when ``c`` is even, in the first when odd),
    so half the nodes use the network at a time. A node without a partner averages inside in both. The
    merged group carries node weight :math:`w` as the rank self-weight

    .. math::
        w_r = 1 - (1 - w) \\frac{2L - 1}{L},

    (``w_r = 1/(2L)``, the plain average, for ``w = 1/2``), so the node means follow the node plan.

    Supported: any number of nodes ``m`` and any ``L``. For ``m = 2^k`` nodes and ``L >= 2`` this is
    exactly decent-dp's ``alternating-exp-ring`` (period ``2k``); ``m = 1`` is one intra-node average
    (period 1); ``L = 1`` is ``one-peer-exp`` (decent-dp would idle half the steps on singleton groups).
    Exact consensus after ``2 T(m)`` steps (``T(m)`` for ``L = 1``). A merge costs every member
    ``2(2L-1)/(2L)`` models, an intra-node average ``2(L-1)/L``.
    """

    def exact_consensus_steps(self) -> int | None:
        """``2 T(m)``, or ``2 T(m) - 1`` when the last node-level phase has one pair and it merges first.

        The final node-level phase consists of uniform pairs (and resting nodes), so once all of its
        merges are done every rank holds the average; the intra-node phase after them changes nothing.
        """
        steps = super().exact_consensus_steps()
        node_plan = exponential_plan(range(self._num_nodes))
        if self._local_world_size == 1 or not node_plan or steps is None:
            return steps
        pairs_before = sum(1 for phase in node_plan[:-1] for g in phase if g.size == 2)
        last_pairs = sum(1 for g in node_plan[-1] if g.size == 2)
        return steps - 1 if last_pairs == 1 and pairs_before % 2 == 1 else steps

    def _expand(self, node_phase: list[Group], pairs_before: int) -> tuple[list[Group], list[Group]]:
        lws = self._local_world_size
        pair_index = pairs_before
        first: list[Group] = []
        second: list[Group] = []
        for pair in node_phase:
            intra = [self._node(node) for node in pair.ranks]
            if pair.size == 1:
                first += intra
                second += intra
                continue
            a, b = pair.ranks
            weight = None if pair.is_uniform else 1.0 - (1.0 - pair.own_weight) * (2 * lws - 1) / lws
            merged = Group(
                tuple(range(a * lws, (a + 1) * lws)) + tuple(range(b * lws, (b + 1) * lws)), weight
            )
            if pair_index % 2 == 0:
                first += intra
                second.append(merged)
            else:
                first.append(merged)
                second += intra
            pair_index += 1
        return first, second


@TopologyFactory.register("hierarchical")
class HierarchicalTopology(_NodeExpTopology):
    """Exact intra-node averaging alternating with rank-parallel one-peer gossip between nodes.

    For every node-level phase of the one-peer exponential plan there are two rank-level phases:

    1. every node averages inside (one group of ``L`` ranks, weight ``1/L``);
    2. for each node pair ``(a, b)`` with node weight :math:`w`, local rank ``l`` of ``a`` averages with
       local rank ``l`` of ``b``:

       .. math::
           x_{aL+l} \\leftarrow w\\,x_{aL+l} + (1 - w)\\,x_{bL+l},

       so all ``L`` links of a node carry traffic in parallel; nodes without a partner rest.

    After step 1 every node is uniform, so step 2 moves node means exactly as the node plan does. Each
    rank sends ``2(L-1)/L`` models in the intra phase and 1 model in the inter phase. Supported: any
    number of nodes ``m`` and any ``L``; exact consensus after ``2 T(m)`` steps. ``m = 1`` is one
    intra-node average (period 1). With ``L = 1`` step 1 is empty and the schedule is ``one-peer-exp``.
    """

    def _expand(self, node_phase: list[Group], pairs_before: int) -> tuple[list[Group], list[Group]]:
        lws = self._local_world_size
        intra = [self._node(node) for node in range(self._num_nodes)]
        inter: list[Group] = []
        for pair in node_phase:
            if pair.size == 1:
                inter += [Group((r,)) for r in self._node(pair.ranks[0]).ranks]
                continue
            a, b = pair.ranks
            inter += [Group((a * lws + i, b * lws + i), pair.self_weight) for i in range(lws)]
        return intra, inter
