"""The front doors: each translates a user's API into calls of one engine.

The engine is :class:`~decent_optim_wrapper.engine.GossipEngine`; the doors are:

* :mod:`.optimizer` -- :class:`DecentOptimWrapper`: any ``torch.optim.Optimizer``, stepped by ``step()``
  (public path: ``decent_optim_wrapper.wrapper``).
* :mod:`.data_parallel` -- :class:`DecentralizedDataParallel`: decent-dp's module API, each bucket
  updated inside backward (:mod:`.data_parallel_backward`), its per-bucket optimizers and training
  state (:mod:`.data_parallel_state`).
* :mod:`.base` -- :class:`~.base.EngineFrontEnd`: what both report of their engine, alike.
* :mod:`.inner_step` -- running the optimizers they step as torch expects (GradScaler, global step
  hooks).

They reach the engine only through :mod:`decent_optim_wrapper.engine`'s public names; the integrations
(Lightning, Hugging Face, Accelerate) sit above them.
"""

from decent_optim_wrapper.front_ends.data_parallel import DecentralizedDataParallel
from decent_optim_wrapper.front_ends.optimizer import DecentOptimWrapper

__all__ = ["DecentOptimWrapper", "DecentralizedDataParallel"]
