r"""Low-communication gossip: ``H`` local steps, an outer optimizer, and the anchors gossiped behind
the next inner steps (DiLoCo's rule with gossip in place of the all-reduce).

Every rank ``i`` keeps an *anchor* ``a_i`` beside its replica ``x_i`` (the parameters the inner
optimizer steps). Round ``r`` ends after inner step ``t_r = (r + 1) H - 1``; then, per bucket,

.. math::
    \Delta_i &= a_i - x_i
        &&\text{the pseudo-gradient: minus the inner progress of the round} \\
    a_i' &= \mathrm{OuterStep}_i(a_i, \Delta_i)
        &&\text{the outer optimizer, its state kept per rank} \\
    x_i &\leftarrow a_i'
        &&\text{the next inner steps start from it} \\
    &\text{launch gossip of } a_i' \text{ in } G_r(i)
        &&\text{non-blocking}

and at the end of inner step ``t_r + D`` (``0 <= D <= H``, the *delay*), the round is folded in:

.. math::
    \tilde a_i = \sum_{j \in G_r(i)} W^{(r)}_{ij}\, a_j', \qquad
    x_i \leftarrow x_i + (\tilde a_i - a_i'), \qquad a_i \leftarrow \tilde a_i ,

so the ``D`` inner steps taken while the round was in flight are kept, and the next pseudo-gradient
measures all ``H`` inner steps of the round against the mixed anchor. ``D = 0`` blocks (the
exchange is folded in before the next inner step, as DiLoCo does); ``D = H`` gives the exchange a
whole round to arrive. Rounds use the topology's phases in turn (round ``r`` gossips in phase
``r % period``), whatever ``H`` is. Without an outer optimizer ``a_i' = x_i`` (periodic gossip of
the parameters). The anchors start as the parameters at the first step.

Properties (``W`` doubly stochastic):

* **Complete topology, no delay: DiLoCo.** Every anchor becomes ``mean_j a_j'``. For an outer rule
  linear in its gradient and state (SGD, with or without momentum or Nesterov) that is the outer
  step applied to the mean pseudo-gradient, DiLoCo's rule (Douillard et al., "DiLoCo: Distributed
  Low-Communication Training of Language Models", 2023), up to the rounding of the average.
* **The mean follows DiLoCo for linear outer rules,** on any topology: mixing keeps the mean of the
  anchors, so the mean anchor and the mean outer state evolve by the outer rule applied to the
  mean pseudo-gradient.
* **Consensus:** the anchors are gossiped every round, so their spread contracts like gossip's
  (with a zero inner learning rate, ``H`` steps of this rule are one gossip round of the anchors).

The outer step before the mixing is GASLoC's order in its non-accelerated form (Cagnasso, Belilovsky
and Oyallon, "Unifying Local Communications and Local Updates for LLM Pretraining", 2026:
``theta <- W (theta + eta g)``), with any outer optimizer in place of ``eta g``. The documentation's
low-communication page compares it with NoLoCo and gives the costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from decent_optim_wrapper.checks import is_int
from decent_optim_wrapper.engine.exchange.buckets import Bucket, check_saved_tensors
from decent_optim_wrapper.engine.exchange.gossip import Gossip, GossipWiring
from decent_optim_wrapper.engine.exchange.guard import drop_state
from decent_optim_wrapper.engine.fleet.membership import ChannelReport, PeerLost
from decent_optim_wrapper.engine.rules.pacing import FixedClock, PacedClock, PaceReport, Pacing

__all__ = ["LocalSteps", "LocalStepsSpec", "OuterFactory", "resolve_local_steps"]

#: Builds the outer optimizer from the anchors (one tensor per parameter, shaped like it).
OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


@dataclass(frozen=True)
class LocalStepsSpec:
    """The checked options: period ``H``, delay ``D``, the outer optimizer's factory (or None), and
    the pacing of rounds (None: every round takes ``H`` inner steps, :mod:`~.pacing`)."""

    sync_every: int
    sync_delay: int
    outer_optimizer: OuterFactory | None
    pacing: Pacing | None = None

    def agreement(self, outer: torch.optim.Optimizer | None) -> tuple[object, ...]:
        """What every rank must agree on: H, D, and the outer optimizer's class, group count and
        defaults (ranks with different outer learning rates would no longer follow one rule)."""
        described = None
        if outer is not None:
            described = (type(outer).__name__, len(outer.param_groups), repr(sorted(outer.defaults.items())))
        paced = None if self.pacing is None else self.pacing.agreement()
        return (self.sync_every, self.sync_delay, described, *(() if paced is None else (paced,)))


def resolve_local_steps(
    sync_every: object, sync_delay: object, outer_optimizer: object, pacing: Pacing | None = None
) -> LocalStepsSpec | None:
    """Check the options; None when they ask for per-step gossip (the defaults).

    ``sync_delay`` None means a whole round (``sync_every``). Paced rounds (``pacing``, checked by
    :func:`~.pacing.resolve_pacing`) always use rounds, also with ``sync_every=1``: a fast rank then
    takes several steps per round.
    """
    if not is_int(sync_every):
        raise TypeError(
            f"sync_every must be a positive int (inner steps per round), got {sync_every!r}; e.g. 8, or 1 "
            "to gossip after every step."
        )
    if sync_every < 1:
        raise ValueError(
            f"sync_every must be >= 1 (inner steps per round), got {sync_every}; e.g. 8, or 1 to gossip "
            "after every step."
        )
    if sync_delay is not None and (not is_int(sync_delay)):
        raise TypeError(
            f"sync_delay must be None or an int in [0, sync_every], got {sync_delay!r}; 0 blocks, "
            f"sync_every={sync_every} (the default) lets the exchange run behind a whole round."
        )
    if sync_delay is not None and sync_delay < 0:
        raise ValueError(
            f"sync_delay must lie in [0, sync_every={sync_every}], got {sync_delay}: the steps a round's "
            "exchange runs behind. 0 blocks; None (the default) means a whole round."
        )
    if sync_delay is not None and sync_delay > sync_every:
        raise ValueError(
            f"sync_delay={sync_delay} exceeds sync_every={sync_every}: a round must be folded in before the "
            f"next one starts. Pass sync_delay in [0, {sync_every}] (0 blocks), None (the default: a whole "
            f"round), or a larger sync_every."
        )
    if outer_optimizer is not None and (
        isinstance(outer_optimizer, torch.optim.Optimizer) or not callable(outer_optimizer)
    ):
        raise TypeError(
            f"outer_optimizer must be None or a function from the anchors (a list of tensors) to a "
            f"torch.optim.Optimizer over them, got {outer_optimizer!r}; e.g. lambda params: "
            "torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)."
        )
    if sync_every == 1 and sync_delay is None and outer_optimizer is None and pacing is None:
        return None
    delay = sync_every if sync_delay is None else sync_delay
    return LocalStepsSpec(sync_every, delay, outer_optimizer, pacing)


def build_outer(factory: OuterFactory, anchors: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``factory(anchors)``, checked: a ``torch.optim.Optimizer`` over exactly these tensors, once each."""
    try:
        outer = factory(list(anchors))
    except (ValueError, TypeError, RuntimeError):
        raise
    except Exception as err:  # any failure of the user's factory becomes an error on every rank
        raise TypeError(f"outer_optimizer(params) raised {type(err).__name__}: {err}") from err
    if not isinstance(outer, torch.optim.Optimizer):
        raise TypeError(
            f"outer_optimizer(params) returned {type(outer).__name__}, not a torch.optim.Optimizer; return "
            "one built on the tensors it is given, e.g. torch.optim.SGD(params, lr=0.7, momentum=0.9, "
            "nesterov=True)."
        )
    held = [p for group in outer.param_groups for p in group["params"]]
    if {id(p) for p in held} != {id(p) for p in anchors} or len(held) != len(anchors):
        raise ValueError(
            f"outer_optimizer(params) built an optimizer over {len(held)} tensors, but it must cover exactly "
            f"the {len(anchors)} anchor tensors it is given, once each (not the model's parameters)."
        )
    return outer


