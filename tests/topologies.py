"""Shared facts about the built-in topologies for the tests: ``from topologies import BUILTIN_TOPOLOGIES``."""

from __future__ import annotations

#: Every topology registered by ``import decent_optim_wrapper.topo``, in the order the docs list them.
BUILTIN_TOPOLOGIES = ("complete", "ring", "one-peer-exp", "alternating-exp-ring", "hierarchical")
