"""What every front-end reports of the engine it drives: :class:`EngineFrontEnd`.

Both front-ends (the optimizer wrapper and the module front-end) inherit these read-only facts and the
consensus distance, so they answer alike and there is one place that says what each means.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

from decent_optim_wrapper.engine import (
    Bucket,
    GossipEngine,
    GuardEvent,
    JoinHook,
    PaceReport,
    PeerFailure,
    PeerFailureHook,
    PeerJoin,
    Stateful,
)
from decent_optim_wrapper.topo import Topology

__all__ = ["EngineFrontEnd"]


class EngineFrontEnd:
    """A front-end's view of its :class:`~decent_optim_wrapper.engine.GossipEngine`.

    A subclass attaches its engine in its constructor (``self._attach(engine)``).
    """

    def _attach(self, engine: GossipEngine) -> GossipEngine:
        """Drive ``engine`` from now on; returns it."""
        self._engine = engine
        return engine

    @property
    def engine(self) -> GossipEngine:
        """The engine that buckets, gossips and averages the parameters."""
        return self._engine

    @property
    def topology(self) -> Topology:
        """The topology whose schedule says who gossips with whom at each step."""
        return self._engine.topology

    @property
    def rank(self) -> int:
        return self._engine.rank

    @property
    def world_size(self) -> int:
        return self._engine.world_size

    @property
    def local_world_size(self) -> int:
        """Processes per node."""
        return self._engine.local_world_size

    @property
    def step_count(self) -> int:
        """Completed updates; update ``t`` gossips in phase ``t % topology.period``."""
        return self._engine.step_count

    @property
    def round_count(self) -> int:
        """How many gossip rounds this rank launched (one per ``sync_every`` updates with
        low-communication gossip, one per update with per-step gossip).

        With paced rounds (``pacing=...``) ranks stand at different updates but launch the same
        rounds: a loop that ends at a round count ends everywhere together (e.g. ``while
        opt.round_count < rounds:``), where one counting updates would leave a slower rank waiting
        for rounds its peers never launch.
        """
        return self._engine.round_count

    @property
    def round_ended(self) -> bool:
        """True right after an update that ended a round, where every rank stands at the same point
        of the schedule (with paced rounds too); so where to evaluate, average globally or save."""
        engine = self._engine
        return engine.step_count > 0 and engine.round_count > engine.rounds_launched_before_last_step()

    def pace_report(self) -> PaceReport | None:
        """Where paced rounds stand on this rank: rounds, planned steps, measured step and round times,
        time waited for peers (:class:`~decent_optim_wrapper.PaceReport`); None without pacing."""
        return self._engine.pace_report()

    @property
    def buckets(self) -> list[Bucket]:
        """The flat buckets the parameters live in, in the order they are updated and gossiped."""
        return self._engine.buckets

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        """The outer optimizer of low-communication gossip (an LR scheduler may drive it), or None."""
        return self._engine.outer_optimizer

    @property
    def peer_failures(self) -> list[PeerFailure]:
        """Every lost peer survived so far (``on_peer_failure="continue"``), oldest first."""
        survival = self._engine.survival
        return [] if survival is None else survival.failures

    def register_peer_failure_hook(self, hook: PeerFailureHook) -> RemovableHandle:
        """Call ``hook(failure)`` on every survivor once it goes on without a lost peer.

        ``failure`` is a :class:`~decent_optim_wrapper.PeerFailure` (the step,
        the lost ranks, the world size before and after); e.g. rescale the learning rate or re-shard
        the data there. Returns a handle whose ``remove()`` unregisters the hook.
        """
        survival = self._engine.survival
        if survival is None:
            raise RuntimeError(
                'register_peer_failure_hook() needs on_peer_failure="continue": with "raise" (the default) '
                "a lost peer raises GossipError instead, and no hook would ever run."
            )
        return survival.register_hook(hook)

    @property
    def peer_joins(self) -> list[PeerJoin]:
        """Every admission of new workers this rank took part in as a member, oldest first."""
        return self._engine.growth.joins

    @property
    def joined(self) -> PeerJoin | None:
        """This worker's admission (a :class:`~decent_optim_wrapper.PeerJoin`) if it joined a running
        job, else None; a joiner starts at ``step_count``, as ``rank`` of ``world_size``."""
        return self._engine.growth.joined

    def register_join_hook(self, hook: JoinHook) -> RemovableHandle:
        """Call ``hook(join)`` on every member after workers joined (the world grew), once they hold
        their replicas; e.g. re-shard the data there. Returns a handle whose ``remove()`` unregisters it.
        """
        return self._engine.growth.register_hook(hook)

    def register_join_state(self, name: str, obj: Stateful) -> None:
        """Hand ``obj``'s ``state_dict()`` (an LR scheduler, a sampler) to joiners with the replica.

        Register the same objects under the same names on every worker; on a worker that joined, the
        call loads what its donor sent into ``obj`` at once.
        """
        self._engine.growth.register_state(name, obj)

    def register_guard_hook(self, hook: Callable[[GuardEvent], None]) -> RemovableHandle:
        """Call ``hook(event)`` whenever guarded mixing keeps a value that is not finite out of a replica.

        ``event`` is a :class:`~decent_optim_wrapper.GuardEvent`: this rank withheld its own values
        (they held inf/NaN), healed from its peers, kept the weight of a peer that withheld, or left
        out received entries that were not finite. Returns a handle whose ``remove()`` unregisters it.
        """
        return self._engine.register_guard_hook(hook)

    @property
    def guard_counts(self) -> dict[str, int]:
        """How many guard events of each kind (``"withheld"``, ``"healed"``, ``"peer_withheld"``,
        ``"not_finite"``, and with clipped gossip ``"dropped"``) happened on this rank."""
        return self._engine.guard_counts

    def metrics(self) -> dict[str, float | int]:
        """This rank's gossip counters since the previous call, as a dict of plain numbers.

        Steps, rounds, bytes sent, seconds waited for rounds, guard events, world size, peers lost and
        joined, under the names the :doc:`metrics page </metrics>` lists (e.g. ``"gossip/bytes_sent"``,
        ``"gossip/wait_s"``, ``"fleet/world_size"``); see
        :meth:`~decent_optim_wrapper.engine.GossipEngine.metrics`. Each call starts the counts again.
        Local (no collective, no device sync): call it on one rank or all, as often as the logger
        writes::

            if step % 50 == 0:
                writer.add_scalars("gossip", optimizer.metrics(), step)  # or wandb.log(...), etc.
        """
        return self._engine.metrics()

    def consensus_distance(self) -> float:
        """Root-mean-square distance of the replicas to their average; the same on every rank.

        See :meth:`~decent_optim_wrapper.engine.GossipEngine.consensus_distance`.

        .. warning:: This is a collective: all ranks must call it.
        """
        return self._engine.consensus_distance()
