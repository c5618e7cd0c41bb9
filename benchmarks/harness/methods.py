"""How the benchmarks name a training method, and what each part of a name turns on.

A method is named ``topology[-module][-gt][~local][@compression][+optimizer]``, or ``ddp[+optimizer]``
(docs/benchmarks.md gives the grammar with examples): ``topology`` any name ``TopologyFactory`` knows,
trained with DecentOptimWrapper (``ddp``: DistributedDataParallel); ``-module`` the module front-end;
``-gt`` gradient tracking; ``~hH[n[LR][mM]][dD][p]`` low-communication gossip (``sync_every=H``, DiLoCo's
outer Nesterov SGD, outer lr and momentum, ``sync_delay=D``, paced rounds of :class:`HalfFastSchedule`);
``@bf16``, ``@int8``, ``@topk:0.01:int2``, ...: compressed gossip (any name ``compression=`` accepts);
``+adamw``, ``+accum-adamw``, ``+muon`` (:class:`MuonAdamW`; ``+sgd`` or none: SGD with momentum),
then ``-local`` for ``second_moment="local"``. For example ``ring@bf16``, ``ring-module-gt+accum-adamw``,
``ddp+adamw``, ``one-peer-exp~h32n@bf16+adamw``, ``complete~h8nd0`` (DiLoCo), ``ring~h8n0.1p+adamw``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper import AccumAdamW, Pacing, TopologyFactory
from decent_optim_wrapper.engine.wire.compression import resolve_compression

MODULE_SUFFIX = "-module"  # a topology name + this suffix: the module front-end
TRACKING_SUFFIX = "-gt"  # after -module, if any: gradient tracking
COMPRESSIONS = ("bf16", "fp16", "int8")  # "topology@compression" (or a sparse name); none when none is named
OPTIMIZERS = ("sgd", "adamw", "accum-adamw", "muon")  # "method+optimizer"; sgd when none is named
LOCAL_MOMENT_SUFFIX = "-local"  # after the optimizer: second_moment="local"
LOCAL = re.compile(  # after "~"
    r"h(?P<every>[1-9][0-9]*)(?P<nesterov>n(?P<lr>[0-9]*\.[0-9]+)?(?:m(?P<momentum>[0-9]*\.[0-9]+))?)?"
    r"(?:d(?P<delay>[0-9]+))?(?P<paced>p)?"
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


def nesterov_outer_with(
    lr: float = OUTER_LR, momentum: float = OUTER_MOMENTUM
) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """DiLoCo's outer optimizer, SGD with Nesterov momentum, at ``lr`` and ``momentum`` (``~h8n0.5m0.5``)."""
    return partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=momentum > 0)


nesterov_outer = nesterov_outer_with()  # DiLoCo's own: lr 0.7, Nesterov momentum 0.9


