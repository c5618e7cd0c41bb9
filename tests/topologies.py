"""Shared test helpers for topologies: the built-in names and a scratch registry."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from decent_optim_wrapper import TopologyFactory

#: Every topology registered by ``import decent_optim_wrapper.topo``, in the order the docs list them.
BUILTIN_TOPOLOGIES = ("complete", "ring", "one-peer-exp", "alternating-exp-ring", "hierarchical")


@contextmanager
def scratch_registry() -> Iterator[None]:
    """Let a test register topologies; afterwards the registry (and every class's name) is as before."""
    saved = dict(TopologyFactory._registry)
    try:
        yield
    finally:
        TopologyFactory._registry.clear()
        # Re-registering in the saved order also restores the name each class reports.
        for name, topology_cls in saved.items():
            TopologyFactory.add_topology(name, topology_cls)
