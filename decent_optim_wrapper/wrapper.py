"""The optimizer front-end's public path, ``decent_optim_wrapper.wrapper.DecentOptimWrapper`` (the
path decent-optim-wrapper 0.1.1's users import); it lives in :mod:`decent_optim_wrapper.front_ends`."""

from decent_optim_wrapper.front_ends.optimizer import DecentOptimWrapper

__all__ = ["DecentOptimWrapper"]
