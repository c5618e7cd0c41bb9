r"""The engine both front-ends drive: :class:`GossipEngine`.

It owns everything decentralized training needs besides the local update: cross-rank agreement on
the topology and the parameter layout, the flat buckets the parameters live in, the process groups,
the initial broadcast, per-bucket gossip, the step counter, exact global averaging with its
snapshot, the consensus distance, growing the buckets, and its part of a checkpoint. A front-end
translates a user's API into calls on it: :meth:`GossipEngine.step` runs one step of the whole
model (the optimizer front-end), :meth:`GossipEngine.step_bucket` one bucket's update inside a step
(the module front-end, as each bucket's gradients become ready in backward). See the architecture
page of the docs for a step's data flow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
from loguru import logger

from decent_optim_wrapper.engine.averaging import (
    Snapshot,
    average_across_world_,
    floating_buffers,
    global_average_message,
    tensors_consensus_distance,
)
from decent_optim_wrapper.engine.buckets import Bucket, build_buckets, check_named_params, misfit
from decent_optim_wrapper.engine.comm import (
    ProcessGroups,
    agree,
    check_identical,
    reduction_dtype,
    resolve_world,
)
from decent_optim_wrapper.engine.compression import (
    CompressionPlan,
    CompressionSpec,
    GossipCompression,
    resolve_compression,
)
from decent_optim_wrapper.engine.errors import GlobalAverageError
from decent_optim_wrapper.engine.gossip import Gossip
from decent_optim_wrapper.engine.tracking import GradientTracker
from decent_optim_wrapper.topo import Topology, TopologyFactory
from decent_optim_wrapper.topo.mixing import allreduce_models_sent

__all__ = ["DEFAULT_TIMEOUT", "STATE_VERSION", "GossipEngine", "TopologySpec"]

#: Version of the engine's checkpoint entry (the ``"decent"`` entry of a front-end's state dict).
STATE_VERSION = 1

#: How long gossip and global averaging wait for a peer before raising, unless ``timeout`` says
#: otherwise. Well under gloo's 30 minutes, yet long enough for a peer's slow first step (compile).
DEFAULT_TIMEOUT = timedelta(minutes=10)

#: What a ``topology`` argument may be: a registered name, a Topology subclass, or an instance.
TopologySpec = str | type[Topology] | Topology

_T = TypeVar("_T")

_CHECKPOINT_KEYS = ("version", "step", "rank", "world_size", "topology", "schedule", "buckets", "params")


class GossipEngine:
    r"""Buckets, topology schedule, process groups and gossip of one rank.

    Built from ``(name, parameter)`` pairs in a given order (the optimizer front-end passes its
    param_groups order, a module front-end the order gradients become ready): the parameters move
    into flat buckets in that order (``param.data`` becomes a view into a bucket, one bucket per
    dtype and device run, at most ``bucket_cap_mb`` each) and rank 0's values are broadcast, so all
    replicas start equal. Gossip of bucket ``b`` at step ``t`` computes, on every rank ``i``,

    .. math::
        x_{i,b} \leftarrow \sum_{j \in G_t(i)} W^{(t)}_{ij}\, x_{j,b}

    with the topology's doubly stochastic mixing matrix ``W^{(t)}`` of the phase the round was
    launched in; the values sent are those at :meth:`launch`, mixed into those at :meth:`mix`.

    .. warning:: Construction, :meth:`launch`/:meth:`mix` (through the gossip rounds),
        :meth:`global_avg`, :meth:`consensus_distance` and :meth:`add_parameters` involve
        collectives: all ranks must call them in the same order, the same number of times.

    Args:
        named_params: ``(name, parameter)`` pairs; names appear in error messages.
        topology: a registered name (see :class:`~decent_optim_wrapper.topo.TopologyFactory`), a
            :class:`~decent_optim_wrapper.topo.Topology` subclass, or an instance.
        rank: this process's rank; defaults to ``torch.distributed.get_rank()``.
        world_size: number of processes; defaults to ``torch.distributed.get_world_size()``.
        local_world_size: processes per node; defaults to ``$LOCAL_WORLD_SIZE`` (torchrun), else 1.
        bucket_cap_mb: largest bucket in MiB; larger buckets mean fewer, bigger messages.
        timeout: how long gossip and global averaging wait for a peer before raising a
            :class:`~decent_optim_wrapper.GossipError` / :class:`~decent_optim_wrapper.GlobalAverageError`.
        params_as_views: make ``param.data`` a view into its bucket. With False the parameters keep
            their own storage and are copied into the bucket before it is read (launch, averaging,
            checkpoints) and back after it is written (mix, averaging, revert, load).
        compression: gossip compressed differences instead of the parameters: ``"bf16"``,
            ``"fp16"``, ``"int8"`` or a :class:`~decent_optim_wrapper.engine.compression.GossipCompression`;
            None (default) sends them exactly. See :mod:`~decent_optim_wrapper.engine.compression`.
        gradient_tracking: gossip a tracker of the average gradient beside the parameters and let
            the local update use it (:meth:`track`); see :mod:`~decent_optim_wrapper.engine.tracking`.
            Off at world size 1.
        context: what the user is building, for error messages (e.g. ``"DecentOptimWrapper"``).
    """

    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.Tensor]] | Callable[[], Sequence[tuple[str, torch.Tensor]]],
        *,
        topology: TopologySpec = "ring",
        rank: int | None = None,
        world_size: int | None = None,
        local_world_size: int | None = None,
        bucket_cap_mb: float = 25,
        timeout: timedelta = DEFAULT_TIMEOUT,
        params_as_views: bool = True,
        compression: CompressionSpec = None,
        gradient_tracking: bool = False,
        context: str = "GossipEngine",
    ) -> None:
        if not isinstance(gradient_tracking, bool):
            raise TypeError(f"gradient_tracking must be True or False, got {gradient_tracking!r}.")
        _check_bucket_cap(bucket_cap_mb)
        _check_timeout(timeout)
        self._as_views = params_as_views
        self._mixing_factor = 1.0
        self._rank, self._world_size, self._local_world_size = resolve_world(
            rank, world_size, local_world_size
        )
        self._bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self._timeout = timeout

        def local_layout() -> tuple[object, ...]:
            self._compression = resolve_compression(compression)
            topo = resolve_topology(topology, self._world_size, self._local_world_size)
            pairs = named_params() if callable(named_params) else named_params
            params, names = check_named_params(pairs)
            buckets = build_buckets(params, names, self._bucket_cap_bytes, self._as_views)
            self._topology, self._buckets = topo, buckets
            return (
                self._local_world_size,
                topo.name,
                topo.fingerprint(),
                _signatures(buckets),
                self._compression,
                gradient_tracking,
            )

        # Every rank reaches this gather even if its own input is bad, so a mistake on one rank is an
        # error everywhere rather than a hang; and layouts are compared before anything is broadcast.
        reports = agree(f"Building {context}", local_layout)
        check_identical(
            "local_world_size", [r[0] for r in reports], "Pass the same local_world_size on every rank."
        )
        check_identical("The topology", [r[1:3] for r in reports], "Pass the same topology on every rank.")
        _check_layouts([cast(tuple[object, ...], r[3]) for r in reports])
        check_identical(
            "compression", [r[4] for r in reports], "Pass the same compression argument on every rank."
        )
        check_identical(
            "gradient_tracking", [r[5] for r in reports], "Pass the same gradient_tracking on every rank."
        )

        self._process_groups = ProcessGroups(self._topology, timeout)
        self._bind_and_broadcast(self._buckets)
        plan = None if self._compression is None else CompressionPlan(self._topology, self._compression)
        self._gossip = Gossip(
            [b.data for b in self._buckets], self._topology, self._rank, self._process_groups, timeout, plan
        )
        self._tracking_requested = gradient_tracking
        self._tracker: GradientTracker | None = None
        if gradient_tracking and self._world_size > 1:
            self._tracker = GradientTracker(
                self._buckets, self._topology, self._rank, self._process_groups, timeout, plan
            )
        self._step = 0
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
                bucket.push()

    # -- facts -----------------------------------------------------------------------------------
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
    def topology(self) -> Topology:
        return self._topology

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    @property
    def compression(self) -> GossipCompression | None:
        """The gossip compression, or None if gossip sends the parameters exactly."""
        return self._compression

    def bytes_sent_per_step(self) -> float:
        """Bytes this rank sends per step, averaged over one period of the schedule.

        Cost model: an all-reduce in a group of ``k`` is a ring, in which each member sends
        ``2 (k - 1) / k`` buckets (in fp32 for 16-bit buckets); a compressed round is a gather, in which
        each member sends its payload ``k - 1`` times. A group's first compressed round (exact) is
        left out: it happens once per group.
        """
        plan = self._gossip.plan
        total = 0.0
        for step in range(self._topology.period):
            group = self._topology.group(self._rank, step)
            for bucket in self._buckets:
                dtype = bucket.data.dtype
                reduced = reduction_dtype(dtype).itemsize
                if plan is not None:
                    total += plan.bytes_sent(group, bucket.data.numel(), dtype, reduced)
                else:
                    total += allreduce_models_sent(group.size) * bucket.data.numel() * reduced
        rounds = 2 if self._tracker is not None else 1  # the trackers travel like the parameters
        return rounds * total / self._topology.period

    @property
    def gradient_tracking_requested(self) -> bool:
        """Whether ``gradient_tracking=True`` was passed (checked for misuse at any world size)."""
        return self._tracking_requested

    @property
    def gradient_tracking_active(self) -> bool:
        """Whether the local update steps with the tracked gradient: requested and world size > 1."""
        return self._tracker is not None

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets, in order (a new list; the buckets themselves are live)."""
        return list(self._buckets)

    @property
    def gossip(self) -> Gossip:
        """The per-bucket gossip (e.g. to time :meth:`Gossip.stage` and :meth:`Gossip.mix` alone)."""
        return self._gossip

    @property
    def step_count(self) -> int:
        """Completed steps; step ``t`` gossips in phase ``t % period``."""
        return self._step

    @property
    def mixing_factor(self) -> float:
        """``a`` in ``x <- (1 - a) x + a sum_j W_ij x_j``; 1 (full mixing) unless set."""
        return self._mixing_factor

    @mixing_factor.setter
    def mixing_factor(self, factor: float) -> None:
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise TypeError(f"the mixing (adaptive) factor must be a number in (0, 1], got {factor!r}.")
        if not 0.0 < factor <= 1.0:
            raise ValueError(
                f"the mixing (adaptive) factor must lie in (0, 1], got {factor!r}: 1 mixes fully, smaller "
                "values keep part of the replica (x <- (1 - a) x + a W x); 0 would never mix."
            )
        self._mixing_factor = float(factor)

    @property
    def has_snapshot(self) -> bool:
        """Whether :meth:`revert_global_avg` has something to restore."""
        return self._snapshot is not None

    # -- one step --------------------------------------------------------------------------------
    # The protocol of a step, in one place for both front-ends: per bucket, mix the round launched at
    # the previous step, track the gradient (when on), run the caller's local update, launch this
    # step's round. A rank whose gradients hold inf/NaN skips its local update and leaves its
    # trackers alone, but still mixes and launches, so no peer waits for it. A round that fails
    # raises from mix (GossipError) and is dropped: it is never mixed or saved.
    def step(self, local_update: Callable[[], _T], *, found_inf: torch.Tensor | None = None) -> _T:
        """One step of the whole model: :meth:`begin_step`, every bucket's update, :meth:`end_step`.

        Mixes every bucket, tracks every bucket's gradients (with gradient tracking, unless
        ``found_inf`` holds a nonzero value: GradScaler found inf/NaN), runs ``local_update()``
        once (it decides itself whether to skip on ``found_inf``), and launches every bucket.
        ``found_inf`` is read on the host only with gradient tracking. Returns what
        ``local_update`` returns.
        """
        self.begin_step()
        buckets = range(len(self._buckets))
        for bucket in buckets:
            self.mix(bucket)
        if self._tracker is not None and (found_inf is None or not bool(found_inf.item())):
            for bucket in buckets:
                self._tracker.track(bucket)
        result = local_update()
        for bucket in buckets:
            self.launch(bucket)
        self.end_step()
        return result

    @torch.no_grad()
    def step_bucket(
        self, bucket: int, local_update: Callable[[], object], *, skip_local_update: bool = False
    ) -> None:
        """One bucket's update inside a step: mix its round, track, ``local_update()``, launch.

        With ``skip_local_update`` (inf/NaN gradients on this rank) only the gossip happens. A
        module front-end calls this per bucket between :meth:`begin_step` and :meth:`end_step`, in
        the same bucket order on every rank.
        """
        self.mix(bucket)
        if not skip_local_update:
            if self._tracker is not None:
                self._tracker.track(bucket)
            local_update()
        self.launch(bucket)

    def begin_step(self) -> None:
        """Start a step: check the buckets, and let an un-reverted global average stand.

        A step after :meth:`global_avg` without a revert continues training from the average, so
        the snapshot is dropped here.
        """
        self.check_buckets()
        self._snapshot = None

    @torch.no_grad()
    def mix(self, bucket: int) -> None:
        """Finish bucket ``bucket``'s round launched at the previous step and mix it in."""
        if self._tracker is not None:  # its rounds outlive a global average: mixed on their own
            self._tracker.gossip.mix(bucket, self._mixing_factor)
        if self._gossip.pending(bucket) is None:
            return
        target = self._buckets[bucket]
        target.pull()
        self._gossip.mix(bucket, self._mixing_factor)
        target.push()

    @torch.no_grad()
    def launch(self, bucket: int, step: int | None = None) -> None:
        """Start bucket ``bucket``'s gossip for ``step`` (default: the current step), non-blocking."""
        self._buckets[bucket].pull()
        step = self._step if step is None else step
        self._gossip.launch(bucket, step)
        if self._tracker is not None:
            self._tracker.gossip.launch(bucket, step)

    def wait_all(self) -> None:
        """Wait until every bucket's round in flight has arrived, without mixing (the next step mixes).

        Raises :class:`~decent_optim_wrapper.GossipError` if a peer does not answer in time.
        """
        for bucket in range(len(self._buckets)):
            self._gossip.wait(bucket)
            if self._tracker is not None:
                self._tracker.gossip.wait(bucket)

    def end_step(self) -> None:
        """Finish a step: the next one gossips in the next phase."""
        self._step += 1

    def check_buckets(self) -> None:
        """Raise if a parameter no longer lives in its bucket (e.g. ``model.to()`` after wrapping)."""
        for bucket in self._buckets:
            bucket.check_views()

    # -- growing -----------------------------------------------------------------------------------
    @torch.no_grad()
    def add_parameters(
        self,
        new_named_params: Callable[[], Sequence[tuple[str, torch.Tensor]]],
        context: str = "add_parameters",
    ) -> list[Bucket]:
        """Move new parameters into new buckets, sync them from rank 0 and gossip them from now on.

        ``new_named_params`` runs inside the cross-rank agreement, so an error it raises on one rank
        (bad input) is an error on every rank instead of a hang. A round already in flight does not
        include the new parameters. Returns the new buckets.

        .. warning:: This is a collective: all ranks must call it, with the same shapes and dtypes.
        """
        known = {id(p) for bucket in self._buckets for p in bucket.params}
        built: list[Bucket] = []

        def local_layout() -> tuple[object, ...]:
            params, names = check_named_params(new_named_params())
            for param, name in zip(params, names, strict=True):
                if id(param) in known:
                    raise ValueError(f"{name} is already gossiped; add each parameter only once.")
            built.extend(build_buckets(params, names, self._bucket_cap_bytes, self._as_views))
            return _signatures(built)

        _check_layouts(agree(context, local_layout))
        self._bind_and_broadcast(built)
        self._buckets.extend(built)
        self._gossip.add_tensors([b.data for b in built])
        if self._tracker is not None:
            self._tracker.add_buckets(built)
        return built

    # -- global averaging ----------------------------------------------------------------------------
    @torch.no_grad()
    def global_avg(
        self, may_revert: bool = True, buffers: torch.nn.Module | None = None, return_distance: bool = False
    ) -> float | None:
        """Set every replica to the exact average of all replicas; see the front-ends' ``global_avg``.

        Pending gossip is finished and dropped first. With ``may_revert``, the replica (and the
        gossip still to be mixed) is saved so that :meth:`revert_global_avg` restores it bit for bit;
        that copy is allocated only then, and a second call keeps the first snapshot. Floating-point
        buffers of ``buffers`` (e.g. BatchNorm statistics) are averaged too and restored by a revert.
        With ``return_distance``, returns this replica's L2 distance to the average, computed in
        float64 over the gossiped parameters (it differs from rank to rank); else None.

        .. warning:: This is a collective: all ranks must call it, with the same ``buffers`` layout.
        """
        if buffers is not None and not isinstance(buffers, torch.nn.Module):
            raise TypeError(
                f"buffers must be an nn.Module whose floating buffers to average (e.g. the model), got "
                f"{type(buffers).__name__}."
            )
        extra = floating_buffers(buffers) if buffers is not None else []
        self.check_buckets()
        for bucket in self._buckets:
            bucket.pull()
        before = [b.data.clone() for b in self._buckets] if return_distance else []
        if may_revert:
            if self._snapshot is None:
                # References stay as they are until the revert: the snapshot need not copy them.
                self._snapshot = Snapshot(
                    params=[b.data.clone() for b in self._buckets],
                    gossip=self._gossip.state_dict(references=False),
                )
            self._snapshot.add_buffers(extra)
        # Every rank settles its groups' references before the rounds are dropped, so ranks that
        # revert and ranks that do not keep identical references.
        self._gossip.settle_references()
        self._gossip.discard_all()
        step, world_size, timeout = self._step, self._world_size, self._timeout

        def failure(cause: BaseException | None) -> Exception:
            return GlobalAverageError(
                f"rank {self._rank}: " + global_average_message(step, world_size, timeout, cause)
            )

        tensors = [b.data for b in self._buckets] + extra
        average_across_world_(tensors, self._process_groups.world, world_size, timeout, failure)
        for bucket in self._buckets:
            bucket.push()
        if not return_distance:
            return None
        squared = sum(
            float((old.double() - b.data.double()).square().sum())
            for old, b in zip(before, self._buckets, strict=True)
        )
        return math.sqrt(squared)

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
            bucket.push()
        snapshot.restore_buffers()
        self._gossip.load_state_dict(snapshot.gossip, references=False)

    def consensus_distance(self) -> float:
        """Root-mean-square distance of the replicas to their average (0 when all agree).

        See :func:`~decent_optim_wrapper.engine.averaging.tensors_consensus_distance`. Gossip in
        flight is not included: this measures the parameters as they are now.

        .. warning:: This is a collective: all ranks must call it.
        """
        self.check_buckets()
        for bucket in self._buckets:
            bucket.pull()
        return tensors_consensus_distance(
            [b.data for b in self._buckets], self._process_groups.world, self._world_size
        )

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This replica's engine state: the ``"decent"`` entry of a front-end's checkpoint.

        Waits for gossip in flight (no collective), so it holds the received rounds the next step
        mixes in, and a run resumed from it continues bit for bit. Layout::

            {
                "version": 1,
                "step": 120,  # completed steps
                "rank": 0, "world_size": 4, "local_world_size": 1,
                "topology": "ring",
                "schedule": [...],  # the topology's groups and weights, phase by phase
                "buckets": [...],  # per bucket: dtype, device type, numel, shapes, offsets
                "params": [tensor, ...],  # this replica's parameters, one flat tensor per bucket
                "gossip": {"step": 119, "buffers": [tensor, ...]} or None,  # received, not mixed
                "snapshot": None,  # or {"params": [...], "gossip": ...} while globally averaged
                "mixing_factor": 1.0,  # a in x <- (1 - a) x + a W x
                "compression": None,  # or the wire format, e.g. "bf16" (informative)
                "tracking": None,  # with gradient tracking: trackers, previous gradients, their gossip
            }

        With compression, ``"gossip"`` also holds the payloads of compressed rounds not mixed yet and
        the groups' references (see :meth:`Gossip.state_dict`), so a resumed run continues bit for bit.

        The parameters are included because they differ between replicas, and building an engine
        broadcasts rank 0's; loading restores this replica's own.
        """
        self.check_buckets()
        for bucket in self._buckets:
            bucket.pull()
        snapshot = None
        if self._snapshot is not None:
            snapshot = {"params": [p.clone() for p in self._snapshot.params], "gossip": self._snapshot.gossip}
        return {
            "version": STATE_VERSION,
            "step": self._step,
            "rank": self._rank,
            "world_size": self._world_size,
            "local_world_size": self._local_world_size,
            "topology": self._topology.name,
            "schedule": _plain(self._topology.fingerprint()),
            "buckets": _plain(_signatures(self._buckets)),
            "params": [b.data.clone() for b in self._buckets],
            "gossip": self._gossip.state_dict(),
            "snapshot": snapshot,
            "mixing_factor": self._mixing_factor,
            "compression": None if self._compression is None else self._compression.wire,
            "tracking": None if self._tracker is None else self._tracker.state_dict(),
        }

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` naming the mismatch if ``state`` cannot be loaded into this engine.

        Checks everything :meth:`load_state_dict` will use, so a front-end can check the engine's
        part before it changes anything of its own.
        """
        if not isinstance(state, dict):
            raise ValueError(
                f"the engine state must be a dict from GossipEngine.state_dict(), got {state!r}."
            )
        missing = [key for key in _CHECKPOINT_KEYS if key not in state]
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
            if state[key] != value:
                raise ValueError(
                    f"checkpoint has {key}={state[key]!r} but this run has {key}={value!r}; resume with the "
                    f"same {key} as the run that saved it (and load each rank's own file)."
                )
        if state["schedule"] != _plain(self._topology.fingerprint()):
            raise ValueError(
                f"checkpoint's topology {state['topology']!r} has a different schedule (world size, "
                "local_world_size, groups or weights) than this run's; resume with the same topology."
            )
        if state["buckets"] != _plain(_signatures(self._buckets)):
            raise ValueError(
                "checkpoint's parameter layout (shapes, dtypes, order or bucket_cap_mb) differs from this "
                "run's; build the same model and optimizer with the same bucket_cap_mb before loading."
            )
        _check_flat_tensors("params", state["params"], self._buckets)
        self._gossip.check_state_dict(state.get("gossip"))
        if self._tracker is not None and state.get("tracking") is not None:
            self._tracker.check_state_dict(state["tracking"])
        snapshot = state.get("snapshot")
        if snapshot is not None:
            _check_flat_tensors("snapshot params", snapshot["params"], self._buckets)
            self._gossip.check_state_dict(snapshot["gossip"])

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same rank, world size, topology and layout.

        Everything is checked (:meth:`check_state_dict`) before anything changes. Local.
        """
        self.check_state_dict(state)
        for bucket, saved in zip(self._buckets, state["params"], strict=True):
            bucket.data.copy_(saved)
            bucket.push()
        self._gossip.load_state_dict(state.get("gossip"))
        if self._tracker is not None:  # a checkpoint without tracking starts the trackers afresh
            self._tracker.load_state_dict(state.get("tracking"))
        self._step = int(state["step"])
        self._mixing_factor = float(state.get("mixing_factor", 1.0))  # absent before 0.2
        snapshot = state.get("snapshot")
        self._snapshot = None
        if snapshot is not None:
            self._snapshot = Snapshot(
                params=[
                    p.to(b.data.device).clone()
                    for p, b in zip(snapshot["params"], self._buckets, strict=True)
                ],
                gossip=snapshot["gossip"],
            )

    def __repr__(self) -> str:
        return (
            f"GossipEngine(topology={self._topology.name!r}, rank={self._rank}, "
            f"world_size={self._world_size}, buckets={len(self._buckets)}, step={self._step})"
        )


def resolve_topology(topology: TopologySpec, world_size: int, local_world_size: int) -> Topology:
    """Build (or check) the topology for this run and validate its schedule, before any communication."""
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


def _check_bucket_cap(bucket_cap_mb: object) -> None:
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, int | float):
        raise TypeError(f"bucket_cap_mb must be a number of MiB, got {bucket_cap_mb!r}; e.g. 25.")
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}; e.g. 25.")


def _check_timeout(timeout: object) -> None:
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout must be a positive datetime.timedelta, got {timeout!r}; e.g. timedelta(minutes=5)."
        )
    if timeout <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout!r}; e.g. timedelta(minutes=5).")


def _check_flat_tensors(what: str, saved: object, buckets: Sequence[Bucket]) -> None:
    if not isinstance(saved, list | tuple) or len(saved) != len(buckets):
        count = len(saved) if isinstance(saved, list | tuple) else type(saved).__name__
        raise ValueError(
            f"checkpoint's {what} hold {count} tensors but this run has {len(buckets)} buckets; the "
            "checkpoint is corrupt or from another layout."
        )
    for index, (tensor, bucket) in enumerate(zip(saved, buckets, strict=True)):
        got = misfit(tensor, bucket.data.shape, bucket.data.dtype)
        if got is not None:
            raise ValueError(
                f"checkpoint's {what}[{index}] has {got} but bucket {index} has shape "
                f"{tuple(bucket.data.shape)}, dtype {bucket.data.dtype}; the checkpoint is corrupt or from "
                "another layout."
            )


def _signatures(buckets: Sequence[Bucket]) -> tuple[object, ...]:
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
