r"""The protocol of a step, in one place for both front-ends: :class:`StepProtocol`.

Per bucket: mix the round launched at the previous step, track the gradient (when on), run the
caller's local update, launch this step's round,

.. math::
    x_{i,b} \leftarrow (1 - a)\, x_{i,b} + a \sum_j W^{(t-1)}_{ij}\, x_{j,b}, \qquad
    x_{i,b} \leftarrow \mathrm{update}(x_{i,b}), \qquad \text{send } x_{i,b} \text{ in phase } t,

with ``a`` the mixing factor. A rank whose gradients hold inf/NaN skips its local update and leaves
its trackers alone, but still mixes and launches, so no peer waits for it. A round that fails raises
from mix (GossipError) and is dropped: it is never mixed or saved. With low-communication gossip the
launch folds in a round that is due and, at a round's end, takes the outer step and launches the
anchors' round (:mod:`~decent_optim_wrapper.engine.rules.local_steps`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from decent_optim_wrapper.engine.exchange.buckets import Bucket, current
from decent_optim_wrapper.engine.member_changes import MemberChanges
from decent_optim_wrapper.engine.progress import StepProgress
from decent_optim_wrapper.engine.quarantine import Quarantine
from decent_optim_wrapper.engine.rules.local_steps import LocalSteps
from decent_optim_wrapper.engine.state.averaging import GlobalAverage
from decent_optim_wrapper.engine.wiring import Wiring

__all__ = ["BucketHealing", "StepProtocol"]

_T = TypeVar("_T")


class BucketHealing:
    """What happens when a bucket took its peers' values (its own were not finite): this step's
    gradients of it were computed at those values, so they are dropped (the local update leaves the
    bucket alone), and the front-ends' hooks drop the optimizer state that stepped it."""

    def __init__(self, buckets: list[Bucket]) -> None:
        self._buckets = buckets  # the engine's list, extended in place by add_parameters
        self._hooks: list[Callable[[list[torch.Tensor]], None]] = []

    def register(self, reset: Callable[[list[torch.Tensor]], None]) -> None:
        """Call ``reset(params)`` with a healed bucket's parameters."""
        self._hooks.append(reset)

    def __call__(self, bucket: int) -> None:
        params = list(self._buckets[bucket].params)
        for param in params:
            param.grad = None
        for reset in self._hooks:
            reset(params)


class StepProtocol:
    """Steps one rank's buckets: a whole model (:meth:`step`) or one bucket inside backward
    (:meth:`step_bucket` between :meth:`begin_step` and :meth:`end_step`).

    Holds the engine's parts it drives; the wiring's gossip and tracker are read at each use, since a
    change of members replaces them.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        wiring: Wiring,
        progress: StepProgress,
        members: MemberChanges,
        averaging: GlobalAverage,
        *,
        local: LocalSteps | None,
        quarantine: Quarantine | None,
        healing: BucketHealing,
    ) -> None:
        self._buckets, self._wiring, self._progress = buckets, wiring, progress
        self._members, self._averaging = members, averaging
        self._local, self._quarantine, self._healing = local, quarantine, healing

    def step(self, local_update: Callable[[], _T], found_inf: torch.Tensor | None) -> _T:
        """Every bucket mixed, tracked (unless ``found_inf`` is nonzero), ``local_update()`` once,
        every bucket launched; returns what ``local_update`` returns."""
        self.begin_step()
        buckets = range(len(self._buckets))
        for bucket in buckets:
            self._mix(bucket)
        tracker = self._wiring.tracker
        if tracker is not None and (found_inf is None or not bool(found_inf.item())):
            for bucket in buckets:
                tracker.track(bucket)
        self._progress.updated = True
        result = local_update()
        for bucket in buckets:
            self._launch(bucket)
        self.end_step()
        return result

    @torch.no_grad()
    def step_bucket(self, bucket: int, local_update: Callable[[], object], skip_local_update: bool) -> None:
        """One bucket: mix its round, track, ``local_update()`` (unless skipped), launch."""
        self._mix(bucket)
        self._progress.updated = True  # the front-end's per-bucket state moves on even when skipping
        if not skip_local_update:
            tracker = self._wiring.tracker
            if tracker is not None:
                tracker.track(bucket)
            local_update()
        self._launch(bucket)

    def begin_step(self) -> None:
        """Check the buckets, drop a global average's snapshot, admit waiting joiners; with
        low-communication gossip the first step sets the anchors to the parameters."""
        self.check_buckets()
        self._averaging.snapshot = None
        self._members.admit_due_joiners()
        self._progress.in_step = True
        if self._local is not None and self._progress.step == 0:
            with current(self._buckets, write=False):
                self._local.reset_anchors()

    def end_step(self) -> None:
        """The next step gossips in the next phase."""
        progress = self._progress
        progress.step += 1
        progress.in_step = progress.updated = False
        if self._quarantine is not None:
            self._quarantine.at_boundary(progress.step)

    def check_buckets(self) -> None:
        """Raise if a parameter no longer lives in its bucket (e.g. ``model.to()`` after wrapping)."""
        for bucket in self._buckets:
            bucket.check_views()

    def wait_all(self) -> None:
        """Wait for every round in flight without mixing it (GossipError if a peer does not answer)."""

        def wait() -> None:
            gossip, tracker = self._wiring.gossip, self._wiring.tracker  # new ones after a change
            for bucket in range(len(self._buckets)):
                gossip.wait(bucket)
                if tracker is not None:
                    tracker.wait(bucket)
            if self._local is not None:
                self._local.wait_all()

        self._members.survive(wait)

    @torch.no_grad()
    def _mix(self, bucket: int) -> None:
        """Finish bucket ``bucket``'s round launched at the previous step and mix it in."""
        self._members.survive(lambda: self._mix_rounds(bucket))

    def _mix_rounds(self, bucket: int) -> None:
        tracker, gossip, factor = self._wiring.tracker, self._wiring.gossip, self._progress.mixing_factor
        if tracker is not None:  # its rounds outlive a global average: mixed on their own
            tracker.mix(bucket, factor)
        if gossip.pending(bucket) is not None:
            with current([self._buckets[bucket]], write=True):
                healed = gossip.mix(bucket, factor)
            if healed:
                self._healing(bucket)

    @torch.no_grad()
    def _launch(self, bucket: int) -> None:
        """Start bucket ``bucket``'s gossip for the current step, non-blocking."""
        local, progress, survive = self._local, self._progress, self._members.survive
        if self._quarantine is not None:  # what this rank sends (the audit's sample of the step)
            with current([self._buckets[bucket]], write=False):
                data = self._buckets[bucket]
                self._quarantine.record(progress.step, bucket, data.spec.number, data.data)
        if local is not None:
            # One block for the fold, the outer step and the anchors' launch: one copy in and out.
            with current([self._buckets[bucket]], write=True):
                survive(lambda: local.fold_due(bucket, progress.step, progress.mixing_factor))
                # A failure inside end_round comes from its last part (the fold without delay), so it
                # is not run again: recovery settles that round.
                survive(
                    lambda: local.end_round(
                        bucket, progress.step, progress.mixing_factor, progress.launch_from
                    ),
                    retry=False,
                )
            return
        if progress.step < progress.launch_from:  # after a lost peer, rounds restart in step
            return
        with current([self._buckets[bucket]], write=False):
            self._wiring.gossip.launch(bucket, progress.step)
        tracker = self._wiring.tracker
        if tracker is not None:
            tracker.launch(bucket, progress.step)
