"""Multi-process: paced rounds (``pacing=...``), where each rank takes its own number of inner steps.

The rule (decent_optim_wrapper.engine.rules.pacing): rank i takes n_i(r) inner steps in round r, then
``a' = OuterStep(a, s_i (a - x))`` (``s_i = 1``, or ``H / n_i(r)`` with ``weighting="workers"``),
``x <- a'``, the anchors are gossiped in round r's phase, and ``ceil(D n_i(r+1) / H)`` of its own
steps later ``x <- x + (W a' - a')``, ``a <- W a'``. Checked against a one-process float64
simulation written from that formula with fixed per-rank counts; the measured mode is checked for
what it promises (counts follow the speeds, equal on every rank where they must be).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from helpers import EmulatedClock, batch, flat, gather, tiny_model
from resume import Resumable, assert_resume_is_bitwise
from test_local_steps import INNER_LR, OUTER, U64, _params

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel, Pacing, TopologyFactory

pytestmark = pytest.mark.dist

SYNC_EVERY = 4
# Inner steps per rank and round: uneven, changing from round to round, each within [1, 3H].
COUNTS = [[2, 4, 1, 6], [4, 4, 7, 3], [6, 3, 4, 2], [4, 9, 2, 5]]


def scheduled(rank: int, round_: int) -> int:
    return COUNTS[rank % len(COUNTS)][round_ % 4]


def uniform(rank: int, round_: int) -> int:
    return SYNC_EVERY


# -- the simulation ------------------------------------------------------------------------------------
class _PacedGossip:
    """Every replica with its own SGD (momentum 0.9), anchor and outer optimizer, in float64; replica i
    takes ``counts(i, r)`` steps in round r on its own batches ``batch(i, t_i)``."""

    def __init__(
        self,
        topology: str,
        world_size: int,
        outer: str | None,
        delay: int,
        weighting: str,
        every: int = SYNC_EVERY,
    ) -> None:
        self.n = world_size
        self.topo = TopologyFactory.create(topology, world_size)
        self.models = [tiny_model(dtype=torch.float64) for _ in range(world_size)]
        self.inner = [torch.optim.SGD(m.parameters(), lr=INNER_LR, momentum=0.9) for m in self.models]
        self.anchors = [tiny_model(dtype=torch.float64) for _ in range(world_size)]
        self.outers = [OUTER[outer](_params(a)) if outer else None for a in self.anchors]
        self.delay, self.weighting, self.every = delay, weighting, every

    def _vector(self, model: torch.nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def _set(self, model: torch.nn.Module, values: torch.Tensor) -> None:
        # a copy: vector_to_parameters makes the parameters views of what it is given
        torch.nn.utils.vector_to_parameters(values.clone(), model.parameters())

    def _inner_step(self, i: int, step: int) -> None:
        x, y = batch(i, step, torch.float64)
        self.inner[i].zero_grad()
        torch.nn.functional.cross_entropy(self.models[i](x), y).backward()
        self.inner[i].step()

    @torch.no_grad()
    def _outer_step(self, i: int, steps: int) -> torch.Tensor:
        scale = self.every / steps if self.weighting == "workers" else 1.0
        anchor, model, outer = self.anchors[i], self.models[i], self.outers[i]
        if outer is None:
            a, x = self._vector(anchor), self._vector(model)
            self._set(anchor, x if scale == 1.0 else a - (a - x) * scale)
        else:
            for a, p in zip(_params(anchor), _params(model), strict=True):
                a.grad = (a - p) * scale if scale != 1.0 else a - p
            outer.step()
        sent = self._vector(anchor)
        self._set(model, sent)
        return sent

    @torch.no_grad()
    def _fold(self, i: int, mixed: torch.Tensor, sent: torch.Tensor) -> None:
        self._set(self.models[i], self._vector(self.models[i]) + (mixed - sent))
        self._set(self.anchors[i], mixed)

    def run(self, rounds: int, counts) -> list[torch.Tensor]:
        steps = [0] * self.n
        pending: tuple[list[torch.Tensor], list[torch.Tensor], list[int]] | None = (
            None  # mixed, sent, fold at
        )
        for round_ in range(rounds):
            planned = [counts(i, round_) for i in range(self.n)]
            if pending is not None:  # the previous round folds D/H of the way into this one
                ends = [steps[i] - 1 for i in range(self.n)]
                pending = (
                    *pending[:2],
                    [e + math.ceil(self.delay * k / self.every) for e, k in zip(ends, planned, strict=True)],
                )
            sent = [torch.empty(0)] * self.n
            for i in range(self.n):
                for _ in range(planned[i]):
                    self._inner_step(i, steps[i])
                    if pending is not None and steps[i] >= pending[2][i]:
                        self._fold(i, pending[0][i], pending[1][i])
                        pending[2][i] = 1 << 60
                    steps[i] += 1
                sent[i] = self._outer_step(i, planned[i])
            w = self.topo.mixing_matrix(round_)
            mixed = [sum(w[i, j] * sent[j] for j in range(self.n)) for i in range(self.n)]
            pending = (mixed, sent, [1 << 60] * self.n)
            if self.delay == 0:
                for i in range(self.n):
                    self._fold(i, mixed[i], sent[i])
                pending = None
        pairs = zip(self.models, self.anchors, strict=True)
        return [torch.cat([self._vector(m), self._vector(a)]) for m, a in pairs]


# -- runs on the pool --------------------------------------------------------------------------------
def _inner(params):
    return torch.optim.SGD(params, lr=INNER_LR, momentum=0.9)


def _front(model, front_end: str, dtype=torch.float64, **keywords):
    if front_end == "module":
        return DecentralizedDataParallel(
            model, lambda named: _inner([p for _, p in named]), bucket_size_in_mb=1e-4, **keywords
        )
    return DecentOptimWrapper(_inner(model.parameters()), bucket_cap_mb=1e-4, **keywords)


def _train_rounds(model, front, front_end: str, rounds: int, slow_s=None, clock=None) -> list[int]:
    """Steps until ``rounds`` rounds are launched; returns each round's step count on this rank.

    ``slow_s(rank, round)``: the step time to emulate, on ``clock`` (an :class:`EmulatedClock`) if
    given, else by sleeping up to it."""
    rank, dtype = dist.get_rank(), next(model.parameters()).dtype
    per_round: list[int] = []
    while front.round_count < rounds:
        began = time.perf_counter()
        x, y = batch(rank, front.step_count, dtype)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if front_end == "module":
            loss.backward()
        else:
            front.zero_grad()
            loss.backward()
            front.step()
        if slow_s is not None and clock is not None:
            clock.advance(slow_s(rank, front.round_count))
        elif slow_s is not None:  # an emulated step time: sleep up to it (no CPU, so ranks do not compete)
            time.sleep(max(0.0, slow_s(rank, front.round_count) - (time.perf_counter() - began)))
        if front.round_ended:
            per_round.append(front.step_count - sum(per_round))
    return per_round


def _anchors_in_model_order(model, front) -> torch.Tensor:
    """The anchors laid out as the model's parameters (the engine's buckets may order and pad them
    otherwise)."""
    views = {}
    for bucket, anchor in zip(front.engine.buckets, front.engine.anchors, strict=True):
        for param, view in zip(bucket.params, bucket.slices(anchor), strict=True):
            views[id(param)] = view
    return torch.cat([views[id(p)].reshape(-1) for p in model.parameters()])


def _run(
    topology, rounds, outer, delay, front_end, weighting, schedule=scheduled, every=SYNC_EVERY, **options
):
    model = tiny_model(dtype=torch.float64)
    pacing = None if schedule is None else Pacing(weighting=weighting, schedule=schedule)
    front = _front(
        model,
        front_end,
        topology=topology,
        sync_every=every,
        sync_delay=delay,
        outer_optimizer=OUTER[outer],
        pacing=pacing,
        **options,
    )
    counts = _train_rounds(model, front, front_end, rounds)
    front.engine.wait_all()
    return torch.cat([flat(model), _anchors_in_model_order(model, front)]), counts


# The simulation mixes with the dense matrix where the engine all-reduces in its group; each round
# differs by a few roundings of the parameters' size (k u max|a|), carried through the next inner
# steps without growing by more than a small factor: 2^10 n u max|x| per round, as in
# test_local_steps (10 orders of magnitude below one inner step's move).
def _tolerance(world_size: int, rounds: int, reference: list[torch.Tensor]) -> float:
    return 2**10 * world_size * rounds * U64 * max(r.abs().max().item() for r in reference)


@pytest.mark.parametrize(
    ("topology", "world_size", "outer", "delay", "weighting", "front_end"),
    [
        ("ring", 4, "nesterov", 4, "samples", "optimizer"),
        ("ring", 4, "nesterov", 1, "workers", "module"),
        ("one-peer-exp", 4, "momentum", 0, "samples", "optimizer"),
        ("one-peer-exp", 4, "adam", 2, "workers", "optimizer"),
        ("complete", 3, None, 3, "workers", "module"),
        ("ring", 3, None, 4, "samples", "optimizer"),
    ],
)
def test_paced_rounds_follow_the_rule(pool, topology, world_size, outer, delay, weighting, front_end):
    rounds = 5
    reference = _PacedGossip(topology, world_size, outer, delay, weighting).run(rounds, scheduled)
    results = pool(world_size).run(_run, topology, rounds, outer, delay, front_end, weighting)
    atol = _tolerance(world_size, rounds, reference)
    for rank, (vector, counts) in enumerate(results):
        assert counts == [scheduled(rank, r) for r in range(rounds)]
        torch.testing.assert_close(vector, reference[rank], rtol=0, atol=atol)
    # and not by accident: the same rounds of H steps each end elsewhere
    fixed = _PacedGossip(topology, world_size, outer, delay, weighting).run(rounds, uniform)
    assert (fixed[0] - reference[0]).abs().max() > 1e6 * atol


def test_paced_rounds_of_one_nominal_step_follow_the_rule(pool):
    # sync_every=1: per-step gossip of the parameters, where a rank takes several steps per round
    rounds = 5
    reference = _PacedGossip("ring", 4, None, 1, "samples", every=1).run(rounds, scheduled)
    results = pool(4).run(_run, "ring", rounds, None, 1, "optimizer", "samples", scheduled, 1)
    atol = _tolerance(4, rounds, reference)
    for rank, (vector, _) in enumerate(results):
        torch.testing.assert_close(vector, reference[rank], rtol=0, atol=atol)


def test_a_uniform_schedule_is_bitwise_unpaced_rounds_and_front_ends_agree(pool):
    unpaced = pool(4).run(_run, "ring", 4, "nesterov", 2, "optimizer", "samples", None)
    paced = pool(4).run(_run, "ring", 4, "nesterov", 2, "optimizer", "samples", uniform)
    optimizer = pool(4).run(_run, "ring", 4, "nesterov", 2, "optimizer", "samples")
    module = pool(4).run(_run, "ring", 4, "nesterov", 2, "module", "samples")
    for rank in range(4):
        assert torch.equal(paced[rank][0], unpaced[rank][0]), f"rank {rank}"
        assert torch.equal(module[rank][0], optimizer[rank][0]), f"rank {rank}"


def _compressed_mean(compression: str) -> tuple[float, float]:
    """One paced round with a zero inner learning rate: the anchors' mean moves by at most roundings."""
    model = tiny_model(dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(dist.get_rank())  # distinct replicas (the first step resets the anchors to them)
    front = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.0),
        topology="ring",
        sync_every=SYNC_EVERY,
        sync_delay=0,
        pacing=Pacing(schedule=scheduled),
        compression=compression,
    )
    before: torch.Tensor | None = None
    while front.round_count < 3:
        x, y = batch(dist.get_rank(), front.step_count, torch.float64)
        front.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        front.step()
        if before is None:
            before = gather(torch.cat(front.engine.anchors)).mean(0)
    after = gather(torch.cat(front.engine.anchors))
    return float((after.mean(0) - before).abs().max()), float(after.abs().max())


