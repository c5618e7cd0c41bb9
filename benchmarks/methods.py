"""How the benchmarks name a training method, and what each part of a name turns on.

A method is named ``topology[-module][-gt][@compression][+optimizer]``, or ``ddp[+optimizer]``:

- ``topology``: any name ``TopologyFactory`` knows (``ring``, ``one-peer-exp``, ``complete``, ...),
  trained with DecentOptimWrapper; ``ddp`` is PyTorch's DistributedDataParallel (all-reduce);
- ``-module``: the module front-end (DecentralizedDataParallel) instead of DecentOptimWrapper;
- ``-gt``: gradient tracking (``gradient_tracking=True`` of both front-ends), the remedy for
  label-skewed data: each rank gossips a tracker of the average gradient beside its parameters and
  steps with it, for twice the bytes. DDP takes none: it already steps with the exact average;
- ``@bf16``, ``@fp16``, ``@int8``: gossip compressed models (``compression=`` of both front-ends);
  DDP takes none;
- ``+adamw``, ``+accum-adamw`` (AccumAdamW, accum_iter 4): train with the Adam learning rate;
  without one (or with ``+sgd``) it is SGD with momentum.

For example ``ring@bf16``, ``one-peer-exp@fp16``, ``ring-module@int8+accum-adamw``, ``ring-gt``,
``one-peer-exp-gt@bf16``, ``ring-module-gt+accum-adamw``, ``ddp+adamw``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from decent_optim_wrapper import AccumAdamW, TopologyFactory

MODULE_SUFFIX = "-module"  # a topology name + this suffix: the module front-end
TRACKING_SUFFIX = "-gt"  # after -module, if any: gradient tracking
COMPRESSIONS = ("bf16", "fp16", "int8")  # "topology@compression"; none when none is named
OPTIMIZERS = ("sgd", "adamw", "accum-adamw")  # "method+optimizer"; sgd when none is named


@dataclass(frozen=True)
class Method:
    """A method name taken apart.

    The grammar is ``topology[-module][-gt][@compression][+optimizer]`` or ``ddp[+optimizer]``.
    """

    topology: str | None  # None: all-reduce with DistributedDataParallel
    module: bool = False  # the module front-end (the update happens inside backward)
    tracking: bool = False  # gradient tracking (gossip a tracker of the average gradient too)
    compression: str | None = None
    optimizer: str | None = None  # None: SGD with momentum

    @property
    def name(self) -> str:
        """The method's name, as :func:`parse_method` reads it."""
        name = self.topology or "ddp"
        if self.module:
            name += MODULE_SUFFIX
        if self.tracking:
            name += TRACKING_SUFFIX
        if self.compression:
            name += f"@{self.compression}"
        if self.optimizer:
            name += f"+{self.optimizer}"
        return name


def parse_method(method: str) -> Method:
    """Read a method name (see the module docstring); ``ValueError`` names the part that is wrong."""
    front, plus, optimizer = method.partition("+")
    if plus and optimizer not in OPTIMIZERS:
        raise ValueError(
            f"method {method!r}: unknown optimizer {optimizer!r} after '+'; "
            f"choose one of {', '.join(OPTIMIZERS)}"
        )
    base, at, compression = front.partition("@")
    if at and base == "ddp":
        raise ValueError(
            f"method {method!r}: ddp takes no compression, got {compression!r}; all-reduce sends "
            f"full-precision gradients. Drop '@{compression}', or compress a gossip topology, "
            f"e.g. 'ring@{compression}'."
        )
    if at and compression not in COMPRESSIONS:
        raise ValueError(
            f"method {method!r}: unknown compression {compression!r} after '@'; choose one of "
            f"{', '.join(COMPRESSIONS)} (or leave out '@' for none)"
        )
    stem = base.removesuffix(TRACKING_SUFFIX)
    if stem == "ddp" and stem != base:
        raise ValueError(
            f"method {method!r}: ddp takes no gradient tracking; all-reduce already steps every rank "
            f"with the exact average gradient. Drop '{TRACKING_SUFFIX}', or track on a gossip "
            f"topology, e.g. 'ring{TRACKING_SUFFIX}'."
        )
    if base.endswith(TRACKING_SUFFIX + MODULE_SUFFIX):
        reordered = base.removesuffix(TRACKING_SUFFIX + MODULE_SUFFIX) + MODULE_SUFFIX + TRACKING_SUFFIX
        raise ValueError(
            f"method {method!r}: '{TRACKING_SUFFIX}' comes after '{MODULE_SUFFIX}'; write "
            f"{reordered + method[len(base) :]!r}"
        )
    if base == "ddp":
        return Method(topology=None, optimizer=optimizer or None)
    topology = stem.removesuffix(MODULE_SUFFIX)
    try:  # an unknown name fails here, before any worker starts training
        TopologyFactory.get(topology)
    except ValueError as error:
        raise ValueError(f"method {method!r}: {error}") from None
    return Method(
        topology=topology,
        module=stem.endswith(MODULE_SUFFIX),
        tracking=stem != base,
        compression=compression or None,
        optimizer=optimizer or None,
    )


def optimizer_factory(
    name: str, lr: float, adam_lr: float
) -> Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer]:
    """Builds the optimizer ``name`` from (name, parameter) pairs (the module front-end's optim_fn)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")

    def build(named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
        params = [p for _, p in named]
        if name == "adamw":
            return torch.optim.AdamW(params, lr=adam_lr, weight_decay=0.0)
        if name == "accum-adamw":  # moments move once per 4 steps, from the mean gradient
            return AccumAdamW(params, lr=adam_lr, weight_decay=0.0, accum_iter=4)
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    return build
