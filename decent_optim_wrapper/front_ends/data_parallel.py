r"""The module front-end: :class:`DecentralizedDataParallel`, decent-dp's API on the gossip engine.

The update happens inside ``loss.backward()``: as soon as every gradient of a bucket has been
accumulated, the bucket's round from the previous iteration is mixed in, the bucket's own
optimizer takes its step, and the bucket's next round is launched, while backward goes on for the
buckets of earlier layers. The user never calls ``optimizer.step()``. The docs' module front-end
page covers its use, and the page on migrating from decent-dp what changed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Unpack

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from decent_optim_wrapper.engine import (
    GossipConfig,
    GossipEngine,
    KeywordOptions,
    TopologySpec,
    document_options,
    drop_state,
    given,
)
from decent_optim_wrapper.front_ends.base import EngineFrontEnd
from decent_optim_wrapper.front_ends.data_parallel_backward import BackwardUpdates, Scaler, inside_backward
from decent_optim_wrapper.front_ends.data_parallel_state import (
    TRAINING_STATE_VERSION,
    BucketOptimizers,
    check_arguments,
)
from decent_optim_wrapper.optim import LR_SCHEDULER_FN_TYPE, OPTIM_FN_TYPE

__all__ = ["TRAINING_STATE_VERSION", "DecentralizedDataParallel"]


@document_options(
    renamed={"bucket_cap_mb": "bucket_size_in_mb", "local_world_size": "_local_world_size"},
    leave_out=("rank", "world_size"),  # the job's own: decent-dp never took them
)
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
        scaler: a ``torch.amp.GradScaler`` the loss is scaled with (``scaler.scale(loss).backward()``);
            this module unscales, steps and updates it.
        grad_clip_norm: clip gradients to this global norm before the update; 0 disables clipping.
        param_as_bucket_view: parameters become views of the flat buckets (no copies). With False
            they keep their own storage and are copied into and out of the buckets around gossip:
            two extra copies of the parameters per iteration.
        sync_buffer_in_global_avg: :meth:`global_avg` also averages floating-point buffers
            (BatchNorm statistics), and :meth:`revert_global_avg` restores them.
        config: the options as one :class:`~decent_optim_wrapper.GossipConfig`; the keywords below build
            it (or change it, if they agree with it: a keyword that contradicts ``config`` is an error).
            ``topology``, ``bucket_size_in_mb`` (``bucket_cap_mb``) and ``_local_world_size``
            (``local_world_size``) may also be passed by position, in decent-dp's order and spelling,
            with decent-dp's defaults (``"complete"``, 25); with ``config``, one left at its default
            leaves the config's value.
            Sharded (DTensor) parameters are refused here (``device_mesh`` is a group to gossip along,
            e.g. pipeline stages): FSDP2 writes their gradients after its reduce-scatter, outside
            autograd's accumulation, so the per-bucket updates inside backward would never run. Wrap the
            optimizer with :class:`~decent_optim_wrapper.DecentOptimWrapper` instead (the big models page).
        {gossip_options}

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
        topology: TopologySpec = "complete",
        scaler: Scaler | None = None,
        grad_clip_norm: float = 0.0,
        param_as_bucket_view: bool = True,
        sync_buffer_in_global_avg: bool = False,
        bucket_size_in_mb: float = 25,
        _local_world_size: int | None = None,
        *,
        config: GossipConfig | None = None,
        **options: Unpack[KeywordOptions],
    ) -> None:
        super().__init__()
        check_arguments(model, optim_fn, lr_scheduler_fn, scaler, grad_clip_norm)
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
        # decent-dp's signature keeps its defaults; with a config, an argument left at its default leaves
        # the config's value.
        positional = given(
            topology=None if config is not None and topology == "complete" else topology,
            bucket_cap_mb=None if config is not None and bucket_size_in_mb == 25 else bucket_size_in_mb,
            local_world_size=_local_world_size,
        )
        engine = GossipEngine(
            trainable,
            config=config,
            params_as_views=param_as_bucket_view,
            reverse_buckets=True,  # backward produces the last layers' gradients first
            context="DecentralizedDataParallel",
            **positional,
            **options,
        )
        self._attach(engine)
        self._state = BucketOptimizers(self._engine, model, optim_fn, lr_scheduler_fn, scaler)
        self._optimizers, self._schedulers = self._state.optimizers, self._state.schedulers
        # A bucket healed from its peers drops the inner state that stepped it (it was not finite).
        self._engine.on_bucket_healed(self._drop_optimizer_state)
        self._engine.open_to_joiners(
            self._state.state_dict,
            self._state.load_state_dict,
            self._state.join_signature(self._grad_clip_norm),
        )
        self._updates = BackwardUpdates(
            self._engine,
            self._optimizers,
            self._schedulers,
            [p for _, p in trainable],
            self._grad_clip_norm,
            scaler,
        )

    def _drop_optimizer_state(self, params: list[torch.Tensor]) -> None:
        for optimizer in self._optimizers:
            drop_state(optimizer, params)

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
        if self._updates.in_backward and not inside_backward():
            # The last backward raised after some of its buckets were updated, so its end-of-backward
            # callback never ran; start the next iteration from a clean slate.
            self._updates.reset()
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
        if self._updates.in_backward:
            raise RuntimeError("set_accumulate_grad() cannot be called during backward.")
        self._updates.accumulating = enable

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
        previous = self._updates.accumulating
        self.set_accumulate_grad(True)
        try:
            yield
        finally:
            self._updates.accumulating = previous

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
        if self._updates.in_backward:
            raise RuntimeError("training_state_dict() cannot be called during backward.")
        return {**self._state.state_dict(), "decent": self._engine.state_dict()}

    def load_training_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`training_state_dict` of the same rank, world size, topology and model.

        Checked before anything changes: the engine's part, the number of optimizers and schedulers,
        the model's keys and shapes, and each optimizer's groups. Local.
        """
        self._state.check_state_dict(state)
        self._state.load_state_dict(state)
        self._engine.load_state_dict(state["decent"])

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
        self.load_training_state_dict(self._state.averaged(states, averaged))