@pytest.mark.parametrize("compression", ["int8", "topk:0.03:int4"])
def test_compressed_paced_rounds_keep_the_mean(pool, compression):
    # The anchors' mean is kept by every mixing (compressed or not); with a zero inner learning rate and
    # no outer optimizer nothing else moves it: only the roundings of the sums, a few u max|a|.
    moved, scale = pool(4).run(_compressed_mean, compression)[0]
    assert moved <= 64 * U64 * scale


@dataclass
class _PacedRun(Resumable):
    """A ring with H=4, D=3, a Nesterov outer optimizer and a fixed uneven schedule, saved at a round
    boundary with a round in flight; ``train``'s range counts rounds."""

    front_end: str
    compression: str | None = None

    def build(self, seed: int):
        model = tiny_model(seed=seed)
        keywords = dict(
            topology="ring",
            sync_every=SYNC_EVERY,
            outer_optimizer=OUTER["nesterov"],
            sync_delay=3,
            compression=self.compression,
            pacing=Pacing(schedule=scheduled),
        )
        if self.front_end == "module":
            return model, DecentralizedDataParallel(
                model,
                lambda named: torch.optim.AdamW([p for _, p in named], lr=0.01),
                bucket_size_in_mb=1e-4,
                **keywords,
            )
        return model, DecentOptimWrapper(torch.optim.AdamW(model.parameters(), lr=0.01), **keywords)

    def train(self, run, steps: range) -> None:
        model, front = run
        _train_rounds(model, front, self.front_end, steps.stop)

    def state_dict(self, run) -> dict:
        front = run[1]
        state = front.training_state_dict() if self.front_end == "module" else front.state_dict()
        local = state["decent"]["local_steps"]
        assert local["gossip"] is not None  # a round still to fold in
        assert local["pacing"]["round"] >= 1
        return state

    def load_state_dict(self, run, state: dict) -> None:
        front = run[1]
        if self.front_end == "module":
            front.load_training_state_dict(state)
        else:
            front.load_state_dict(state)

    def result(self, run) -> torch.Tensor:
        model, front = run
        front.engine.wait_all()
        return torch.cat([flat(model), *front.engine.anchors, torch.tensor([float(front.step_count)])])


