"""The exchange: flat buckets of parameters and the asynchronous gossip rounds over them.

* :mod:`~decent_optim_wrapper.engine.exchange.shards` -- sharded (DTensor) parameters: their local shards.
* :mod:`~decent_optim_wrapper.engine.exchange.buckets` -- flat buckets that parameters become views of.
* :mod:`~decent_optim_wrapper.engine.exchange.staging` -- a round's payload through pinned host buffers
  (GPU buckets over gloo), its collective launched in order from a thread of its own.
* :mod:`~decent_optim_wrapper.engine.exchange.guard` -- guarded mixing: values that are not finite are
  withheld, left out, and healed from the peers; its events.
* :mod:`~decent_optim_wrapper.engine.exchange.clipping` -- clipped gossip: each neighbour's difference
  clipped to a radius from the recent ones (against a Byzantine neighbour, opt-in); its options, which
  are the rule of a gathered round's mix, and that mix.
* :mod:`~decent_optim_wrapper.engine.exchange.rounds` -- a bucket's channel (buffers, references) and
  its round in flight.
* :mod:`~decent_optim_wrapper.engine.exchange.transport` -- how a round's collective runs: on the
  buckets' buffers or through host copies; a pair gathered by XOR.
* :mod:`~decent_optim_wrapper.engine.exchange.plain` -- a plain round: an all-reduce of the weighted values.
* :mod:`~decent_optim_wrapper.engine.exchange.gathered` -- a gathered round: every member's payload,
  compressed differences from the group's reference, or exact values.
* :mod:`~decent_optim_wrapper.engine.exchange.gossip` -- :class:`~decent_optim_wrapper.engine.Gossip`:
  stage, launch, wait and mix per bucket, one round in flight each, over the parts above; the
  checkpoint format.

Imports: :mod:`~decent_optim_wrapper.engine.fleet` (process groups, waits, the gossip world),
:mod:`~decent_optim_wrapper.engine.wire` (wire formats), :mod:`decent_optim_wrapper.engine.errors` and
:mod:`decent_optim_wrapper.topo`.
"""
