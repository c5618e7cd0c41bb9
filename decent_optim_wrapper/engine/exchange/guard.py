r"""Guarded mixing: a value that is not finite never enters a replica through gossip.

One bad worker (a loss that overflows, failing memory, a mistaken build) would otherwise poison the
whole fleet: its NaN reaches its neighbours at the next mix, theirs at the one after, and every
replica is lost for good. Every rank keeps a whole replica of its own, so gossip can do better than
an all-reduce here. The rules, per bucket and round (:class:`~.gossip.Gossip` applies them):

**Withholding.** At launch a member checks what it is about to send (one sum over the bucket: it
is finite unless some entry is inf/NaN). If it is not finite, the member sends zeros instead and
raises its flag (one slot per member travels with the values in the same collective).

**Mixing.** With ``k`` members, peer weight ``c``, own weight ``w``, ``m`` flags raised and ``S`` the
all-reduced sum of what was sent, a member that sent mixes

.. math::
    x_i \leftarrow (w - c + m c)\, x_i + S

(the withheld members' weight stays with the receiver: every row still sums to one, so the honest
members' mean within the group is kept), and a member that withheld *heals* from the others:

.. math::
    x_i \leftarrow S / ((k - m)\, c),

the average of the members that sent. Entries of ``S`` that are not finite (a payload altered after
its sender's check: nobody can tell whose) are not mixed: every member sees the same sum, so all
keep their own values there and the mean is kept. Compressed rounds gather every member's payload
separately: a withheld member sends a zero difference (it counts as holding the group's reference,
a recent average) and heals to ``r + c s``; a payload that decodes to values that are not finite is
read as zero by every member alike (an all-gather delivers the same bytes to all), so the
references stay identical.

**Healing what the replica's step needs.** A bucket healed this way had NaN/inf in it, and so, most
likely, has the optimizer state that stepped it: the engine tells its front-end, which drops the
inner optimizer's state of that bucket's parameters (it starts again as at the first step), and
low-communication gossip drops the outer optimizer's state and restarts the inner progress from
the healed anchor.

**When nothing can heal** (every member of the round withheld), the rank raises
:class:`NonFiniteReplicaError` naming the step, the bucket and what was gossiped; its peers then
see it as a lost peer and follow their ``on_peer_failure`` policy.

Cost: one sum over each bucket at launch and one over each received sum at the mix, read on the host:
free of device syncs on CPU and when rounds are staged through host buffers (the GPU fleet path);
gossip directly between GPUs reads the flags with one small sync per mixed bucket.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from loguru import logger
from torch.utils.hooks import RemovableHandle

from decent_optim_wrapper.engine.errors import DecentError

__all__ = [
    "GuardEvent",
    "GuardLog",
    "NonFiniteReplicaError",
    "all_finite",
    "drop_state",
    "heal_from_peers",
    "withhold_if_nonfinite",
]


class NonFiniteReplicaError(DecentError):
    """This rank's replica holds inf/NaN and no peer could give it finite values to heal from."""


@dataclass(frozen=True)
class GuardEvent:
    """Something guarded mixing did, as the hooks see it.

    Attributes:
        kind: ``"withheld"`` (this rank's values were not finite and were left out of the round: it
            sent zeros, or, in a gathered round, every member left its slot out), ``"healed"`` (this
            rank took its peers' values in place of its own), ``"peer_withheld"`` (peers sent nothing:
            their weight stayed with this rank), ``"not_finite"`` (entries of a received sum or payload
            were not finite and were left out), ``"dropped"`` (clipped gossip: the differences of
            ``senders`` were beyond ``drop_beyond`` radii and left out, their weight kept here),
            ``"quarantined"`` (clipped gossip's audit found the values ``senders`` sent far from every
            other rank's: see :mod:`~.audit`).
        step: the step (or, for low-communication gossip, the inner step) the round was launched at.
        bucket: the bucket's position (-1: every bucket).
        tensors: what was gossiped: ``"parameters"``, ``"anchors"`` or ``"trackers"``.
        group: the round's members.
        senders: the ranks whose payload was left out (empty when nobody can tell: a plain round's sum).
        entries: for ``"not_finite"`` in a plain round's sum, how many entries were left out (0 when
            whole payloads were: a gathered round, ``senders`` names whose).
    """

    kind: str
    step: int
    bucket: int
    tensors: str
    group: tuple[int, ...]
    senders: tuple[int, ...] = ()
    entries: int = 0


