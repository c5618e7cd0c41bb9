r"""Gradient tracking: every rank steps with an estimate of the *average* gradient, not its own.

When workers see different data (label-skewed shards, one site or language per worker), each local
step pulls its replica towards its own data's optimum, and gossip only partly undoes that: the
heterogeneity term of decentralized SGD's error (Koloskova et al., "A Unified Theory of
Decentralized SGD with Changing Topology and Local Updates", ICML 2020). Gradient tracking removes
it. Each rank keeps a tracker ``y_i`` that it gossips beside its parameters, with the recursion of
DSGT / GT-DSGD (Pu and Nedić, "Distributed Stochastic Gradient Tracking Methods", Math. Prog. 2021;
Koloskova, Lin and Stich, "An Improved Analysis of Gradient Tracking for Decentralized Machine
Learning", NeurIPS 2021):

.. math::
    y_i^{t} = \sum_j W_{ij}\, y_j^{t-1} + g_i^{t} - g_i^{t-1}, \qquad y_i^{0} = g_i^{0},

and the inner optimizer receives ``y_i^t`` as the gradient (so any optimizer works: SGD with
momentum, AdamW, ...). Because ``W`` is doubly stochastic, the mean of the trackers equals the mean
of the current gradients at every step (up to rounding): each rank's update direction is its
neighbours' view of the global gradient, which all-reduce would have given it exactly.

What it keeps and what it costs:

* The parameters' gossip is unchanged, so their mean still moves only by the local updates, and
  global averaging and its revert stay exact (the trackers are not averaged; they are left as they
  are, rounds in flight included). At world size 1 tracking is off: the step is the bare optimizer's.
* Twice the bytes per step (the tracker travels with the same schedule and compression as the
  parameters) and three more copies of the gossiped parameters: the trackers, the previous
  gradients, and the trackers' communication buffers.
* The trackers and previous gradients are part of a checkpoint, so a run resumes bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from decent_optim_wrapper.engine.buckets import Bucket, misfit
from decent_optim_wrapper.engine.comm import ProcessGroups
from decent_optim_wrapper.engine.compression import CompressionPlan
from decent_optim_wrapper.engine.gossip import Gossip
from decent_optim_wrapper.topo import Topology

__all__ = ["GradientTracker"]


class GradientTracker:
    """The trackers of one rank's buckets, their gossip, and the gradient substitution.

    Args:
        buckets: the parameter buckets; tracker ``b`` has bucket ``b``'s layout.
        topology, rank, process_groups, timeout, plan: as for :class:`~.gossip.Gossip` (the trackers
            follow the parameters' schedule).
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        topology: Topology,
        rank: int,
        process_groups: ProcessGroups,
        timeout: timedelta | None,
        plan: CompressionPlan | None,
    ) -> None:
        self._buckets: list[Bucket] = []
        self._trackers: list[torch.Tensor] = []  # y_i, one flat tensor per bucket
        self._previous: list[torch.Tensor] = []  # g_i^{t-1}
        self._gossip = Gossip([], topology, rank, process_groups, timeout, plan)
        self.add_buckets(buckets)

    @property
    def gossip(self) -> Gossip:
        return self._gossip

    def add_buckets(self, buckets: Sequence[Bucket]) -> None:
        """Track these buckets too (trackers and previous gradients start at zero)."""
        trackers = [torch.zeros_like(b.data) for b in buckets]
        self._buckets.extend(buckets)
        self._trackers.extend(trackers)
        self._previous.extend(torch.zeros_like(b.data) for b in buckets)
        self._gossip.add_tensors(trackers)

    @torch.no_grad()
    def track(self, bucket: int) -> None:
        """``y <- y + g - g_prev``, ``g_prev <- g``, then hand ``y`` to the optimizer as the gradient.

        Call it after the bucket's gossip was mixed and before its local update. A parameter
        without a gradient on this rank counts as a zero gradient in its tracker, and keeps no
        gradient, so the optimizer leaves it alone as it would without tracking.
        """
        owner = self._buckets[bucket]
        for param, name in zip(owner.params, owner.names, strict=True):
            if param.grad is not None and param.grad.is_sparse:
                raise ValueError(
                    f"gradient_tracking=True cannot track the sparse gradient of {name} (e.g. "
                    "nn.Embedding(sparse=True)); use dense gradients or turn gradient tracking off."
                )
        trackers = _views(owner, self._trackers[bucket])
        previous = _views(owner, self._previous[bucket])
        with_grad = [i for i, p in enumerate(owner.params) if p.grad is not None]
        grads: list[torch.Tensor] = [owner.params[i].grad for i in with_grad]  # type: ignore[misc]
        y = [trackers[i] for i in with_grad]
        prev = [previous[i] for i in with_grad]
        if with_grad:
            torch._foreach_sub_(prev, grads)  # g_prev - g
            torch._foreach_sub_(y, prev)  # y + (g - g_prev)
            torch._foreach_copy_(prev, grads)
            torch._foreach_copy_(grads, y)
        for i, param in enumerate(owner.params):
            if param.grad is None:  # g = 0: y <- y - g_prev, g_prev <- 0
                trackers[i].sub_(previous[i])
                previous[i].zero_()

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"trackers": [...], "previous": [...], "gossip": ...}``: flat tensors per bucket."""
        return {
            "trackers": [t.clone() for t in self._trackers],
            "previous": [p.clone() for p in self._previous],
            "gossip": self._gossip.state_dict(),
        }

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` if ``state`` does not fit these buckets."""
        if not isinstance(state, dict) or not {"trackers", "previous", "gossip"} <= set(state):
            raise ValueError(
                "gradient tracking state must be a dict with 'trackers', 'previous' and 'gossip', got "
                f"{state!r}."
            )
        for key in ("trackers", "previous"):
            saved = state[key]
            if len(saved) != len(self._buckets):
                raise ValueError(
                    f"gradient tracking state has {len(saved)} {key} for {len(self._buckets)} buckets; the "
                    "checkpoint comes from a different parameter layout."
                )
            for index, (tensor, bucket) in enumerate(zip(saved, self._buckets, strict=True)):
                got = misfit(tensor, bucket.data.shape, bucket.data.dtype)
                if got is not None:
                    raise ValueError(
                        f"gradient tracking {key} {index} of {got} does not fit its bucket "
                        f"({tuple(bucket.data.shape)}, {bucket.data.dtype})."
                    )
        self._gossip.check_state_dict(state["gossip"])

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`; None (a checkpoint without tracking) starts the trackers afresh."""
        if state is None:
            self._gossip.load_state_dict(None)
            for tensor in (*self._trackers, *self._previous):
                tensor.zero_()
            return
        self.check_state_dict(state)
        for mine, saved in zip(self._trackers, state["trackers"], strict=True):
            mine.copy_(saved)
        for mine, saved in zip(self._previous, state["previous"], strict=True):
            mine.copy_(saved)
        self._gossip.load_state_dict(state["gossip"])


def _views(bucket: Bucket, flat: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's slice of ``flat`` (laid out like ``bucket.data``), shaped like the parameter."""
    return [
        flat[offset : offset + param.numel()].view(param.shape)
        for param, offset in zip(bucket.params, bucket.spec.offsets, strict=True)
    ]
