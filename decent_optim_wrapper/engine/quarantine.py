"""What the engine does with clipped gossip's audit (:mod:`~.exchange.audit`): keep each step's samples,
audit at the boundaries it is due, and act on the verdict on every rank alike.

A quarantined rank, with ``on_peer_failure="continue"``, leaves the job and raises
:class:`~.errors.QuarantinedError`; the others meet its absence at their next round with it and
re-form the topology without it, as after a lost peer (:mod:`~.survival`). Without survival nobody
leaves: every rank's clipped mix leaves the quarantined rank out from then on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from loguru import logger

from decent_optim_wrapper.engine.errors import GossipError, QuarantinedError
from decent_optim_wrapper.engine.exchange.audit import OUTLIER_SPREADS, Audit, AuditVerdict
from decent_optim_wrapper.engine.exchange.guard import GuardEvent, GuardLog
from decent_optim_wrapper.engine.fleet.comm import wait_all
from decent_optim_wrapper.engine.fleet.membership import PeerLost
from decent_optim_wrapper.engine.member_changes import MemberChanges
from decent_optim_wrapper.engine.state.averaging import GlobalAverage
from decent_optim_wrapper.engine.wiring import Wiring

__all__ = ["Quarantine"]


class Quarantine:
    """The audit of one engine, run at its step boundaries.

    Args:
        audit: the samples and verdicts (the one the parameters' clipped mix reads).
        wiring: the world the audit gathers over (the current one after a change).
        members: survival, if on (a quarantined rank leaves through it).
        averaging: marks the audit as a collective of the whole world (no joiner admitted inside).
        guard: where the ``"quarantined"`` events are counted.
        buckets: how many buckets are audited (the live count).
    """

    def __init__(
        self,
        audit: Audit,
        wiring: Wiring,
        members: MemberChanges,
        averaging: GlobalAverage,
        guard: GuardLog,
        buckets: Callable[[], int],
    ) -> None:
        self._audit = audit
        self._wiring = wiring
        self._members = members
        self._averaging = averaging
        self._guard = guard
        self._buckets = buckets
        self._verdicts: list[AuditVerdict] = []

    @property
    def verdicts(self) -> list[AuditVerdict]:
        """Every audit's verdict on this rank so far (those that found outliers)."""
        return list(self._verdicts)

    def record(self, step: int, bucket: int, number: int, values: torch.Tensor) -> None:
        self._audit.record(step, bucket, number, values)

    def at_boundary(self, step: int) -> None:
        """Audit if the boundary before ``step`` is due (a collective of the world, on every rank)."""
        if not self._audit.due(step) or self._wiring.world_size < 3:
            return
        # Not run again after a recovery: a rank whose gather completed before it saw the loss has
        # gone on, and would not meet the others in a second one (the next audit judges the new world).
        with self._averaging.whole_world():
            verdict = self._members.survive(lambda: self._gather(step), retry=False)
        self._members.collective_done()
        judged, self._audit.judged_before_change = self._audit.judged_before_change, None
        if judged is not None:  # the gather completed, then a recovery (the quarantined rank left)
            verdict = judged
        if verdict is not None and verdict.outliers:
            self._act(verdict)

    def _gather(self, step: int) -> AuditVerdict:
        world = self._wiring.world_reduce
        survives = world.waiter is not None
        waiter = world.waiter if world.waiter is not None else wait_all

        def failure(cause: BaseException | None) -> Exception:
            if survives:
                return PeerLost(f"clipped gossip's audit at step {step}: {cause}")
            return GossipError(
                f"rank {world.rank}: clipped gossip's audit at step {step} (an all-gather of the whole "
                f"world) did not complete within {world.timeout} ({cause}): a peer is gone or stalled."
            )

        def wait(works: Sequence[dist.Work], device: torch.device) -> None:
            waiter(works, device, world.timeout, failure)

        return self._audit.gather(step, world.rank, self._buckets(), world.group, world.world_size, wait)

    def _act(self, verdict: AuditVerdict) -> None:
        rank, world_size = verdict.rank, len(verdict.share_out)  # as audited (before a recovery)
        self._verdicts.append(verdict)
        if not verdict.quarantined:
            logger.warning(
                "rank {}: clipped gossip's audit at step {} found ranks {} far from the others' values, half "
                "the world or more: with no honest majority to tell by, nobody is quarantined",
                rank,
                verdict.step,
                list(verdict.outliers),
            )
            return
        everyone = tuple(range(world_size))
        for bad in verdict.quarantined:
            self._guard.record(GuardEvent("quarantined", verdict.step, -1, "parameters", everyone, (bad,)))
        if rank not in verdict.quarantined:
            return
        share = verdict.share_out[rank]
        if self._members.survival is None:
            logger.error(
                "rank {}: clipped gossip's audit at step {} found this rank's values beyond {} spreads of "
                "the fleet's median in {:.0%} of its samples: every rank leaves it out of its mix from now "
                "on. Look for what changes its values (a hook, a bad checkpoint, bad hardware).",
                rank,
                verdict.step,
                OUTLIER_SPREADS,
                share,
            )
            return
        self._members.leave()
        raise QuarantinedError(
            f"rank {rank}: clipped gossip's audit at step {verdict.step} found the values this rank sent "
            f"beyond {OUTLIER_SPREADS:g} spreads of the fleet's median in {share:.0%} of its samples: it is "
            "quarantined and has left the job, and the others go on without it. Look for what changes its "
            "values (a hook, a bad checkpoint, bad hardware), then restart it from a checkpoint."
        )
