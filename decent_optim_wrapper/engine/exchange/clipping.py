r"""Clipped gossip: mixing that a Byzantine neighbour cannot drag far (opt-in, ``clipped_gossip=``).

A neighbour that sends finite but wrong values (a model scaled by 100, random values, the negated
model: on purpose or from a broken build) passes the non-finite guard (:mod:`~.guard`) and, under plain
mixing, moves its receivers as far as it likes. Clipped gossip (after He, Karimireddy and Jaggi,
"Byzantine-robust decentralized learning via ClippedGossip", 2022) mixes each neighbour's *difference*
clipped to a radius:

.. math::
    x_i \leftarrow x_i + \sum_{j \in G(i),\, j \ne i} W_{ij}\,
        \mathrm{clip}(\hat x_j - \hat x_i,\ \tau_i), \qquad
    \mathrm{clip}(d, \tau) = d \cdot \min\Big(1, \frac{\tau}{\lVert d \rVert}\Big),

where ``\hat x_j`` is what member ``j`` sent (its values, or with compression the reference plus its
decoded difference, so that ``\hat x_j - \hat x_i = q_j - q_i``). A neighbour within the radius mixes
exactly as under plain gossip; one beyond it moves ``x_i`` by at most ``W_{ij} \tau_i`` per round.

**Dropping** (``drop_beyond=c``, default 10): a difference longer than ``c \tau_i`` is left out of the
round instead of clipped (its weight stays with ``x_i``), a redescending rule: an attacker far outside
the honest spread (a scaled, random or negated model) then moves its receivers not at all, where
clipping alone still lets it push ``W_{ij} \tau_i`` a round, the same way every round for the negated
model. Until the bucket's window is full (``window`` norms: 32 rounds on a ring with the default), a
difference is dropped only if it is also longer than the receiver's own values, ``\lVert \hat x_j -
\hat x_i \rVert > \lVert x_i \rVert``: replicas start equal, so the first norms are the smallest of
the run and a radius learnt from a few of them would leave out honest neighbours while the spread
grows (measured: one honest difference dropped at the third round of a clean run under the radius
alone), whereas honest replicas of one model stay far closer to each other than to the origin; a
scaled, random or negated model (``\lVert -x - x \rVert = 2 \lVert x \rVert``) is that far from the
first round with a radius on. An honest neighbour that far out later is left out for those rounds
only: its norms still enter the window, so a spread that grows for everyone raises the radius within
half a window of rounds and readmits it.

**Probation** (``probation=P``, default 16): a neighbour whose difference was dropped is left out of
its next ``P`` rounds with the receiver whatever it sends, a drop starting the count again, so that an
attacker cannot alternate rounds beyond the cut-off with rounds that pass the radius (with a receiver
that meets it in both kinds). Honest neighbours are not dropped (above), so probation costs them
nothing. It does not help a receiver that only ever sees the attacker's passing rounds (on a ring of
alternating pairs, an attacker that flips each step shows each neighbour one phase): such a
neighbour is bounded by the radius alone. ``drop_beyond=None`` clips every difference (the published
rule), and no one is put on probation.

**The radius** follows the recent differences: ``\tau_i = \text{factor} \cdot
Q_q(\text{the last ``window`` norms } \lVert \hat x_j - \hat x_i \rVert \text{ this rank received for the
bucket, before this round's})``, the ``q``-quantile (default: the lower quartile, which stays an honest
neighbour's norm while at most three quarters of the samples are an attacker's; fewer samples than four
give their minimum, and none a radius of 0: the bucket's first round mixes nothing of the neighbours, so
an attacker's first difference is never taken whole). Honest differences shrink as the replicas
agree, and the radius with them.

Costs: every round gathers each member's values instead of all-reducing their sum (the same bytes in a
pair, ``k - 1`` models per member in a group of ``k`` instead of ``2 (k - 1) / k``), two more
bucket-sized buffers, one norm per neighbour and bucket (and one of the receiver's values) read on the
host (a device sync on GPUs). Every rank must agree on it (it changes what travels). The mean of the
replicas is no longer kept exactly when a difference is clipped (clipping is not symmetric); global
averaging stays exact.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from decent_optim_wrapper.engine.exchange.audit import Audit
from decent_optim_wrapper.engine.exchange.guard import GuardEvent, GuardLog
from decent_optim_wrapper.engine.exchange.rounds import Channel, Round
from decent_optim_wrapper.engine.wire.compression import codec, round_seed

__all__ = [
    "ClippedGossip",
    "ClippedGossipSpec",
    "ClippedMix",
    "RadiusWindow",
    "clip_scale",
    "resolve_clipped_gossip",
]


@dataclass(frozen=True)
class ClippedGossip:
    """The options of clipped gossip.

    Args:
        factor: the radius is ``factor`` times the quantile of the recent norms (> 0; default 0.5: an
            attacker that pushes the same way every round, such as one sending the negated model,
            drifts its receivers by about its weight times the radius a round, so a tight radius
            matters more than mixing honest outliers whole).
        quantile: which quantile, in ``[0, 1]`` (default 0.25: the lower quartile).
        window: how many recent norms per bucket the quantile is taken over (>= 1; default 32).
        drop_beyond: ``c >= 1`` (default 10): a difference longer than ``c`` radii is left out of the
            round, its weight kept by the receiver (until the window is full, only if it is also longer
            than the receiver's values); None clips every difference.
        probation: after a neighbour's difference was left out, the receiver leaves that neighbour
            out of its next ``probation`` rounds with it whatever it sends (>= 0; default 16), so that
            an attacker cannot alternate attacks with rounds that pass the radius.
        audit_every: every this many steps the ranks compare the values each of them sent, and a rank
            whose values stood far from everyone's is quarantined (:mod:`~.audit`: with
            ``on_peer_failure="continue"`` it leaves and the topology is re-formed without it; else it
            is left out of every mix); >= 1, e.g. 32; None (the default): no audit.
    """

    factor: float = 0.5
    quantile: float = 0.25
    window: int = 32
    drop_beyond: float | None = 10.0
    probation: int = 16
    audit_every: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, int | float) or not self.factor > 0:
            raise ValueError(
                f"ClippedGossip(factor=...) must be a number > 0, got {self.factor!r}; e.g. 3.0."
            )
        if isinstance(self.quantile, bool) or not isinstance(self.quantile, int | float):
            raise ValueError(f"ClippedGossip(quantile=...) must lie in [0, 1], got {self.quantile!r}.")
        if not 0.0 <= self.quantile <= 1.0:
            raise ValueError(f"ClippedGossip(quantile=...) must lie in [0, 1], got {self.quantile!r}.")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"ClippedGossip(window=...) must be an int >= 1, got {self.window!r}; e.g. 32.")
        probation = self.probation
        if isinstance(probation, bool) or not isinstance(probation, int) or probation < 0:
            raise ValueError(
                f"ClippedGossip(probation=...) must be an int >= 0 (rounds), got {probation!r}; e.g. 16."
            )
        every = self.audit_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(
                f"ClippedGossip(audit_every=...) must be None or an int >= 1 (steps), got {every!r}; "
                "e.g. 32 compares the ranks' values every 32 steps."
            )
        drop = self.drop_beyond
        if drop is not None and (
            isinstance(drop, bool) or not isinstance(drop, int | float) or not 1.0 <= drop < math.inf
        ):
            raise ValueError(
                f"ClippedGossip(drop_beyond=...) must be None or a number >= 1 (radii), got {drop!r}; "
                "e.g. 10.0 leaves out differences longer than ten radii."
            )

    def mixer(self, guard: GuardLog, label: str, audit: Audit | None = None) -> ClippedMix:
        """The mix of one :class:`~.gossip.Gossip`'s rounds under these options (a
        :class:`~.gathered.MixRule`): its buckets' radii, their probation and their buffers; it leaves
        out the ranks ``audit`` quarantined."""
        return ClippedMix(self, guard, label, audit)


ClippedGossipSpec = bool | ClippedGossip | None


def resolve_clipped_gossip(spec: object) -> ClippedGossip | None:
    """``clipped_gossip=`` as options: None/False (off), True (the defaults) or a :class:`ClippedGossip`."""
    if spec is None or spec is False:
        return None
    if spec is True:
        return ClippedGossip()
    if isinstance(spec, ClippedGossip):
        return spec
    raise TypeError(
        f"clipped_gossip must be None, True or a ClippedGossip(factor=..., quantile=..., window=...), got "
        f"{spec!r}; True clips each neighbour's difference to half the lower quartile of the recent ones "
        "and leaves it out beyond ten radii."
    )


class RadiusWindow:
    """One bucket's recent difference norms and the radius they give."""

    def __init__(
        self,
        options: ClippedGossip,
        norms: list[float] | None = None,
        probation: dict[int, int] | None = None,
    ) -> None:
        self._options = options
        self._norms: deque[float] = deque(norms or (), maxlen=options.window)
        self._probation = dict(probation or {})  # sender's rank -> its rounds still left out

    def radius(self) -> float:
        """``factor`` times the quantile of the recent norms; 0 before any was seen (the first round
        mixes nothing of the neighbours: nobody can tell an attacker's first difference yet)."""
        if not self._norms:
            return 0.0
        ordered = sorted(self._norms)
        if len(ordered) < 4:
            return self._options.factor * ordered[0]
        position = self._options.quantile * (len(ordered) - 1)
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        value = ordered[low] + (position - low) * (ordered[high] - ordered[low])
        return self._options.factor * value

    def full(self) -> bool:
        """Whether the window holds ``window`` norms (its radius is then trusted on its own)."""
        return len(self._norms) == self._options.window

    def scale(self, norm: float, radius: float, own_norm: float) -> float:
        """The factor of a difference of length ``norm`` at a receiver whose values have length
        ``own_norm``: 1 within ``radius``, clipped beyond it, 0 (dropped) beyond ``drop_beyond`` radii
        once the window is full, or before that if it is also longer than ``own_norm``."""
        drop = self._options.drop_beyond
        if drop is not None and not self.full() and norm <= own_norm:
            drop = None  # warm-up: a radius of a few early norms alone does not leave anyone out
        return clip_scale(norm, radius, drop)

    def judge(self, sender: int, norm: float, radius: float, own_norm: float) -> float:
        """:meth:`scale`, with probation: a sender whose difference is dropped is left out of its next
        ``probation`` rounds with this receiver too (a drop starts the count again)."""
        scale = self.scale(norm, radius, own_norm)
        if scale == 0.0 and radius > 0.0:  # beyond the cut-off (0 only then, with a radius)
            if self._options.probation > 0:
                self._probation[sender] = self._options.probation
            return 0.0
        left = self._probation.pop(sender, 0)
        if left > 0:
            if left > 1:
                self._probation[sender] = left - 1
            return 0.0
        return scale

    def on_probation(self) -> dict[int, int]:
        return dict(self._probation)

    def add(self, norms: list[float]) -> None:
        self._norms.extend(norms)

    def state(self) -> list[float]:
        return list(self._norms)


