r"""Clipped gossip's audit: every ``audit_every`` steps the ranks compare the values each of them sent,
and a rank whose values stood far from everyone's is quarantined (``ClippedGossip(audit_every=...)``).

Why: clipping and dropping keep a wrong neighbour's values out of each round, but not the hole it
leaves in the topology. On a ring its two neighbours no longer mix with it, the ring becomes a path,
and a path's ends agree with the rest far more slowly (the second eigenvalue of pair averaging is
``0.93`` on a path of 7, ``0.81`` on a ring of 8): measured on scikit-learn's digits, the worst honest
worker ends 1.06x its clean loss under the negated model even though every one of its rounds is left
out. Only a topology without the wrong rank closes the hole, and that needs every rank to name it
alike.

**The rule.** At every step each rank keeps ``K = 32`` coordinates of the values it launches from each
bucket (the same coordinates on every rank, drawn from the bucket's number): ``f_i(t)``, one sample
per step and bucket. At the audit the ranks all-gather their last ``audit_every`` steps of them (a
collective of the whole world of ``K`` floats per step, bucket and rank) and every rank computes, for
each sample ``t`` that at least three ranks recorded,

.. math::
    M(t) = \operatorname{median}_i f_i(t) \;\text{(coordinate-wise)}, \qquad
    S(t) = \operatorname{median}_i \lVert f_i(t) - M(t) \rVert, \qquad
    d_i(t) = \lVert f_i(t) - M(t) \rVert / S(t),

(``d_i = 0`` for ``f_i = M`` when ``S = 0``, else infinite). Rank ``i`` is an **outlier** when
``d_i(t) > OUTLIER_SPREADS`` (20) in at least a quarter of its samples, so that an attacker cannot
hide by sending honest values every other step. The median is an honest rank's while fewer than half
the ranks are wrong, and honest replicas of one model stay far closer to each other than to the
negation, a scaling or noise (``\lVert -x - x \rVert = 2 \lVert x \rVert``). Outliers are quarantined
only while they are fewer than half of the world (else nobody can tell who is honest: logged, nobody
is).

**What quarantine does** (every rank alike, from the same gathered samples): with
``on_peer_failure="continue"`` the quarantined rank leaves the job (it raises
:class:`~decent_optim_wrapper.QuarantinedError`) and the others re-form the topology without it, as
after a lost peer; without survival every rank leaves it out of every mix from then on (the topology
keeps its hole, the values stay out). Either way a ``"quarantined"`` guard event is counted on every
rank and logged.

What it trusts: each rank's report of what it sent. A rank whose library reports other values than
the ones it sends is not found by the audit; clipping still bounds what it does to each round. Ranks
at different steps (paced rounds) or replicas sharded over a node are not audited.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["OUTLIER_SPREADS", "Audit", "AuditVerdict", "outliers", "sampled_coordinates"]

#: How many spreads of the fleet a rank's values stand from its median before the sample counts as wrong.
OUTLIER_SPREADS = 20.0
#: The share of its samples in which a rank must stand out to be an outlier.
OUTLIER_SHARE = 0.25
#: Coordinates kept per bucket and step.
COORDINATES = 32


@dataclass(frozen=True)
class AuditVerdict:
    """What one audit found: the ranks quarantined, and each rank's share of samples beyond the cut-off."""

    step: int
    rank: int  # this rank's, in the world audited (survivors are renumbered after a change)
    outliers: tuple[int, ...]  # the ranks beyond the cut-off in enough samples, not quarantined before
    quarantined: tuple[int, ...]  # those of them quarantined now: if fewer than half the world, all
    share_out: tuple[float, ...]  # each rank's share of its samples beyond the cut-off


def outliers(
    samples: torch.Tensor, spreads: float = OUTLIER_SPREADS, share: float = OUTLIER_SHARE
) -> tuple[list[int], list[float]]:
    """The outliers among the ranks of ``samples`` (``[ranks, samples, K]``, NaN rows: not recorded), and
    each rank's share of its samples beyond ``spreads`` spreads of the median (see the module doc).

    Computed in float64, the same on every rank for the same input."""
    values = samples.to(torch.float64)
    ranks = values.shape[0]
    recorded = torch.isfinite(values).all(dim=2)  # [ranks, samples]; not finite: the guard's business
    beyond = torch.zeros(ranks, dtype=torch.float64)
    counted = torch.zeros(ranks, dtype=torch.float64)
    for t in range(values.shape[1]):
        present = recorded[:, t].nonzero().flatten()
        if len(present) < 3:
            continue  # a median of two cannot tell which one is wrong
        rows = values[present, t]
        median = rows.median(dim=0).values
        distance = torch.linalg.vector_norm(rows - median, dim=1)
        spread = float(distance.median())
        out = distance > spreads * spread if spread > 0.0 else distance > 0.0
        beyond[present] += out.to(torch.float64)
        counted[present] += 1.0
    shares = [float(b / c) if c > 0 else 0.0 for b, c in zip(beyond, counted, strict=True)]
    found = [rank for rank, s in enumerate(shares) if s >= share and counted[rank] > 0]
    return found, shares


