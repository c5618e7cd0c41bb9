"""Topologies: which ranks gossip together at each step.

A :class:`Topology` is pure logic (no process group): a periodic schedule of :class:`Group` s,
validated before any communication, with the mixing matrix of every step. Built-ins are registered
in :class:`TopologyFactory` by name: ``complete``, ``ring``, ``one-peer-exp``, ``alternating-exp-ring``
and ``hierarchical``. ``python -m decent_optim_wrapper.topo NAME --world-size N`` prints a schedule and
its figures (:mod:`decent_optim_wrapper.topo.analysis`).

Topologies written for decent-dp (``_get_topo_edges()`` returning :class:`Edge` lists, registered with
``@TopologyReg.register(name)``) work unchanged. The topologies page of the docs describes the
built-ins, their figures, and how to write and check your own.

Each module imports only modules listed before it: ``group`` (:class:`Group`, :data:`Phase`);
``validation`` and ``mixing`` (schedule checks; models sent and consensus rate); ``compat``
(decent-dp's :class:`Edge` and its conversion to groups); ``base`` (:class:`Topology`); ``factory``
(:class:`TopologyFactory`, :class:`TopologyReg`); the built-ins ``builtin``, ``exponential``,
``hierarchical``; then ``analysis``, ``cli`` (the arguments that name a topology) and ``__main__``.
"""

from decent_optim_wrapper.topo.base import Phase, Topology
from decent_optim_wrapper.topo.builtin import CompleteTopology, RingTopology
from decent_optim_wrapper.topo.compat import Edge
from decent_optim_wrapper.topo.exponential import OnePeerExpTopology
from decent_optim_wrapper.topo.factory import TopologyFactory, TopologyReg
from decent_optim_wrapper.topo.group import Group
from decent_optim_wrapper.topo.hierarchical import AlternatingExpRingTopology, HierarchicalTopology

__all__ = [
    "AlternatingExpRingTopology",
    "CompleteTopology",
    "Edge",
    "Group",
    "HierarchicalTopology",
    "OnePeerExpTopology",
    "Phase",
    "RingTopology",
    "Topology",
    "TopologyFactory",
    "TopologyReg",
]
