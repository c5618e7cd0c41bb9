"""Integrations with training frameworks: gossip instead of all-reduce where users already train.

* :mod:`decent_optim_wrapper.integrations.lightning` -- :class:`DecentralizedStrategy`, a PyTorch
  Lightning strategy (``Trainer(strategy="decentralized")``); needs the ``[lightning]`` extra.
* :mod:`decent_optim_wrapper.integrations.transformers` -- :class:`DecentralizedTrainer` and
  :class:`DecentralizedTrainerMixin` for Hugging Face's ``Trainer``; needs the ``[transformers]`` extra.

This package imports neither framework: each module imports its own, so the library itself still
needs only torch and loguru.
"""

__all__: list[str] = []