def sampled_coordinates(number: int, numel: int) -> torch.Tensor:
    """The coordinates the audit keeps of bucket ``number`` (of ``numel`` entries): the same on every rank."""
    draws = torch.Generator().manual_seed(0x5EED + number)
    return torch.randperm(numel, generator=draws)[: min(COORDINATES, numel)]


class Audit:
    """One rank's samples of the values it launched, the audit over the world, and who is quarantined.

    Args:
        every: audit every this many steps (``ClippedGossip(audit_every=...)``).
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self._samples: dict[int, torch.Tensor] = {}  # bucket -> [every, K], NaN rows: not recorded
        self._coordinates: dict[int, torch.Tensor] = {}  # bucket number -> the coordinates kept
        #: The ranks of this world quarantined so far, which clipped mixes leave out (without survival).
        self.quarantined: set[int] = set()
        #: A verdict reached on samples that arrived while a peer was found lost (kept for the engine
        #: across the recovery that follows, which renumbers the ranks).
        self.judged_before_change: AuditVerdict | None = None

    def _coordinates_of(self, number: int, numel: int, device: torch.device) -> torch.Tensor:
        picked = self._coordinates.get(number)
        if picked is None or picked.device != device:
            picked = self._coordinates[number] = sampled_coordinates(number, numel).to(device)
        return picked

    @torch.no_grad()
    def record(self, step: int, bucket: int, number: int, values: torch.Tensor) -> None:
        """Keep step ``step``'s sample of bucket ``bucket`` (number ``number``): what this rank launches."""
        flat = values.reshape(-1)
        samples = self._samples.get(bucket)
        if samples is None:
            samples = self._samples[bucket] = torch.full(
                (self.every, COORDINATES), math.nan, dtype=torch.float32, device=flat.device
            )
        picked = self._coordinates_of(number, flat.numel(), flat.device)
        row = samples[step % self.every]
        row.zero_()  # a bucket of fewer than K entries: zeros alike on every rank
        row[: len(picked)].copy_(flat.index_select(0, picked))

    def due(self, step: int) -> bool:
        """Whether the boundary before ``step`` audits (every ``every`` completed steps)."""
        return step > 0 and step % self.every == 0

    def forget(self) -> None:
        """Drop the samples and the quarantined ranks (the world changed: ranks were renumbered)."""
        self._samples.clear()
        self.quarantined.clear()

    def gather(
        self,
        step: int,
        rank: int,
        buckets: int,
        group: dist.ProcessGroup | None,
        world_size: int,
        wait: Callable[[Sequence[dist.Work], torch.device], None] | None = None,
    ) -> AuditVerdict:
        """All-gather every rank's samples of ``buckets`` buckets and judge them (a collective of the
        world; ``wait`` waits for it, e.g. survival's failure-aware wait). The samples are dropped."""
        device = next(iter(self._samples.values())).device if self._samples else torch.device("cpu")
        mine = torch.full((buckets, self.every, COORDINATES), math.nan, dtype=torch.float32, device=device)
        for bucket, samples in self._samples.items():
            if bucket < buckets:
                mine[bucket].copy_(samples)
        self._samples.clear()
        everyone = torch.empty(world_size * mine.numel(), dtype=mine.dtype, device=device)
        work = dist.all_gather_into_tensor(everyone, mine.reshape(-1), group=group, async_op=True)
        assert work is not None  # async_op=True
        try:
            if wait is None:
                work.wait()
            else:
                wait([work], device)
        except Exception:
            # Survival's wait follows a peer's loss even after the gather completed (the quarantined
            # rank leaves at once): the samples did arrive, so the verdict stands and is kept.
            if work.is_completed():
                self.judged_before_change = self._judge(step, rank, everyone, world_size)
            raise
        return self._judge(step, rank, everyone, world_size)

    def _judge(self, step: int, rank: int, everyone: torch.Tensor, world_size: int) -> AuditVerdict:
        found, shares = outliers(everyone.reshape(world_size, -1, COORDINATES).cpu())
        # No honest majority to tell by: nobody is quarantined (the engine logs the outliers).
        quarantined = found if 2 * len(found) < world_size else []
        found = [r for r in found if r not in self.quarantined]  # (without survival) found before
        quarantined = [r for r in quarantined if r not in self.quarantined]
        self.quarantined.update(quarantined)
        return AuditVerdict(step, rank, tuple(found), tuple(quarantined), tuple(shares))
