"""The update rules beside the gossip, and their clocks.

* :mod:`~decent_optim_wrapper.engine.rules.adam_step` -- Adam's and AdamW's step with the rule's denominator.
* :mod:`~decent_optim_wrapper.engine.rules.second_moment` -- Adam's second moment of the average gradient.
* :mod:`~decent_optim_wrapper.engine.rules.tracking` -- gradient tracking (DSGT).
* :mod:`~decent_optim_wrapper.engine.rules.pacing` -- paced rounds for uneven fleets: inner steps per
  rank and round, from measured speeds.
* :mod:`~decent_optim_wrapper.engine.rules.local_steps` -- low-communication gossip: local steps, an
  outer optimizer, anchors gossiped behind the next inner steps.

Imports: :mod:`~decent_optim_wrapper.engine.exchange`, :mod:`~decent_optim_wrapper.engine.fleet`,
:mod:`~decent_optim_wrapper.engine.wire`, :mod:`decent_optim_wrapper.engine.errors` and
:mod:`decent_optim_wrapper.topo`.
"""
