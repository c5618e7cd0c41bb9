"""The engine's options as one value: :class:`GossipConfig`, made of parts that check themselves.

A front-end takes ``config=`` and today's keywords (``topology="ring"``, ``sync_every=8``, ...); the
keywords build the config (:meth:`~decent_optim_wrapper.GossipConfig.merge`), so every option reaches
the engine through one object and each door forwards them in one line. Each part checks its own
fields, and the combinations inside it (gradient tracking with rounds), when it is built, with the
messages the options always had (the argument, the value, the fix). What depends on the world or on
several parts at once (surviving a lost peer with a device mesh, paced rounds of sharded replicas) is
checked where the world is known, in one place:
:func:`~decent_optim_wrapper.engine.layout.build_parts`.

The parts, in the order the keywords are documented:

* :class:`Placement` -- where this rank gossips: ``rank``, ``world_size``, ``local_world_size``,
  ``device_mesh``, ``process_group``;
* :class:`Transport` -- how rounds travel: ``bucket_cap_mb``, ``timeout``, ``compression``,
  ``host_staging``;
* :class:`Rounds` -- when ranks exchange and what with: ``gradient_tracking``, ``sync_every``,
  ``outer_optimizer``, ``sync_delay``, ``pacing``;
* :class:`Robustness` -- what a round lets in: ``nonfinite_guard``, ``clipped_gossip``;
* :class:`Elasticity` -- who may leave and join: ``on_peer_failure``, ``store``;

beside ``topology`` and ``second_moment``. Example::

    config = GossipConfig(
        topology="ring", rounds=Rounds(sync_every=8), robustness=Robustness(clipped_gossip=True)
    )
    optimizer = DecentOptimWrapper(torch.optim.AdamW(model.parameters()), config=config)
    # the same as DecentOptimWrapper(..., topology="ring", sync_every=8, clipped_gossip=True)
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from typing import Any, TypedDict

import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]
from torch.distributed.device_mesh import DeviceMesh

from decent_optim_wrapper.engine.exchange.audit import Audit
from decent_optim_wrapper.engine.exchange.clipping import ClippedGossipSpec, resolve_clipped_gossip
from decent_optim_wrapper.engine.exchange.gathered import MixRule
from decent_optim_wrapper.engine.options import (
    DEFAULT_TIMEOUT,
    TopologySpec,
    check_bucket_cap,
    check_host_staging,
    check_peer_failure_mode,
    check_timeout,
)
from decent_optim_wrapper.engine.rules.local_steps import OuterFactory, resolve_local_steps
from decent_optim_wrapper.engine.rules.pacing import PacingSpec, resolve_pacing
from decent_optim_wrapper.engine.rules.second_moment import check_second_moment
from decent_optim_wrapper.engine.wire.compression import CompressionSpec, resolve_compression

__all__ = [
    "Elasticity",
    "GossipConfig",
    "GossipOptions",
    "KeywordOptions",
    "Placement",
    "Robustness",
    "Rounds",
    "Transport",
    "given",
]


def _option(*, canonical: Callable[[Any], object] | None = None, agreed: bool = False) -> dict[str, Any]:
    """The metadata of an option's field. ``canonical``: what its spellings stand for (``True`` and
    ``ClippedGossip()`` ask for the same), to compare a keyword with a config; ``agreed``: every rank of the
    job passes the same value (compared as ``canonical`` gives it, before the first collective) and a
    joiner shares it, under the option's name (:meth:`GossipConfig.agreed`)."""
    return {"canonical": canonical, "agreed": agreed}


