r"""Clipped gossip's mix of a gathered round: ``x_i <- x_i + a sum_j c clip(x^_j - x^_i, tau_i)``.

The rule, its radius, dropping and probation are :mod:`~.clipping`'s; this part applies them to a
round whose members' payloads were gathered (:mod:`~.gathered`), keeping each bucket's recent
difference norms (:class:`~.clipping.RadiusWindow`) and the two bucket-sized buffers it needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from decent_optim_wrapper.engine.exchange.clipping import ClippedGossip, RadiusWindow
from decent_optim_wrapper.engine.exchange.guard import GuardEvent, GuardLog
from decent_optim_wrapper.engine.exchange.rounds import Channel, Round
from decent_optim_wrapper.engine.wire.compression import codec, round_seed

__all__ = ["ClippedMix"]


class ClippedMix:
    """Mixes each neighbour's difference clipped to the bucket's radius, over the members that sent
    finite values (compressed: ``x^_j - x^_i = q_j - q_i``), then the radius learns the norms.
    Neighbours left out beyond ``drop_beyond`` radii are a ``"dropped"`` guard event.

    Args:
        options: clipped gossip's options.
        guard: where the ``"dropped"`` events go.
        label: what the buckets are, for the events.
    """

    def __init__(self, options: ClippedGossip, guard: GuardLog, label: str) -> None:
        self._options = options
        self._guard = guard
        self._label = label
        self._radii: dict[int, RadiusWindow] = {}  # bucket -> its recent norms (made at first use)
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> a difference, the update

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
        for j in range(group.size):
            if j == slot or j in bad:
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

    def load_state(
        self, buckets: int, norms: list[list[float]], probation: list[dict[Any, Any]] | None
    ) -> None:
        """Restore the windows of :meth:`state` (of at most ``buckets`` buckets)."""
        held_by_bucket = probation or [{} for _ in norms]
        for bucket, saved, held in zip(range(buckets), norms, held_by_bucket, strict=False):
            self._radii[bucket] = RadiusWindow(
                self._options, [float(n) for n in saved], {int(r): int(n) for r, n in held.items()}
            )
