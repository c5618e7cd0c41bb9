"""The module front-end's update inside backward: :class:`BackwardUpdates`.

A gradient hook on every trainable parameter counts the gradients each bucket still waits for. When
the first hook of an iteration fires the engine begins a step and a callback is queued for the end
of backward; a bucket is updated (:meth:`~decent_optim_wrapper.engine.GossipEngine.step_bucket`: mix
last iteration's round, the bucket's optimizer step, launch this iteration's round, then its
``zero_grad`` and LR scheduler) as soon as it and every bucket before it are complete, so buckets
are updated in the same order on every rank whatever order autograd takes. The end-of-backward
callback updates the buckets still waiting (a parameter without a gradient this iteration) and
ends the engine's step.

With gradient clipping or a GradScaler the updates wait for the end of backward: clipping takes the
global norm over all gradients, and an inf/NaN gradient anywhere skips this rank's whole local update
(gossip still runs, so no peer waits for it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from decent_optim_wrapper.engine import GossipEngine
from decent_optim_wrapper.front_ends.inner_step import (
    fire_global_step_post_hooks,
    fire_global_step_pre_hooks,
    global_step_hooks_suspended,
)

__all__ = ["BackwardUpdates", "Scaler", "inside_backward"]


class Scaler(Protocol):
    """What the module front-end uses of a ``torch.amp.GradScaler``."""

    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    def unscale_(self, optimizer: Optimizer) -> None: ...
    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> float | None: ...
    def update(self, new_scale: float | torch.Tensor | None = None) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class BackwardUpdates:
    """Per-bucket updates of one model inside its backward passes.

    Args:
        engine: the engine whose buckets are updated (``begin_step``, ``step_bucket``, ``end_step``).
        optimizers, schedulers: one optimizer and one LR scheduler (or None) per bucket, in bucket order.
        params_in_model_order: the trainable parameters in the model's order (for the global norm).
        grad_clip_norm: clip to this global norm at the end of backward; 0 disables clipping.
        scaler: the GradScaler the loss is scaled with, or None.
    """

    def __init__(
        self,
        engine: GossipEngine,
        optimizers: list[Optimizer],
        schedulers: list[LRScheduler | None],
        params_in_model_order: list[torch.Tensor],
        grad_clip_norm: float,
        scaler: Scaler | None,
    ) -> None:
        self._engine = engine
        self._optimizers, self._schedulers = optimizers, schedulers
        self._params_in_model_order = params_in_model_order
        self._grad_clip_norm, self._scaler = grad_clip_norm, scaler
        #: While True, backward only accumulates gradients (``set_accumulate_grad``, ``no_sync``).
        self.accumulating = False
        #: Between the first gradient hook of an update and its end-of-backward callback.
        self.in_backward = False
        self._next_bucket = 0  # buckets before it are updated in this iteration
        self._waiting: list[int] = []  # per bucket, gradients not accumulated yet in this iteration
        self.reset()
        self._hooks = [
            # torch leaves this method unannotated
            param.register_post_accumulate_grad_hook(self._grad_ready_hook(index))  # type: ignore[no-untyped-call]
            for index, bucket in enumerate(engine.buckets)
            for param in bucket.params
        ]

    @property
    def deferred(self) -> bool:
        """Whether the updates wait for the end of backward (clipping or a scaler)."""
        return self._grad_clip_norm > 0 or self._scaler is not None

    def reset(self) -> None:
        """Start the next iteration from a clean slate (also after a backward that raised)."""
        self.in_backward = False
        self._next_bucket = 0
        self._waiting = [len(b.params) for b in self._engine.buckets]

    def _grad_ready_hook(self, bucket: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self._on_grad_ready(bucket)

        return hook

    def _on_grad_ready(self, bucket: int) -> None:
        if self.accumulating:
            return
        try:
            if not self.in_backward:
                self.in_backward = True
                self._engine.begin_step()
                fire_global_step_pre_hooks(self._optimizers[0])  # once per update, not per bucket
                _queue_at_end_of_backward(self._finish_backward)
            self._waiting[bucket] -= 1
            if self.deferred:
                return
            while self._next_bucket < len(self._waiting) and self._waiting[self._next_bucket] == 0:
                self._update_bucket(self._next_bucket, skip_local_update=False)
                self._next_bucket += 1
        except BaseException:
            self.reset()  # backward fails and the end-of-backward callback never runs
            raise

    def _finish_backward(self) -> None:
        try:
            if self.deferred:
                self._finish_deferred()
            else:
                for bucket in range(self._next_bucket, len(self._waiting)):
                    self._update_bucket(bucket, skip_local_update=False)
            self._engine.end_step()
            fire_global_step_post_hooks(self._optimizers[0])
        finally:
            self.reset()

    def _finish_deferred(self) -> None:
        scaler = self._scaler
        if scaler is not None:
            for optimizer in self._optimizers:
                scaler.unscale_(optimizer)
        grads = [p.grad for p in self._params_in_model_order if p.grad is not None]
        skip = False
        norm = torch.zeros(())
        if self._grad_clip_norm > 0:
            # the global norm over all parameters, in the model's order (as clip_grad_norm_ on the model)
            norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self._params_in_model_order if p.grad is not None], self._grad_clip_norm
            )
        elif scaler is not None and grads:
            norm = torch.nn.utils.get_total_norm(grads)
        if scaler is not None and grads:
            skip = not math.isfinite(float(norm))  # one host read per iteration, as GradScaler makes
        try:
            for bucket in range(len(self._waiting)):
                self._update_bucket(bucket, skip_local_update=skip)
        finally:
            if scaler is not None:
                scaler.update()  # uses the inf checks unscale_ recorded above

    @torch.no_grad()
    def _update_bucket(self, bucket: int, skip_local_update: bool) -> None:
        """The engine's bucket update with this bucket's optimizer, then its zero_grad and scheduler."""
        optimizer = self._optimizers[bucket]

        def local_update() -> None:
            # With a scaler the gradients are unscaled already and the inf decision is taken for the
            # whole model; scaler.step() would also refuse a bucket without gradients (no inf check).
            # Global step hooks fire once per update (in backward's hooks), not once per bucket.
            rule_step = self._engine.second_moment_step(optimizer)
            with global_step_hooks_suspended():
                if rule_step is not None:
                    rule_step(None)
                else:
                    optimizer.step()

        self._engine.step_bucket(bucket, local_update, skip_local_update=skip_local_update)
        optimizer.zero_grad(set_to_none=True)
        scheduler = self._schedulers[bucket]
        if scheduler is not None:
            scheduler.step()


def _queue_at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (as torch DDP and FSDP finish their work)."""
    queue = getattr(torch.autograd.graph, "queue_callback", None)
    if queue is None:  # torch before torch.autograd.graph.queue_callback was public
        queue = torch.autograd.Variable._execution_engine.queue_callback
    queue(callback)


def inside_backward() -> bool:
    """Whether the autograd engine is running a backward pass in this thread."""
    # -1 outside backward; a private but long-standing binding, used by torch's own checkpointing.
    return bool(torch._C._current_graph_task_id() != -1)
