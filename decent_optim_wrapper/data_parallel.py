r"""The module front-end: :class:`DecentralizedDataParallel`, decent-dp's API on the gossip engine.

The update happens inside ``loss.backward()``: as soon as every gradient of a bucket has been
accumulated, the bucket's round from the previous iteration is mixed in, the bucket's own
optimizer takes its step, and the bucket's next round is launched, while backward goes on for the
buckets of earlier layers. The user never calls ``optimizer.step()``. The docs' module front-end
page covers its use, and the page on migrating from decent-dp what changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import Store  # type: ignore[attr-defined]
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from decent_optim_wrapper.engine import (
    DEFAULT_TIMEOUT,
    CompressionSpec,
    GossipEngine,
    OuterFactory,
    PacingSpec,
)
from decent_optim_wrapper.engine.exchange.shards import is_sharded
from decent_optim_wrapper.engine.fleet.comm import agree, check_identical
from decent_optim_wrapper.engine.front_end import EngineFrontEnd
from decent_optim_wrapper.engine.state.resize import average_nested, average_optimizer_states
from decent_optim_wrapper.inner_step import (
    fire_global_step_post_hooks,
    fire_global_step_pre_hooks,
    global_step_hooks_suspended,
)
from decent_optim_wrapper.optim import LR_SCHEDULER_FN_TYPE, OPTIM_FN_TYPE
from decent_optim_wrapper.topo import Topology

__all__ = ["DecentralizedDataParallel"]

#: Version of :meth:`DecentralizedDataParallel.training_state_dict`'s layout.
TRAINING_STATE_VERSION = 1


class _Scaler(Protocol):
    """The part of ``torch.amp.GradScaler`` this front-end and its users rely on."""

    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    def unscale_(self, optimizer: Optimizer) -> None: ...
    def step(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> float | None: ...
    def update(self, new_scale: float | torch.Tensor | None = None) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class DecentralizedDataParallel(EngineFrontEnd, nn.Module):
    r"""Decentralized data parallelism for an ``nn.Module``, updating bucket by bucket inside backward.

    Every rank keeps its own replica and, instead of all-reducing gradients, averages parameters
    with the few neighbours its topology names for the iteration (D-PSGD: Lian et al., "Can
    Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017). Per rank ``i``,
    iteration ``t`` and bucket:

    .. math::
        x_i^{(t)} = \sum_j W^{(t-1)}_{ij}\, x_j^{(t-1)} + d_i^{(t)},
        \qquad d_i^{(t)} = \mathrm{OptimizerStep}\big(\nabla F_i(x_i^{(t-1)})\big),

    the local update ``d_i`` being computed from the gradient at the unmixed replica, and the round
    launched at iteration ``t-1`` mixed with the weights of the phase it was launched in. This is the
    recursion :class:`~decent_optim_wrapper.DecentOptimWrapper` runs, so both front-ends give the
    same numbers for the same optimizer.

    Buckets follow the reverse of the model's parameter registration order, the order in which
    backward usually produces gradients; every trainable parameter is bucketed, and trained, from
    the first iteration. Buckets are always updated and launched in that order on every rank (a
    bucket whose gradients are ready early waits for the ones before it), so collectives match
    across ranks whatever order autograd takes; buckets still waiting when backward ends (a
    parameter without a gradient in this iteration) are updated then.

    With ``grad_clip_norm > 0`` or a ``scaler``, the updates wait for the end of backward: clipping
    then uses the global norm of all gradients, and an inf/NaN gradient anywhere skips this rank's
    whole local update (gossip still runs, and the scaler backs off once). The cost: the optimizer
    steps no longer overlap backward.

    .. warning:: Construction, every backward that updates, :meth:`global_avg` and
        :meth:`consensus_distance` involve collectives: all ranks must call them the same number of
        times, in the same order.

    Args:
        model: the module to train, already on its device and in its dtype (it is never moved).
        optim_fn: builds one bucket's optimizer from its ``(name, parameter)`` pairs, e.g.
            :func:`~decent_optim_wrapper.optim_fn_adamw`.
        lr_scheduler_fn: builds one bucket's LR scheduler from its optimizer; stepped once per update.
        topology: a registered name, a :class:`~decent_optim_wrapper.topo.Topology` subclass or instance.
        scaler: a ``torch.amp.GradScaler`` the loss is scaled with (``scaler.scale(loss).backward()``);
            this module unscales, steps and updates it.
        grad_clip_norm: clip gradients to this global norm before the update; 0 disables clipping.
        param_as_bucket_view: parameters become views of the flat buckets (no copies). With False
            they keep their own storage and are copied into and out of the buckets around gossip:
            two extra copies of the parameters per iteration.
        sync_buffer_in_global_avg: :meth:`global_avg` also averages floating-point buffers
            (BatchNorm statistics), and :meth:`revert_global_avg` restores them.
        bucket_size_in_mb: largest bucket in MiB.
        _local_world_size: processes per node; defaults to ``$LOCAL_WORLD_SIZE``, else 1.
        timeout, compression, gradient_tracking, sync_every, outer_optimizer, sync_delay, second_moment: the
            engine's options, keyword-only; see :class:`~decent_optim_wrapper.engine.GossipEngine`.
            Defaults: ten minutes, exact gossip, no tracking, per-step gossip (``sync_every > 1``
            gives low-communication gossip: local steps, an outer optimizer, anchors gossiped).
        pacing: ``"measured"`` or a :class:`~decent_optim_wrapper.Pacing`: each rank takes as many inner
            steps per round as its speed allows (uneven fleets; with ``sync_every``); loops then count
            rounds (:attr:`round_count`), as ranks stand at different steps. Default None.
        on_peer_failure, store: ``"raise"`` (default): a dead or silent peer raises;
            ``"continue"``: the survivors drop it and go on, meeting in ``store`` (see the engine
            and the failures page of the docs).
        device_mesh, process_group: gossip along one group instead of the whole job (a 1-D
            device mesh, or a process group): e.g. pipeline stages, or several jobs in one world.
            Sharded (DTensor) parameters are refused: FSDP2 writes their gradients after its
            reduce-scatter, outside autograd's accumulation, so the per-bucket updates inside
            backward would never run. Wrap the optimizer with
            :class:`~decent_optim_wrapper.DecentOptimWrapper` instead (the big models page).

    Example::

        model = DecentralizedDataParallel(net, optim_fn_adamw, topology="ring")
        for x, y in loader:
            loss_fn(model(x), y).backward()  # mixes, steps and launches gossip, bucket by bucket
        model.global_avg()  # every replica is now the exact average: evaluate it
        model.revert_global_avg()  # back to this rank's own replica, bit for bit
    """

    def __init__(
        self,
        model: nn.Module,
        optim_fn: OPTIM_FN_TYPE,
        lr_scheduler_fn: LR_SCHEDULER_FN_TYPE | None = None,
        topology: str | type[Topology] | Topology = "complete",
        scaler: _Scaler | None = None,
        grad_clip_norm: float = 0.0,
        param_as_bucket_view: bool = True,
        sync_buffer_in_global_avg: bool = False,
        bucket_size_in_mb: float = 25,
        _local_world_size: int | None = None,
        *,
        timeout: timedelta = DEFAULT_TIMEOUT,
        compression: CompressionSpec = None,
        gradient_tracking: bool = False,
        sync_every: int = 1,
        outer_optimizer: OuterFactory | None = None,
        sync_delay: int | None = None,
        pacing: PacingSpec = None,
        on_peer_failure: str = "raise",
        store: Store | None = None,
        second_moment: str = "average",
        device_mesh: DeviceMesh | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        _check_arguments(model, optim_fn, lr_scheduler_fn, scaler, grad_clip_norm)
        for name, flag in (
            ("param_as_bucket_view", param_as_bucket_view),
            ("sync_buffer_in_global_avg", sync_buffer_in_global_avg),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}.")
        self._model = model
        self._scaler = scaler
        self._grad_clip_norm = float(grad_clip_norm)
        self._sync_buffers = sync_buffer_in_global_avg
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._params_in_model_order = [p for _, p in trainable]
        self._engine = GossipEngine(
            list(reversed(trainable)),  # backward produces the last layers' gradients first
            topology=topology,
            params_as_views=param_as_bucket_view,
            bucket_cap_mb=bucket_size_in_mb,
            local_world_size=_local_world_size,
            timeout=timeout,
            compression=compression,
            gradient_tracking=gradient_tracking,
            sync_every=sync_every,
            outer_optimizer=outer_optimizer,
            sync_delay=sync_delay,
            pacing=pacing,
            on_peer_failure=on_peer_failure,
            store=store,
            second_moment=second_moment,
            device_mesh=device_mesh,
            process_group=process_group,
            context="DecentralizedDataParallel",
        )
        self._optimizers, self._schedulers = self._build_optimizers(optim_fn, lr_scheduler_fn)
        self._sync_frozen_state()
        self._engine.open_to_joiners(
            self._training_state,
            self._load_training_state,
            (
                ("optimizers", tuple((type(o).__name__, len(o.param_groups)) for o in self._optimizers)),
                ("lr_schedulers", tuple(None if s is None else type(s).__name__ for s in self._schedulers)),
                ("scaler", None if scaler is None else type(scaler).__name__),
                ("grad_clip_norm", self._grad_clip_norm),
                (
                    "model_state",
                    tuple((k, tuple(v.shape), str(v.dtype)) for k, v in model.state_dict().items()),
                ),
            ),
        )

        num_buckets = len(self._engine.buckets)
        self._accumulating = False
        self._in_backward = False  # between the first gradient hook of an update and its callback
        self._next_bucket = 0  # buckets before it are updated in this iteration
        self._waiting: list[int] = []  # per bucket, gradients not accumulated yet in this iteration
        self._reset_iteration()
        self._hooks = [
            # torch leaves this method unannotated
            param.register_post_accumulate_grad_hook(self._grad_ready_hook(index))  # type: ignore[no-untyped-call]
            for index in range(num_buckets)
            for param in self._engine.buckets[index].params
        ]

    # -- construction helpers ------------------------------------------------------------------------
    def _build_optimizers(
        self, optim_fn: OPTIM_FN_TYPE, lr_scheduler_fn: LR_SCHEDULER_FN_TYPE | None
    ) -> tuple[list[Optimizer], list[LRScheduler | None]]:
        optimizers: list[Optimizer] = []
        schedulers: list[LRScheduler | None] = []

        def build() -> tuple[object, ...]:
            for index, bucket in enumerate(self._engine.buckets):
                optimizer = optim_fn(list(zip(bucket.names, bucket.params, strict=True)))
                _check_bucket_optimizer(optimizer, bucket.params, index)
                optimizers.append(optimizer)
                schedulers.append(lr_scheduler_fn(optimizer) if lr_scheduler_fn is not None else None)
            return tuple(
                (type(o).__name__, len(o.param_groups), type(s).__name__)
                for o, s in zip(optimizers, schedulers, strict=True)
            )

        # optim_fn may fail on one rank only (bad input): fail on every rank instead of hanging.
        reports = agree("Building the bucket optimizers of DecentralizedDataParallel", build)
        check_identical(
            "The bucket optimizers",
            [reports[r] for r in self._engine.gossip_ranks],
            "Pass the same optim_fn and lr_scheduler_fn on every rank.",
        )
        return optimizers, schedulers

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

    # -- facts ---------------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        """The wrapped model (the same object that was passed in)."""
        return self._model

    @property
    def optimizers(self) -> list[Optimizer]:
        """One optimizer per bucket, in bucket order."""
        return list(self._optimizers)

    @property
    def lr_schedulers(self) -> list[LRScheduler | None]:
        return list(self._schedulers)

    def get_lr(self) -> float:
        """The learning rate the next update uses (of the first bucket's first param group)."""
        return float(self._optimizers[0].param_groups[0]["lr"])

    # -- the nn.Module face --------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._in_backward and not _inside_backward():
            # The last backward raised after some of its buckets were updated, so its end-of-backward
            # callback never ran; start the next iteration from a clean slate.
            self._reset_iteration()
        with torch.autograd.profiler.record_function("DecentralizedDataParallel.forward"):
            return self._model(*args, **kwargs)

    def train(self, mode: bool = True) -> DecentralizedDataParallel:
        super().train(mode)
        return self

    def eval(self) -> DecentralizedDataParallel:
        super().eval()
        return self

    # -- accumulation --------------------------------------------------------------------------------
    def set_accumulate_grad(self, enable: bool = True) -> None:
        """While enabled, backward only accumulates gradients; the first backward after disabling updates.

        Accumulating over ``k`` micro-batches::

            model.set_accumulate_grad(True)
            for x, y in micro_batches[:-1]:
                (loss_fn(model(x), y) / k).backward()  # accumulates only
            model.set_accumulate_grad(False)
            x, y = micro_batches[-1]
            (loss_fn(model(x), y) / k).backward()  # accumulates the last one, then updates

        (Disabling after the last backward, as decent-dp's tutorial shows, performs no update.)
        """
        if not isinstance(enable, bool):
            raise TypeError(f"enable must be True or False, got {enable!r}.")
        if self._in_backward:
            raise RuntimeError("set_accumulate_grad() cannot be called during backward.")
        self._accumulating = enable

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without updating, as with torch DDP's ``no_sync``.

        Backward passes inside the context only accumulate; the first backward after it updates::

            with model.no_sync():
                for x, y in micro_batches[:-1]:
                    (loss_fn(model(x), y) / k).backward()
            x, y = micro_batches[-1]
            (loss_fn(model(x), y) / k).backward()
        """
        previous = self._accumulating
        self.set_accumulate_grad(True)
        try:
            yield
        finally:
            self._accumulating = previous

    # -- the update inside backward --------------------------------------------------------------------
    @property
    def _deferred(self) -> bool:
        return self._grad_clip_norm > 0 or self._scaler is not None

    def _grad_ready_hook(self, bucket: int) -> Callable[[torch.Tensor], None]:
        def hook(_: torch.Tensor) -> None:
            self._on_grad_ready(bucket)

        return hook

    def _on_grad_ready(self, bucket: int) -> None:
        if self._accumulating:
            return
        try:
            if not self._in_backward:
                self._in_backward = True
                self._engine.begin_step()
                fire_global_step_pre_hooks(self._optimizers[0])  # once per update, not per bucket
                _queue_at_end_of_backward(self._finish_backward)
            self._waiting[bucket] -= 1
            if self._deferred:
                return
            while self._next_bucket < len(self._waiting) and self._waiting[self._next_bucket] == 0:
                self._update_bucket(self._next_bucket, skip_local_update=False)
                self._next_bucket += 1
        except BaseException:
            self._reset_iteration()  # backward fails and the end-of-backward callback never runs
            raise

    def _finish_backward(self) -> None:
        try:
            if self._deferred:
                self._finish_deferred()
            else:
                for bucket in range(self._next_bucket, len(self._waiting)):
                    self._update_bucket(bucket, skip_local_update=False)
            self._engine.end_step()
            fire_global_step_post_hooks(self._optimizers[0])
        finally:
            self._reset_iteration()

    def _reset_iteration(self) -> None:
        self._in_backward = False
        self._next_bucket = 0
        self._waiting = [len(b.params) for b in self._engine.buckets]

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

    # -- averaging -----------------------------------------------------------------------------------
    def global_avg(self, will_revert: bool = True, return_d2c: bool = False) -> float | None:
        """Set every replica to the exact average of all replicas (e.g. to evaluate the average model).

        Callable at any time, also before the first iteration. Gossip in flight is finished first;
        with ``will_revert`` the replica is saved for :meth:`revert_global_avg`. Without a revert,
        the next iteration trains from the average. With ``sync_buffer_in_global_avg``, floating
        buffers are averaged too (summed in fp32).

        Args:
            will_revert: keep a snapshot for :meth:`revert_global_avg`.
            return_d2c: return this replica's L2 distance to the average (``||x_i - x_bar||_2``);
                it differs from rank to rank. :meth:`consensus_distance` gives the collective
                root-mean-square figure.

        .. warning:: This is a collective: all ranks must call it.
        """
        distance = self._engine.global_avg(
            may_revert=will_revert,
            buffers=self._model if self._sync_buffers else None,
            return_distance=return_d2c,
        )
        return distance if return_d2c else None

    def revert_global_avg(self) -> None:
        """Restore the replica (and buffers) saved by :meth:`global_avg` bit for bit.

        Raises :class:`RuntimeError` (parameters untouched) if there is nothing to revert.
        """
        self._engine.revert_global_avg()

    def set_adaptive_factor(self, factor: float) -> None:
        """Mix only part of the way: ``x <- (1 - a) x + a sum_j W_ij x_j`` with ``a = factor`` in (0, 1]."""
        self._engine.mixing_factor = factor

    # -- checkpoints -----------------------------------------------------------------------------------
    def training_state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this rank bit for bit; save one file per rank.

        Layout::

            {
                "version": 1,
                "model": {...},  # self.module.state_dict()
                "optimizers": [...],  # one state dict per bucket optimizer
                "lr_schedulers": [...],  # one per bucket, or None
                "scaler": {...} or None,
                "decent": {...},  # GossipEngine.state_dict(): step, replica, gossip in flight, ...
            }

        Waits for gossip in flight (no collective). Save between iterations (not during backward or
        halfway through an accumulation: gradients are not saved).
        """
        if self._in_backward:
            raise RuntimeError("training_state_dict() cannot be called during backward.")
        return {**self._training_state(), "decent": self._engine.state_dict()}

    def _training_state(self) -> dict[str, Any]:
        """Everything but the engine's part (also what a donor hands a joiner, possibly inside backward)."""
        return {
            "version": TRAINING_STATE_VERSION,
            "model": self._model.state_dict(),
            "optimizers": [o.state_dict() for o in self._optimizers],
            "lr_schedulers": [s.state_dict() if s is not None else None for s in self._schedulers],
            "scaler": self._scaler.state_dict() if self._scaler is not None else None,
        }

    def load_training_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`training_state_dict` of the same rank, world size, topology and model.

        Checked before anything changes: the engine's part, the number of optimizers and schedulers,
        the model's keys and shapes, and each optimizer's groups. Local.
        """
        if not isinstance(state, dict) or state.get("version") != TRAINING_STATE_VERSION:
            raise ValueError(
                "state is not a DecentralizedDataParallel.training_state_dict() of version "
                f"{TRAINING_STATE_VERSION} (got {type(state).__name__} with version "
                f"{state.get('version') if isinstance(state, dict) else None!r})."
            )
        self._engine.check_state_dict(state["decent"])
        for key, expected in (
            ("optimizers", len(self._optimizers)),
            ("lr_schedulers", len(self._schedulers)),
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
            zip(self._optimizers, state["optimizers"], strict=True)
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
        self._load_training_state(state)
        self._engine.load_state_dict(state["decent"])

    def _load_training_state(self, state: dict[str, Any]) -> None:
        self._model.load_state_dict(state["model"])
        for optimizer, saved in zip(self._optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(self._schedulers, state["lr_schedulers"], strict=True):
            if scheduler is not None:
                scheduler.load_state_dict(saved)
        if self._scaler is not None:
            self._scaler.load_state_dict(state["scaler"])

    def load_training_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Resume at any world size from every saved rank's :meth:`training_state_dict`, in rank order.

        At the saved world size and topology this rank loads its own saved state (``states[rank]``)
        with :meth:`load_training_state_dict`, and the run continues bit for bit. Otherwise every rank
        starts from the exact average of the saved replicas: parameters, floating buffers and the
        bucket optimizers' floating state averaged (float64 sums rounded once, the same bits on every
        rank), counters (Adam's ``step``, integer buffers) checked equal, param groups, LR schedulers
        and the GradScaler from saved rank 0, gossip in flight, compression references and gradient
        trackers started afresh. The rule and why: :mod:`~decent_optim_wrapper.engine.state.resize`.

        Everything is checked before anything changes. Local: no communication; each rank reads every
        saved state (``torch.load(path, mmap=True)`` keeps that cheap).
        """
        for index, state in enumerate(states):
            if not isinstance(state, dict) or "decent" not in state or "optimizers" not in state:
                raise ValueError(
                    f"states[{index}] is not a DecentralizedDataParallel.training_state_dict(); pass the one "
                    "of every saved rank, in rank order."
                )
        averaged = self._engine.resume_state([state["decent"] for state in states])
        if averaged is None:
            self.load_training_state_dict(states[self.rank])
            return
        first = states[0]  # its engine entry has this run's bucket layout: one optimizer per bucket
        optimizers = [
            average_optimizer_states([s["optimizers"][b] for s in states], f"optimizers[{b}]")
            for b in range(len(self._optimizers))
        ]
        self.load_training_state_dict(
            {
                **first,
                "model": average_nested([s["model"] for s in states], "model"),
                "optimizers": optimizers,
                "decent": averaged,
            }
        )


def _queue_at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (as torch DDP and FSDP finish their work)."""
    queue = getattr(torch.autograd.graph, "queue_callback", None)
    if queue is None:  # torch before torch.autograd.graph.queue_callback was public
        queue = torch.autograd.Variable._execution_engine.queue_callback
    queue(callback)


def _inside_backward() -> bool:
    """Whether the autograd engine is running a backward pass in this thread."""
    # -1 outside backward; a private but long-standing binding, used by torch's own checkpointing.
    return bool(torch._C._current_graph_task_id() != -1)


def _check_arguments(
    model: object, optim_fn: object, lr_scheduler_fn: object, scaler: object, grad_clip_norm: object
) -> None:
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
    if isinstance(grad_clip_norm, bool) or not isinstance(grad_clip_norm, int | float):
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