def _check_flag(name: str, value: object, fix: str = "") -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}{fix}.")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where this rank gossips. Checked against the running job when the engine is built
    (:func:`~decent_optim_wrapper.engine.fleet.world.resolve_gossip_world`): each field defaults to the
    job's (or the group's) own."""

    rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    device_mesh: DeviceMesh | None = None
    process_group: dist.ProcessGroup | None = None


@dataclass(frozen=True, kw_only=True)
class Transport:
    """How a round's bytes travel: bucket size, patience, wire format and host staging."""

    bucket_cap_mb: float = 25
    timeout: timedelta = DEFAULT_TIMEOUT
    compression: CompressionSpec = field(default=None, metadata=_option(canonical=resolve_compression))
    host_staging: bool | None = None

    def __post_init__(self) -> None:
        check_bucket_cap(self.bucket_cap_mb)
        check_timeout(self.timeout)
        resolve_compression(self.compression)
        check_host_staging(self.host_staging)

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 2**20)


@dataclass(frozen=True, kw_only=True)
class Rounds:
    """When ranks exchange, and what: every step (the default), with a gradient tracker, or in rounds of
    local steps (low-communication gossip, optionally paced)."""

    gradient_tracking: bool = field(default=False, metadata=_option(agreed=True))
    sync_every: int = 1
    outer_optimizer: OuterFactory | None = None
    sync_delay: int | None = None
    pacing: PacingSpec = field(default=None, metadata=_option(canonical=resolve_pacing))

    def __post_init__(self) -> None:
        _check_flag("gradient_tracking", self.gradient_tracking)
        resolve_local_steps(
            self.sync_every, self.sync_delay, self.outer_optimizer, resolve_pacing(self.pacing)
        )
        self._check_tracking_composes()

    def _check_tracking_composes(self) -> None:
        """Refuse gradient tracking with paced rounds or low-communication gossip: the trackers are
        gossiped after every step, rounds once per round. Paced rounds are named first: they use rounds
        whatever ``sync_every`` is."""
        if not self.gradient_tracking:
            return
        if self.pacing is not None:
            raise ValueError(
                f"pacing={self.pacing!r} cannot be combined with gradient_tracking=True: the trackers are "
                "gossiped after every step, but paced ranks take different numbers of steps per round. Pass "
                "pacing=None to track gradients, or gradient_tracking=False to pace the rounds."
            )
        defaults = Rounds()
        rounds = [
            f"{name}={getattr(self, name)!r}"
            for name in ("sync_every", "sync_delay", "outer_optimizer")
            if getattr(self, name) != getattr(defaults, name)
        ]
        if rounds:
            raise ValueError(
                f"gradient_tracking=True cannot be combined with low-communication gossip "
                f"({', '.join(rounds)}): the trackers are gossiped after every step, low-communication "
                "gossip once per round. Pass gradient_tracking=False to keep the rounds, or leave "
                "sync_every=1, sync_delay=None and outer_optimizer=None (the defaults) to track gradients."
            )


@dataclass(frozen=True, kw_only=True)
class Robustness:
    """What a round lets into a replica: nothing that is not finite (the guard), and with clipped
    gossip no neighbour's difference beyond a radius.

    A rule of how rounds are mixed is a field here and the rule :meth:`mix_rule` gives: the engine hands
    it to every round it wires (parameters, trackers, anchors), and ranks agree on it by its field's
    metadata, so that nothing else names it."""

    nonfinite_guard: bool = True
    clipped_gossip: ClippedGossipSpec = field(
        default=None, metadata=_option(canonical=resolve_clipped_gossip, agreed=True)
    )

    def __post_init__(self) -> None:
        _check_flag(
            "nonfinite_guard", self.nonfinite_guard, "; True (the default) keeps inf/NaN out of the replicas"
        )
        resolve_clipped_gossip(self.clipped_gossip)

    def audit(self) -> Audit | None:
        """Clipped gossip's audit (:mod:`~.exchange.audit`), or None (no clipped gossip, or no audit)."""
        clipped = resolve_clipped_gossip(self.clipped_gossip)
        return None if clipped is None or clipped.audit_every is None else Audit(clipped.audit_every)

    def mix_rule(self) -> MixRule | None:
        """The rule gathered rounds are mixed by (:class:`~.gathered.MixRule`): clipped gossip's options;
        None: plain differences."""
        return resolve_clipped_gossip(self.clipped_gossip)


