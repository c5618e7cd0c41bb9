"""The exchange: flat buckets of parameters and the asynchronous gossip rounds over them.

* :mod:`~decent_optim_wrapper.engine.exchange.shards` -- sharded (DTensor) parameters: their local shards.
* :mod:`~decent_optim_wrapper.engine.exchange.buckets` -- flat buckets that parameters become views of.
* :mod:`~decent_optim_wrapper.engine.exchange.staging` -- a round's payload through pinned host buffers
  (GPU buckets over gloo), its collective launched in order from a thread of its own.
* :mod:`~decent_optim_wrapper.engine.exchange.guard` -- guarded mixing: values that are not finite are
  withheld, left out, and healed from the peers; its events.
* :mod:`~decent_optim_wrapper.engine.exchange.clipping` -- clipped gossip: each neighbour's difference
  clipped to a radius from the recent ones (against a Byzantine neighbour, opt-in).
* :mod:`~decent_optim_wrapper.engine.exchange.gossip` -- :class:`~decent_optim_wrapper.engine.Gossip`:
  stage, launch, wait and mix per bucket, one round in flight each, exact or compressed.

Imports: :mod:`~decent_optim_wrapper.engine.fleet` (process groups, waits, the gossip world),
:mod:`~decent_optim_wrapper.engine.wire` (wire formats), :mod:`decent_optim_wrapper.engine.errors` and
:mod:`decent_optim_wrapper.topo`.
"""