class LocalSteps:
    """The anchors, the outer optimizer and the anchors' gossip of one rank (see the module docstring).

    Memory: one anchor per bucket (a copy of the parameters), the outer optimizer's state (SGD with
    momentum: one copy; Adam: two), the anchor gossip's buffer (one copy, in fp32 for 16-bit
    buckets) and, with compression, its references. The pseudo-gradient of one bucket lives only
    during its outer step.

    Args:
        buckets: the parameter buckets (anchor ``b`` has bucket ``b``'s layout and dtype).
        spec: the checked options.
        replica_max: under decentralized HSDP, the maximum of a value over the ranks of this rank's
            replica (paced rounds plan one replica's shards alike); None: this rank is its replica.
    """

    def __init__(
        self,
        buckets: Sequence[Bucket],
        spec: LocalStepsSpec,
        replica_max: Callable[[float], float] | None = None,
    ) -> None:
        self._spec = spec
        self._replica_max = replica_max
        self._clock = (
            FixedClock(spec.sync_every, spec.sync_delay)
            if spec.pacing is None
            else PacedClock(spec.pacing, spec.sync_every, spec.sync_delay)
        )
        self._buckets: list[Bucket] = []
        self._anchors: list[torch.Tensor] = []  # a_i, one flat tensor per bucket
        self._views: list[list[torch.Tensor]] = []  # per bucket: each parameter's slice of its anchor
        self._gossip: Gossip | None = None
        self._on_healed: Callable[[int], None] | None = None
        self._add(buckets)
        views = [v for per_bucket in self._views for v in per_bucket]
        factory = spec.outer_optimizer
        self._outer = None if factory is None else build_outer(factory, views)

    def _add(self, buckets: Sequence[Bucket]) -> list[torch.Tensor]:
        anchors = [b.data.clone() for b in buckets]
        self._buckets.extend(buckets)
        self._anchors.extend(anchors)
        views = [b.slices(a) for b, a in zip(buckets, anchors, strict=True)]
        self._views.extend(views)
        return [v for per_bucket in views for v in per_bucket]

    def connect(
        self, wired: GossipWiring, reset: bool = True, on_healed: Callable[[int], None] | None = None
    ) -> None:
        """Start the anchors' gossip over ``wired`` (the parameters' wiring, after the process groups
        exist) and, with ``reset``, copy the broadcast parameters (without: the survivors of a lost peer
        keep their anchors). ``on_healed`` is told which bucket's anchor healed (:mod:`~.guard`), so the
        inner optimizer's state of it is dropped too."""
        self._on_healed = on_healed
        self._gossip = wired.gossip(self._anchors, "anchors")
        self._clock.connect(
            wired.process_groups.world,
            wired.rank,
            wired.topology.world_size,
            # Staged (gloo groups): the pace messages stay on the host, read there without a device sync.
            device=self._anchors[0].device if self._anchors and wired.staging is None else None,
            waiter=wired.waiter,
            timeout=wired.timeout,
            replica_max=self._replica_max,
        )
        if reset:
            self.reset_anchors()
            self._gossip.start_from_common_point()  # the anchors are the broadcast parameters

    @property
    def spec(self) -> LocalStepsSpec:
        return self._spec

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer | None:
        return self._outer

    @property
    def anchors(self) -> list[torch.Tensor]:
        """The flat anchors, one per bucket (live)."""
        return list(self._anchors)

    def agreement(self) -> tuple[object, ...]:
        return self._spec.agreement(self._outer)

    def rounds_launched(self, step: int) -> int:
        """Rounds launched once ``step`` inner steps are complete."""
        return self._clock.rounds_launched(step)

    def check_round_boundary(self, step: int, what: str) -> None:
        """With paced rounds, raise ``RuntimeError`` unless ``step`` completed steps end a round: only
        there do all ranks stand at the same point of the schedule (a collective elsewhere would
        meet peers at other rounds)."""
        if self._spec.pacing is None or step == 0:
            return
        if self._clock.rounds_launched(step) == self._clock.rounds_launched(step - 1):
            inside = self._clock.rounds_launched(step)
            raise RuntimeError(
                f"{what} was called after step {step}, inside round {inside}: with paced rounds, ranks "
                "stand at different steps, so collectives go where a round ends, the same round on every "
                "rank. Call it when round_ended is True (e.g. when round_count reaches a multiple of your "
                "evaluation period)."
            )

    def position(self, step_position: int) -> int:
        """Where this rank stands for a recovery, given the first step whose rounds it can still
        launch: that step, or with paced rounds the first round it can still launch."""
        return self._clock.position(step_position)

    def restart(self, launch_from: int) -> None:
        """After a change of the world: rounds launch from position ``launch_from`` on (the
        survivors' furthest :meth:`position`), and paced rounds' messages restart there."""
        self._clock.restart(launch_from)

    def pace_report(self) -> PaceReport | None:
        """Where paced rounds stand on this rank (None without pacing)."""
        return self._clock.report() if isinstance(self._clock, PacedClock) else None

    @property
    def _channels(self) -> Gossip:
        assert self._gossip is not None, "connect() first"
        return self._gossip

    def bytes_sent_per_step(self) -> float:
        """The anchors' gossip bytes per round (mean over the schedule's phases), over ``H`` steps."""
        return self._channels.bytes_sent_per_step() / self._spec.sync_every

    # -- the rule ------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_anchors(self) -> None:
        """``a_i <- x_i`` for every bucket (the first step: the anchors start as the parameters)."""
        for bucket, anchor in zip(self._buckets, self._anchors, strict=True):
            anchor.copy_(bucket.data)

    def fold_due(self, bucket: int, step: int, mixing_factor: float) -> None:
        """Fold bucket ``bucket``'s round in if it is due after inner step ``step``."""
        pending = self._channels.pending(bucket)
        if pending is not None and step >= self._clock.fold_after(pending, step):
            self._fold(bucket, mixing_factor)

    def end_round(self, bucket: int, step: int, mixing_factor: float, launch_from: int = 0) -> None:
        """At the end of a round (after inner step ``step``): the outer step, the anchors' launch (from
        position ``launch_from`` on, see :meth:`restart`) and, without delay, their fold."""
        round_ = self._clock.round_ending_at(step)
        if round_ is None:
            return
        self._outer_step(bucket, self._clock.scale())
        if self._clock.launches(round_, step, launch_from):
            self._channels.launch(bucket, round_)
        if self._spec.sync_delay == 0:
            self._fold(bucket, mixing_factor)

    def _fold(self, bucket: int, mixing_factor: float) -> None:
        """``x <- x + (mixed - sent)``, ``a <- mixed``: two roundings, none when ``x`` is still ``a'``.

        An anchor healed from the peers (its own was not finite, :mod:`~.guard`) restarts the inner
        steps from it, ``x <- a``, and the outer (and, through ``on_healed``, the inner) optimizer's
        state of the bucket is dropped: all were computed from the values that were not finite.
        """
        x, anchor = self._buckets[bucket].data, self._anchors[bucket]
        with self._clock.waiting():  # a paced rank's step time leaves out the wait for its peers
            self._channels.wait(bucket)  # before x changes: a round that fails leaves x as it was
        if self._channels.pending(bucket) is None:
            return
        x.sub_(anchor)  # the inner progress since the launch (exactly 0 with no delay)
        if not self._channels.mix(bucket, mixing_factor):
            x.add_(anchor)
            return
        x.copy_(anchor)
        if self._outer is not None:
            drop_state(self._outer, self._views[bucket])
        if self._on_healed is not None:
            self._on_healed(bucket)

    def _outer_step(self, bucket: int, scale: float = 1.0) -> None:
        """``a <- OuterStep(a, s (a - x))`` (or ``a <- a - s (a - x)`` without an outer optimizer), then
        ``x <- a``; ``s`` is paced rounds' weighting, 1 otherwise (no multiplication then)."""
        x, anchor = self._buckets[bucket].data, self._anchors[bucket]
        if self._outer is None:
            if scale == 1.0:
                anchor.copy_(x)
            else:
                anchor.sub_(torch.sub(anchor, x).mul_(scale))
                x.copy_(anchor)
            return
        views = self._views[bucket]
        pseudo_gradient = torch.sub(anchor, x)
        if scale != 1.0:
            pseudo_gradient.mul_(scale)
        # The other buckets' anchors have no gradient, so the outer optimizer leaves them alone.
        for view, delta in zip(views, self._buckets[bucket].slices(pseudo_gradient), strict=True):
            view.grad = delta
        try:
            self._outer.step()
        finally:
            for view in views:
                view.grad = None
        x.copy_(anchor)

    # -- growing, averaging ------------------------------------------------------------------------------
    def add_buckets(self, buckets: Sequence[Bucket]) -> None:
        """Anchor new buckets at their current values; the outer optimizer gets them as a new group."""
        views = self._add(buckets)
        self._channels.add_tensors(self._anchors[-len(buckets) :])
        # New buckets are broadcast before they are anchored: their anchors are a common point.
        self._channels.start_from_common_point(range(len(self._anchors) - len(buckets), len(self._anchors)))
        if self._outer is not None and views:
            self._outer.add_param_group({"params": views})

    def prepare_global_avg(self) -> list[torch.Tensor]:
        """Drop the rounds in flight (references settled on every rank first); the anchors to average.

        A dropped round changes no mean: mixing keeps the mean of the anchors, so averaging ``a'``
        gives what averaging the mixed anchors would.
        """
        self._channels.settle_references()
        self._channels.discard_all()
        return list(self._anchors)

    def reports(self) -> list[ChannelReport]:
        """The anchors' rounds in flight, for the survivors of a lost peer."""
        return self._channels.reports("anchors")

    @torch.no_grad()
    def resolve(self, bucket: int, finish: bool, mixing_factor: float) -> None:
        """Fold bucket ``bucket``'s anchor round in (``finish``) or drop it (``x`` and ``a`` stay)."""
        if self._channels.pending(bucket) is None:
            return
        if finish:
            try:
                self._channels.wait(bucket)
            except PeerLost:  # a second failure: dropped after all, x and a unchanged
                finish = False
        if finish:
            self._fold(bucket, mixing_factor)
        else:
            self._channels.resolve(bucket, False, mixing_factor)

    def snapshot(self) -> dict[str, Any]:
        """What a revert of the global average restores: the anchors and the rounds still to fold in."""
        return {
            "anchors": [a.clone() for a in self._anchors],
            "gossip": self._channels.state_dict(references=False),
        }

    @torch.no_grad()
    def restore(self, snapshot: dict[str, Any]) -> None:
        for anchor, saved in zip(self._anchors, snapshot["anchors"], strict=False):
            anchor.copy_(saved)
        self._channels.load_state_dict(snapshot["gossip"], references=False)

    # -- checkpoints -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"sync_every", "sync_delay", "anchors", "outer", "gossip"}`` and, with paced rounds,
        ``"pacing"`` (:meth:`~.pacing.PacedClock.state_dict`); waits for rounds in flight."""
        state = {
            "sync_every": self._spec.sync_every,
            "sync_delay": self._spec.sync_delay,
            "anchors": [a.clone() for a in self._anchors],
            "outer": None if self._outer is None else self._outer.state_dict(),
            "gossip": self._channels.state_dict(),
        }
        paced = self._clock.state_dict()
        if paced is not None:
            state["pacing"] = paced
        return state

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ValueError`` naming the mismatch if ``state`` does not fit this run's options/layout."""
        if not isinstance(state, dict) or not {"sync_every", "sync_delay", "anchors", "gossip"} <= set(state):
            raise ValueError(
                "the checkpoint has no local-steps state (anchors, outer optimizer): it was saved with "
                f"per-step gossip, but this run has sync_every={self._spec.sync_every}; resume with the "
                "options it was saved with."
            )
        for key in ("sync_every", "sync_delay"):
            if state[key] != getattr(self._spec, key):
                raise ValueError(
                    f"checkpoint has {key}={state[key]!r} but this run has "
                    f"{key}={getattr(self._spec, key)!r}; resume with the same sync_every and sync_delay."
                )
        layout = [(a.shape, a.dtype) for a in self._anchors]
        check_saved_tensors("anchors", state["anchors"], layout)
        if (state.get("outer") is None) != (self._outer is None):
            raise ValueError(
                "checkpoint and this run disagree on whether an outer optimizer is used; pass the same "
                "outer_optimizer."
            )
        if self._outer is not None:
            sizes = [len(g["params"]) for g in self._outer.param_groups]
            if [len(g["params"]) for g in state["outer"]["param_groups"]] != sizes:
                raise ValueError(
                    f"checkpoint's outer optimizer has other param groups than this run's ({sizes} tensors "
                    "per group); pass the same outer_optimizer."
                )
        self._channels.check_state_dict(state["gossip"])
        paced = state.get("pacing")
        if paced is not None and self._spec.pacing is None:
            raise ValueError(
                "checkpoint was saved with paced rounds (pacing=...) but this run has pacing=None: its "
                "ranks stand at different inner steps of one round; resume with the same pacing."
            )
        if paced is not None and (
            not isinstance(paced, dict) or not {"round", "start", "steps"} <= set(paced)
        ):
            raise ValueError(f"checkpoint's local_steps['pacing'] is not a paced clock's state: {paced!r}.")

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any], step: int = 0) -> None:
        """Restore a checked :meth:`state_dict`: anchors, outer state, the round still to fold in and,
        with paced rounds, the round position (``step``: the engine's, where none was saved)."""
        for anchor, saved in zip(self._anchors, state["anchors"], strict=True):
            anchor.copy_(saved)
        if self._outer is not None:
            self._outer.load_state_dict(state["outer"])
        self._channels.load_state_dict(state["gossip"])
        self._clock.load_state_dict(state.get("pacing"), step)

    def wait_all(self) -> None:
        self._channels.wait_all()