@dataclass(frozen=True, kw_only=True)
class Elasticity:
    """Who may leave and join: the policy on a lost peer, and the store survivors and joiners meet in."""

    on_peer_failure: str = "raise"
    store: Store | None = None

    def __post_init__(self) -> None:
        check_peer_failure_mode(self.on_peer_failure)

    @property
    def survives(self) -> bool:
        """Whether the members go on without a lost peer (and admit joiners)."""
        return self.on_peer_failure == "continue"


@dataclass(frozen=True, kw_only=True)
class GossipConfig:
    """Every option of the engine, as one frozen value of self-checking parts (the module docstring).

    Build it with the parts, or from the keywords with :meth:`from_options`; :meth:`options` gives the
    keywords back and :meth:`with_options` a copy with some changed.
    """

    topology: TopologySpec = "ring"
    placement: Placement = field(default_factory=Placement)
    transport: Transport = field(default_factory=Transport)
    rounds: Rounds = field(default_factory=Rounds)
    robustness: Robustness = field(default_factory=Robustness)
    elasticity: Elasticity = field(default_factory=Elasticity)
    second_moment: str = field(default="average", metadata=_option(agreed=True))

    def __post_init__(self) -> None:
        for part in _PART_TYPES:
            value = getattr(self, part)
            if not isinstance(value, _PART_TYPES[part]):
                raise TypeError(
                    f"GossipConfig({part}=...) must be a {_PART_TYPES[part].__name__}, got {value!r}; e.g. "
                    f"GossipConfig({part}={_PART_TYPES[part].__name__}(...))."
                )
        check_second_moment(self.second_moment)

    # -- keywords ----------------------------------------------------------------------------------
    @classmethod
    def keywords(cls) -> tuple[str, ...]:
        """Every keyword a front-end accepts for the config, in documentation order."""
        return tuple(_KEYWORD_PART)

    @classmethod
    def from_options(cls, **options: Any) -> GossipConfig:
        """The config the keywords describe, the rest at their defaults."""
        return cls().with_options(**options)

    def options(self) -> dict[str, object]:
        """The keywords this config stands for, every one of them."""
        return {name: self._get(name) for name in _KEYWORD_PART}

    def with_options(self, **options: Any) -> GossipConfig:
        """A copy with the keywords ``options`` changed (each part checks itself again)."""
        _check_known(options)
        changes: dict[str, Any] = {}
        by_part: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            part = _KEYWORD_PART[name]
            if part is None:
                changes[name] = value
            else:
                by_part.setdefault(part, {})[name] = value
        for part, values in by_part.items():
            changes[part] = replace(getattr(self, part), **values)
        return replace(self, **changes)

    @classmethod
    def merge(cls, config: GossipConfig | None, options: Mapping[str, Any]) -> GossipConfig:
        """``config`` (default: the defaults) with the keywords ``options`` set: a front-end's way to
        take both. A keyword ``config`` already sets to another value is an error naming both."""
        _check_known(options)
        if config is None:
            return cls.from_options(**options)
        if not isinstance(config, GossipConfig):
            raise TypeError(f"config must be a GossipConfig or None, got {config!r}.")
        for name, value in options.items():
            given = config._get(name)
            if not _same(name, given, value):
                raise ValueError(
                    f"{name}={value!r} contradicts config=, which has {name}={given!r}; pass the option in "
                    f"one place: config.with_options({name}=...), or leave the keyword out."
                )
        return config

    def agreed(self) -> tuple[tuple[str, object], ...]:
        """The options every rank of the job passes alike and a joiner shares, by name, each as the value
        its spellings stand for: the fields marked so (the engine's layout compares them before the
        first collective, so a new one needs no list of its own)."""
        return tuple((name, _canonical(name, self._get(name))) for name in _AGREED)

    def _get(self, name: str) -> object:
        part = _KEYWORD_PART[name]
        return getattr(self if part is None else getattr(self, part), name)


