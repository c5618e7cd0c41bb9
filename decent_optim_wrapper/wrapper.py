"""The optimizer front-end: :class:`DecentOptimWrapper` drives buckets and gossip from ``step()``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from loguru import logger
from torch.optim import Optimizer

from decent_optim_wrapper.averaging import Snapshot, average_across_world_, floating_buffers
from decent_optim_wrapper.buckets import Bucket, build_buckets, check_params
from decent_optim_wrapper.comm import ProcessGroups, agree, check_identical, resolve_world
from decent_optim_wrapper.gossip import Gossip
from decent_optim_wrapper.metrics import tensors_consensus_distance
from decent_optim_wrapper.topo import Topology, TopologyFactory

__all__ = ["DEFAULT_TIMEOUT", "DecentOptimWrapper"]

#: Version of the ``"decent"`` entry of :meth:`DecentOptimWrapper.state_dict`.
STATE_VERSION = 1

#: How long gossip and global averaging wait for a peer before raising, unless ``timeout`` says
#: otherwise. Well under gloo's 30 minutes, yet long enough for a peer's slow first step (compile).
DEFAULT_TIMEOUT = timedelta(minutes=10)


class DecentOptimWrapper(Optimizer):
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
        rank: this process's rank; defaults to ``torch.distributed.get_rank()``.
        world_size: number of processes; defaults to ``torch.distributed.get_world_size()``.
        local_world_size: processes per node; defaults to ``$LOCAL_WORLD_SIZE`` (torchrun), else 1.
        topology: a registered name (``"ring"``, ``"complete"``, ...; see :class:`TopologyFactory`),
            a :class:`Topology` subclass, or an instance.
        bucket_cap_mb: largest bucket in MiB; larger buckets mean fewer, bigger messages.
        timeout: how long gossip and global averaging wait for a peer before raising an error
            that names the step and the group (a peer died or hangs); default
            :data:`DEFAULT_TIMEOUT` (10 minutes).

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
        topology: str | type[Topology] | Topology = "ring",
        bucket_cap_mb: float = 25,
        *,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        if isinstance(optimizer, DecentOptimWrapper):
            raise TypeError("optimizer is already a DecentOptimWrapper; wrap the inner optimizer only once.")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}. "
                "Build it first, e.g. torch.optim.SGD(model.parameters(), lr=0.1)."
            )
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, int | float):
            raise TypeError(f"bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r}; e.g. 25.")
        if bucket_cap_mb <= 0:
            raise ValueError(
                f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}; e.g. 25."
            )
        if not isinstance(timeout, timedelta):
            raise TypeError(
                f"timeout must be a positive datetime.timedelta, got {timeout!r}; e.g. timedelta(minutes=5)."
            )
        if timeout <= timedelta(0):
            raise ValueError(f"timeout must be positive, got {timeout!r}; e.g. timedelta(minutes=5).")
        self._rank, self._world_size, self._local_world_size = resolve_world(
            rank, world_size, local_world_size
        )

        self.optimizer = optimizer
        self._init_optimizer_hooks()

        def local_layout() -> tuple[object, ...]:
            topo = _resolve_topology(topology, self._world_size, self._local_world_size)
            params, names = check_params(optimizer.param_groups)
            buckets = build_buckets(params, names, self._bucket_cap_bytes)
            self._topology, self._buckets = topo, buckets
            return (self._local_world_size, topo.name, topo.fingerprint(), _signatures(buckets))

        self._bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        # Every rank reaches this gather even if its own input is bad, so a mistake on one rank is an
        # error everywhere rather than a hang; and layouts are compared before anything is broadcast.
        reports = agree("Building DecentOptimWrapper", local_layout)
        check_identical(
            "local_world_size", [r[0] for r in reports], "Pass the same local_world_size on every rank."
        )
        check_identical("The topology", [r[1:3] for r in reports], "Pass the same topology on every rank.")
        _check_layouts([r[3] for r in reports])

        self._timeout = timeout
        self._process_groups = ProcessGroups(self._topology, timeout)
        self._bind_and_broadcast(self._buckets)
        self._gossip = Gossip(
            [b.data for b in self._buckets], self._topology, self._rank, self._process_groups, timeout
        )
        self._step_count = 0
        self._snapshot: Snapshot | None = None
        logger.debug(
            "rank {}/{}: topology {} (period {}), {} buckets",
            self._rank,
            self._world_size,
            self._topology.name,
            self._topology.period,
            len(self._buckets),
        )

    def _bind_and_broadcast(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            bucket.bind()
            if self._world_size > 1:
                torch.distributed.broadcast(bucket.data, src=0, group=self._process_groups.world)

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
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    # -- read-only facts ---------------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_world_size(self) -> int:
        return self._local_world_size

    @property
    def step_count(self) -> int:
        """Number of completed :meth:`step` calls; step ``t`` gossips in phase ``t % period``."""
        return self._step_count

    @property
    def buckets(self) -> list[Bucket]:
        return list(self._buckets)

    # -- the algorithm -----------------------------------------------------------------------------
    #: GradScaler calls ``step()`` even when it found inf/NaN gradients (telling us through
    #: ``found_inf``), so a rank that skips its local update still joins this step's gossip; otherwise
    #: its peers would wait forever for it.
    _step_supports_amp_scaling = True

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Mix in the previous gossip, take the inner optimizer's step, launch this step's gossip.

        With a ``closure``, it is passed to the inner optimizer, so loss and gradients are evaluated
        at the mixed parameters. Returns what the inner step returns (the closure's loss, or None).

        Under ``torch.amp.GradScaler`` (``scaler.step(optimizer)``), gradients are unscaled here and
        the local update is skipped on a rank whose gradients hold inf/NaN; mixing and gossip happen
        on every rank regardless, so no rank is left waiting.

        .. warning:: All ranks must call ``step()`` the same number of times.
        """
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step, see above
        found_inf = getattr(self, "found_inf", None)
        self._check_buckets()
        self._snapshot = None  # an un-reverted global average is where training continues from
        with torch.no_grad():
            self._gossip.mix()
        loss = None
        if found_inf is None or not bool(found_inf.item()):
            if grad_scale is not None:
                self._unscale_grads(grad_scale)
            loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        with torch.no_grad():
            self._gossip.launch(self._step_count)
        self._step_count += 1
        return loss

    @torch.no_grad()
    def _unscale_grads(self, grad_scale: torch.Tensor) -> None:
        # The same arithmetic as GradScaler.unscale_: multiply by the fp32 reciprocal of the scale.
        inv_scale = grad_scale.double().reciprocal().float()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        for device, tensors in by_device.items():
            torch._foreach_mul_(tensors, inv_scale.to(device))

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
        if not hasattr(self, "_buckets"):  # torch.optim.Optimizer internals may call this early
            raise RuntimeError("add_param_group() called before the wrapper was built.")
        known = [p for bucket in self._buckets for p in bucket.params]
        before = len(self.optimizer.param_groups)

        def local_layout() -> tuple[object, ...]:
            self.optimizer.add_param_group(param_group)
            try:
                params, names = check_params(self.optimizer.param_groups)
                new = [(p, n) for p, n in zip(params, names, strict=True) if not any(p is k for k in known)]
                buckets = build_buckets([p for p, _ in new], [n for _, n in new], self._bucket_cap_bytes)
            except (ValueError, TypeError):
                del self.optimizer.param_groups[before:]
                raise
            self._new_buckets = buckets
            return _signatures(buckets)

        try:
            layouts = agree("add_param_group", local_layout)
            _check_layouts(layouts)
        except (ValueError, TypeError):
            del self.optimizer.param_groups[before:]  # leave the optimizer as it was on every rank
            raise
        new_buckets, self._new_buckets = self._new_buckets, []
        self._bind_and_broadcast(new_buckets)
        self._buckets.extend(new_buckets)
        self._gossip.add_tensors([b.data for b in new_buckets])

    @torch.no_grad()
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

        .. warning:: This is a collective: all ranks must call it, with the same ``buffers`` layout.
        """
        if buffers is not None and not isinstance(buffers, torch.nn.Module):
            raise TypeError(
                f"buffers must be an nn.Module whose floating buffers to average (e.g. the model), got "
                f"{type(buffers).__name__}."
            )
        extra = floating_buffers(buffers) if buffers is not None else []
        self._check_buckets()
        if may_revert:
            if self._snapshot is None:
                self._snapshot = Snapshot(
                    params=[b.data.clone() for b in self._buckets], gossip=self._gossip.state_dict()
                )
            self._snapshot.add_buffers(extra)
        self._gossip.discard()
        tensors = [b.data for b in self._buckets] + extra
        average_across_world_(tensors, self._process_groups.world, self._world_size, self._timeout)

    @torch.no_grad()
    def revert_global_avg(self) -> None:
        """Restore the replica saved by :meth:`global_avg` bit for bit, as if no average had happened.

        Local: no communication. Raises :class:`RuntimeError` (parameters untouched) if there is no
        snapshot: ``global_avg(may_revert=True)`` was not called, or a step or revert came since.
        """
        if self._snapshot is None:
            raise RuntimeError(
                "revert_global_avg() has nothing to revert: call global_avg(may_revert=True) first (a "
                "step() or revert_global_avg() since then drops the snapshot). Parameters are unchanged."
            )
        snapshot, self._snapshot = self._snapshot, None
        for bucket, saved in zip(self._buckets, snapshot.params, strict=False):
            bucket.data.copy_(saved)
        snapshot.restore_buffers()
        self._gossip.load_state_dict(snapshot.gossip)

    def consensus_distance(self) -> float:
        """Root-mean-square distance of the replicas to their average (0 when all agree).

        See :func:`decent_optim_wrapper.metrics.tensors_consensus_distance`.

        .. warning:: This is a collective: all ranks must call it.
        """
        self._check_buckets()
        return tensors_consensus_distance(
            [b.data for b in self._buckets], self._process_groups.world, self._world_size
        )

    def _check_buckets(self) -> None:
        for bucket in self._buckets:
            bucket.check_views()

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus a ``"decent"`` entry with this replica's gossip state.

        Waits for gossip in flight (no collective), so a checkpoint holds the received round that the
        next step mixes in, and a run resumed from it continues bit for bit like the uninterrupted run.
        Save one file per rank. Layout::

            {
                "state": {...},  # the inner optimizer's state (e.g. momentum buffers)
                "param_groups": [...],  # the inner optimizer's groups (lr, ...)
                "decent": {
                    "version": 1,
                    "step": 120,  # completed steps
                    "rank": 0, "world_size": 4, "local_world_size": 1,
                    "topology": "ring",
                    "schedule": [...],  # the topology's groups and weights, phase by phase
                    "buckets": [...],  # per bucket: dtype, device type, numel, shapes, offsets
                    "params": [tensor, ...],  # this replica's parameters, one flat tensor per bucket
                    "gossip": {"step": 119, "buffers": [tensor, ...]} or None,  # received, not mixed
                    "snapshot": None,  # or {"params": [...], "gossip": ...} while globally averaged
                },
            }

        The parameters are included because they differ between replicas, and constructing the
        wrapper broadcasts rank 0's; loading this state restores this replica's own.
        """
        self._check_buckets()
        state = self.optimizer.state_dict()
        snapshot = None
        if self._snapshot is not None:
            snapshot = {
                "params": [p.clone() for p in self._snapshot.params],
                "gossip": self._snapshot.gossip,
            }
        state["decent"] = {
            "version": STATE_VERSION,
            "step": self._step_count,
            "rank": self._rank,
            "world_size": self._world_size,
            "local_world_size": self._local_world_size,
            "topology": self._topology.name,
            "schedule": _plain(self._topology.fingerprint()),
            "buckets": _plain(self._layout()),
            "params": [b.data.clone() for b in self._buckets],
            "gossip": self._gossip.state_dict(),
            "snapshot": snapshot,
        }
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same rank, world size, topology and parameter layout.

        Everything is checked before anything changes, so a rejected checkpoint leaves training
        state untouched. Local: no communication.
        """
        if not isinstance(state_dict, dict) or "decent" not in state_dict:
            raise ValueError(
                "state_dict has no 'decent' entry: it does not come from DecentOptimWrapper.state_dict(). "
                "A plain optimizer's state dict loads into wrapper.optimizer.load_state_dict(...)."
            )
        decent = state_dict["decent"]
        missing = [
            key
            for key in ("version", "step", "rank", "world_size", "topology", "schedule", "buckets", "params")
            if key not in decent
        ]
        if missing:
            raise ValueError(
                f"state_dict['decent'] lacks {missing}; the checkpoint is incomplete or corrupt."
            )
        expected = {
            "version": STATE_VERSION,
            "world_size": self._world_size,
            "rank": self._rank,
            "topology": self._topology.name,
        }
        for key, value in expected.items():
            if decent[key] != value:
                raise ValueError(
                    f"checkpoint has {key}={decent[key]!r} but this run has {key}={value!r}; resume with the "
                    f"same {key} as the run that saved it (and load each rank's own file)."
                )
        if decent["schedule"] != _plain(self._topology.fingerprint()):
            raise ValueError(
                f"checkpoint's topology {decent['topology']!r} has a different schedule (world size, "
                "local_world_size, groups or weights) than this run's; resume with the same topology."
            )
        if decent["buckets"] != _plain(self._layout()):
            raise ValueError(
                "checkpoint's parameter layout (shapes, dtypes, order or bucket_cap_mb) differs from this "
                "run's; build the same model and optimizer with the same bucket_cap_mb before loading."
            )
        inner_state = {key: value for key, value in state_dict.items() if key != "decent"}
        self.optimizer.load_state_dict(inner_state)
        for bucket, saved in zip(self._buckets, decent["params"], strict=True):
            bucket.data.copy_(saved)
        self._gossip.load_state_dict(decent.get("gossip"))
        self._step_count = int(decent["step"])
        snapshot = decent.get("snapshot")
        self._snapshot = None
        if snapshot is not None:
            self._snapshot = Snapshot(
                params=[
                    p.to(b.data.device).clone()
                    for p, b in zip(snapshot["params"], self._buckets, strict=True)
                ],
                gossip=snapshot["gossip"],
            )

    def _layout(self) -> tuple[object, ...]:
        return _signatures(self._buckets)

    def __repr__(self) -> str:
        return (
            f"DecentOptimWrapper(optimizer={type(self.optimizer).__name__}, "
            f"topology={self._topology.name!r}, rank={self._rank}, world_size={self._world_size}, "
            f"buckets={len(self._buckets)})"
        )


def _resolve_topology(
    topology: str | type[Topology] | Topology, world_size: int, local_world_size: int
) -> Topology:
    if isinstance(topology, str):
        topo = TopologyFactory.create(topology, world_size, local_world_size)
    elif isinstance(topology, type) and issubclass(topology, Topology):
        topo = topology(world_size, local_world_size)
    elif isinstance(topology, Topology):
        topo = topology
        if topo.world_size != world_size or topo.local_world_size != local_world_size:
            raise ValueError(
                f"topology {topo!r} was built for world_size={topo.world_size}, "
                f"local_world_size={topo.local_world_size}, but this run has world_size={world_size}, "
                f"local_world_size={local_world_size}; build it with the run's sizes or pass its name."
            )
    else:
        raise TypeError(
            f"topology must be a name, a Topology subclass or a Topology instance, got {topology!r}. "
            f"Registered names: {', '.join(TopologyFactory.names())}."
        )
    _ = topo.schedule  # validate now, before any communication
    return topo


def _signatures(buckets: list[Bucket]) -> tuple[object, ...]:
    """What must agree across ranks and checkpoints: each bucket's dtype, device type and shapes."""
    return tuple(b.signature() for b in buckets)


def _check_layouts(layouts: list[tuple[object, ...]]) -> None:
    check_identical(
        "The bucket layout (parameter shapes, dtypes, devices or bucket_cap_mb)",
        layouts,
        "Build the same model and optimizer (same param_groups order) with the same bucket_cap_mb on "
        "every rank.",
    )


def _plain(value: object) -> object:
    """Nested tuples to lists, so a checkpoint round-trips through torch.save unchanged."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value
