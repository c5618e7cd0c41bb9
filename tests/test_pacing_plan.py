"""Pure: paced rounds' planning (decent_optim_wrapper.engine.rules.pacing) without a process group.

Closed forms for the round length and the counts, the positions of round ends and folds a clock
gives the engine, its checkpoint, and the options' checks.
"""

from __future__ import annotations

import math

import pytest

from decent_optim_wrapper import Pacing
from decent_optim_wrapper.engine.rules import pacing as pacing_module
from decent_optim_wrapper.engine.rules.pacing import (
    FixedClock,
    PacedClock,
    planned_steps,
    resolve_pacing,
    round_seconds,
)

pytestmark = pytest.mark.pure


def test_round_length_holds_n_h_steps_of_the_fleet():
    # 2 ranks of 1 s and 2 s per step, H = 4: together 1.5 steps/s, so 8 steps take 16/3 s
    assert round_seconds([1.0, 2.0], 4) == pytest.approx(16 / 3, rel=1e-15)
    # equal ranks: a round of H steps each
    assert round_seconds([0.25] * 8, 4) == pytest.approx(1.0, rel=1e-15)


@pytest.mark.parametrize(("step_s", "expected"), [(1.0, 16 / 3), (2.0, 8 / 3)])
def test_counts_average_the_share_exactly(step_s, expected):
    tau, carry, total, rounds = 16 / 3, 0.5, 0, 300
    for _ in range(rounds):
        steps, carry = planned_steps(tau, step_s, carry, 4, 4.0)
        assert steps in (math.floor(expected), math.ceil(expected))
        total += steps
    # error diffusion: the total is within one step of rounds * tau / step_s
    assert abs(total - rounds * expected) <= 1


def test_counts_are_held_between_one_and_max_share():
    assert planned_steps(100.0, 1.0, 0.5, 4, 2.0)[0] == 8
    assert planned_steps(0.1, 1.0, 0.5, 4, 2.0)[0] == 1


