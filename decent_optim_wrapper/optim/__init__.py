"""Optimizers for decentralized training and the factories of the decent-dp 0.2.3 API.

* :class:`AccumAdam`, :class:`AccumAdamW` -- Adam/AdamW whose moments move once per ``accum_iter``
  steps, from the mean gradient of those steps.
* ``optim_fn_*`` -- build an optimizer from ``(name, parameter)`` pairs, with weight decay on weights
  only; :func:`lr_scheduler_fn_cosine_with_warmup` -- linear warm-up, then cosine annealing.
"""

from decent_optim_wrapper.optim.accum_adam import AccumAdam, AccumAdamW
from decent_optim_wrapper.optim.factories import (
    LR_SCHEDULER_FN_TYPE,
    OPTIM_FN_TYPE,
    lr_scheduler_fn_cosine_with_warmup,
    optim_fn_accum_adam,
    optim_fn_accum_adamw,
    optim_fn_adam,
    optim_fn_adamw,
)

__all__ = [
    "LR_SCHEDULER_FN_TYPE",
    "OPTIM_FN_TYPE",
    "AccumAdam",
    "AccumAdamW",
    "lr_scheduler_fn_cosine_with_warmup",
    "optim_fn_accum_adam",
    "optim_fn_accum_adamw",
    "optim_fn_adam",
    "optim_fn_adamw",
]