#: The parts, by field name (built from the dataclass: a new part is a new field).
_PART_TYPES: dict[str, type] = {
    f.name: f.default_factory  # type: ignore[misc]
    for f in fields(GossipConfig)
    if isinstance(f.default_factory, type)
}

#: Each keyword's part (None: a field of the config itself), in documentation order.
_KEYWORD_PART: dict[str, str | None] = {}
for _field in fields(GossipConfig):
    if _field.name in _PART_TYPES:
        _KEYWORD_PART.update((f.name, _field.name) for f in fields(_PART_TYPES[_field.name]))
    else:
        _KEYWORD_PART[_field.name] = None


def _check_known(options: Mapping[str, Any]) -> None:
    for name in options:
        if name not in _KEYWORD_PART:
            close = difflib.get_close_matches(name, list(_KEYWORD_PART), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TypeError(
                f"unexpected keyword argument {name!r}: not an option of the engine; {hint}the options are "
                f"{', '.join(_KEYWORD_PART)} (see GossipConfig)."
            )


#: Each keyword's field metadata (:func:`_option`; empty for a plain option).
_METADATA: dict[str, Mapping[str, Any]] = {
    f.name: f.metadata
    for part in (GossipConfig, *_PART_TYPES.values())
    for f in fields(part)
    if f.name in _KEYWORD_PART
}

#: The options whose values have several spellings, with what each spelling stands for.
_CANONICAL: dict[str, Callable[[Any], object]] = {
    name: meta["canonical"] for name, meta in _METADATA.items() if meta.get("canonical") is not None
}

#: The options every rank passes alike (:meth:`GossipConfig.agreed`), in documentation order.
_AGREED = tuple(name for name in _KEYWORD_PART if _METADATA[name].get("agreed"))


def _canonical(name: str, value: object) -> object:
    canonical = _CANONICAL.get(name)
    return value if canonical is None else canonical(value)


def _same(name: str, a: object, b: object) -> bool:
    """Whether two values of option ``name`` ask for the same thing (``"measured"`` and ``Pacing()`` do)."""
    if a is b or a == b:
        return True
    canonical = _CANONICAL.get(name)
    if canonical is None:
        return False
    try:
        return bool(canonical(a) == canonical(b))
    except (TypeError, ValueError):  # a value that is not an option's is never the same as another
        return False


class KeywordOptions(TypedDict, total=False):
    """The keywords every front-end takes by name only: those of :class:`GossipOptions` but the five that
    decent-optim-wrapper 0.1.1 and decent-dp also took by position."""

    device_mesh: DeviceMesh | None
    process_group: dist.ProcessGroup | None
    timeout: timedelta
    compression: CompressionSpec
    host_staging: bool | None
    gradient_tracking: bool
    sync_every: int
    outer_optimizer: OuterFactory | None
    sync_delay: int | None
    pacing: PacingSpec
    nonfinite_guard: bool
    clipped_gossip: ClippedGossipSpec
    on_peer_failure: str
    store: Store | None
    second_moment: str


class PositionalOptions(TypedDict, total=False):
    """The five options decent-optim-wrapper 0.1.1 and decent-dp also took by position."""

    topology: TopologySpec
    rank: int | None
    world_size: int | None
    local_world_size: int | None
    bucket_cap_mb: float


class GossipOptions(PositionalOptions, KeywordOptions, total=False):
    """The keywords a front-end accepts besides ``config=``: one per field of :class:`GossipConfig`'s
    parts (a test holds the two equal), each described in the front-ends' docstrings."""


def given(**options: Any) -> PositionalOptions:
    """The options among ``options`` that were given (not None): a front-end's positional arguments,
    whose None means "not passed" (the config's value then stands)."""
    return {name: value for name, value in options.items() if value is not None}  # type: ignore[return-value]
