"""How the benchmarks name a training method, and what each part of a name turns on.

A method is named ``topology[-module][-gt][~local][@compression][+optimizer]``, or ``ddp[+optimizer]``:

- ``topology``: any name ``TopologyFactory`` knows (``ring``, ``one-peer-exp``, ``complete``, ...),
  trained with DecentOptimWrapper; ``ddp`` is PyTorch's DistributedDataParallel (all-reduce);
- ``-module``: the module front-end (DecentralizedDataParallel) instead of DecentOptimWrapper;
- ``-gt``: gradient tracking (``gradient_tracking=True`` of both front-ends), the remedy for
  label-skewed data: each rank gossips a tracker of the average gradient beside its parameters and
  steps with it, for twice the bytes. DDP takes none: it already steps with the exact average;
- ``~hH``, ``~hHn``, ``~hHnD`` (``D`` after a ``d``): low-communication gossip with ``sync_every=H``:
  ``~h8`` is periodic gossip (8 local steps, then a gossip round of the parameters), ``~h8n`` adds
  DiLoCo's outer optimizer (SGD, lr 0.7, Nesterov momentum 0.9; ``~h8n0.3``: outer lr 0.3;
  ``~h8n0.5m0.5``: outer lr 0.5 and Nesterov momentum 0.5, ``m0.0`` plain SGD),
  ``~h8nd0`` with ``sync_delay=0``
  (blocking; without ``d`` the default, a whole round); ``complete~h8nd0`` is DiLoCo;
- ``@bf16``, ``@fp16``, ``@int8``, ``@int4``, ``@int2`` or a sparse format such as
  ``@topk:0.01:int2`` (any name ``compression=`` accepts): gossip compressed models (``compression=``
  of both front-ends); DDP takes none;
- ``+adamw``, ``+accum-adamw`` (AccumAdamW, accum_iter 4): train with the Adam learning rate;
  without one (or with ``+sgd``) it is SGD with momentum. ``-local`` after the optimizer
  (``+adamw-local``): Adam's second moment from each rank's own gradients (``second_moment="local"``,
  the rule before the correction) instead of the default estimate of the average gradient's.

For example ``ring@bf16``, ``one-peer-exp@fp16``, ``ring-module@int8+accum-adamw``, ``ring-gt``,
``one-peer-exp-gt@bf16``, ``ring-module-gt+accum-adamw``, ``ddp+adamw``, ``ring~h8n``,
``one-peer-exp~h32n@bf16+adamw``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from decent_optim_wrapper import AccumAdamW, TopologyFactory
from decent_optim_wrapper.engine.compression import resolve_compression

MODULE_SUFFIX = "-module"  # a topology name + this suffix: the module front-end
TRACKING_SUFFIX = "-gt"  # after -module, if any: gradient tracking
COMPRESSIONS = ("bf16", "fp16", "int8")  # "topology@compression" (or a sparse name); none when none is named
OPTIMIZERS = ("sgd", "adamw", "accum-adamw")  # "method+optimizer"; sgd when none is named
LOCAL_MOMENT_SUFFIX = "-local"  # after the optimizer: second_moment="local"
LOCAL = re.compile(  # after "~"
    r"h(?P<every>[1-9][0-9]*)(?P<nesterov>n(?P<lr>[0-9]*\.[0-9]+)?(?:m(?P<momentum>[0-9]*\.[0-9]+))?)?"
    r"(?:d(?P<delay>[0-9]+))?"
)
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's outer Nesterov SGD


def check_compression(method: str, compression: str) -> None:
    """Raise ``ValueError`` naming ``method`` unless ``compression`` is a name ``compression=`` accepts."""
    try:
        resolve_compression(compression)
    except ValueError:
        raise ValueError(
            f"method {method!r}: unknown compression {compression!r} after '@'; choose one of "
            f"{', '.join(COMPRESSIONS)}, a sparse format such as 'topk:0.01:int2' (or leave out '@' for none)"
        ) from None


def nesterov_outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD with lr 0.7 and Nesterov momentum 0.9."""
    return torch.optim.SGD(params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)