@pytest.mark.parametrize("case", [_PacedRun("optimizer"), _PacedRun("module", "topk:0.03:int4")], ids=str)
def test_resume_at_a_round_boundary_with_uneven_counts_is_bitwise(pool, resume_pool, tmp_path, case):
    assert_resume_is_bitwise(pool, resume_pool, 4, case, tmp_path, total=6, save_at=3)


def _average_at_round_end() -> tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor, torch.Tensor]:
    model = tiny_model(dtype=torch.float64)
    front = _front(
        model,
        "optimizer",
        topology="ring",
        sync_every=SYNC_EVERY,
        outer_optimizer=OUTER["nesterov"],
        pacing=Pacing(schedule=scheduled),
    )
    _train_rounds(model, front, "optimizer", 3)
    front.engine.wait_all()
    own = torch.cat([flat(model), *front.engine.anchors])
    everyone = gather(own)
    front.global_avg()
    averaged = torch.cat([flat(model), *front.engine.anchors])
    front.revert_global_avg()
    reverted = torch.cat([flat(model), *front.engine.anchors])
    return everyone.mean(0), averaged, torch.equal(reverted, own), own, everyone


def test_global_avg_at_a_round_end_is_exact_and_revert_bitwise(pool):
    results = pool(4).run(_average_at_round_end)
    for mean, averaged, reverted, _, _ in results:
        # the average of 4 float64 values, summed in another order: a few u of the largest entry
        torch.testing.assert_close(averaged, mean, rtol=0, atol=8 * U64 * mean.abs().max().item())
        assert reverted
    assert all(torch.equal(r[1], results[0][1]) for r in results)


