"""The engine's counters for a logger: what happened since the last read, as plain numbers.

:class:`GossipMetrics` turns the engine's running totals (steps, rounds, time spent waiting for
rounds, guard events, peers lost and joined) into the change since its previous read, under stable
names (:data:`METRIC_NAMES`). :class:`WaitClock` adds the one total the engine did not keep: host
seconds spent waiting for gossip rounds to arrive. Reading is local: no collective, no device sync,
a few additions (so a logger may read every step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.exchange.gossip import Waiter

__all__ = ["GUARD_KINDS", "METRIC_NAMES", "CounterTotals", "GossipMetrics", "WaitClock"]

#: The guard's event kinds (:class:`~.exchange.guard.GuardEvent`), each counted as ``guard/<kind>``.
GUARD_KINDS = ("withheld", "healed", "peer_withheld", "not_finite", "dropped")

#: Every name :meth:`GossipMetrics.read` returns, with its unit and meaning (the docs list these).
METRIC_NAMES: dict[str, str] = {
    "gossip/steps": "steps completed since the last read",
    "gossip/rounds": "gossip rounds launched since the last read (one per step, or per sync_every steps)",
    "gossip/bytes_sent": "bytes this rank sent since the last read (steps x gossip/bytes_per_step)",
    "gossip/bytes_per_step": "bytes this rank sends per step now (nominal, from the topology and layout)",
    "gossip/wait_s": "seconds this rank's host waited for gossip rounds to arrive since the last read",
    **{f"guard/{kind}": f"guard events {kind!r} since the last read" for kind in GUARD_KINDS},
    "guard/forged_entries": "store entries without the job's secret refused since the last read",
    "fleet/world_size": "ranks gossiping together now",
    "fleet/losses": "peers lost and survived since the last read",
    "fleet/joins": "admissions of new workers since the last read",
}


@dataclass(frozen=True)
class CounterTotals:
    """The engine's running totals at one moment (what :meth:`GossipMetrics.read` differences).

    Attributes:
        steps: completed steps. rounds: rounds launched. wait_s: seconds waited for rounds.
        bytes_per_step: bytes sent per step now. world_size: ranks gossiping together now.
        guard: guard events and refused store entries (``forged_<kind>``) by kind.
        losses: peers lost so far. joins: admissions so far.
    """

    steps: int
    rounds: int
    wait_s: float
    bytes_per_step: float
    world_size: int
    guard: Mapping[str, int]
    losses: int
    joins: int


class GossipMetrics:
    """The change of the engine's totals between two reads, with their names.

    Each read starts from the previous read's totals (the first from construction). A count that went
    down (a checkpoint loaded an earlier step) reads as 0, never negative. ``gossip/bytes_sent`` counts
    the steps since the last read at the bytes per step of the read: a change of members between two
    reads counts that interval at the new rate.
    """

    def __init__(self, totals: Callable[[], CounterTotals]) -> None:
        self._totals = totals
        self._last = totals()

    def read(self) -> dict[str, float | int]:
        """The counters since the previous read, by the names of :data:`METRIC_NAMES`."""
        now, last = self._totals(), self._last
        self._last = now
        steps = max(0, now.steps - last.steps)

        def change(name: str) -> int:
            return max(0, now.guard.get(name, 0) - last.guard.get(name, 0))

        forged = sum(
            max(0, count - last.guard.get(name, 0))
            for name, count in now.guard.items()
            if name.startswith("forged_")
        )
        return {
            "gossip/steps": steps,
            "gossip/rounds": max(0, now.rounds - last.rounds),
            "gossip/bytes_sent": steps * now.bytes_per_step,
            "gossip/bytes_per_step": now.bytes_per_step,
            "gossip/wait_s": max(0.0, now.wait_s - last.wait_s),
            **{f"guard/{kind}": change(kind) for kind in GUARD_KINDS},
            "guard/forged_entries": forged,
            "fleet/world_size": now.world_size,
            "fleet/losses": max(0, now.losses - last.losses),
            "fleet/joins": max(0, now.joins - last.joins),
        }


class WaitClock:
    """Host seconds spent in the rounds' waits: :meth:`timed` wraps a :data:`~.exchange.gossip.Waiter`.

    Two ``time.perf_counter()`` calls per wait, nothing else: on CPU (gloo) the wait blocks the host,
    so this is the time the step stood still for its peers; on an accelerator (NCCL) the wait is
    stream-ordered and returns at once, so this stays near 0 and the device's own wait is not seen.
    """

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, waiter: Waiter) -> Waiter:
        """``waiter``, adding the time each call takes (raised or not) to ``seconds``."""

        def wait(
            works: Sequence[dist.Work],
            device: torch.device,
            timeout: timedelta | None,
            failure: Callable[[BaseException | None], Exception],
        ) -> None:
            started = time.perf_counter()
            try:
                waiter(works, device, timeout, failure)
            finally:
                self.seconds += time.perf_counter() - started

        return wait