def nesterov_outer_with(
    lr: float, momentum: float = OUTER_MOMENTUM
) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """DiLoCo's outer optimizer with another learning rate or momentum (``~h8n0.3``: lr 0.3;
    ``~h8n0.5m0.5``: lr 0.5, Nesterov momentum 0.5)."""

    def build(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    return build


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
    sync_every: int = 1  # low-communication gossip: inner steps per round (1: per-step gossip)
    nesterov: bool = False  # with DiLoCo's outer optimizer
    outer_lr: float | None = None  # its learning rate, if not DiLoCo's 0.7
    outer_momentum: float | None = None  # its Nesterov momentum, if not DiLoCo's 0.9
    sync_delay: int | None = None  # None: the library's default (a whole round)
    second_moment: str = "average"  # "local": Adam's statistics from each rank's own gradients

    @property
    def local(self) -> str:
        """The ``~`` part of the name, without the ``~`` ("" for per-step gossip)."""
        if self.sync_every == 1 and not self.nesterov and self.sync_delay is None:
            return ""
        return (
            f"h{self.sync_every}"
            + ("n" if self.nesterov else "")
            + ("" if self.outer_lr is None else str(self.outer_lr))
            + ("" if self.outer_momentum is None else f"m{self.outer_momentum}")
            + ("" if self.sync_delay is None else f"d{self.sync_delay}")
        )

    def engine_options(self) -> dict[str, Any]:
        """The keywords both front-ends take for this method's gossip."""
        options: dict[str, Any] = {
            "topology": self.topology,
            "compression": self.compression,
            "gradient_tracking": self.tracking,
            "second_moment": self.second_moment,
        }
        if self.local:
            options.update(
                sync_every=self.sync_every,
                outer_optimizer=(
                    None
                    if not self.nesterov
                    else nesterov_outer
                    if self.outer_lr is None and self.outer_momentum is None
                    else nesterov_outer_with(
                        OUTER_LR if self.outer_lr is None else self.outer_lr,
                        OUTER_MOMENTUM if self.outer_momentum is None else self.outer_momentum,
                    )
                ),
                sync_delay=self.sync_delay,
            )
        return options

    @property
    def name(self) -> str:
        """The method's name, as :func:`parse_method` reads it."""
        name = self.topology or "ddp"
        if self.module:
            name += MODULE_SUFFIX
        if self.tracking:
            name += TRACKING_SUFFIX
        if self.local:
            name += f"~{self.local}"
        if self.compression:
            name += f"@{self.compression}"
        if self.optimizer:
            name += f"+{self.optimizer}"
        if self.second_moment == "local":
            name += LOCAL_MOMENT_SUFFIX
        return name


def parse_method(method: str) -> Method:
    """Read a method name (see the module docstring); ``ValueError`` names the part that is wrong."""
    front, plus, optimizer = method.partition("+")
    second_moment = "average"
    if optimizer.endswith(LOCAL_MOMENT_SUFFIX):
        optimizer, second_moment = optimizer.removesuffix(LOCAL_MOMENT_SUFFIX), "local"
        if front.partition("~")[0].partition("@")[0] == "ddp":
            raise ValueError(
                f"method {method!r}: ddp takes no '{LOCAL_MOMENT_SUFFIX}'; its optimizer already sees the "
                "all-reduced gradient."
            )
    if plus and optimizer not in OPTIMIZERS:
        raise ValueError(
            f"method {method!r}: unknown optimizer {optimizer!r} after '+'; "
            f"choose one of {', '.join(OPTIMIZERS)}"
        )
    base, at, compression = front.partition("@")
    base, tilde, local = base.partition("~")
    every, nesterov, delay, outer_lr, outer_momentum = 1, False, None, None, None
    if tilde:
        match = LOCAL.fullmatch(local)
        if base == "ddp" or match is None:
            raise ValueError(
                f"method {method!r}: after '~' write hH for H local steps per round, then n for DiLoCo's "
                "outer optimizer and dD for a delay of D steps (e.g. 'ring~h8n', 'ring~h8nd0'), after a "
                f"gossip topology, got {local!r}"
            )
        every, nesterov = int(match["every"]), match["nesterov"] is not None
        outer_lr = None if match["lr"] is None else float(match["lr"])
        outer_momentum = None if match["momentum"] is None else float(match["momentum"])
        delay = None if match["delay"] is None else int(match["delay"])
        if delay is not None and delay > every:
            raise ValueError(f"method {method!r}: the delay d{delay} exceeds the round of h{every} steps")
    if at and base == "ddp":
        raise ValueError(
            f"method {method!r}: ddp takes no compression, got {compression!r}; all-reduce sends "
            f"full-precision gradients. Drop '@{compression}', or compress a gossip topology, "
            f"e.g. 'ring@{compression}'."
        )
    if at:
        check_compression(method, compression)
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
        sync_every=every,
        nesterov=nesterov,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        sync_delay=delay,
        second_moment=second_moment,
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