# -- measured pacing -----------------------------------------------------------------------------------
def _measured(
    rounds: int, slow_rank, swap_at: int | None, host_staging: bool = False, emulated: bool = True
) -> tuple[list[int], list[float | None]]:
    """Step times of 8 ms, and 48 ms on the slow rank (which changes at ``swap_at``): on an emulated
    clock (exact, whatever the load), or slept (``emulated=False``: the host's own clock)."""

    def step_s(rank: int, round_: int) -> float:
        slow = slow_rank if swap_at is None or round_ < swap_at else (slow_rank + 1) % dist.get_world_size()
        return 0.048 if rank == slow else 0.008

    clock = EmulatedClock()
    model = tiny_model()
    front = _front(
        model,
        "optimizer",
        topology="ring",
        sync_every=SYNC_EVERY,
        outer_optimizer=OUTER["nesterov"],
        pacing=Pacing(repace_every=2, **({"clock": clock} if emulated else {})),
        host_staging=host_staging,
    )
    assert front.engine.host_staging is host_staging
    counts = _train_rounds(model, front, "optimizer", rounds, step_s, clock if emulated else None)
    report = front.pace_report()
    assert report is not None
    return counts, [report.round_seconds, report.step_seconds, report.waited_seconds]


def _assert_paced(counts: list[int], share: float) -> None:
    """Counts of a rank of ``share = tau / t`` planned steps per round: by error diffusion every count
    is the floor or the ceiling of the share (1 at least), and any n of them in a row sum to within 1
    of ``n * share``."""
    assert all(c in {max(1, math.floor(share)), max(1, math.ceil(share))} for c in counts), (counts, share)
    assert share < 1 or abs(sum(counts) - len(counts) * share) <= 1, (counts, share)


