"""Links shared in time: each link's rate split among the transfers crossing it at that instant.

A :class:`Transfer` is one collective's data: its hops (a ring all-reduce's member-to-successor sends)
run in lock step, so they all move at one rate, and each hop crosses zero or more shared links
(:class:`SharedLink`: one direction of one node's link). Between events the rates are weighted
max-min fair (progressive filling): raise every transfer's hop rate in proportion to its weight; a
link is full when the rates of the hops crossing it add up to its bandwidth, and the transfers
crossing it stop there; a transfer also stops at its own ``cap`` (the fastest its hops go alone,
e.g. a node's loopback). The rates are recomputed whenever a transfer starts or ends
(:class:`LinkSharing`), so transfers share a link only while they overlap in time.

The weights are the :class:`SharingModel`'s. With equal weights (the default) two transfers of ``T``
seconds alone, the second starting ``delta`` later, both end at ``2 T`` from the first's start: the
first after ``2 T - delta``, the second after ``2 T - delta`` too. TCP through a shaped link with a
deep FIFO queue (``tc tbf``) favours the transfer already running: the newcomer's packets queue
behind the incumbent's, and its congestion window grows by one doubling per (queued) round trip, so
its share grows from little. ``doubling_s`` models that: a transfer that started ``a`` seconds
earlier weighs ``2 ** (a / doubling_s)`` times more; ``head_start_s`` models the race between
transfers that start together (one wins it): each transfer counts as having started up to that much
earlier, drawn uniformly from a generator seeded with ``seed``.

Progressive filling hands what a transfer held back on one link leaves of another to the transfers
still climbing there, at once. With ``reclaim=False`` it does not: each link is split by weight among
the transfers crossing it, and a transfer runs at the least of its splits (and its cap), leaving the
rest of its larger splits unused. TCP behaves more like that after a race through a FIFO queue: the
stream that lost it backs off (dropped packets, a halved congestion window) rather than taking up at
once what a neighbour held back elsewhere leaves.

A transfer's latency (``latency_s``, its sequential messages' latencies) is added after its last byte.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["LinkSharing", "SharedLink", "SharingModel", "Transfer", "transfer_seconds"]

#: A transfer whose bits left are this small a share of its total has ended (float rounding of the
#: rate changes along the way, never a real remainder: a byte of a 1 GB transfer is 1e-9 of it).
_DONE = 1e-12

_Key = TypeVar("_Key", bound=Hashable)


@dataclass(frozen=True)
class SharedLink:
    """One direction of a link that transfers share: ``bandwidth`` bits per second, named by ``key``."""

    key: Hashable
    bandwidth: float


@dataclass(frozen=True)
class Transfer:
    """``nbytes`` on every hop, the hops in lock step at one rate, then ``latency_s``.

    Args:
        nbytes: bytes each hop carries.
        crossings: ``(link, hops)``: each shared link the transfer uses and how many of its hops cross it.
        cap: the rate (bits per second) of a hop alone; ``math.inf`` for none (then ``crossings`` or
            ``nbytes = 0`` must bound it).
        latency_s: seconds after the last byte (sequential messages' latencies).
    """

    nbytes: float
    crossings: tuple[tuple[SharedLink, int], ...] = ()
    cap: float = math.inf
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.nbytes < 0 or self.latency_s < 0 or not self.cap > 0:
            raise ValueError(
                f"a transfer needs nbytes >= 0, latency_s >= 0 and cap > 0, got nbytes={self.nbytes}, "
                f"latency_s={self.latency_s}, cap={self.cap}"
            )
        if self.nbytes > 0 and self.cap == math.inf and not self.crossings:
            raise ValueError("a transfer of bytes needs a finite cap or a shared link to bound its rate")

    @classmethod
    def fixed(cls, seconds: float) -> Transfer:
        """A transfer that takes ``seconds`` whatever else runs (it shares no link)."""
        return cls(0.0, latency_s=seconds)

    def seconds_alone(self) -> float:
        """Seconds with no other transfer running."""
        rate = min([self.cap] + [link.bandwidth / hops for link, hops in self.crossings])
        return (8.0 * self.nbytes / rate if self.nbytes else 0.0) + self.latency_s


@dataclass(frozen=True)
class SharingModel:
    """How transfers that overlap split a link (see the module docstring).

    Args:
        doubling_s: an earlier start of this many seconds doubles a transfer's share weight (0: every
            transfer weighs the same, max-min fair sharing).
        head_start_s: every transfer counts as started up to this many seconds earlier, at random.
        seed: seed of the head starts.
        reclaim: whether a transfer takes up what another, held back on a different link, leaves of
            a link it shares with it (max-min fair sharing); False: each runs at its least weighted
            split of the links it crosses.
    """

    doubling_s: float = 0.0
    head_start_s: float = 0.0
    seed: int = 0
    reclaim: bool = True

    def __post_init__(self) -> None:
        if self.doubling_s < 0 or self.head_start_s < 0 or (self.head_start_s and not self.doubling_s):
            raise ValueError(
                f"need doubling_s >= 0 and head_start_s >= 0 (> 0 only with doubling_s > 0), got "
                f"doubling_s={self.doubling_s}, head_start_s={self.head_start_s}"
            )


@dataclass
class _Flow:
    transfer: Transfer
    bits_left: float
    since: float  # when bits_left was last brought up to date
    started: float  # minus its head start
    rate: float = 0.0
    version: int = 0  # bumped at every rate change: older entries of the finish heap are stale

    def finish(self) -> float:
        if self.bits_left <= 0:
            return self.since
        return self.since + self.bits_left / self.rate if self.rate > 0 else math.inf


class LinkSharing(Generic[_Key]):
    """Transfers in flight on shared links; call in time order (:meth:`start`, :meth:`next_end`, :meth:`end`).

    Only the transfers linked to a starting or ending one through shared links (its component) get
    new rates, so a large cluster whose transfers share nothing costs one transfer's work per event.
    """

    def __init__(self, model: SharingModel = SharingModel()) -> None:
        self.model = model
        self._random = random.Random(f"{model.seed}/sharing")  # hashed string: same on every platform
        self._flows: dict[_Key, _Flow] = {}
        self._on_link: dict[SharedLink, set[_Key]] = {}
        self._finishes: list[tuple[float, int, _Key]] = []

    def __bool__(self) -> bool:
        return bool(self._flows)

    def start(self, key: _Key, transfer: Transfer, now: float) -> None:
        """Transfer ``key`` starts at ``now``; the transfers it shares a link with slow down."""
        if key in self._flows:
            raise ValueError(f"transfer {key!r} is already in flight")
        head_start = self._random.uniform(0.0, self.model.head_start_s) if self.model.head_start_s else 0.0
        self._flows[key] = _Flow(transfer, 8.0 * transfer.nbytes, now, now - head_start)
        for link, _ in transfer.crossings:
            self._on_link.setdefault(link, set()).add(key)
        self._share(self._component([key]), now)

    def next_end(self) -> tuple[float, _Key] | None:
        """When the first transfer in flight sends its last byte, and its key (None: nothing in flight)."""
        while self._finishes:
            at, version, key = self._finishes[0]
            flow = self._flows.get(key)
            if flow is not None and flow.version == version:
                return at, key
            heapq.heappop(self._finishes)
        return None

    def end(self, key: _Key, now: float) -> Transfer:
        """Transfer ``key`` has sent its last byte at ``now``: its links' share goes to the others."""
        flow = self._flows.pop(key)
        neighbours: set[_Key] = set()
        for link, _ in flow.transfer.crossings:
            self._on_link[link].discard(key)
            neighbours |= self._on_link[link]
        if neighbours:
            self._share(self._component(neighbours), now)
        return flow.transfer

    def _component(self, seeds: Iterable[_Key]) -> list[_Key]:
        """The transfers connected to ``seeds`` through links they share."""
        seen = set(seeds)
        todo = list(seen)
        while todo:
            for link, _ in self._flows[todo.pop()].transfer.crossings:
                for other in self._on_link[link] - seen:
                    seen.add(other)
                    todo.append(other)
        return sorted(seen, key=repr)  # a fixed order: the same rates whatever the set's order

    def _fill(
        self,
        flows: dict[_Key, _Flow],
        weights: dict[_Key, float],
        rates: dict[_Key, float],
        used: dict[SharedLink, float],
    ) -> None:
        """Weighted progressive filling: every free transfer's rate is its weight times one level."""
        while len(rates) < len(flows):
            free = [k for k in flows if k not in rates]
            # the level at which the first link fills up, or a transfer reaches its cap
            level, limited = math.inf, []
            for key in free:
                if flows[key].transfer.cap / weights[key] < level:
                    level, limited = flows[key].transfer.cap / weights[key], [key]
            demand: dict[SharedLink, float] = {}  # weighted hops per link; dict order: first crossed
            crossing: dict[SharedLink, list[_Key]] = {}
            for key in free:
                for link, hops in flows[key].transfer.crossings:
                    demand[link] = demand.get(link, 0.0) + hops * weights[key]
                    crossing.setdefault(link, []).append(key)
            for link, weighed in demand.items():
                fill = max(0.0, link.bandwidth - used.get(link, 0.0)) / weighed
                if fill < level:
                    level, limited = fill, crossing[link]
            if not limited:  # nothing bounds the rest: transfers of no bytes (see Transfer)
                limited = free
            for key in limited:
                rates[key] = level * weights[key]
                for link, hops in flows[key].transfer.crossings:
                    used[link] = used.get(link, 0.0) + hops * rates[key]

    def _split(self, flows: dict[_Key, _Flow], weights: dict[_Key, float], rates: dict[_Key, float]) -> None:
        """Every link split by weight among its transfers' hops; a transfer runs at its least split."""
        demand: dict[SharedLink, float] = {}
        for key, flow in flows.items():
            for link, hops in flow.transfer.crossings:
                demand[link] = demand.get(link, 0.0) + hops * weights[key]
        for key, flow in flows.items():
            splits = [link.bandwidth / demand[link] * weights[key] for link, _ in flow.transfer.crossings]
            rates[key] = min([flow.transfer.cap, *splits])

    def _share(self, keys: Sequence[_Key], now: float) -> None:
        """New hop rates of ``keys`` (see the module docstring); bring their progress up to ``now``."""
        flows = {key: self._flows[key] for key in keys}
        for flow in flows.values():
            if flow.rate > 0:
                flow.bits_left = max(0.0, flow.bits_left - flow.rate * (now - flow.since))
            flow.since = now
        rates: dict[_Key, float] = {}
        latest = max(flow.started for flow in flows.values())
        doubling = self.model.doubling_s
        weights = {  # relative to the latest start; 2 ** 60 already leaves the latest nothing
            key: 2.0 ** min((latest - flow.started) / doubling, 60.0) if doubling else 1.0
            for key, flow in flows.items()
        }
        if self.model.reclaim:
            self._fill(flows, weights, rates, {})
        else:
            self._split(flows, weights, rates)
        for key, flow in flows.items():
            if flow.bits_left <= _DONE * 8.0 * flow.transfer.nbytes:
                flow.bits_left = 0.0
            flow.rate = rates[key]
            flow.version += 1
            heapq.heappush(self._finishes, (flow.finish(), flow.version, key))


def transfer_seconds(
    transfers: Sequence[Transfer], starts: Sequence[float] | None = None, model: SharingModel = SharingModel()
) -> list[float]:
    """Seconds each transfer takes (bytes and latency) when they start at ``starts`` (default: all at 0)."""
    starts = [0.0] * len(transfers) if starts is None else list(starts)
    if len(starts) != len(transfers):
        raise ValueError(f"need one start per transfer, got {len(starts)} for {len(transfers)}")
    order = sorted(range(len(transfers)), key=lambda i: starts[i])
    sharing: LinkSharing[int] = LinkSharing(model)
    ended: dict[int, float] = {}
    waiting = 0
    while waiting < len(order) or sharing:
        upcoming = sharing.next_end()
        if waiting < len(order) and (upcoming is None or starts[order[waiting]] < upcoming[0]):
            i = order[waiting]
            sharing.start(i, transfers[i], starts[i])
            waiting += 1
        else:
            assert upcoming is not None  # the loop's condition: something is in flight
            at, key = upcoming
            ended[key] = at + sharing.end(key, at).latency_s
    return [ended[i] - starts[i] for i in range(len(transfers))]