@dataclass(frozen=True)
class HalfFastSchedule:
    """Paced rounds' fixed counts (``Pacing(schedule=...)``) for a fleet whose first half is twice as fast.

    Called as ``schedule(rank, round)``. Ranks ``0 .. N//2 - 1`` are fast and take ``a(r)`` inner steps
    in round ``r``, the error diffusion of ``4H/3`` (the cumulative count ``round(4 H r / 3)``, halves
    rounded up); ranks ``N//2 .. 2 (N//2) - 1`` are slow and take ``2H - a(r)``; with an odd ``N`` the
    last rank takes ``H``. Every round's counts sum to exactly ``N H``, and over many rounds a fast
    rank takes twice a slow one's steps. With ``H = 1`` (per-step gossip, where a slow rank cannot take
    ``2/3`` of a step) a fast rank takes 2 steps per round and every other rank 1: rounds then hold
    more than ``N`` steps (:attr:`fleet_steps_per_round`).
    """

    world: int
    sync_every: int

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"paced rounds need sync_every >= 1, got {self.sync_every}")

    @property
    def fleet_steps_per_round(self) -> int:
        """The inner steps of one round over the whole fleet: ``N H`` (``H = 1``: ``N + N//2``)."""
        if self.sync_every == 1:
            return self.world + self.world // 2
        return self.world * self.sync_every

    def rounds_for(self, steps: int) -> int:
        """The rounds that process the samples of ``steps`` steps on every rank (DDP's ``steps``);
        ``ValueError`` if no whole number of rounds does."""
        if (steps * self.world) % self.fleet_steps_per_round:
            raise ValueError(
                f"{steps} steps on {self.world} ranks are not a whole number of paced rounds of "
                f"{self.fleet_steps_per_round} fleet steps (H={self.sync_every}); pick a multiple of "
                f"{self.fleet_steps_per_round // math.gcd(self.fleet_steps_per_round, self.world)}"
            )
        return steps * self.world // self.fleet_steps_per_round

    def _fast_total(self, rounds: int) -> int:
        """A fast rank's inner steps in rounds ``0 .. rounds - 1``: ``round(4 H rounds / 3)``."""
        return (8 * self.sync_every * rounds + 3) // 6

    def __call__(self, rank: int, round_: int) -> int:
        half = self.world // 2
        if self.sync_every == 1:
            return 2 if rank < half else 1
        fast = self._fast_total(round_ + 1) - self._fast_total(round_)
        if rank < half:
            return fast
        if rank < 2 * half:
            return 2 * self.sync_every - fast
        return self.sync_every

    def total(self, rank: int, rounds: int) -> int:
        """Rank ``rank``'s inner steps in rounds ``0 .. rounds - 1`` (its own LR schedule's length)."""
        half = self.world // 2
        if self.sync_every == 1:
            return (2 if rank < half else 1) * rounds
        if rank < half:
            return self._fast_total(rounds)
        if rank < 2 * half:
            return 2 * self.sync_every * rounds - self._fast_total(rounds)
        return self.sync_every * rounds


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
    paced: bool = False  # paced rounds with HalfFastSchedule (trained by rounds)

    @property
    def local(self) -> str:
        """The ``~`` part of the name, without the ``~`` ("" for per-step gossip)."""
        if self.sync_every == 1 and not self.nesterov and self.sync_delay is None and not self.paced:
            return ""
        lr, momentum, delay = self.outer_lr, self.outer_momentum, self.sync_delay
        outer = ("n" if self.nesterov else "") + ("" if lr is None else str(lr))
        outer += "" if momentum is None else f"m{momentum}"
        return f"h{self.sync_every}{outer}{'' if delay is None else f'd{delay}'}{'p' if self.paced else ''}"

    def schedule(self, world: int | None = None) -> HalfFastSchedule | None:
        """A paced method's fixed counts on ``world`` ranks (default: the process group's), else None."""
        if not self.paced:
            return None
        return HalfFastSchedule(dist.get_world_size() if world is None else world, self.sync_every)

    def engine_options(self, world: int | None = None) -> dict[str, Any]:
        """The keywords both front-ends take for this method's gossip (``world``: the ranks a paced
        method's schedule is for; default the process group's)."""
        options = dict(topology=self.topology, compression=self.compression, second_moment=self.second_moment)
        options["gradient_tracking"] = self.tracking
        if self.local:
            outer = None
            if self.nesterov:
                lr = OUTER_LR if self.outer_lr is None else self.outer_lr
                outer = nesterov_outer_with(
                    lr, OUTER_MOMENTUM if self.outer_momentum is None else self.outer_momentum
                )
            options.update(sync_every=self.sync_every, outer_optimizer=outer, sync_delay=self.sync_delay)
        if self.paced:
            options.update(pacing=Pacing(schedule=self.schedule(world)))
        return options

    @property
    def name(self) -> str:
        """The method's name, as :func:`parse_method` reads it."""
        return (
            (self.topology or "ddp")
            + (MODULE_SUFFIX if self.module else "")
            + (TRACKING_SUFFIX if self.tracking else "")
            + (f"~{self.local}" if self.local else "")
            + (f"@{self.compression}" if self.compression else "")
            + (f"+{self.optimizer}" if self.optimizer else "")
            + (LOCAL_MOMENT_SUFFIX if self.second_moment == "local" else "")
        )


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
    every, nesterov, delay, outer_lr, outer_momentum, paced = 1, False, None, None, None, False
    if tilde:
        match = LOCAL.fullmatch(local)
        if base == "ddp" or match is None:
            raise ValueError(
                f"method {method!r}: after '~' write hH for H local steps per round, then n for DiLoCo's "
                "outer optimizer, dD for a delay of D steps and p for paced rounds (e.g. 'ring~h8n', "
                f"'ring~h8nd0', 'ring~h8n0.1p'), after a gossip topology, got {local!r}"
            )
        every, nesterov = int(match["every"]), match["nesterov"] is not None
        outer_lr = None if match["lr"] is None else float(match["lr"])
        outer_momentum = None if match["momentum"] is None else float(match["momentum"])
        delay = None if match["delay"] is None else int(match["delay"])
        paced = match["paced"] is not None
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
    if paced and stem != base:
        raise ValueError(
            f"method {method!r}: paced rounds ('p') take no gradient tracking (its trackers are gossiped "
            f"every step); drop '{TRACKING_SUFFIX}' or 'p'"
        )
    if base == "ddp":
        return Method(topology=None, optimizer=optimizer or None)
    topology = stem.removesuffix(MODULE_SUFFIX)
    try:  # an unknown name fails here, before any worker starts training
        TopologyFactory.get(topology)
    except ValueError as error:
        raise ValueError(f"method {method!r}: {error}") from None
    front_end = dict(topology=topology, module=stem.endswith(MODULE_SUFFIX), tracking=stem != base)
    wire = dict(compression=compression or None, optimizer=optimizer or None, second_moment=second_moment)
    rounds = dict(sync_every=every, nesterov=nesterov, outer_lr=outer_lr, outer_momentum=outer_momentum)
    return Method(**front_end, **wire, **rounds, sync_delay=delay, paced=paced)


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
        if name == "muon":
            return MuonAdamW(named, lr=adam_lr)
        if name == "accum-adamw":  # moments move once per 4 steps, from the mean gradient
            return AccumAdamW(params, lr=adam_lr, weight_decay=0.0, accum_iter=4)
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    return build


class MuonAdamW(torch.optim.Optimizer):
    """Muon (``adjust_lr_fn="match_rms_adamw"``, so AdamW's learning rate carries over) on the hidden
    matrices, AdamW on the rest (embeddings, positions, biases, norms), stepped as one optimizer: the
    benchmarks' loops wrap a single optimizer, where a training script wraps the two (docs/
    low-communication.md). Its param groups are the two optimizers' own, so schedulers drive both; its
    state stays in the two (the benchmarks take no checkpoints of it)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], lr: float) -> None:
        hidden = [p for name, p in named if p.ndim == 2 and not name.startswith(("embed", "position"))]
        rest = [p for name, p in named if all(p is not h for h in hidden)]
        self.parts: list[torch.optim.Optimizer] = []
        if hidden:
            self.parts.append(
                torch.optim.Muon(hidden, lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw")
            )
        if rest:
            self.parts.append(torch.optim.AdamW(rest, lr=lr, weight_decay=0.0))
        super().__init__([group for part in self.parts for group in part.param_groups], {})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for part in self.parts:
            part.step()
