"""The planner's paced rounds (``Gossip(pacing=True)``) and uneven fleets (``ComputeTimes(jitter="uneven")``).

Closed forms on two ranks of step times ``t = (1 s, 2 s)`` gossiping as one pair with ``H = 4``: the
round length is ``tau = N H / sum_j 1 / t_j = 8 / 1.5 = 16 / 3`` s, so after the three unpaced rounds
rank 0 plans ``q_0 = 16 / 3`` steps per round and rank 1 ``q_1 = 8 / 3``; error diffusion (carry from
0.5) gives 5, 6, 5 and 3, 2, 3 repeating, 8 steps per round together. Without pacing the fast rank
waits for the slow one: ``N H`` steps every ``H t_1 = 8`` s, 1.0 step/s. Paced, with a free link and
``D >= 1``, no rank waits once the pace settles: ``1 / 1 + 1 / 2 = 1.5`` steps/s. Blocking rounds
(``D = 0``) pay the rounding instead: each round lasts its slower rank's ``max_i n_i t_i = 6`` s, so
8 steps per 6 s. A round slower than every rank's share of it (``d = 7`` s against at most 6 s of
steps), folded a whole round later (``D = H``), sets the pace alone: 8 steps every ``d``.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from decent_optim_wrapper.plan import (
    ComputeTimes,
    Gossip,
    Link,
    Network,
    Transfer,
    gossip_scheme,
    main,
    paced_steps,
    predict,
    simulate,
)
from decent_optim_wrapper.plan.compute import JITTERS, UNEVEN
from decent_optim_wrapper.topo import TopologyFactory
from decent_optim_wrapper.topo.group import Group

pytestmark = pytest.mark.pure

EXACT = 1e-12
T_1_2 = ComputeTimes(1.0, "uneven", factors=(1.0, 2.0))  # t = (1 s, 2 s)
PAIR = (Group((0, 1)),)


def pair(delay: int, link_s: float = 0.0, pacing: bool = True, **options: float) -> Gossip:
    """Ranks 0 and 1 gossip as one pair every round, a round taking ``link_s`` (0: a free link)."""
    return Gossip(
        2,
        lambda k: PAIR,
        lambda k: [Transfer.fixed(link_s)],
        sync_every=4,
        sync_delay=delay,
        pacing=pacing,
        **options,
    )


def launches(run, rank: int) -> list[float]:
    """When ``rank`` launched each round: the end of its last step of it."""
    ends, last = [], -1
    for count in run.round_steps[rank]:
        last += count
        ends.append(run.rank_ends[rank][last])
    return ends


# -- an uneven fleet's compute times ---------------------------------------------------------------


def test_uneven_scales_each_rank_by_its_factor_and_the_rest_keep_the_mean():
    times = ComputeTimes(0.1, "uneven", factors=[2.0, 0.5])  # a list (a command line's) is kept as a tuple
    assert times.factors == (2.0, 0.5)
    assert times.draws(0, 3) == [0.2] * 3
    assert times.draws(1, 2) == [0.05] * 2
    assert times.draws(5, 2) == [0.1] * 2  # beyond the factors: nominal speed


def test_the_other_jitters_draw_as_before():
    # the benchmarks run every jitter of JITTERS by name; uneven needs its factors, so it stays out
    assert JITTERS == ("none", "lognormal", "straggler") and UNEVEN == "uneven"
    # the log-normal stream of rank r is seeded by "seed/r" alone (the emulated cluster replays it)
    rng = random.Random("3/2")
    expected = [0.2 * math.exp(0.5 * rng.gauss(0.0, 1.0) - 0.125) for _ in range(5)]
    assert ComputeTimes(0.2, "lognormal", sigma=0.5, seed=3).draws(2, 5) == expected
    assert ComputeTimes(0.2, "straggler", slow_rank=1, slow_factor=2.0).draws(1, 2) == [0.4, 0.4]
    assert ComputeTimes(0.2).draws(0, 2) == [0.2, 0.2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"factors": (2.0,)},
            r"factors=\(2.0,\) are the per-rank slowdowns of jitter='uneven', but jitter='none'",
        ),
        (
            {"jitter": "lognormal", "factors": (2.0,)},
            "pass jitter='uneven' to use them, or leave factors out",
        ),
        ({"jitter": "uneven"}, r"jitter='uneven' needs factors.*factors=\(2, 2, 1, 1\)"),
        (
            {"jitter": "uneven", "factors": (1.0, 0.0)},
            r"factors=\(1.0, 0.0\) holds 0.0; every factor must be",
        ),
        ({"jitter": "uneven", "factors": (-1.0,)}, "holds -1.0; every factor must be a finite number > 0"),
        ({"jitter": "uneven", "factors": (math.inf,)}, "holds inf"),
        ({"jitter": "uneven", "factors": (math.nan,)}, "holds nan"),
        ({"jitter": "uneven", "factors": (True,)}, "holds True"),
    ],
)
def test_uneven_factors_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ComputeTimes(0.1, **kwargs)


# -- the plan: the engine's rule --------------------------------------------------------------------


def test_counts_follow_the_speeds_after_three_rounds_and_average_tau_over_t():
    counts = paced_steps(pair(1), [1.0, 2.0], 3 + 3 * 20)
    assert counts[0][:9] == [4, 4, 4, 5, 6, 5, 5, 6, 5]
    assert counts[1][:9] == [4, 4, 4, 3, 2, 3, 3, 2, 3]
    assert sum(counts[0][3:]) / 60 == pytest.approx(16 / 3, rel=EXACT)
    assert sum(counts[1][3:]) / 60 == pytest.approx(8 / 3, rel=EXACT)
    assert {a + b for a, b in zip(*counts, strict=True)} == {8}  # N H steps in every round


def test_counts_are_held_between_one_step_and_max_share_rounds():
    assert paced_steps(pair(1, max_share=1.25), [1.0, 2.0], 6)[0] == [4, 4, 4, 5, 5, 5]  # floor(1.25 H)
    assert paced_steps(pair(1), [1.0, 100.0], 6)[1] == [4, 4, 4, 1, 1, 1]  # q = 0.08: at least one step
    assert paced_steps(pair(1), [1.0, 2.0], 2) == [[4, 4], [4, 4]]  # the unpaced rounds only


# -- the simulation: closed forms -------------------------------------------------------------------


@pytest.mark.parametrize("delay", [1, 2, 4])
def test_a_free_link_lets_every_rank_run_at_its_own_speed(delay):
    paced = simulate(pair(delay), T_1_2, 4 * 40)  # 40 rounds
    unpaced = simulate(pair(delay, pacing=False), T_1_2, 4 * 40)
    # rounds 0 .. 2 throttle the fast rank; from round 7 on the pace repeats every 3 rounds of 16 s
    assert paced.steps_per_second(7) == pytest.approx(1.0 + 0.5, rel=EXACT)
    assert unpaced.steps_per_second(7) == pytest.approx(2 * 0.5, rel=EXACT)
    assert launches(paced, 0)[10] - launches(paced, 0)[7] == pytest.approx(16.0, rel=EXACT)
    assert [len(ends) for ends in paced.rank_ends] == [12 + 12 * 16 + 5, 12 + 12 * 8 + 3]  # 37 paced rounds
    assert paced.ends == []  # the ranks took different numbers of steps
    # counted from the first paced round, it approaches the bound from below as the run grows
    short = simulate(pair(delay), T_1_2, 4 * 10).steps_per_second(3)
    assert short < paced.steps_per_second(3) <= 1.5 + EXACT


def test_blocking_paced_rounds_last_their_slowest_ranks_steps():
    run = simulate(pair(0), T_1_2, 4 * 30)
    # round k starts when both launched it, and the next one's steps start when it arrives (at once):
    # rounds of (5, 3), (6, 2), (5, 3) steps last max(5 * 1, 3 * 2) = max(6 * 1, 2 * 2) = 6 s each
    starts = [max(a, b) for a, b in zip(launches(run, 0), launches(run, 1), strict=True)]
    assert [b - a for a, b in itertools.pairwise(starts[2:])] == [pytest.approx(6.0, rel=EXACT)] * 27
    # 8 whole periods of 3 rounds, timed from a round of each rank's same place in its 5, 6, 5 / 3, 2, 3
    assert run.steps_per_second(6) == pytest.approx(8 / 6, rel=EXACT)
    assert simulate(pair(0, pacing=False), T_1_2, 4 * 30).steps_per_second(3) == pytest.approx(1.0, rel=EXACT)


def test_a_slow_round_makes_every_rank_wait_and_sets_the_pace():
    # d = 7 s > tau = 16/3 s (and > 6 s, the longest share): each round starts when both launched it and
    # is folded a whole round later, so every rank launches round k + 1 when round k arrives
    run = simulate(pair(4, link_s=7.0), T_1_2, 4 * 30)
    sps = run.steps_per_second(4)
    assert sps == pytest.approx(2 * 4 / 7.0, rel=EXACT)  # N H steps per d
    assert sps < 1.0 + 0.5  # the bound of ranks that never wait
    assert launches(run, 0)[4:] == launches(run, 1)[4:]  # in lock step with the rounds
    assert simulate(pair(4, link_s=7.0, pacing=False), T_1_2, 4 * 30).steps_per_second(4) == pytest.approx(
        1.0
    )
    # every second of a rank is compute or waiting: (5, 6, 5) s of steps per 21 s on rank 0
    for rank, t in enumerate((1.0, 2.0)):
        steps = len(run.rank_ends[rank])
        assert run.rank_ends[rank][-1] == pytest.approx(steps * t + run.waited[rank], rel=EXACT)
        assert run.waited[rank] > 0


@pytest.mark.parametrize(("delay", "link_s"), [(0, 0.0), (1, 3.0), (2, 7.0), (4, 0.5), (4, 7.0)])
def test_the_fleet_never_beats_its_ranks_speeds(delay, link_s):
    run = simulate(pair(delay, link_s), T_1_2, 4 * 20)
    # a rank adds at most 1 / t_r; and it launches round k + 1 only after round k arrived (folded in
    # first, or blocking), so its launches are at least link_s apart: a window that opens at a launch
    # holds at most N H steps (every round's, here) per link_s
    for skip in (0, 3, 5, 11):
        assert run.steps_per_second(skip) <= (1.0 + 0.5) * (1 + EXACT)
        if skip and link_s:
            assert run.steps_per_second(skip) <= 2 * 4 / link_s * (1 + EXACT)


@pytest.mark.parametrize(
    ("blocking", "every", "delay"), [(False, 4, 1), (False, 8, 3), (False, 4, 4), (True, 1, 1)]
)
@pytest.mark.parametrize("jitter", [{}, {"jitter": "uneven", "factors": (1.5,) * 8}])
def test_equal_speeds_pace_every_round_at_h_steps_event_for_event(blocking, every, delay, jitter):
    # a ring of 8 ranks on 4 nodes sharing their links, rounds with processor time: the general case
    topology = TopologyFactory.create("ring", 8, 2)
    network = Network(Link(2e8, 1e-3), Link(1e10), local_world_size=2)
    options = {"blocking": blocking, "sync_every": every, "sync_delay": delay}
    unpaced = gossip_scheme(topology, 3_000_000, network, None, 0.013, **options)
    paced = gossip_scheme(topology, 3_000_000, network, None, 0.013, pacing=True, **options)
    times = ComputeTimes(0.07, **jitter)
    a, b = simulate(unpaced, times, 12 * every), simulate(paced, times, 12 * every)
    assert b.round_steps == [[every] * 12] * 8
    assert b.ends == a.ends and b.rank_ends == a.rank_ends and b.waited == a.waited
    assert b.iteration_s(every) == a.iteration_s(every)


def test_paced_runs_are_checked():
    with pytest.raises(ValueError, match=r"max_share=0.5 must be a finite number >= 1"):
        pair(1, max_share=0.5)
    with pytest.raises(ValueError, match="sized in rounds of sync_every=4 nominal steps"):
        simulate(pair(1), T_1_2, 3)
    with pytest.raises(ValueError, match="barrier_at=8: paced ranks stand at different steps"):
        simulate(pair(1), T_1_2, 40, barrier_at=8)
    run = simulate(pair(1), T_1_2, 40)
    with pytest.raises(ValueError, match=r"use steps_per_second\(skip_rounds\)"):
        run.iteration_s(2)
    with pytest.raises(ValueError, match=r"skip_rounds must be in \[0, 10\)"):
        run.steps_per_second(10)


# -- predictions and the command line ---------------------------------------------------------------


def test_predict_adds_a_paced_row_after_each_low_communication_row():
    times = ComputeTimes(0.1, "uneven", factors=(2.0, 2.0, 1.0, 1.0))
    args = (4e6, times, Network(Link(4e9)), 4, ["ring"], ("int8",))
    plain = predict(*args, local_steps=[(4, 4)])
    found = predict(*args, local_steps=[(4, 4)], paced=True)
    assert [p.method for p in found] == [
        *[p.method for p in plain[:5]],
        "ring~h4d4p",
        *[p.method for p in plain[5:7]],
        "ring~h4d4p@int8",
    ]
    assert [p for p in found if "~h4d4p" not in p.method] == plain  # the other rows are unchanged
    by_name = {p.method: p for p in found}
    # the slow pair sets the unpaced ring's pace (0.2 s); paced, the fleet nears 4 ranks over
    # sum_r 1 / t_r = 30 steps/s, never beating it
    assert by_name["ring~h4d4"].step_s > 0.19
    assert 4 / 30 - EXACT <= by_name["ring~h4d4p"].step_s < 0.15
    assert by_name["ring~h4d4p"].sent_bytes == by_name["ring~h4d4"].sent_bytes


def test_plan_prints_paced_rows_for_an_uneven_fleet(capsys):
    argv = ["--model-bytes", "4M", "--compute-ms", "100", "--bandwidth", "40gbit", "--nodes", "4"]
    extra = ["--topologies", "ring", "--compression", "int8", "--sync-every", "4", "--sync-delay", "4"]
    assert main([*argv, *extra, "--pacing", "--factors", "2", "2", "1", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "(uneven jitter)" in lines[0]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:-2]}
    assert {"ring~h4d4", "ring~h4d4p", "ring~h4d4@int8", "ring~h4d4p@int8"} <= set(rows)
    assert float(rows["ring~h4d4p"][0]) < float(rows["ring~h4d4"][0]) * 0.75
    assert lines[-1].startswith("paced methods (p)")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pacing"], "--pacing paces low-communication rounds: add --sync-every H"),
        (["--factors", "2", "1", "--jitter", "lognormal"], "jitter='lognormal'; pass jitter='uneven'"),
        (["--jitter", "uneven"], "jitter='uneven' needs factors"),
        (["--factors", "2", "0"], "every factor must be a finite number > 0"),
    ],
)
def test_pacing_options_exit_2_with_a_message(extra, message, capsys):
    argv = ["--model-bytes", "1M", "--compute-ms", "10", "--bandwidth", "1gbit", "--nodes", "2"]
    with pytest.raises(SystemExit) as info:
        main([*argv, *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err
