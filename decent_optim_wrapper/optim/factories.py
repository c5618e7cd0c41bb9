r"""Optimizer and LR-scheduler factories with the signatures of decent-dp 0.2.3.

An optimizer factory takes the model's ``(name, parameter)`` pairs (``list(model.named_parameters())``)
and returns an optimizer with two param groups: weights (``ndim >= 2``: linear and convolution
kernels, embeddings) with the given weight decay, and biases and normalization parameters
(``ndim < 2``) without it, the usual convention for Adam(W) training. (decent-dp 0.2.3 does the
opposite: it decays biases and norms and leaves the weights alone.) Change a hyperparameter with
``functools.partial``, e.g. ``partial(optim_fn_adamw, lr=3e-4)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeAlias

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

from decent_optim_wrapper.checks import is_int, is_real
from decent_optim_wrapper.optim.accum_adam import AccumAdam, AccumAdamW

__all__ = [
    "LR_SCHEDULER_FN_TYPE",
    "OPTIM_FN_TYPE",
    "lr_scheduler_fn_cosine_with_warmup",
    "optim_fn_accum_adam",
    "optim_fn_accum_adamw",
    "optim_fn_adam",
    "optim_fn_adamw",
]

OPTIM_FN_TYPE: TypeAlias = Callable[[list[tuple[str, Tensor]]], Optimizer]
"""Builds an optimizer from ``(name, parameter)`` pairs."""

LR_SCHEDULER_FN_TYPE: TypeAlias = Callable[[Optimizer], LRScheduler]
"""Builds an LR scheduler for an optimizer."""


def _param_groups(params: Iterable[tuple[str, Tensor]], weight_decay: float) -> list[dict[str, Any]]:
    """Weights (``ndim >= 2``) with ``weight_decay``, the rest without; empty groups left out.

    The groups keep the names (torch's ``param_names``), so ``state_dict()`` says which is which.
    """
    if not is_real(weight_decay):
        raise TypeError(f"weight_decay must be a float, got {weight_decay!r}; e.g. weight_decay=0.1.")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}; pass 0 for no weight decay.")
    if isinstance(params, Tensor) or not isinstance(params, Iterable):
        raise TypeError(
            f"params must be a list of (name, parameter) pairs, got {type(params).__name__}; "
            "pass list(model.named_parameters())."
        )
    decay: list[tuple[str, Tensor]] = []
    no_decay: list[tuple[str, Tensor]] = []
    for index, pair in enumerate(params):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], Tensor)):
            raise TypeError(
                f"params[{index}] must be a (name, parameter) pair, got {type(pair).__name__}; "
                "pass list(model.named_parameters()), not model.parameters()."
            )
        name, param = pair
        # Decaying a bias or a norm's scale toward zero only biases the model; weights are what
        # weight decay regularizes.
        (decay if param.ndim >= 2 else no_decay).append((str(name), param))
    if not decay and not no_decay:
        raise ValueError("params is empty; pass list(model.named_parameters()) of a model with parameters.")
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def optim_fn_adam(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 1.0 / 32768,
    eps: float = 1e-8,
) -> Optimizer:
    r"""``torch.optim.Adam`` with L2 weight decay on the weights only.

    Args:
        params: The model's ``(name, parameter)`` pairs, e.g. ``list(model.named_parameters())``.
        lr: Learning rate.
        beta1: Decay rate of the first moment.
        beta2: Decay rate of the second moment.
        weight_decay: L2 coefficient :math:`\lambda` (gradient :math:`g + \lambda p`) for ``ndim >= 2``
            parameters; biases and normalization parameters get 0.
        eps: Term added to the denominator.

    Returns:
        The optimizer, with up to two param groups (decayed weights first).

    Raises:
        TypeError: ``params`` is not a list of ``(name, tensor)`` pairs.
        ValueError: ``params`` is empty or a hyperparameter is out of range.
    """
    return torch.optim.Adam(_param_groups(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps)


def optim_fn_adamw(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.1,
    eps: float = 1e-8,
) -> Optimizer:
    r"""``torch.optim.AdamW`` with decoupled weight decay on the weights only.

    Args:
        params: The model's ``(name, parameter)`` pairs, e.g. ``list(model.named_parameters())``.
        lr: Learning rate :math:`\gamma`.
        beta1: Decay rate of the first moment.
        beta2: Decay rate of the second moment.
        weight_decay: :math:`\lambda` (each step :math:`p \leftarrow p(1 - \gamma\lambda)`) for
            ``ndim >= 2`` parameters; biases and normalization parameters get 0.
        eps: Term added to the denominator.

    Returns:
        The optimizer, with up to two param groups (decayed weights first).

    Raises:
        TypeError: ``params`` is not a list of ``(name, tensor)`` pairs.
        ValueError: ``params`` is empty or a hyperparameter is out of range.
    """
    return torch.optim.AdamW(_param_groups(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps)


def optim_fn_accum_adam(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1.0 / 32768,
    accum_iter: int = 4,
) -> Optimizer:
    r""":class:`~decent_optim_wrapper.optim.AccumAdam` with L2 weight decay on the weights only.

    Args:
        params: The model's ``(name, parameter)`` pairs, e.g. ``list(model.named_parameters())``.
        lr: Learning rate.
        beta1: Decay rate of the first moment.
        beta2: Decay rate of the second moment.
        eps: Term added to the denominator.
        weight_decay: L2 coefficient :math:`\lambda` for ``ndim >= 2`` parameters; biases and
            normalization parameters get 0.
        accum_iter: Steps per moment update.

    Returns:
        The optimizer, with up to two param groups (decayed weights first).

    Raises:
        TypeError: ``params`` is not a list of ``(name, tensor)`` pairs, or a hyperparameter's type.
        ValueError: ``params`` is empty or a hyperparameter is out of range.
    """
    return AccumAdam(
        _param_groups(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps, accum_iter=accum_iter
    )


def optim_fn_accum_adamw(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    accum_iter: int = 4,
) -> Optimizer:
    r""":class:`~decent_optim_wrapper.optim.AccumAdamW` with decoupled weight decay on the weights only.

    Args:
        params: The model's ``(name, parameter)`` pairs, e.g. ``list(model.named_parameters())``.
        lr: Learning rate :math:`\gamma`.
        beta1: Decay rate of the first moment.
        beta2: Decay rate of the second moment.
        eps: Term added to the denominator.
        weight_decay: :math:`\lambda` (each step :math:`p \leftarrow p(1 - \gamma\lambda)`) for
            ``ndim >= 2`` parameters; biases and normalization parameters get 0.
        accum_iter: Steps per moment update.

    Returns:
        The optimizer, with up to two param groups (decayed weights first).

    Raises:
        TypeError: ``params`` is not a list of ``(name, tensor)`` pairs, or a hyperparameter's type.
        ValueError: ``params`` is empty or a hyperparameter is out of range.
    """
    return AccumAdamW(
        _param_groups(params, weight_decay), lr=lr, betas=(beta1, beta2), eps=eps, accum_iter=accum_iter
    )


def lr_scheduler_fn_cosine_with_warmup(
    optimizer: Optimizer,
    t_max: int,
    t_warmup: int,
    cosine_eta_min: float = 1e-6,
    warmup_decay: float = 0.01,
) -> LRScheduler:
    r"""Linear warm-up for ``t_warmup`` steps, then cosine annealing over ``t_max`` steps.

    After ``s`` calls of ``scheduler.step()``, a group with base learning rate :math:`\gamma_0` has

    .. math::
        \gamma_s = \begin{cases}
            \gamma_0 \left(\delta + (1 - \delta)\, s / T_w\right) & s < T_w \\
            \eta + \tfrac12 (\gamma_0 - \eta) \left(1 + \cos\left(\pi (s - T_w) / T\right)\right)
                & T_w \le s \le T_w + T
        \end{cases}

    with :math:`T_w` = ``t_warmup``, :math:`T` = ``t_max``, :math:`\eta` = ``cosine_eta_min`` and
    :math:`\delta` = ``warmup_decay``: the schedule lasts ``t_warmup + t_max`` steps in all. Built from
    torch's ``LinearLR`` and ``CosineAnnealingLR`` in a ``SequentialLR`` (``t_warmup=0``: the
    ``CosineAnnealingLR`` alone, since ``SequentialLR`` mishandles a milestone at 0). Past
    ``t_warmup + t_max`` steps ``CosineAnnealingLR`` climbs back up; size ``t_max`` to the run.

    Args:
        optimizer: The optimizer whose groups' ``lr`` are the base learning rates :math:`\gamma_0`.
        t_max: Length of the cosine phase in steps, ``>= 1``.
        t_warmup: Length of the warm-up in steps, ``>= 0``.
        cosine_eta_min: Learning rate at the end of the cosine phase, ``>= 0``.
        warmup_decay: Fraction of the base learning rate the warm-up starts at, in ``(0, 1]``.

    Returns:
        The scheduler; call its ``step()`` after each ``optimizer.step()``.

    Raises:
        TypeError: ``t_max`` or ``t_warmup`` is not an int.
        ValueError: An argument out of range.
    """
    for name, value, least in (("t_max", t_max, 1), ("t_warmup", t_warmup, 0)):
        if not is_int(value):
            raise TypeError(
                f"{name} must be an int number of steps, got {value!r} ({type(value).__name__}); "
                f"e.g. {name}=int({name})."
            )
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}; pass a step count >= {least}.")
    if not (isinstance(cosine_eta_min, int | float) and cosine_eta_min >= 0):
        raise ValueError(
            f"cosine_eta_min must be a float >= 0, got {cosine_eta_min!r}; it is the final learning rate."
        )
    if not (isinstance(warmup_decay, int | float) and 0 < warmup_decay <= 1):
        raise ValueError(
            f"warmup_decay must be in (0, 1], got {warmup_decay!r}; it is the fraction of the base "
            "learning rate the warm-up starts at, e.g. 0.01 (1 means no warm-up)."
        )
    cosine = CosineAnnealingLR(optimizer, T_max=t_max, eta_min=cosine_eta_min)
    if t_warmup == 0:
        return cosine
    warmup = LinearLR(optimizer, start_factor=warmup_decay, total_iters=t_warmup)
    return SequentialLR(optimizer, schedulers=[warmup, cosine], milestones=[t_warmup])