def clip_scale(norm: float, radius: float, drop_beyond: float | None = None) -> float:
    """``min(1, radius / norm)`` (1 for a zero difference); 0 beyond ``drop_beyond`` radii."""
    if norm <= radius:
        return 1.0
    if drop_beyond is not None and norm > drop_beyond * radius:
        return 0.0
    return radius / norm


class ClippedMix:
    r"""Clipped gossip's mix of a gathered round (:mod:`~.gathered`):
    ``x_i <- x_i + a sum_j c clip(x^_j - x^_i, tau_i)`` over the members that sent finite values
    (compressed: ``x^_j - x^_i = q_j - q_i``), then the bucket's radius learns the norms. Neighbours left
    out beyond ``drop_beyond`` radii are a ``"dropped"`` guard event. Every round is gathered, compressed
    or not (the differences need each member's values), and an uncompressed one keeps no reference.

    Args:
        options: clipped gossip's options.
        guard: where the ``"dropped"`` events go.
        label: what the buckets are, for the events.
        audit: whose quarantined ranks are left out of every round (:mod:`~.audit`), or None.
    """

    def __init__(
        self, options: ClippedGossip, guard: GuardLog, label: str, audit: Audit | None = None
    ) -> None:
        self._options = options
        self._guard = guard
        self._label = label
        self._audit = audit
        self._radii: dict[int, RadiusWindow] = {}  # bucket -> its recent norms (made at first use)
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> a difference, the update

    #: every round gathers the members' values, so that each neighbour's difference can be clipped
    gathers_every_round = True

    def _window(self, bucket: int) -> RadiusWindow:
        window = self._radii.get(bucket)
        if window is None:
            window = self._radii[bucket] = RadiusWindow(self._options)
        return window

    def __call__(
        self,
        channel: Channel,
        bucket: int,
        round_: Round,
        slot: int,
        factor: float,
        total: torch.Tensor,
        scratch: torch.Tensor,
        bad: Sequence[int],
    ) -> None:
        assert round_.codec is not None
        group, window = round_.group, self._window(bucket)
        coder = codec(round_.codec)
        slots, seed = channel.payloads(group.size), round_seed(round_.step, channel.index)
        if bucket not in self._buffers:
            self._buffers[bucket] = (torch.empty_like(scratch), torch.empty_like(scratch))
        other, update = self._buffers[bucket]
        own = scratch
        coder.decode_into(slots[slot], own, seed)
        update.zero_()
        radius, norms = window.radius(), []
        own_norm = float(torch.linalg.vector_norm(channel.tensor))  # the warm-up's cut-off (clipping)
        sent_with = 1.0 / group.size if group.self_weight is None else group.peer_weight
        dropped = []
        quarantined = () if self._audit is None else self._audit.quarantined
        for j in range(group.size):
            if j == slot or j in bad or group.ranks[j] in quarantined:
                continue
            coder.decode_into(slots[j], other, seed)
            other.sub_(own)
            norm = float(torch.linalg.vector_norm(other))
            norms.append(norm)
            scale = window.judge(group.ranks[j], norm, radius, own_norm)
            if scale > 0.0:
                update.add_(other, alpha=factor * sent_with * scale)
            elif radius > 0.0:  # a radius of 0 (nothing learnt yet) mixes nobody: not a verdict on j
                dropped.append(group.ranks[j])
        channel.tensor.add_(update)
        window.add(norms)
        if dropped:
            self._guard.record(
                GuardEvent("dropped", round_.step, bucket, self._label, group.ranks, tuple(dropped))
            )

    # -- checkpoints: each bucket's norms and the neighbours on probation ------------------------------
    def state(self, buckets: int) -> dict[str, list[Any]]:
        """``clip_norms`` and ``clip_probation``, one entry per bucket."""
        windows = [self._radii.get(bucket) for bucket in range(buckets)]
        return {
            "clip_norms": [[] if w is None else w.state() for w in windows],
            "clip_probation": [{} if w is None else w.on_probation() for w in windows],
        }

    def across_change(self, buckets: int) -> dict[str, list[Any]]:
        """The recent norms (the replicas' spread stays what it was when members change); not who is on
        probation, whose ranks are renumbered. Measured on digits: a ring re-formed with empty windows
        mixes next to nothing for a window of rounds (a radius of the first few, smallest norms) and
        ended 1.09x its clean loss after one worker left, against 1.02x under plain gossip."""
        return {"clip_norms": self.state(buckets)["clip_norms"]}

    def load_state(self, buckets: int, state: Mapping[str, Any]) -> None:
        """Restore the windows of :meth:`state` (of at most ``buckets`` buckets) from a gossip checkpoint;
        one without them (taken without clipped gossip) leaves the windows as they are."""
        norms = state.get("clip_norms")
        if norms is None:
            return
        held_by_bucket = state.get("clip_probation") or [{} for _ in norms]
        for bucket, saved, held in zip(range(buckets), norms, held_by_bucket, strict=False):
            self._radii[bucket] = RadiusWindow(
                self._options, [float(n) for n in saved], {int(r): int(n) for r, n in held.items()}
            )