def test_measured_pacing_gives_a_slow_rank_fewer_steps_and_follows_a_change(pool):
    # 3 ranks of 8, 8 and 48 ms per step, on an emulated clock (so the plan is exact whatever the
    # machine's load; sleeping instead made the ranks' waits part of their steps on a loaded machine):
    # tau = 3 H / (1/8 + 1/8 + 1/48) ms = 44.3 ms, so 5.54 steps per round on a fast rank and
    # 0.92, held at 1, on the slow one. Rounds 0-2 take H steps; the first pace message (round 2)
    # applies from round 3. At round 11 rank 1 becomes the slow one: rank 0 plans with its new speed
    # at once, rank 1 in round 13 (its own slowdown at once, the new tau the message after).
    results = pool(3).run(_measured, 22, 0, 11)
    tau = 3 * SYNC_EVERY / (2 / 0.008 + 1 / 0.048)
    for rank, (counts, (round_s, step_s, waited_s)) in enumerate(results):
        assert round_s == pytest.approx(tau, rel=1e-9)  # the step times travel as integer ns
        assert step_s == pytest.approx(0.048 if rank == 1 else 0.008, rel=1e-9)
        assert waited_s == 0.0  # waits take no emulated time
        assert len(counts) == 22 and counts[:3] == [SYNC_EVERY] * 3
    counts = [r[0] for r in results]
    _assert_paced(counts[0][3:11], tau / 0.048)  # rank 0 slow
    _assert_paced(counts[1][3:11], tau / 0.008)
    _assert_paced(counts[0][11:], tau / 0.008)  # then rank 1
    _assert_paced(counts[1][13:], tau / 0.048)
    _assert_paced(counts[2][3:], tau / 0.008)


def test_measured_pacing_with_host_staged_rounds_agrees_on_every_pace(pool):
    # Host-staged: the rounds launch from another thread and the pace messages stay on the host. What
    # must hold whatever the machine's load: every rank computed the same round length from the same
    # messages, and every count stays within [1, 4 H] (timing itself is the test above's).
    results = pool(3).run(_measured, 12, 0, None, True, False)
    taus = {r[1][0] for r in results}
    assert len(taus) == 1 and next(iter(taus)) is not None
    assert all(1 <= c <= 4 * SYNC_EVERY for r in results for c in r[0])
    assert len({len(r[0]) for r in results}) == 1  # every rank ran the same rounds


# -- what is refused -------------------------------------------------------------------------------------
def _refused(**options) -> str:
    model = tiny_model()
    try:
        DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4, **options)
    except (ValueError, TypeError) as err:
        return str(err)
    return ""


def test_pacing_that_cannot_compose_is_refused_on_every_rank(pool):
    for options, words in (
        (dict(pacing="measured", gradient_tracking=True), "gradient_tracking"),
        (dict(pacing="fast"), "pacing must be None, 'measured'"),
        (dict(pacing=Pacing(weighting="steps")), "weighting"),
    ):
        messages = pool(2).run(_refused, **options)
        assert all(words in m for m in messages), messages


def _average_mid_round() -> str:
    model = tiny_model(dtype=torch.float64)
    front = _front(
        model, "optimizer", topology="ring", sync_every=SYNC_EVERY, pacing=Pacing(schedule=scheduled)
    )
    _train_rounds(model, front, "optimizer", 0)
    x, y = batch(dist.get_rank(), 0, torch.float64)
    front.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    front.step()  # every rank's round 0 has 2 or more steps: all are inside it
    try:
        front.global_avg()
    except RuntimeError as err:
        return str(err)
    return ""


def test_global_avg_inside_a_paced_round_is_refused(pool):
    messages = pool(4).run(_average_mid_round)
    assert all("round_ended" in m and "inside round 0" in m for m in messages), messages