@pytest.mark.parametrize(
    ("pacing", "error", "words"),
    [
        ("fast", TypeError, "pacing must be None, 'measured' or a Pacing"),
        (Pacing(weighting="steps"), ValueError, "weighting='steps'"),
        (Pacing(repace_every=0), ValueError, "repace_every=0"),
        (Pacing(max_share=0.5), ValueError, "max_share=0.5"),
        (Pacing(max_share=math.inf), ValueError, "max_share=inf"),
        (Pacing(schedule=3), TypeError, "schedule=3"),  # type: ignore[arg-type]
        (Pacing(clock=0.5), TypeError, "clock=0.5"),  # type: ignore[arg-type]
    ],
)
def test_bad_pacing_is_named(pacing, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        resolve_pacing(pacing)


def test_measured_is_the_default_pacing():
    assert resolve_pacing(None) is None
    assert resolve_pacing("measured") == Pacing()


def _walk(clock, steps: int, launched: dict[int, int]) -> list[tuple[int, str, int]]:
    """What the engine does with a clock over ``steps`` steps (one bucket): folds, then round ends."""
    events = []
    pending = None
    for step in range(steps):
        if pending is not None and step >= clock.fold_after(pending, step):
            events.append((step, "fold", pending))
            pending = None
        ended = clock.round_ending_at(step)
        if ended is not None:
            events.append((step, "launch", ended))
            launched[ended] = step
            pending = ended
            if step >= clock.fold_after(pending, step):
                events.append((step, "fold", pending))
                pending = None
    return events


@pytest.mark.parametrize("delay", [0, 1, 3, 4])
def test_a_uniform_schedule_walks_like_fixed_rounds(delay):
    paced = PacedClock(Pacing(schedule=lambda rank, r: 4), 4, delay)
    paced.connect(None, 0, 1)
    assert _walk(paced, 30, {}) == _walk(FixedClock(4, delay), 30, {})


def test_uneven_counts_end_rounds_and_fold_the_same_fraction_later():
    counts = [3, 8, 2, 4]
    clock = PacedClock(Pacing(schedule=lambda rank, r: counts[r % 4]), 4, 2)
    clock.connect(None, 0, 1)
    launched: dict[int, int] = {}
    events = _walk(clock, 17, launched)
    # ends after steps 2, 10, 12, 16; round r folds ceil(2 n(r+1) / 4) steps after its end
    assert launched == {0: 2, 1: 10, 2: 12, 3: 16}
    folds = {r: s for s, kind, r in events if kind == "fold"}
    assert folds == {0: 2 + 4, 1: 10 + 1, 2: 12 + 2}
    assert clock.rounds_launched(17) == 4 and clock.rounds_launched(16) == 3


def test_a_schedule_that_gives_no_steps_is_named():
    clock = PacedClock(Pacing(schedule=lambda rank, r: 0 if r else 2), 4, 4)
    clock.connect(None, 3, 4)
    clock.round_ending_at(0)
    with pytest.raises(ValueError, match="gave 0 inner steps for rank 3 in round 1"):
        clock.round_ending_at(2)


def test_the_clock_resumes_where_it_was_saved():
    counts = [3, 8, 2, 4, 5]

    def schedule(rank, r):
        return counts[r % 5]

    first = PacedClock(Pacing(schedule=schedule), 4, 3)
    first.connect(None, 0, 1)
    _walk(first, 12, {})
    state = first.state_dict()
    second = PacedClock(Pacing(schedule=schedule), 4, 3)
    second.connect(None, 0, 1)
    second.load_state_dict(state, step=12)
    assert _walk(first, 40, {})[-20:] == _walk(second, 40, {})[-20:]


def test_measured_steps_leave_out_waits_and_outliers():
    now = [0.0]
    clock = PacedClock(Pacing(clock=lambda: now[0]), 2, 2)
    clock.connect(None, 0, 1)
    step = 0

    def take(seconds: float, waited: float = 0.0) -> None:
        nonlocal step
        clock.round_ending_at(step)
        if waited:
            with clock.waiting():
                now[0] += waited
        now[0] += seconds
        step += 1

    for _ in range(4):  # round 0 (not measured) and round 1
        take(0.1, waited=0.5)
    take(0.1)
    report = clock.report()
    assert report.step_seconds == pytest.approx(0.1) and report.waited_seconds == pytest.approx(2.0)
    take(10.0)  # round 2 (steps 4 and 5): a step of 10 s (an evaluation) counts as 3 estimates
    clock.round_ending_at(step)  # round 3 is planned: a mean of 0.2 s is a new speed, taken at once
    assert clock.report().step_seconds == pytest.approx((0.1 + 0.3) / 2)
    take(0.23)
    clock.round_ending_at(step)  # round 3 (one step: tau / 0.2 s) within a quarter of it: averaged in
    assert clock.report().step_seconds == pytest.approx(0.5 * (0.2 + 0.23))


def test_after_a_change_of_the_world_rounds_and_pace_messages_restart_at_the_resume_round(monkeypatch):
    # Two equal ranks (the peer's message mirrors this rank's), H = 2, messages every 4 rounds from
    # round 2. After a recovery that resumes at round 7, rounds before 7 are not launched and the
    # messages go out at rounds 8, 12, 16: the first rounds no member can have begun (one may stand
    # inside round 7), the same on every member of the new group.
    now, sent = [0.0], []

    class Arrived:
        def wait(self, *timeout: object) -> bool:
            return True

    def all_gather(gathered, mine, group=None, async_op=False):
        sent.append(clock.report().rounds + 1)  # sent while planning the next round
        gathered.fill_(int(mine.item()))
        return Arrived()

    monkeypatch.setattr(pacing_module.dist, "all_gather_into_tensor", all_gather)
    clock = PacedClock(Pacing(repace_every=4, clock=lambda: now[0]), 2, 2)
    clock.connect(object(), 0, 2)  # any group: the gather above stands in for it
    step = 0

    def walk_to(rounds: int) -> None:
        nonlocal step
        while clock.rounds_launched(step) < rounds:
            clock.round_ending_at(step)
            now[0] += 0.1
            step += 1

    walk_to(5)
    assert sent == [2] and clock.report().round_seconds == pytest.approx(0.2)
    # Positions: the first round this rank can still launch, given the first step whose rounds it can
    # (between steps 9 and 10: step 10; inside step 10, which ends no round: step 11; inside step 11,
    # whose end of round 5 some buckets may have launched: step 12).
    assert clock.position(step) == clock.position(step + 1) == 5
    walk_to(5)  # nothing to do: round 5 is not launched yet
    clock.round_ending_at(step)
    now[0], step = now[0] + 0.1, step + 1
    assert clock.round_ending_at(step) == 5 and clock.position(step + 1) == 6
    now[0], step = now[0] + 0.1, step + 1
    clock.restart(7)
    assert not clock.launches(6, step, 7) and clock.launches(7, step, 7)
    walk_to(17)
    assert sent == [2, 8, 12, 16]
    fixed = FixedClock(4, 1)
    assert fixed.position(13) == 13 and fixed.launches(3, 15, 13) and not fixed.launches(2, 11, 13)


def test_pacing_in_a_job_of_nodes_that_survives_failures_is_refused_by_name():
    from decent_optim_wrapper.engine.layout import check_pacing_composes

    with pytest.raises(ValueError, match=r"on_peer_failure='continue'.*shards=k"):
        check_pacing_composes(Pacing(), "continue", sharded=True)
    check_pacing_composes(Pacing(), "continue", sharded=False)  # whole replicas: supported
    check_pacing_composes(Pacing(), "raise", sharded=True)  # measured HSDP: supported
