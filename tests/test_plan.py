"""Pure logic of the planner: compute-time draws, the cost model, the simulator and the command line.

The simulator is checked against closed forms it must reproduce exactly (up to float rounding, hence
``rel=1e-12``): a zero-jitter ring steps every ``max(compute, exchange) + overhead``, DDP every
slowest compute plus its all-reduce, a ring all-reduce takes ``2 (k - 1) / k`` of the bytes over the
link plus ``2 (k - 1)`` latencies; and against the property that makes gossip scale: a rank waits for
its group, so gossip never ends a step later than DDP with the same exchange time.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from decent_optim_wrapper import GossipCompression
from decent_optim_wrapper.engine.wire.compression import CompressionPlan, codec
from decent_optim_wrapper.plan import (
    AllReduce,
    ComputeTimes,
    Gossip,
    HostCopy,
    Link,
    LinkSharing,
    Network,
    NoComm,
    SharedLink,
    SharingModel,
    Transfer,
    allreduce_scheme,
    bytes_per_parameter,
    ddp_buckets,
    gossip_round_bytes,
    gossip_scheme,
    main,
    simulate,
    transfer_seconds,
)
from decent_optim_wrapper.plan.cli import parse_quantity
from decent_optim_wrapper.topo import TopologyFactory
from decent_optim_wrapper.topo.group import Group

pytestmark = pytest.mark.pure

EXACT = 1e-12  # sums of a few dozen float64 times of ~0.1 s: rounding only


def constant_gossip(topology_name: str, n: int, exchange_s: float, overhead_s: float) -> Gossip:
    topology = TopologyFactory.create(topology_name, n)
    return Gossip(
        n, topology.phase, lambda step: [Transfer.fixed(exchange_s)] * len(topology.phase(step)), overhead_s
    )


# -- compute times -------------------------------------------------------------------------------


def test_lognormal_keeps_the_mean_and_is_reproducible_per_rank():
    times = ComputeTimes(0.2, "lognormal", sigma=0.5, seed=3)
    draws = [t for rank in range(40) for t in times.draws(rank, 500)]
    # 20,000 draws of a log-normal with sigma 0.5: standard error sqrt(e^{0.25} - 1) * 0.2 / sqrt(20000)
    # = 7.5e-4; allow 4 standard errors.
    assert statistics.fmean(draws) == pytest.approx(0.2, abs=4 * 7.5e-4)
    assert max(draws) > 3 * 0.2  # a heavy right tail
    assert times.draws(7, 10) == times.draws(7, 30)[:10]  # rank 7's stream, whatever the step count
    assert times.draws(7, 10) != ComputeTimes(0.2, "lognormal", sigma=0.5, seed=4).draws(7, 10)


def test_straggler_slows_one_rank_only():
    times = ComputeTimes(0.1, "straggler", slow_rank=2, slow_factor=1.5)
    assert times.draws(2, 3) == [pytest.approx(0.15)] * 3
    assert times.draws(0, 3) == times.draws(5, 3) == [0.1] * 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mean_s": 0.0}, "mean_s must be > 0"),
        ({"mean_s": 0.1, "jitter": "gamma"}, "jitter must be one of none, lognormal, straggler"),
        ({"mean_s": 0.1, "slow_factor": 0.0}, "slow_factor > 0"),
    ],
)
def test_compute_times_reject_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ComputeTimes(**kwargs)


# -- cost model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 8, 64])
def test_ring_allreduce_closed_form(k):
    link = Link(1e9, 1e-4)
    seconds = Network(link).allreduce_seconds([Group(tuple(range(k)))], [2 * (k - 1) / k * 1e6])
    assert seconds == [pytest.approx(2 * (k - 1) / k * 8e6 / 1e9 + 2 * (k - 1) * 1e-4, rel=EXACT)]
    tree = Network(link, tree_latency=True).allreduce_seconds([Group(tuple(range(k)))], [0.0])
    assert tree == [pytest.approx(2 * math.ceil(math.log2(k)) * 1e-4, rel=EXACT)]


@pytest.mark.parametrize("k", [2, 3, 16])
def test_each_message_adds_the_links_message_bytes_to_the_hop(k):
    # a ring all-reduce's 2 (k - 1) messages each carry message_bytes more over the link
    link = Link(1e6, 1e-3, message_bytes=900.0)
    sent = 2 * (k - 1) / k * 2714.0  # a sparse round's payload
    seconds = Network(link).allreduce_seconds([Group(tuple(range(k)))], [sent])
    messages = 2 * (k - 1)
    assert seconds == [pytest.approx(8 * (sent + messages * 900.0) / 1e6 + messages * 1e-3, rel=EXACT)]
    # nothing sent, nothing charged but the latencies; inside a node the intra link's cost applies
    assert Network(link).allreduce_seconds([Group(tuple(range(k)))], [0.0]) == [
        pytest.approx(messages * 1e-3, rel=EXACT)
    ]
    inside = Network(link, Link(1e6, message_bytes=100.0), local_world_size=k)
    assert inside.allreduce_seconds([Group(tuple(range(k)))], [sent]) == [
        pytest.approx(8 * (sent + messages * 100.0) / 1e6, rel=EXACT)
    ]


def test_links_reject_a_negative_message_cost():
    with pytest.raises(ValueError, match=r"message_bytes >= 0.*message_bytes=-1"):
        Link(1e6, message_bytes=-1.0)


def test_ranks_of_a_node_share_its_link_and_talk_fast_inside_it():
    # hierarchical on 2 nodes x 2: phase 0 averages inside each node, phase 1 pairs local rank l of
    # node 0 with local rank l of node 1, so both of a node's ranks send on its one link at once
    topology = TopologyFactory.create("hierarchical", 4, 2)
    network = Network(Link(8e6), Link(8e9), local_world_size=2)
    intra, inter = (network.allreduce_seconds(p, [1e6] * len(p)) for p in topology.schedule[:2])
    assert intra == [pytest.approx(1e-3)] * 2  # 1 MB at 1 GB/s
    assert inter == [pytest.approx(2.0)] * 2  # 1 MB at half of 1 MB/s


def test_bytes_follow_the_engine_rule():
    topology = TopologyFactory.create("ring", 8)
    pair = topology.group(0, 0)
    assert gossip_round_bytes(pair, 1000) == 4000  # one fp32 model to the peer
    plan = gossip_scheme(topology, 1 << 20, Network(Link(1e9)), GossipCompression("bf16"))
    rounds = [r.seconds_alone() for r in plan.rounds(0)]
    assert rounds == [pytest.approx(2 * (1 << 20) * 8 / 1e9)] * 4  # a bf16 payload per hop
    assert bytes_per_parameter(topology, GossipCompression("bf16")) == 2.0


def test_ddp_buckets_cover_the_model_in_backward_order():
    buckets = ddp_buckets(60e6, forward_fraction=0.25)
    assert [b for b, _ in buckets] == [
        1024 * 1024,
        25 * 1024 * 1024,
        25 * 1024 * 1024,
        pytest.approx(60e6 - 51 * 1024 * 1024),
    ]
    fractions = [f for _, f in buckets]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and fractions[0] > 0.25
    assert ddp_buckets(1e5) == [(1e5, 1.0)]  # a small model: one bucket, ready when backward ends


# -- links shared in time ------------------------------------------------------------------------

# One byte over an 8 bit/s link: T = 1 s alone, so every time below is a count of T.
LINK_X, LINK_Y = SharedLink("x", 8.0), SharedLink("y", 8.0)


def on(*links: SharedLink, nbytes: float = 1.0, cap: float = math.inf) -> Transfer:
    return Transfer(nbytes, tuple((link, 1) for link in links), cap)


@pytest.mark.parametrize(
    ("second_start", "expected"),
    [
        (0.0, [2.0, 2.0]),  # together all the way: half the link each
        (0.5, [1.5, 1.5]),  # overlap for half of the first: 0.5 alone + 0.5 left at half rate = 1.5;
        # the second: 0.5 done at half rate by t = 1.5, the other 0.5 alone, ends at 2.0
        (1.0, [1.0, 1.0]),  # back to back: no overlap, no sharing
        (3.0, [1.0, 1.0]),
    ],
)
def test_two_transfers_share_a_link_only_while_they_overlap(second_start, expected):
    seconds = transfer_seconds([on(LINK_X), on(LINK_X)], [0.0, second_start])
    assert seconds == [pytest.approx(e, rel=EXACT) for e in expected]


def test_transfers_on_different_links_do_not_slow_each_other():
    assert transfer_seconds([on(LINK_X), on(LINK_Y)]) == [pytest.approx(1.0, rel=EXACT)] * 2


def test_shares_are_max_min_fair():
    # y has half x's bandwidth: b and c split it (2 bit/s each); a takes what b leaves of x (6 bit/s)
    slow_y = SharedLink("y", 4.0)
    a, b, c = on(LINK_X, nbytes=3.0), on(LINK_X, slow_y), on(slow_y)
    assert transfer_seconds([a, b, c]) == [pytest.approx(4.0, rel=EXACT)] * 3  # 24/6, 8/2, 8/2
    # a transfer held back by its own cap (a loopback, say) leaves the rest of the link to the others
    capped, other = on(LINK_X, cap=2.0), on(LINK_X, nbytes=3.0)
    assert transfer_seconds([capped, other]) == [pytest.approx(4.0, rel=EXACT)] * 2  # 8/2, 24/6


def test_without_reclaim_a_transfer_leaves_unused_what_another_holds_back_elsewhere():
    # as above, but a gets its half of x (4 bit/s), not what b leaves of it: b and c end at 8/2 = 4 s,
    # a has sent 16 of its 24 bits by then and the last 8 alone take 1 s more
    slow_y = SharedLink("y", 4.0)
    a, b, c = on(LINK_X, nbytes=3.0), on(LINK_X, slow_y), on(slow_y)
    seconds = transfer_seconds([a, b, c], model=SharingModel(reclaim=False))
    assert seconds == [
        pytest.approx(5.0, rel=EXACT),
        pytest.approx(4.0, rel=EXACT),
        pytest.approx(4.0, rel=EXACT),
    ]
    # transfers that cross the same links lose nothing: the same as max-min fair
    assert (
        transfer_seconds([on(LINK_X), on(LINK_X)], model=SharingModel(reclaim=False))
        == [pytest.approx(2.0, rel=EXACT)] * 2
    )


def test_an_earlier_start_weighs_more_with_a_doubling_time():
    # the second starts one doubling time (0.25 s) later: weights 2 : 1 while both run.
    # first: 0.25 alone, then 0.75 left at 2/3 of the link = 1.125 s, ends at 1.375;
    # second: 1/3 of the link for 1.125 s = 0.375 done, 0.625 left alone, ends at 2.0 (1.75 after its start)
    model = SharingModel(doubling_s=0.25)
    seconds = transfer_seconds([on(LINK_X), on(LINK_X)], [0.0, 0.25], model)
    assert seconds == [pytest.approx(1.375, rel=EXACT), pytest.approx(1.75, rel=EXACT)]


def test_head_starts_break_a_tie_reproducibly_and_lose_no_bandwidth():
    model = SharingModel(doubling_s=0.1, head_start_s=0.2, seed=3)
    seconds = transfer_seconds([on(LINK_X), on(LINK_X)], model=model)
    assert min(seconds) < 2.0 and max(seconds) == pytest.approx(2.0, rel=EXACT)  # the link never idles
    assert transfer_seconds([on(LINK_X), on(LINK_X)], model=model) == seconds


def test_latency_comes_after_the_last_byte():
    late = Transfer(1.0, ((LINK_X, 1),), latency_s=0.5)
    assert transfer_seconds([late, on(LINK_X)]) == [
        pytest.approx(2.5, rel=EXACT),
        pytest.approx(2.0, rel=EXACT),
    ]
    assert Transfer.fixed(0.3).seconds_alone() == 0.3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nbytes": -1.0}, "nbytes >= 0"),
        ({"nbytes": 1.0}, "needs a finite cap or a shared link"),
        ({"nbytes": 1.0, "cap": 0.0}, "cap > 0"),
    ],
)
def test_transfers_reject_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Transfer(**kwargs)


def test_sharing_rejects_bad_input():
    with pytest.raises(ValueError, match="only with doubling_s > 0"):
        SharingModel(head_start_s=0.1)
    sharing: LinkSharing[int] = LinkSharing()
    sharing.start(0, on(LINK_X), 0.0)
    with pytest.raises(ValueError, match="already in flight"):
        sharing.start(0, on(LINK_X), 0.1)


def test_two_ranks_of_a_node_that_drift_apart_share_less_than_the_whole_exchange():
    # hierarchical on 2 nodes x 2: both ranks of a node send to the other node in phase 1. In step
    # with each other they split the link for the whole exchange (the equal-split closed form);
    # once jitter moves their launches apart they overlap only part of the time.
    topology = TopologyFactory.create("hierarchical", 4, 2)
    network = Network(Link(8e6), Link(8e9), local_world_size=2)
    scheme = gossip_scheme(topology, 250_000, network)  # 1 MB per inter-node round: 1 s alone
    together = simulate(scheme, ComputeTimes(0.5), 40).iteration_s(10)
    # the round after the inter-node phase waits 2 s (shared), the one after the intra-node phase
    # (1 ms) none: its 0.5 s of compute
    assert together == pytest.approx((2.0 + 0.5) / 2, rel=EXACT)
    apart = simulate(scheme, ComputeTimes(0.5, "lognormal", sigma=0.5), 40).iteration_s(10)
    assert apart < together


# -- simulator ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("compute", "exchange"), [(0.2, 0.15), (0.2, 0.3)])
def test_zero_jitter_ring_steps_every_max_of_compute_and_exchange(compute, exchange):
    run = simulate(constant_gossip("ring", 16, exchange, 0.01), ComputeTimes(compute), 30)
    assert run.iteration_s(skip=1) == pytest.approx(max(compute, exchange) + 0.01, rel=EXACT)
    assert run.ends[0] == [pytest.approx(compute + 0.01)] * 16  # nothing to wait for at step 0


def test_allreduce_waits_every_step_for_the_slowest_rank():
    times = ComputeTimes(0.2, "lognormal", sigma=0.5, seed=1)
    n, steps = 16, 20
    draws = [times.draws(r, steps) for r in range(n)]
    run = simulate(AllReduce(n, [(0.05, 1.0)], 0.01), times, steps)
    ends = [0.0] + [run.ends[t][0] for t in range(steps)]
    for t in range(steps):
        assert run.ends[t] == [ends[t + 1]] * n  # every rank leaves the step together
        assert ends[t + 1] - ends[t] == pytest.approx(max(d[t] for d in draws) + 0.05 + 0.01, rel=EXACT)


def test_allreduce_of_an_early_bucket_overlaps_the_rest_of_backward():
    # the first bucket is ready half way through the compute and its all-reduce fits in the rest
    run = simulate(AllReduce(4, [(0.05, 0.5), (0.05, 1.0)]), ComputeTimes(0.2), 5)
    assert run.iteration_s() == pytest.approx(0.25, rel=EXACT)


def test_no_communication_is_compute_plus_overhead():
    assert simulate(NoComm(3, 0.002), ComputeTimes(0.1), 4).iteration_s() == pytest.approx(0.102, rel=EXACT)


@pytest.mark.parametrize("topology", ["ring", "one-peer-exp"])
def test_gossip_never_ends_a_step_after_ddp_with_the_same_exchange(topology):
    times = ComputeTimes(0.2, "lognormal", sigma=0.7, seed=5)
    gossip = simulate(constant_gossip(topology, 16, 0.2, 0.001), times, 40)
    ddp = simulate(AllReduce(16, [(0.2, 1.0)], 0.001), times, 40)
    assert all(
        g <= d for gs, ds in zip(gossip.ends, ddp.ends, strict=True) for g, d in zip(gs, ds, strict=True)
    )
    # transient jitter costs DDP the expected maximum of 16 draws, gossip much less
    assert ddp.iteration_s(10) > 1.5 * gossip.iteration_s(10)


def test_a_persistent_straggler_sets_the_pace_of_a_connected_topology():
    times = ComputeTimes(0.1, "straggler", slow_rank=0, slow_factor=2.0)
    run = simulate(constant_gossip("ring", 8, 0.05, 0.0), times, 60)
    assert run.iteration_s(skip=30) == pytest.approx(0.2, rel=EXACT)  # every rank, not just rank 0


def test_barrier_starts_a_step_on_every_rank_together():
    times = ComputeTimes(0.1, "straggler", slow_factor=3.0)
    run = simulate(NoComm(2), times, 3, barrier_at=2)
    assert run.ends[1] == [pytest.approx(0.6), pytest.approx(0.2)]
    assert run.ends[2] == [pytest.approx(0.9), pytest.approx(0.7)]
    assert run.iteration_s(2) == pytest.approx(0.2)  # timed from the barrier (0.6), as the benchmark times


def test_ddp_scheme_sends_a_ring_allreduce_of_the_buckets():
    scheme = allreduce_scheme(4, Network(Link(8e6, 0.001)), [(1e6, 1.0)], wire_fraction=0.5)
    assert scheme.buckets == [(pytest.approx(2 * 3 / 4 * 0.5 + 6 * 0.001), 1.0)]


def test_simulate_rejects_bad_input():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        simulate(NoComm(2), ComputeTimes(0.1), 0)
    with pytest.raises(ValueError, match="skip must be in"):
        simulate(NoComm(2), ComputeTimes(0.1), 3).iteration_s(3)
    with pytest.raises(ValueError, match="local_world_size"):
        gossip_scheme(TopologyFactory.create("ring", 4, 2), 10, Network(Link(1e9)))


# -- command line ---------------------------------------------------------------------------------


def test_plan_prints_every_method_and_the_fastest(capsys):
    argv = ["--model-bytes", "500M", "--compute-ms", "100", "--bandwidth", "1gbit", "--latency", "1ms"]
    assert main([*argv, "--nodes", "8", "--topologies", "ring", "one-peer-exp"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:-1]}
    assert list(rows) == [
        "nocomm",
        "ddp",
        "ddp-bf16",
        "ring",
        "ring@bf16",
        "ring@int8",
        "one-peer-exp",
        "one-peer-exp@bf16",
        "one-peer-exp@int8",
    ]
    # DDP: 2 * 7/8 * 500 MB at 1 Gbit/s (7 s), in 21 buckets (1 MiB, then 25 MiB) of 14 latencies of
    # 1 ms each, the first starting once forward (33 ms) and that bucket's share of backward are done
    ddp = float(rows["ddp"][0]) / 1e3
    assert 7.0 + 21 * 0.014 + 0.033 < ddp < 7.0 + 21 * 0.014 + 0.034
    assert float(rows["ring"][0]) == pytest.approx(4000 + 2 + 0, abs=0.1)  # one model per step + 2 latencies
    assert rows["ring"][2] == "500.00" and rows["ddp"][2] == "875.00"
    assert out.splitlines()[-1].startswith("fastest: ring@int8")


@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("500M", "bytes", 5e8),
        ("4GB", "bytes", 4e9),
        ("25gbit", "bandwidth", 25e9),
        ("10us", "latency", 1e-5),
        ("50ms", "latency", 0.05),
        ("1e9", "bandwidth", 1e9),
    ],
)
def test_quantities(text, kind, value):
    assert parse_quantity(text, kind) == pytest.approx(value)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bandwidth", "fast"], "'fast' is not a bandwidth"),
        (["--latency", "5 parsecs"], "is not a latency"),
        (["--nodes", "0"], "need --nodes >= 1"),
        (["--message-bytes", "lots"], "'lots' is not a bytes"),
        (["--topologies", "torus"], "Unknown topology 'torus'"),
    ],
)
def test_plan_errors_exit_2_with_a_message(argv, message, capsys):
    base = {"--model-bytes": "1M", "--compute-ms": "10", "--bandwidth": "1gbit", "--nodes": "4"}
    base.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    with pytest.raises(SystemExit) as info:
        main([item for pair in base.items() for item in pair])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_bytes_subcommand_keeps_the_byte_report(capsys):
    assert main(["bytes", "ring", "-n", "8", "-c", "bf16"]) == 0
    assert "with bf16 compression: 2.0000 (uncompressed 4.0000; x0.500)" in capsys.readouterr().out


def test_bytes_subcommand_counts_sparse_payloads(capsys):
    # ring of 8: one pair per step, one payload each. top-k 1% int2, per chunk of 256: a 2-byte scale,
    # 3 one-byte positions and 3 2-bit values, (2 + 3 + 0.75) / 256 = 0.0225 bytes per element
    # (the payload's padding to 4 bytes is negligible at 2^20 elements); random-k sends no positions.
    assert main(["bytes", "ring", "-n", "8", "-c", "topk:0.01:int2", "randk:1%:int2"]) == 0
    out = capsys.readouterr().out
    assert "with topk:0.01:int2 compression: 0.0225 (" in out
    assert "with randk:0.01:int2 compression: 0.0107 (" in out


def test_plan_simulates_the_named_formats(capsys):
    argv = ["--model-bytes", "40M", "--compute-ms", "100", "--bandwidth", "100mbit", "--nodes", "4"]
    assert main([*argv, "--topologies", "ring", "--compression", "int8", "topk:0.01:int2"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:-1]}
    assert list(rows)[3:] == ["ring", "ring@int8", "ring@topk:0.01:int2"]
    # 10^7 elements: 39063 chunks of 2 + 3 + 0.75 bytes, 224612 bytes a member sends per step
    assert rows["ring@topk:0.01:int2"][2] == "0.22"


def test_the_command_line_charges_every_message_its_bytes(capsys):
    # 1.2 MB over 0.5 Mbit/s: a sparse round of a pair every step, 2 messages of 900 bytes each
    argv = ["--model-bytes", "1.2M", "--compute-ms", "100", "--bandwidth", "0.5mbit", "--nodes", "8"]
    argv += ["--topologies", "one-peer-exp", "--compression", "topk:0.01:int2", "--jitter", "none"]
    steps = {}
    for extra in ([], ["--message-bytes", "900"]):
        assert main([*argv, *extra]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("one-peer-exp@"))
        steps[bool(extra)] = float(row.split()[1])
    assert "0 ms and 900 bytes per message" in out
    # 300k elements: 1172 chunks of 6 bytes, 7032 bytes a round, 112 ms at 0.5 Mbit/s: the link sets
    # the pace, so the step grows by the 1800 bytes' 28.8 ms (to the printed 0.1 ms)
    assert steps[False] > 100.0
    assert steps[True] - steps[False] == pytest.approx(8 * 1800 / 0.5e6 * 1e3, abs=0.2)


@pytest.mark.parametrize(
    "argv", [["bytes", "ring", "-n", "8", "-c", "topk:2:int2"], ["bytes", "ring", "-n", "8", "-c", "int3"]]
)
def test_bad_formats_exit_2_naming_them(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and repr(argv[-1]) in capsys.readouterr().err


# -- blocking rounds (sync_every=1, sync_delay=0) ---------------------------------------------------


def blocking_gossip(topology_name: str, n: int, exchange_s: float, overhead_s: float) -> Gossip:
    topology = TopologyFactory.create(topology_name, n)
    rounds = lambda step: [Transfer.fixed(exchange_s)] * len(topology.phase(step))  # noqa: E731
    return Gossip(n, topology.phase, rounds, overhead_s, blocking=True)


@pytest.mark.parametrize(("compute", "exchange"), [(0.2, 0.15), (0.2, 0.3)])
def test_blocking_rounds_add_the_exchange_to_every_step(compute, exchange):
    run = simulate(blocking_gossip("ring", 8, exchange, 0.01), ComputeTimes(compute), 20)
    # nothing hides the exchange: compute + overhead + exchange, whichever is longer
    assert run.iteration_s(skip=1) == pytest.approx(compute + 0.01 + exchange, rel=EXACT)
    assert run.ends[0] == [pytest.approx(compute + 0.01)] * 8


def test_blocking_rounds_wait_for_the_groups_slowest_member_every_step():
    times = ComputeTimes(0.1, "lognormal", sigma=0.5, seed=3)
    n, steps = 8, 30
    blocking = simulate(blocking_gossip("ring", n, 0.05, 0.0), times, steps)
    overlapped = simulate(constant_gossip("ring", n, 0.05, 0.0), times, steps)
    assert blocking.iteration_s(5) > overlapped.iteration_s(5) + 0.05  # the exchange, and jitter on top
    # one-peer-exp pairs: a rank's next step starts when its pair's round arrives, so each pair
    # steps together; the slower member of the pair sets both ends
    draws = [times.draws(r, steps) for r in range(n)]
    run = simulate(blocking_gossip("one-peer-exp", n, 0.05, 0.0), times, 2)
    topology = TopologyFactory.create("one-peer-exp", n)
    for group in topology.phase(0):
        a, b = group.ranks
        start = max(draws[a][0], draws[b][0]) + 0.05
        assert run.ends[1][a] == pytest.approx(start + draws[a][1], rel=EXACT)


def test_blocking_barrier_starts_a_step_on_every_rank_together():
    times = ComputeTimes(0.1, "straggler", slow_rank=0, slow_factor=2.0)
    run = simulate(blocking_gossip("ring", 4, 0.05, 0.0), times, 4, barrier_at=2)
    # steps 0 and 1 end when the slow rank's neighbours have its round: 0.2 + 0.05 + 0.2; the
    # barrier before step 2 opens when the last round of step 1 has arrived everywhere
    assert run.barriers[2] == pytest.approx(0.2 + 0.05 + 0.2 + 0.05, rel=EXACT)
    assert run.ends[2] == [pytest.approx(run.barriers[2] + c, rel=EXACT) for c in (0.2, 0.1, 0.1, 0.1)]


def test_predict_names_blocking_variants():
    from decent_optim_wrapper.plan import predict

    found = {
        p.method: p.step_s
        for p in predict(4e6, ComputeTimes(0.1), Network(Link(4e7)), 4, ["ring"], (), blocking=True)
    }
    assert set(found) == {"nocomm", "ddp", "ddp-bf16", "ring", "ring~h1d0"}
    # a 4 MB model at 40 MB/s: a ring round of ~0.1 s hides behind 0.1 s of compute, or adds to it
    assert found["ring~h1d0"] > found["ring"] + 0.05


# -- low-communication rounds (sync_every=H, sync_delay=D) and a round's processor time ------------


def local_gossip(n: int, exchange_s: float, every: int, delay: int, **costs: float) -> Gossip:
    topology = TopologyFactory.create("ring", n)
    rounds = lambda k: [Transfer.fixed(exchange_s)] * len(topology.phase(k))  # noqa: E731
    return Gossip(n, topology.phase, rounds, 0.01, sync_every=every, sync_delay=delay, **costs)


@pytest.mark.parametrize("every", [1, 4, 8])
def test_a_round_that_arrives_within_its_delay_costs_only_its_processor_time(every):
    # compute 0.2 s, a round of 0.15 s folded one step later: hidden; each round's own 3 + 5 ms
    # land once per sync_every steps
    scheme = local_gossip(8, 0.15, every, 1, encode_s=0.003, fold_s=0.005)
    run = simulate(scheme, ComputeTimes(0.2), 9 * every)  # 8 whole periods timed
    expected = 0.2 + 0.01 + (0.003 + 0.005) / every
    assert run.iteration_s(skip=every) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(("every", "delay"), [(8, 1), (8, 4), (8, 8), (4, 2)])
def test_a_slow_round_waits_only_for_what_its_delay_does_not_cover(every, delay):
    # a round of 0.5 s against compute 0.1 s: the fold step waits 0.5 - delay * 0.11 if positive
    compute, overhead, exchange = 0.1, 0.01, 0.5
    run = simulate(local_gossip(4, exchange, every, delay), ComputeTimes(compute), 12 * every)
    wait = max(0.0, exchange - delay * (compute + overhead) + overhead)
    # the steady state: each period of H steps is H steps of compute and overhead plus the wait
    assert run.iteration_s(skip=4 * every) == pytest.approx(compute + overhead + wait / every, rel=1e-9)


def test_blocking_low_communication_adds_each_round_to_its_period():
    run = simulate(local_gossip(4, 0.5, 8, 0, fold_s=0.002), ComputeTimes(0.1), 80)
    assert run.iteration_s(skip=16) == pytest.approx(0.1 + 0.01 + (0.5 + 0.002) / 8, rel=1e-9)


def test_per_step_gossip_is_low_communication_with_sync_every_1():
    times = ComputeTimes(0.1, "lognormal", sigma=0.5, seed=2)
    per_step = simulate(constant_gossip("ring", 8, 0.12, 0.01), times, 30)
    general = simulate(local_gossip(8, 0.12, 1, 1), times, 30)
    assert per_step.ends == general.ends


def test_low_communication_options_are_checked():
    topology = TopologyFactory.create("ring", 4)
    rounds = lambda k: [Transfer.fixed(0.1)] * 2  # noqa: E731
    with pytest.raises(ValueError, match="sync_delay=9"):
        Gossip(4, topology.phase, rounds, sync_every=8, sync_delay=9)
    with pytest.raises(ValueError, match="encode_s and fold_s"):
        Gossip(4, topology.phase, rounds, encode_s=-1.0)
    with pytest.raises(ValueError, match="stage_out_s and stage_in_s"):
        Gossip(4, topology.phase, rounds, stage_in_s=-1.0)


def test_predict_names_low_communication_variants_and_charges_round_costs():
    from decent_optim_wrapper.plan import predict
    from decent_optim_wrapper.plan.round_cost import RoundCost

    asked: list[tuple[str | None, int]] = []

    def costs(compression: GossipCompression | None, group_size: int) -> RoundCost:
        asked.append((None if compression is None else compression.name, group_size))
        return RoundCost(0.0, 0.0) if compression is None else RoundCost(0.016, 0.008)

    found = {
        p.method: p
        for p in predict(
            4e6,
            ComputeTimes(0.1),
            Network(Link(4e8)),
            4,
            ["ring"],
            ("topk:0.01:int2",),
            local_steps=[(8, 1)],
            round_costs=costs,
        )
    }
    assert {"ring~h8d1", "ring~h8d1@topk:0.01:int2"} <= set(found)
    assert set(asked) == {(None, 2), ("topk:0.01:int2", 2)}  # the ring gossips in pairs
    # a 4 MB model at 50 MB/s: a round hides behind a step; the sparse one costs 24 ms per 8 steps
    assert found["ring~h8d1"].step_s == pytest.approx(0.1, rel=1e-9)
    assert found["ring~h8d1@topk:0.01:int2"].step_s == pytest.approx(0.1 + 0.024 / 8, rel=1e-9)
    assert found["ring~h8d1"].sent_bytes == pytest.approx(found["ring"].sent_bytes / 8)


def test_round_cost_is_measured_for_every_format_and_rejects_bad_input():
    from decent_optim_wrapper.plan.round_cost import measure_round_cost

    for compression in (None, GossipCompression("int8"), GossipCompression("int4", density=0.03)):
        cost = measure_round_cost(10_000, 3, compression, repeats=2)
        assert cost.encode_s > 0 and cost.fold_s > 0
    with pytest.raises(ValueError, match="group_size >= 2"):
        measure_round_cost(10, 1)


def test_plan_simulates_low_communication_and_measures_rounds(capsys):
    argv = ["--model-bytes", "40M", "--compute-ms", "100", "--bandwidth", "100mbit", "--nodes", "4"]
    extra = ["--topologies", "ring", "--compression", "int8", "--sync-every", "8", "--measure-rounds"]
    assert main([*argv, *extra]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:-1]}
    assert {"ring~h8d1", "ring~h8d1@int8"} <= set(rows)
    # 40 MB at 12.5 MB/s: 3.2 s per per-step round; a round every 8 steps still waits, but 8x less often
    assert float(rows["ring~h8d1"][0]) < float(rows["ring"][0]) / 4
    with pytest.raises(SystemExit):
        main([*argv, "--sync-every", "4", "--sync-delay", "5"])
    assert "--sync-delay 5" in capsys.readouterr().err


# -- host staging of a GPU model's rounds ---------------------------------------------------------
def test_host_staging_delays_the_round_by_the_copy_out_and_the_fold_by_the_copy_back():
    # Zero jitter, an exchange slower than compute: a step takes the exchange, plus the copy out
    # (before the round can start) and the copy back (on the compute stream, before the mix).
    compute, exchange, out, back = 0.2, 0.3, 0.02, 0.03
    topology = TopologyFactory.create("ring", 8)
    staged = Gossip(
        8,
        topology.phase,
        lambda step: [Transfer.fixed(exchange)] * len(topology.phase(step)),
        0.01,
        stage_out_s=out,
        stage_in_s=back,
    )
    run = simulate(staged, ComputeTimes(compute), 30)
    assert run.iteration_s(skip=2) == pytest.approx(out + exchange + back + 0.01, rel=EXACT)
    # An exchange that hides behind the compute hides the copy out too; the copy back is always paid.
    fast = Gossip(
        8, topology.phase, lambda step: [Transfer.fixed(0.05)] * len(topology.phase(step)), 0.01,
        stage_out_s=out, stage_in_s=back,
    )  # fmt: skip
    assert simulate(fast, ComputeTimes(compute), 30).iteration_s(skip=2) == pytest.approx(
        compute + back + 0.01, rel=EXACT
    )


def test_host_copies_count_the_bytes_the_engine_stages():
    copy = HostCopy(25e9)
    pair, numel, fp32_sum = Group((0, 1)), 10**6, 4e6 / 25e9
    assert copy.staged_seconds(pair, numel, None) == (fp32_sum, fp32_sum)  # the sum buffer both ways
    assert copy.staged_seconds(pair, numel, None, torch.bfloat16) == (fp32_sum, fp32_sum)  # summed in fp32
    ring = TopologyFactory.create("ring", 4)
    group = max((g for phase in ring.schedule for g in phase), key=lambda g: g.size)
    plan = CompressionPlan(ring, GossipCompression("int8"))
    assert plan.compresses(group, torch.float32)
    payload = codec("int8").payload_bytes(numel, torch.float32)
    out, back = copy.staged_seconds(group, numel, plan)
    assert (out, back) == (payload / 25e9, group.size * payload / 25e9)  # its own out, every member's back
    scheme = gossip_scheme(ring, numel, Network(Link(1e9)), host_copy=copy)
    assert (scheme.stage_out_s, scheme.stage_in_s) == (fp32_sum, fp32_sum)
    with pytest.raises(ValueError, match="bytes_per_s > 0"):
        HostCopy(0)


def test_the_command_line_charges_host_copies_to_gossip_only(capsys):
    argv = ["--model-bytes", "4G", "--compute-ms", "1000", "--bandwidth", "100mbit", "--nodes", "4"]
    argv += ["--topologies", "ring", "--compression", "int8"]

    def ms_per_step(*extra: str) -> dict[str, float]:
        assert main([*argv, *extra]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        return {row[0]: float(row[1]) for row in rows if len(row) == 4 and row[0] != "method"}

    plain, staged = ms_per_step(), ms_per_step("--host-copy", "25G")
    for method in ("nocomm", "ddp", "ddp-bf16"):
        assert staged[method] == plain[method]
    # Uncompressed, each round copies 4 GB out and back at 25 GB/s: 160 ms each way, both on the path.
    assert staged["ring"] - plain["ring"] == pytest.approx(320, abs=0.2)
    assert staged["ring@int8"] > plain["ring@int8"]
