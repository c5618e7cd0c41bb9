"""Method names, ``topology[-module][-gt][~local][@compression][+optimizer]`` or ``ddp[+optimizer]``
(docs/benchmarks.md): a ``TopologyFactory`` name (``ddp``: DistributedDataParallel), the module front-end,
gradient tracking, ``~hH[n[LR][mM]][dD][p]`` low-communication gossip (``sync_every=H``, DiLoCo's outer
Nesterov SGD, its lr and momentum, ``sync_delay=D``, paced rounds of :class:`HalfFastSchedule`), any
``compression=``, ``+adamw``/``+accum-adamw``/``+muon`` (none: SGD with momentum) then ``-local`` for
``second_moment="local"``; e.g. ``ring-module-gt+accum-adamw``, ``complete~h8nd0`` (DiLoCo)."""

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
nesterov_outer = partial(torch.optim.SGD, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
OptimizerFactory = Callable[[list[tuple[str, torch.Tensor]]], torch.optim.Optimizer]  # (name, parameter)s


@dataclass(frozen=True)
class HalfFastSchedule:
    """Paced rounds' fixed counts (``Pacing(schedule=...)``) for a fleet whose first half is twice as fast:
    in round ``r`` ranks ``0 .. N//2 - 1`` take ``a(r)`` inner steps, the error diffusion of ``4H/3``
    (cumulative ``round(4 H r / 3)``), ranks ``N//2 .. 2 (N//2) - 1`` ``2H - a(r)``, an odd ``N``'s last
    rank ``H``: ``N H`` a round. ``H = 1``: a fast rank takes 2 steps, every other rank 1."""

    world: int
    sync_every: int

    def __post_init__(self) -> None:
        if self.sync_every < 1:
            raise ValueError(f"paced rounds need sync_every >= 1, got {self.sync_every}")

    @property
    def fleet_steps_per_round(self) -> int:
        return self.world + self.world // 2 if self.sync_every == 1 else self.world * self.sync_every

    def rounds_for(self, steps: int) -> int:
        """The rounds that process the samples of ``steps`` steps on every rank (DDP's ``steps``)."""
        per_round = self.fleet_steps_per_round
        if (steps * self.world) % per_round:
            raise ValueError(
                f"{steps} steps on {self.world} ranks are not a whole number of paced rounds of "
                f"{per_round} fleet steps (H={self.sync_every}); pick a multiple of "
                f"{per_round // math.gcd(per_round, self.world)}"
            )
        return steps * self.world // per_round

    def __call__(self, rank: int, round_: int) -> int:
        half, every = self.world // 2, self.sync_every
        if every == 1:
            return 2 if rank < half else 1
        fast = (8 * every * (round_ + 1) + 3) // 6 - (8 * every * round_ + 3) // 6
        if rank < half:
            return fast
        return 2 * every - fast if rank < 2 * half else every

    def total(self, rank: int, rounds: int) -> int:
        return sum(self(rank, round_) for round_ in range(rounds))


@dataclass(frozen=True)
class Method:
    """A method name taken apart (the grammar of the module docstring)."""

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
        """A paced method's counts on ``world`` ranks (default: the process group's), else None."""
        if not self.paced:
            return None
        return HalfFastSchedule(dist.get_world_size() if world is None else world, self.sync_every)

    def engine_options(self, world: int | None = None) -> dict[str, Any]:
        """The keywords both front-ends take for this method's gossip (``world``: see :meth:`schedule`)."""
        options = dict(topology=self.topology, compression=self.compression, second_moment=self.second_moment)
        options["gradient_tracking"] = self.tracking
        if self.local:
            lr = OUTER_LR if self.outer_lr is None else self.outer_lr
            momentum = OUTER_MOMENTUM if self.outer_momentum is None else self.outer_momentum
            outer = partial(torch.optim.SGD, lr=lr, momentum=momentum, nesterov=momentum > 0)
            outer = outer if self.nesterov else None
            options.update(sync_every=self.sync_every, outer_optimizer=outer, sync_delay=self.sync_delay)
        if self.paced:
            options.update(pacing=Pacing(schedule=self.schedule(world)))
        return options

    @property
    def name(self) -> str:
        """The method's name, as :func:`parse_method` reads it."""
        name = (self.topology or "ddp") + (MODULE_SUFFIX if self.module else "")
        name += (TRACKING_SUFFIX if self.tracking else "") + (f"~{self.local}" if self.local else "")
        name += f"@{self.compression}" if self.compression else ""
        name += f"+{self.optimizer}" if self.optimizer else ""
        return name + (LOCAL_MOMENT_SUFFIX if self.second_moment == "local" else "")


def parse_method(method: str) -> Method:
    """Read a method name (the module docstring's grammar); ``ValueError`` names the part that is wrong."""

    def wrong(reason: str) -> ValueError:
        return ValueError(f"method {method!r}: {reason}")

    front, plus, optimizer = method.partition("+")
    base, at, compression = front.partition("@")
    base, tilde, local = base.partition("~")
    stem = base.removesuffix(TRACKING_SUFFIX)
    second_moment = "local" if optimizer.endswith(LOCAL_MOMENT_SUFFIX) else "average"
    optimizer = optimizer.removesuffix(LOCAL_MOMENT_SUFFIX)
    if second_moment == "local" and base == "ddp":
        raise wrong(f"ddp takes no '{LOCAL_MOMENT_SUFFIX}'; its optimizer sees the all-reduced gradient")
    if plus and optimizer not in OPTIMIZERS:
        raise wrong(f"unknown optimizer {optimizer!r} after '+'; choose one of {', '.join(OPTIMIZERS)}")
    rounds: dict[str, Any] = {}
    if tilde:
        match = LOCAL.fullmatch(local)
        if base == "ddp" or match is None:
            raise wrong(
                "after '~' write hH for H local steps per round, then n for DiLoCo's outer optimizer, dD for "
                "a delay of D steps and p for paced rounds (e.g. 'ring~h8n', 'ring~h8nd0', 'ring~h8n0.1p'), "
                f"after a gossip topology, got {local!r}"
            )
        number = lambda key, kind: None if match[key] is None else kind(match[key])  # noqa: E731
        rounds = dict(sync_every=int(match["every"]), nesterov=match["nesterov"] is not None)
        rounds |= dict(outer_lr=number("lr", float), outer_momentum=number("momentum", float))
        rounds |= dict(sync_delay=number("delay", int), paced=match["paced"] is not None)
        if rounds["sync_delay"] is not None and rounds["sync_delay"] > rounds["sync_every"]:
            raise wrong(f"the delay d{match['delay']} exceeds the round of h{match['every']} steps")
    if at and base == "ddp":
        raise wrong(
            f"ddp takes no compression, got {compression!r}; all-reduce sends full-precision gradients. "
            f"Drop '@{compression}', or compress a gossip topology, e.g. 'ring@{compression}'."
        )
    if at:
        try:
            resolve_compression(compression)
        except ValueError:
            raise wrong(
                f"unknown compression {compression!r} after '@'; choose one of {', '.join(COMPRESSIONS)}, "
                "a sparse format such as 'topk:0.01:int2' (or leave out '@' for none)"
            ) from None
    if stem == "ddp" and stem != base:
        raise wrong(
            "ddp takes no gradient tracking; all-reduce steps every rank with the exact average gradient. "
            f"Drop '{TRACKING_SUFFIX}', or track on a gossip topology, e.g. 'ring{TRACKING_SUFFIX}'."
        )
    if base.endswith(TRACKING_SUFFIX + MODULE_SUFFIX):
        reordered = base.removesuffix(TRACKING_SUFFIX + MODULE_SUFFIX) + MODULE_SUFFIX + TRACKING_SUFFIX
        raise wrong(
            f"'{TRACKING_SUFFIX}' comes after '{MODULE_SUFFIX}'; write {reordered + method[len(base) :]!r}"
        )
    if rounds.get("paced") and stem != base:
        raise wrong(f"paced rounds ('p') take no gradient tracking (its trackers are gossiped every step); "
                    f"drop '{TRACKING_SUFFIX}' or 'p'")  # fmt: skip
    if base == "ddp":
        return Method(topology=None, optimizer=optimizer or None)
    topology = stem.removesuffix(MODULE_SUFFIX)
    try:  # an unknown name fails here, before any worker starts training
        TopologyFactory.get(topology)
    except ValueError as error:
        raise wrong(str(error)) from None
    front_end = dict(topology=topology, module=stem.endswith(MODULE_SUFFIX), tracking=stem != base)
    wire = dict(compression=compression or None, optimizer=optimizer or None, second_moment=second_moment)
    return Method(**front_end, **wire, **rounds)


def optimizer_factory(name: str, lr: float, adam_lr: float) -> OptimizerFactory:
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
    """Muon (``adjust_lr_fn="match_rms_adamw"``: AdamW's learning rate carries over) on the hidden matrices,
    AdamW on the rest, as one optimizer whose param groups are the two's own (schedulers drive both)."""

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