@dataclass
class GuardLog:
    """The events of one rank: counted, logged once per kind and sender, passed to the hooks."""

    rank: int
    enabled: bool = True  # False: this rank checks nothing (its flags travel as zeros)
    counts: Counter[str] = field(default_factory=Counter)
    hooks: OrderedDict[int, Callable[[GuardEvent], None]] = field(default_factory=OrderedDict)
    _logged: set[tuple[str, str, tuple[int, ...]]] = field(default_factory=set)

    def register_hook(self, hook: Callable[[GuardEvent], None]) -> RemovableHandle:
        """Call ``hook(event)`` on every event of this rank; the handle's ``remove()`` unregisters it."""
        if not callable(hook):
            raise TypeError(f"hook must be callable with a GuardEvent, got {hook!r}.")
        handle = RemovableHandle(self.hooks)
        self.hooks[handle.id] = hook
        return handle

    def record(self, event: GuardEvent) -> None:
        self.counts[event.kind] += 1
        key = (event.kind, event.tensors, event.senders)
        if key not in self._logged:  # once: a rank that stays bad would otherwise flood the log
            self._logged.add(key)
            logger.warning(
                "rank {}: {} ({}, {}, round of step {} in group {}{}); further such events are "
                "counted, not logged",
                self.rank,
                _describe(event),
                event.tensors,
                "every bucket" if event.bucket < 0 else f"bucket {event.bucket}",
                event.step,
                list(event.group),
                f", from ranks {list(event.senders)}" if event.senders else "",
            )
        for hook in list(self.hooks.values()):
            hook(event)


def _describe(event: GuardEvent) -> str:
    return {
        "withheld": "own values not finite, left out of the round",
        "healed": "healed from the peers' values of the round",
        "peer_withheld": "a peer withheld its values, its weight kept",
        "dropped": "a neighbour's difference beyond the clipping cut-off, left out, its weight kept",
        "quarantined": "clipped gossip's audit found a rank's values far from every other's: quarantined",
        "not_finite": (
            f"{event.entries} received entries not finite, left out"
            if event.entries
            else "a received payload not finite, left out whole"
        ),
    }.get(event.kind, event.kind)


def all_finite(values: torch.Tensor) -> bool:
    """Whether every entry of ``values`` is finite: one sum, read on the host (a NaN or inf anywhere
    makes it so; a sum that overflows from finite entries of about 1e38 counts as not finite, which
    no trained replica holds)."""
    wide = torch.float32 if values.dtype in (torch.float16, torch.bfloat16) else None  # fp16 sums overflow
    return math.isfinite(float(values.sum(dtype=wide)))


def withhold_if_nonfinite(values: torch.Tensor, flag: torch.Tensor) -> bool | None:
    """Zero ``values`` and set ``flag`` to 1 if some entry is not finite (else ``flag`` 0).

    Returns whether it withheld, or None where that is not known on the host: on an accelerator the
    decision stays on the device (no sync), and the flag tells the mix.
    """
    if values.device.type == "cpu":
        bad = not all_finite(values)
        if bad:
            values.zero_()
        flag.fill_(1.0 if bad else 0.0)
        return bad
    wide = torch.float32 if values.dtype in (torch.float16, torch.bfloat16) else None
    bad_tensor = torch.isfinite(values.sum(dtype=wide)).logical_not_()
    values.masked_fill_(bad_tensor, 0.0)
    flag.copy_(bad_tensor)
    return None


def heal_from_peers(
    log: GuardLog,
    label: str,
    bucket: int,
    step: int,
    group: tuple[int, ...],
    recorded: bool | None,
    raised: Sequence[int],
    heal: Callable[[], object],
) -> bool:
    """This rank withheld its values in the round of ``step`` in ``group``: take its peers' (``heal``)
    and return True, or raise :class:`NonFiniteReplicaError` if every member withheld (``raised``: the
    members' positions that did). ``recorded``: whether the launch already recorded the withholding."""
    # Recorded at launch when decided there on the host; decided on the device (None), or found at
    # the mix (a gathered round: its own slot not finite, left out by every member), recorded now.
    if not recorded:
        log.record(GuardEvent("withheld", step, bucket, label, group))
    if len(raised) == len(group):
        raise NonFiniteReplicaError(
            f"rank {log.rank}: the {label} of bucket {bucket} are not finite (inf/NaN) and every "
            f"member of the round launched at step {step} in group {list(group)} withheld "
            "its values, so there is nothing finite to heal from. Look for the step that overflowed "
            "(a loss or gradient that became inf/NaN: lower the learning rate, clip gradients, or use "
            "GradScaler), then restart from the last checkpoint."
        )
    heal()
    log.record(GuardEvent("healed", step, bucket, label, group))
    return True


def drop_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    """Forget ``optimizer``'s state of ``params`` (momentum, Adam's moments): it starts again as at
    their first step. A healed bucket's state was computed from the values that were not finite."""
    for param in params:
        if param in optimizer.state:
            del optimizer.state[param]
