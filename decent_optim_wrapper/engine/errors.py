"""The errors the engine raises when a collective cannot complete.

Both derive from :class:`DecentError` (itself a ``RuntimeError``), so a training loop can catch one
type for "a peer is gone: restart from the last checkpoint":

* :class:`GossipError` -- raised by ``step()`` (the optimizer front-end) or inside ``backward()``
  (the module front-end) when a gossip round with the step's neighbours does not complete;
* :class:`GlobalAverageError` -- raised by ``global_avg()`` when the all-reduce over every rank does
  not complete;
* :class:`PeerFailureError` -- raised with ``on_peer_failure="continue"`` when this rank cannot go on
  with the survivors (they dropped it, or the store they meet in is gone).

Bad arguments are ``ValueError``/``TypeError`` and misuse of state (a revert with nothing to revert)
is a plain ``RuntimeError``; neither is a :class:`DecentError`.
"""

from __future__ import annotations

__all__ = ["DecentError", "GlobalAverageError", "GossipError", "PeerFailureError", "QuarantinedError"]


class DecentError(RuntimeError):
    """A collective of the engine could not complete: a peer died or did not answer in time."""


class GossipError(DecentError):
    """A gossip round could not complete; the message names the step it was launched at and the group."""


class GlobalAverageError(DecentError):
    """The exact world average could not complete; the message names the step and the world size."""


class PeerFailureError(DecentError):
    """This rank cannot go on with the survivors: they left it out, or their store is gone."""


class QuarantinedError(PeerFailureError):
    """Clipped gossip's audit quarantined this rank (its values stood far from every other rank's) and,
    with ``on_peer_failure="continue"``, it has left the job: the others go on without it."""
