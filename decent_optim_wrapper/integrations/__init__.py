"""Integrations with training frameworks: gossip instead of all-reduce where users already train.

* :mod:`decent_optim_wrapper.integrations.lightning` --
  :class:`~decent_optim_wrapper.integrations.lightning.DecentralizedStrategy`, a PyTorch Lightning
  strategy (``Trainer(strategy="decentralized")``); needs the ``[lightning]`` extra.
* :mod:`decent_optim_wrapper.integrations.transformers` --
  :class:`~decent_optim_wrapper.integrations.transformers.DecentralizedTrainer` and
  :class:`~decent_optim_wrapper.integrations.transformers.DecentralizedTrainerMixin` for Hugging
  Face's ``Trainer``; needs the ``[transformers]`` extra.

This package imports neither framework: each module imports its own, so the library itself still
needs only torch and loguru.
"""

__all__: list[str] = []
