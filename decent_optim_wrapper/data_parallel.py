"""The module front-end's public path, ``decent_optim_wrapper.data_parallel.DecentralizedDataParallel``;
it lives in :mod:`decent_optim_wrapper.front_ends`."""

from decent_optim_wrapper.front_ends.data_parallel import DecentralizedDataParallel

__all__ = ["DecentralizedDataParallel"]
