"""A replica's state beyond the step: its exact global average and the snapshot that undoes it, and
the engine's part of a checkpoint, loaded at the same world size or at another.

* :mod:`~decent_optim_wrapper.engine.state.averaging` -- exact global averaging, its snapshot, the
  consensus distance.
* :mod:`~decent_optim_wrapper.engine.state.checkpoint` -- the ``"decent"`` entry of a checkpoint: its
  layout and checks.
* :mod:`~decent_optim_wrapper.engine.state.resize` -- what each rank loads from a checkpoint of another
  world size: the average of the saved replicas.

Imports: :mod:`~decent_optim_wrapper.engine.rules`, :mod:`~decent_optim_wrapper.engine.exchange`,
:mod:`~decent_optim_wrapper.engine.fleet` and :mod:`decent_optim_wrapper.engine.errors`.
"""
