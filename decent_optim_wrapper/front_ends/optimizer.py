"""The optimizer front-end: :class:`DecentOptimWrapper`, a ``torch.optim.Optimizer`` over the engine.

It translates the optimizer API into engine calls: ``step()`` mixes every bucket, runs the inner
optimizer's step, and launches every bucket's gossip; ``state_dict()`` composes the inner
optimizer's state with the engine's. Buckets, gossip, global averaging and checkpoints of the
replica live in :class:`~decent_optim_wrapper.engine.GossipEngine`. The docs' training loops page
shows it with AMP, clipping, accumulation, schedulers and checkpoints.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Unpack

import torch
from torch.optim import Optimizer

from decent_optim_wrapper.engine import (
    DEFAULT_TIMEOUT,
    GossipConfig,
    GossipEngine,
    KeywordOptions,
    TopologySpec,
    average_optimizer_states,
    document_options,
    drop_state,
    given,
    local_optimizer_state,
    placed_optimizer_state,
)
from decent_optim_wrapper.front_ends.base import EngineFrontEnd
from decent_optim_wrapper.front_ends.inner_step import scaled_step

__all__ = ["DEFAULT_TIMEOUT", "DecentOptimWrapper", "named_param_groups"]


@document_options
class DecentOptimWrapper(EngineFrontEnd, Optimizer):
    r"""Decentralized data parallelism for any ``torch.optim.Optimizer``.

    Every rank keeps its own replica ``x_i`` and, instead of all-reducing gradients, averages
    parameters with the few neighbours its topology names for the step (gossip, as in D-PSGD: Lian
    et al., "Can Decentralized Algorithms Outperform Centralized Algorithms?", NeurIPS 2017). The
    communication of step ``t`` overlaps the forward and backward pass of step ``t + 1``:

    .. math::
        x_i &\leftarrow \sum_{j \in G_{t-1}(i)} W^{(t-1)}_{ij}\, x_j
            &&\text{(1) finish the gossip launched at step } t-1 \text{ and mix it in} \\
        x_i &\leftarrow \mathrm{OptimizerStep}(x_i, g_i)
            &&\text{(2) the inner optimizer's step with the user's gradients } g_i \\
        &\text{launch gossip of } x_i \text{ in } G_t(i)
            &&\text{(3) non-blocking, mixed in at step } t+1

    where ``W^{(t)}`` is the topology's (doubly stochastic) mixing matrix of step ``t``. Step 0 mixes
    nothing. The mean of the replicas changes only through the local steps.

    The wrapped optimizer is used as is (its state is kept): the wrapper shares its
    ``param_groups``, so a stock LR scheduler built on either object changes the lr actually used.
    At construction the parameters move into flat buckets (one per dtype and device run, at most
    ``bucket_cap_mb`` each; ``param.data`` becomes a view into a bucket) and rank 0's values are
    broadcast, so all replicas start equal.

    .. warning:: Construction, :meth:`step` (through the gossip it launches and waits for) and
        :meth:`global_avg` involve collectives: all ranks must call them, the same number of times.

    Args:
        optimizer: the optimizer to wrap, already built on the model's parameters.
        config: the options as one :class:`~decent_optim_wrapper.GossipConfig`; the keywords below build
            it (or change it, if they agree with it: a keyword that contradicts ``config`` is an error).
            ``rank``, ``world_size``, ``local_world_size``, ``topology`` and ``bucket_cap_mb`` may also be
            passed by position, in this order (decent-optim-wrapper 0.1.1's).
        {gossip_options}

    The work is done by a :class:`~decent_optim_wrapper.engine.GossipEngine` (:attr:`engine`); this
    class is its ``torch.optim.Optimizer`` face.

    Example::

        model = Net().to(device)
        optimizer = DecentOptimWrapper(torch.optim.AdamW(model.parameters(), lr=1e-3), topology="ring")
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
        optimizer.global_avg()  # evaluate the average model ...
        optimizer.revert_global_avg()  # ... then continue exactly where training was
    """

    def __init__(
        self,
        optimizer: Optimizer,
        rank: int | None = None,
        world_size: int | None = None,
        local_world_size: int | None = None,
        topology: TopologySpec | None = None,
        bucket_cap_mb: float | None = None,
        *,
        config: GossipConfig | None = None,
        **options: Unpack[KeywordOptions],
    ) -> None:
        if isinstance(optimizer, DecentOptimWrapper):
            raise TypeError("optimizer is already a DecentOptimWrapper; wrap the inner optimizer only once.")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}. "
                "Build it first, e.g. torch.optim.SGD(model.parameters(), lr=0.1)."
            )
        self.optimizer = optimizer
        self._init_optimizer_hooks()
        positional = given(
            rank=rank,
            world_size=world_size,
            local_world_size=local_world_size,
            topology=topology,
            bucket_cap_mb=bucket_cap_mb,
        )
        engine = GossipEngine(
            lambda: named_param_groups(optimizer.param_groups),
            config=config,
            context="DecentOptimWrapper",
            **positional,
            **options,
        )
        self._attach(engine)
        # A bucket healed from its peers drops the inner state that stepped it (it was not finite).
        self._engine.on_bucket_healed(lambda params: drop_state(optimizer, params))
        self._engine.open_to_joiners(
            lambda: local_optimizer_state(optimizer.state_dict()),
            self._load_inner_state,
            (("optimizer", (type(optimizer).__name__, [len(g["params"]) for g in optimizer.param_groups])),),
        )

    def _init_optimizer_hooks(self) -> None:
        # Optimizer.__init__ would re-create param_groups and state, which belong to the inner
        # optimizer here; set up only the hook registries that step()/state_dict() hooks rely on.
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    # -- the inner optimizer's state, shared rather than copied ------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    # -- the algorithm -----------------------------------------------------------------------------
    #: GradScaler calls ``step()`` even when it found inf/NaN gradients (telling us through
    #: ``found_inf``), so a rank that skips its local update still joins this step's gossip; otherwise
    #: its peers would wait forever for it.
    _step_supports_amp_scaling = True

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Mix in the previous gossip, take the inner optimizer's step, launch this step's gossip.

        With a ``closure``, it is passed to the inner optimizer, so loss and gradients are evaluated
        at the mixed parameters. Returns what the inner step returns (the closure's loss, or None).

        Under ``torch.amp.GradScaler`` (``scaler.step(optimizer)``) the local update is skipped on a
        rank whose gradients hold inf/NaN; mixing and gossip happen on every rank regardless, so no
        rank is left waiting. If the inner optimizer takes the scaling itself (``fused=True``
        Adam/AdamW/SGD), ``grad_scale`` and ``found_inf`` are handed to it and nothing is read on
        the host, as GradScaler does for such an optimizer; otherwise gradients are unscaled here
        and ``found_inf`` is read once (the host sync GradScaler itself makes for other optimizers).
        With gradient tracking, ``found_inf`` is read once in any case (a rank with inf/NaN gradients
        leaves its tracker alone), and the gradients must have been unscaled before.

        Global optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``)
        fire once per call, with this wrapper as the optimizer; per-instance hooks of the wrapper
        and of the inner optimizer both fire.

        .. warning:: All ranks must call ``step()`` the same number of times.
        """
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step, see above
        found_inf = getattr(self, "found_inf", None)
        engine = self._engine
        if engine.gradient_tracking_requested:  # checked at any world size: a 1-rank test finds misuse too
            _check_tracking_step(closure, grad_scale)
        inner = self.optimizer
        return engine.step(
            lambda: scaled_step(inner, closure, grad_scale, found_inf, engine.second_moment_step(inner)),
            found_inf=found_inf,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients of all parameters (see :meth:`torch.optim.Optimizer.zero_grad`)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the inner optimizer; its parameters join new buckets and gossip.

        The new parameters are synced from rank 0, like at construction, and are gossiped from the
        next step on (a round already in flight does not include them).

        .. warning:: This is a collective: all ranks must call it, with the same shapes and dtypes.
        """
        if not hasattr(self, "_engine"):  # torch.optim.Optimizer internals may call this early
            raise RuntimeError("add_param_group() called before the wrapper was built.")
        groups = self.optimizer.param_groups
        before = len(groups)

        def new_named_params() -> list[tuple[str, torch.Tensor]]:
            self.optimizer.add_param_group(param_group)
            return named_param_groups(groups)[sum(len(g["params"]) for g in groups[:before]) :]

        try:
            self._engine.add_parameters(new_named_params, context="add_param_group")
        except (ValueError, TypeError):
            del groups[before:]  # leave the optimizer as it was, on every rank
            raise

    def global_avg(self, may_revert: bool = True, buffers: torch.nn.Module | None = None) -> None:
        """Set every replica to the exact average of all replicas (e.g. to evaluate the average model).

        Pending gossip is finished first. With ``may_revert``, the replica (and the gossip still to
        be mixed) is saved so that :meth:`revert_global_avg` can restore it bit for bit; that copy is
        allocated only then. A second call keeps the first snapshot. A :meth:`step` without a
        revert continues training from the average (the snapshot and the stale gossip are dropped).

        Args:
            may_revert: keep a snapshot for :meth:`revert_global_avg`.
            buffers: a module whose floating-point buffers (e.g. BatchNorm running statistics) are
                averaged too, and restored by the revert; integer buffers are left alone.

        Raises:
            GlobalAverageError: a peer died or did not call ``global_avg`` within ``timeout``.

        .. warning:: This is a collective: all ranks must call it, with the same ``buffers`` layout.
        """
        self._engine.global_avg(may_revert, buffers)

    def revert_global_avg(self) -> None:
        """Restore the replica saved by :meth:`global_avg` bit for bit, as if no average had happened.

        Local: no communication. Raises :class:`RuntimeError` (parameters untouched) if there is no
        snapshot: ``global_avg(may_revert=True)`` was not called, or a step or revert came since.
        """
        self._engine.revert_global_avg()

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus a ``"decent"`` entry with this replica's engine state.

        Waits for gossip in flight (no collective), so a checkpoint holds the received round that the
        next step mixes in, and a run resumed from it continues bit for bit like the uninterrupted run.
        Save one file per rank. Layout::

            {
                "state": {...},  # the inner optimizer's state (e.g. momentum buffers; local shards)
                "param_groups": [...],  # the inner optimizer's groups (lr, ...)
                "decent": {...},  # GossipEngine.state_dict(): step, parameters, gossip in flight, ...
            }

        See :meth:`~decent_optim_wrapper.engine.GossipEngine.state_dict` for the ``"decent"`` entry.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        decent = self._engine.state_dict()
        # A sharded parameter's state is saved as its local shard: a per-rank file of plain tensors.
        state = local_optimizer_state(self.optimizer.state_dict())
        state["decent"] = decent
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            returned = post_hook(self, state)
            if returned is not None:
                state = returned
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same rank, world size, topology and parameter layout.

        Everything is checked before anything changes, so a rejected checkpoint leaves parameters,
        gossip and optimizer state untouched. Local: no communication.
        """
        if not isinstance(state_dict, dict) or "decent" not in state_dict:
            raise ValueError(
                "state_dict has no 'decent' entry: it does not come from DecentOptimWrapper.state_dict(). "
                "A plain optimizer's state dict loads into wrapper.optimizer.load_state_dict(...)."
            )
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        decent = state_dict["decent"]
        self._engine.check_state_dict(decent)
        # The inner optimizer checks its own part before changing anything; the engine's part is
        # already checked, so after this nothing below can fail halfway.
        self._load_inner_state({key: value for key, value in state_dict.items() if key != "decent"})
        self._engine.load_state_dict(decent)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_inner_state(self, inner: dict[str, Any]) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.optimizer.load_state_dict(placed_optimizer_state(inner, params))

    def load_state_dicts(self, states: Sequence[dict[str, Any]]) -> None:
        """Resume at any world size from every saved rank's :meth:`state_dict`, in rank order.

        At the saved world size and topology this rank loads its own saved state (``states[rank]``)
        with :meth:`load_state_dict`, and the run continues bit for bit. Otherwise every rank starts
        from the exact average of the saved replicas: parameters and the inner optimizer's floating
        state averaged (float64 sums rounded once, the same bits on every rank), counters such as
        Adam's ``step`` checked equal, param groups from saved rank 0, gossip in flight, compression
        references and gradient trackers started afresh. The rule and why:
        :mod:`~decent_optim_wrapper.engine.state.resize`. Only this wrapper's state is loaded: an LR
        scheduler's state is the same on every rank (load saved rank 0's), and the parameters come
        from here (load the model's buffers, if any, before this call or average them with
        :func:`~decent_optim_wrapper.engine.state.resize.average_nested`).

        Everything is checked before anything changes. Local: no communication; each rank reads
        every saved state (``torch.load(path, mmap=True)`` keeps that cheap).

        Example::

            files = sorted(Path("ckpt/step_00001000").glob("rank_*.pt"), key=lambda p: int(p.stem[5:]))
            optimizer.load_state_dicts([torch.load(f, mmap=True, weights_only=True) for f in files])
        """
        for index, state in enumerate(states):
            if not isinstance(state, dict) or "decent" not in state:
                raise ValueError(
                    f"states[{index}] has no 'decent' entry: pass DecentOptimWrapper.state_dict() of every "
                    "saved rank, in rank order."
                )
        averaged = self._engine.resume_state([state["decent"] for state in states])
        if averaged is None:
            self.load_state_dict(states[self.rank])
            return
        inner = average_optimizer_states(
            [{key: value for key, value in state.items() if key != "decent"} for state in states]
        )
        self.load_state_dict({**inner, "decent": averaged})

    def __repr__(self) -> str:
        return (
            f"DecentOptimWrapper(optimizer={type(self.optimizer).__name__}, "
            f"topology={self.topology.name!r}, rank={self.rank}, world_size={self.world_size}, "
            f"buckets={len(self.buckets)})"
        )


def named_param_groups(param_groups: Iterable[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """``param_groups`` flattened in order; parameters named ``param_groups[G]['params'][P] (shape S)``."""
    return [
        (f"param_groups[{g}]['params'][{p}] (shape {tuple(getattr(param, 'shape', ()))})", param)
        for g, group in enumerate(param_groups)
        for p, param in enumerate(group["params"])
    ]


def _check_tracking_step(closure: object, grad_scale: object) -> None:
    """Gradient tracking reads the gradients before the inner step: they must be final and unscaled."""
    if closure is not None:
        raise ValueError(
            "step(closure) with gradient_tracking=True: the tracker needs the gradients before the inner "
            "step, but a closure computes them inside it. Call backward() before step() instead."
        )
    if grad_scale is not None:
        raise RuntimeError(
            "gradient_tracking=True under GradScaler needs unscaled gradients before step(): call "
            "scaler.unscale_(optimizer) before scaler.step(optimizer) (and skip nothing else)."
        )
