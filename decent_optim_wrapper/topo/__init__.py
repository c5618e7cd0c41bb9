"""Topologies: which ranks gossip together at each step.

A :class:`Topology` is pure logic (no process group): a periodic schedule of :class:`Group` s,
validated before any communication, with the mixing matrix of every step. Built-ins are registered
in :class:`TopologyFactory` by name: ``complete``, ``ring``, ``one-peer-exp``, ``alternating-exp-ring``
and ``hierarchical``. ``python -m decent_optim_wrapper.topo NAME --world-size N`` prints a schedule and
its figures (:mod:`decent_optim_wrapper.topo.analysis`).

Each module imports only modules listed before it: ``group`` (:class:`Group`, :data:`Phase`);
``validation`` and ``mixing`` (schedule checks; models sent and consensus rate); ``base``
(:class:`Topology`); ``factory``; the built-ins ``builtin``, ``exponential``, ``hierarchical``; then
``analysis`` and ``__main__``.
"""

from decent_optim_wrapper.topo.base import Phase, Topology
from decent_optim_wrapper.topo.builtin import CompleteTopology, RingTopology
from decent_optim_wrapper.topo.exponential import OnePeerExpTopology
from decent_optim_wrapper.topo.factory import TopologyFactory
from decent_optim_wrapper.topo.group import Group
from decent_optim_wrapper.topo.hierarchical import AlternatingExpRingTopology, HierarchicalTopology

__all__ = [
    "AlternatingExpRingTopology",
    "CompleteTopology",
    "Group",
    "HierarchicalTopology",
    "OnePeerExpTopology",
    "Phase",
    "RingTopology",
    "Topology",
    "TopologyFactory",
]
