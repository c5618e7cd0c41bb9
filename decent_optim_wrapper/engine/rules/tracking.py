r"""Gradient tracking (DSGT): every rank steps with an estimate of the *average* gradient.

Each rank gossips a tracker beside its parameters, ``y_i <- sum_j W_ij y_j + g_i - g_i_prev``
(``y_i = g_i`` at the first step), and the inner optimizer steps with ``y_i`` instead of its own
gradient ``g_i`` (Pu and Nedić, Math. Prog. 2021; Koloskova, Lin and Stich, NeurIPS 2021). The
trackers' mean is the mean gradient, so data that differs between workers no longer pulls the
replicas apart. Costs, guarantees and when to use it: the gradient tracking page of the docs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from decent_optim_wrapper.engine.exchange.buckets import Bucket, check_saved_tensors
from decent_optim_wrapper.engine.exchange.gossip import GossipWiring
from decent_optim_wrapper.engine.exchange.shards import local_tensor

__all__ = ["GradientTracker"]


class GradientTracker:
    """The trackers of one rank's buckets, their gossip, and the gradient substitution.

    Args:
        buckets: the parameter buckets; tracker ``b`` has bucket ``b``'s layout.
        wired: the wiring of the parameters' gossip (the trackers follow the parameters' schedule).
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        wired: GossipWiring,
    ) -> None:
        self._buckets: list[Bucket] = []
        self._trackers: list[torch.Tensor] = []  # y_i, one flat tensor per bucket
        self._previous: list[torch.Tensor] = []  # g_i^{t-1}
        self._restart: set[int] = set()  # healed trackers: their previous gradient was not finite
        self._gossip = wired.gossip([], "trackers")
        self.add_buckets(buckets)

    # -- the trackers' gossip, with the parameters' schedule ------------------------------------------
    def mix(self, bucket: int, factor: float) -> None:
        """Mix tracker ``bucket``'s round in (if one is pending): ``y <- sum_j W_ij y_j``. A tracker
        healed from its peers (:mod:`~.guard`) forgets its previous gradient too (it was not finite):
        the next :meth:`track` keeps the healed tracker as it is (no innovation term)."""
        if self._gossip.mix(bucket, factor):
            self._restart.add(bucket)

    def launch(self, bucket: int, step: int) -> None:
        """Start tracker ``bucket``'s round for ``step`` (non-blocking)."""
        self._gossip.launch(bucket, step)

    def wait(self, bucket: int) -> None:
        """Wait for tracker ``bucket``'s round without mixing it."""
        self._gossip.wait(bucket)

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
        trackers = owner.slices(self._trackers[bucket])
        previous = owner.slices(self._previous[bucket])
        with_grad = [i for i, p in enumerate(owner.params) if p.grad is not None]
        # A sharded parameter's gradient is a DTensor like it: its local shard is what the tracker holds.
        grads = [local_tensor(owner.params[i].grad) for i in with_grad]  # type: ignore[arg-type]
        y = [trackers[i] for i in with_grad]
        prev = [previous[i] for i in with_grad]
        if with_grad and bucket in self._restart:
            torch._foreach_copy_(prev, grads)  # a healed tracker: g_prev := g, so y stays as healed
        self._restart.discard(bucket)
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
        layout = [(b.data.shape, b.data.dtype) for b in self._buckets]
        for key in ("trackers", "previous"):
            check_saved_tensors(f"gradient tracking {key}", state[key], layout)
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
