"""The module front-end's own state: its bucket optimizers and its part of a checkpoint.

:class:`BucketOptimizers` holds the model, one optimizer and one LR scheduler per engine bucket, and
the GradScaler. It builds them (an error on one rank becomes an error on every rank, through the
engine's agreement), starts every replica from rank 0's frozen parameters and buffers, and saves,
checks and loads the training state beside the engine's ``"decent"`` entry (layout in
:meth:`~decent_optim_wrapper.DecentralizedDataParallel.training_state_dict`), also averaged over the
saved replicas when a run resumes at another world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from decent_optim_wrapper.checks import is_real
from decent_optim_wrapper.engine import (
    GossipEngine,
    agree,
    average_nested,
    average_optimizer_states,
    check_identical,
    is_sharded,
)
from decent_optim_wrapper.front_ends.data_parallel_backward import Scaler
from decent_optim_wrapper.optim import LR_SCHEDULER_FN_TYPE, OPTIM_FN_TYPE

__all__ = ["TRAINING_STATE_VERSION", "BucketOptimizers", "check_arguments"]

#: Version of :meth:`~decent_optim_wrapper.DecentralizedDataParallel.training_state_dict`'s layout.
TRAINING_STATE_VERSION = 1


class BucketOptimizers:
    """One optimizer and LR scheduler per bucket of ``engine``, built by ``optim_fn`` on every rank.

    .. warning:: Construction is a collective over the job (the agreement on the optimizers and the
        broadcast of the frozen state): all ranks must build it at the same point.
    """

    def __init__(
        self,
        engine: GossipEngine,
        model: nn.Module,
        optim_fn: OPTIM_FN_TYPE,
        lr_scheduler_fn: LR_SCHEDULER_FN_TYPE | None,
        scaler: Scaler | None,
    ) -> None:
        self._engine, self._model, self._scaler = engine, model, scaler
        self.optimizers: list[Optimizer] = []
        self.schedulers: list[LRScheduler | None] = []
        self._build(optim_fn, lr_scheduler_fn)
        self._sync_frozen_state()

    def _build(self, optim_fn: OPTIM_FN_TYPE, lr_scheduler_fn: LR_SCHEDULER_FN_TYPE | None) -> None:
        def build() -> tuple[object, ...]:
            for index, bucket in enumerate(self._engine.buckets):
                optimizer = optim_fn(list(zip(bucket.names, bucket.params, strict=True)))
                _check_bucket_optimizer(optimizer, bucket.params, index)
                self.optimizers.append(optimizer)
                self.schedulers.append(lr_scheduler_fn(optimizer) if lr_scheduler_fn is not None else None)
            return tuple(
                (type(o).__name__, len(o.param_groups), type(s).__name__)
                for o, s in zip(self.optimizers, self.schedulers, strict=True)
            )

        # optim_fn may fail on one rank only (bad input): fail on every rank instead of hanging.
        reports = agree("Building the bucket optimizers of DecentralizedDataParallel", build)
        check_identical(
            "The bucket optimizers",
            [reports[r] for r in self._engine.gossip_ranks],
            "Pass the same optim_fn and lr_scheduler_fn on every rank.",
        )

    @torch.no_grad()
    def _sync_frozen_state(self) -> None:
        """Start every replica from rank 0's frozen parameters and buffers, as torch DDP does."""
        frozen = [p for p in self._model.parameters() if not p.requires_grad]
        tensors = frozen + list(self._model.buffers())

        def layout() -> tuple[object, ...]:
            return tuple((tuple(t.shape), str(t.dtype)) for t in tensors)

        reports = agree("Checking the model's buffers", layout)
        check_identical(
            "The model's frozen parameters and buffers",
            [reports[r] for r in self._engine.gossip_ranks],
            "Build the same model on every rank.",
        )
        self._engine.broadcast_(tensors)

    def join_signature(self, grad_clip_norm: float) -> tuple[tuple[str, object], ...]:
        """What a joiner must share with the job besides the engine's layout."""
        return (
            ("optimizers", tuple((type(o).__name__, len(o.param_groups)) for o in self.optimizers)),
            ("lr_schedulers", tuple(None if s is None else type(s).__name__ for s in self.schedulers)),
            ("scaler", None if self._scaler is None else type(self._scaler).__name__),
            ("grad_clip_norm", grad_clip_norm),
            (
                "model_state",
                tuple((k, tuple(v.shape), str(v.dtype)) for k, v in self._model.state_dict().items()),
            ),
        )

    # -- the training state beside the engine's entry ------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything but the engine's part (also what a donor hands a joiner, possibly inside backward)."""
        return {
            "version": TRAINING_STATE_VERSION,
            "model": self._model.state_dict(),
            "optimizers": [o.state_dict() for o in self.optimizers],
            "lr_schedulers": [s.state_dict() if s is not None else None for s in self.schedulers],
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
        }

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` naming the mismatch if ``state`` (engine's part included) cannot be loaded."""
        if not isinstance(state, dict) or state.get("version") != TRAINING_STATE_VERSION:
            raise ValueError(
                "state is not a DecentralizedDataParallel.training_state_dict() of version "
                f"{TRAINING_STATE_VERSION} (got {type(state).__name__} with version "
                f"{state.get('version') if isinstance(state, dict) else None!r})."
            )
        self._engine.check_state_dict(state["decent"])
        for key, expected in (
            ("optimizers", len(self.optimizers)),
            ("lr_schedulers", len(self.schedulers)),
        ):
            if len(state[key]) != expected:
                raise ValueError(
                    f"checkpoint has {len(state[key])} {key} but this model has {expected} buckets; build "
                    "the same model with the same bucket_size_in_mb before loading."
                )
        live = self._model.state_dict()
        saved = state["model"]
        wrong = [k for k in live if k not in saved or tuple(saved[k].shape) != tuple(live[k].shape)]
        if wrong or len(saved) != len(live):
            raise ValueError(
                f"checkpoint's model state does not fit this model (missing or reshaped: {wrong[:5]}); "
                "build the same model before loading."
            )
        for index, (optimizer, saved_optimizer) in enumerate(
            zip(self.optimizers, state["optimizers"], strict=True)
        ):
            sizes = [len(g["params"]) for g in optimizer.param_groups]
            if [len(g["params"]) for g in saved_optimizer["param_groups"]] != sizes:
                raise ValueError(
                    f"checkpoint's optimizer of bucket {index} has other param groups than this run's "
                    f"({sizes} parameters per group); pass the same optim_fn."
                )
        if (state["scaler"] is None) != (self._scaler is None):
            raise ValueError(
                "checkpoint and this run disagree on whether a GradScaler is used; pass the same scaler."
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (unchecked: :meth:`check_state_dict` first)."""
        self._model.load_state_dict(state["model"])
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(self.schedulers, state["lr_schedulers"], strict=True):
            if scheduler is not None:
                scheduler.load_state_dict(saved)
        if self._scaler is not None:
            self._scaler.load_state_dict(state["scaler"])

    def averaged(self, states: Sequence[dict[str, Any]], engine_state: dict[str, Any]) -> dict[str, Any]:
        """The training state every rank starts from when resuming ``states`` at another world size:
        the model's and the bucket optimizers' floating state averaged, the rest from saved rank 0."""
        first = states[0]  # its engine entry has this run's bucket layout: one optimizer per bucket
        optimizers = [
            average_optimizer_states([s["optimizers"][b] for s in states], f"optimizers[{b}]")
            for b in range(len(self.optimizers))
        ]
        return {
            **first,
            "model": average_nested([s["model"] for s in states], "model"),
            "optimizers": optimizers,
            "decent": engine_state,
        }


def check_arguments(
    model: object, optim_fn: object, lr_scheduler_fn: object, scaler: object, grad_clip_norm: object
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument if the front-end's own input is bad."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    for name, param in model.named_parameters():
        if is_sharded(param):
            raise ValueError(
                f"{name} is a sharded parameter (DTensor, e.g. from FSDP2's fully_shard). "
                "DecentralizedDataParallel updates each bucket inside backward as its gradients are "
                "accumulated, but FSDP2 writes sharded gradients after its reduce-scatter, outside that "
                "accumulation, so no update would ever run. Wrap the optimizer instead: "
                'DecentOptimWrapper(torch.optim.AdamW(model.parameters()), device_mesh=mesh["replicate"]).'
            )
    if not callable(optim_fn) or isinstance(optim_fn, Optimizer):
        raise TypeError(
            f"optim_fn must be a function from a list of (name, parameter) pairs to an optimizer, got "
            f"{optim_fn!r}; e.g. decent_optim_wrapper.optim_fn_adamw, or "
            "lambda params: torch.optim.SGD([p for _, p in params], lr=0.1)."
        )
    if lr_scheduler_fn is not None and not callable(lr_scheduler_fn):
        raise TypeError(
            f"lr_scheduler_fn must be None or a function from an optimizer to an LR scheduler, got "
            f"{lr_scheduler_fn!r}."
        )
    if scaler is not None and not all(hasattr(scaler, m) for m in ("scale", "unscale_", "step", "update")):
        raise TypeError(f"scaler must be None or a torch.amp.GradScaler, got {type(scaler).__name__}.")
    if not is_real(grad_clip_norm):
        raise TypeError(f"grad_clip_norm must be a number, got {grad_clip_norm!r}; 0.0 disables clipping.")
    if not (grad_clip_norm >= 0 and math.isfinite(grad_clip_norm)):
        raise ValueError(
            f"grad_clip_norm must be a finite number >= 0, got {grad_clip_norm!r}; 0.0 disables clipping."
        )


def _check_bucket_optimizer(optimizer: object, params: list[torch.Tensor], index: int) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"optim_fn returned {type(optimizer).__name__} for bucket {index}; it must return a "
            "torch.optim.Optimizer built on the parameters it is given."
        )
    if hasattr(optimizer, "pre_average_hook"):
        raise ValueError(
            f"{type(optimizer).__name__} defines pre_average_hook(edge, weight), decent-dp's hook into "
            "gossip, which this library does not support; use an optimizer without it."
        )
    given = {id(p) for p in params}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if {id(p) for p in held} != given or len(held) != len(params):
        raise ValueError(
            f"optim_fn built an optimizer over {len(held)} parameters for bucket {index}, which holds "
            f"{len(params)}: the optimizer must cover exactly the parameters it is given, once each."
        )
