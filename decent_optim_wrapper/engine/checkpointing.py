"""The engine's part of a checkpoint: saving a replica's state, loading it back bit for bit, and what a
rank starts from when the checkpoint was written at another world size.

:class:`EngineCheckpoint` is the part of :class:`~decent_optim_wrapper.engine.GossipEngine` that turns
the engine's live state (its step counters, buckets, rounds in flight, trackers, anchors and global
average's snapshot) into the ``"decent"`` entry of a front-end's checkpoint and back. The layout of
that entry and its checks are :mod:`~decent_optim_wrapper.engine.state.checkpoint`'s; the rule for
another world size is :mod:`~decent_optim_wrapper.engine.state.resize`'s. Nothing here is a
collective: saving waits for the rounds in flight (surviving a peer lost there first), loading is
local.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from decent_optim_wrapper.engine.exchange.buckets import Bucket
from decent_optim_wrapper.engine.layout import signatures
from decent_optim_wrapper.engine.progress import StepProgress
from decent_optim_wrapper.engine.rules.local_steps import LocalSteps
from decent_optim_wrapper.engine.state.averaging import GlobalAverage, restore_buckets
from decent_optim_wrapper.engine.state.checkpoint import (
    RunIdentity,
    check_engine_state,
    plain,
    snapshot_from_state,
    snapshot_state,
)
from decent_optim_wrapper.engine.state.resize import averaged_engine_state, check_saved_world
from decent_optim_wrapper.engine.wire.compression import GossipCompression
from decent_optim_wrapper.engine.wiring import Wiring

__all__ = ["EngineCheckpoint"]


class EngineCheckpoint:
    """Saving, loading and resizing the engine's state (the engine holds one).

    Args:
        wiring: the engine's communication (world, topology, rounds in flight, trackers).
        progress: the engine's step counters; ``buckets``: its buckets (live).
        local: low-communication gossip's state, or None; ``averaging``: the engine's global average.
        compression: the gossip compression, or None.
        wait_all: waits for every round in flight, surviving a peer lost there.
    """

    def __init__(
        self,
        wiring: Wiring,
        progress: StepProgress,
        *,
        buckets: list[Bucket],
        local: LocalSteps | None,
        averaging: GlobalAverage,
        compression: GossipCompression | None,
        wait_all: Callable[[], None],
    ) -> None:
        self._wiring, self._progress = wiring, progress
        self._buckets, self._local, self._averaging = buckets, local, averaging
        self._compression, self._wait_all = compression, wait_all

    def state_dict(self) -> dict[str, Any]:
        """This replica's engine state: the ``"decent"`` entry of a front-end's checkpoint (layout in
        :mod:`~.checkpoint`). Waits for gossip in flight (no collective), so it holds the received
        rounds the next step mixes in, and a run resumed from it continues bit for bit."""
        for bucket in self._buckets:
            bucket.check_views()
        self._wait_all()  # a peer lost now is survived before anything is saved
        params = [b.data.clone() for b in self._buckets]
        tracker = self._wiring.tracker
        return {
            **self._identity().as_state(),
            "step": self._progress.step,
            "params": params,
            "gossip": self._wiring.gossip.state_dict(),
            "snapshot": snapshot_state(self._averaging.snapshot),
            "mixing_factor": self._progress.mixing_factor,
            "compression": None if self._compression is None else self._compression.wire,
            "tracking": None if tracker is None else tracker.state_dict(),
            "local_steps": None if self._local is None else self._local.state_dict(),
        }

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` naming the mismatch if ``state`` cannot be loaded into this engine.

        Checks everything :meth:`load_state_dict` will use, so a front-end can check the engine's
        part before it changes anything of its own.
        """
        wiring = self._wiring
        check_engine_state(state, self._identity(), self._buckets, wiring.gossip, wiring.tracker, self._local)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same rank, world size, topology and layout.

        Everything is checked (:meth:`check_state_dict`) before anything changes. Local.
        """
        self.check_state_dict(state)
        restore_buckets(self._buckets, state["params"])
        self._wiring.gossip.load_state_dict(state.get("gossip"))
        tracker, progress = self._wiring.tracker, self._progress
        if tracker is not None:  # a checkpoint without tracking starts the trackers afresh
            tracker.load_state_dict(state.get("tracking"))
        progress.step = int(state["step"])
        progress.mixing_factor = float(state.get("mixing_factor", 1.0))  # absent in the oldest checkpoints
        if self._local is not None:
            self._local.load_state_dict(state["local_steps"], progress.step)
        self._averaging.snapshot = snapshot_from_state(state, self._buckets)

    def resume_state(self, states: Sequence[Any]) -> dict[str, Any] | None:
        """What this rank loads from a checkpoint's engine entries (every saved rank's, in order).

        None when this run has the saved world size and topology: rank ``r`` then loads ``states[r]``
        with :meth:`load_state_dict` and continues bit for bit. Otherwise the state every rank starts
        from: the average of the saved replicas, the same bits on every rank (the rule, and what is
        reset, in :mod:`~decent_optim_wrapper.engine.state.resize`). Raises ``ValueError`` if the entries
        are not one checkpoint of this parameter layout. Local.
        """
        if check_saved_world(states, self._identity()):
            return None
        return averaged_engine_state(states, self._identity())

    def _identity(self) -> RunIdentity:
        """What a checkpoint must match to be loaded here bit for bit: place, schedule and layout."""
        world, topology = self._wiring.world, self._wiring.topology
        return RunIdentity(
            rank=world.rank,
            world_size=world.world_size,
            local_world_size=world.local_world_size,
            topology=topology.name,
            schedule=plain(topology.fingerprint()),
            buckets=plain(signatures(self._buckets)),
        )
