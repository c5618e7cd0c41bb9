"""The planner's recommendation (``decent_optim_wrapper.plan.recommend``): its rule, its bound, its
command line, and that what it prints is a setting the wrapper takes and trains with.

The rule is checked against what it says: candidates in the order of bytes per step (most first,
ties to the shorter period, then the shorter delay), the first whose simulated throughput reaches
the target chosen, every candidate before it below the target or ruled out by the link bound, and the
bound itself never ruling out a candidate the simulator would let through.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import flat, tiny_model, train_steps

from decent_optim_wrapper import DecentOptimWrapper, TopologyFactory
from decent_optim_wrapper.engine.wire.compression import parse_compression
from decent_optim_wrapper.plan import (
    ComputeTimes,
    Link,
    Network,
    NoComm,
    bytes_per_parameter,
    gossip_scheme,
    main,
    recommend,
    simulate,
)
from decent_optim_wrapper.plan.recommend import FORMATS, PERIODS, Candidate, candidates

SLOW = dict(model_bytes=4e9, compute=ComputeTimes(1.0, "none"), network=Network(Link(100e6)), nodes=16)


def _throughput(candidate: Candidate, model_bytes: float, compute: ComputeTimes, network: Network, nodes):
    topology = TopologyFactory.create(candidate.topology, nodes, 1)
    compression = None if candidate.compression is None else parse_compression(candidate.compression)
    scheme = gossip_scheme(
        topology,
        int(model_bytes // 4),
        network,
        compression,
        sync_every=candidate.sync_every,
        sync_delay=candidate.sync_delay,
    )
    nocomm = simulate(NoComm(nodes), compute, 40).iteration_s(10)
    return nocomm / simulate(scheme, compute, max(40, 10 + 8 * candidate.sync_every)).iteration_s(10)


@pytest.mark.pure
def test_candidates_are_ordered_by_bytes_per_step_then_period_then_delay():
    found = candidates("ring", 4e9, 16)
    assert len(found) == len(FORMATS) * (2 * len(PERIODS) - 1)
    keys = [(-c.sent_bytes, c.sync_every, c.sync_delay) for c in found]
    assert keys == sorted(keys)
    ring = TopologyFactory.create("ring", 16, 1)
    numel = 10**9
    by_method = {c.method: c for c in found}
    assert by_method["ring"].sent_bytes == bytes_per_parameter(ring) * numel
    int8 = bytes_per_parameter(ring, parse_compression("int8")) * numel
    assert by_method["ring~h8d1@int8"].sent_bytes == int8 / 8
    # fp32 at H = 2 and bf16 per step send the same: the shorter period first
    assert [c.method for c in found[1:4]] == ["ring@bf16", "ring~h2d1", "ring~h2d2"]


@pytest.mark.pure
def test_options_are_the_wrappers_keywords_without_the_defaults():
    assert Candidate("ring", None, 1, 1, 0.0).options() == {"topology": "ring"}
    assert Candidate("ring", "int8", 8, 8, 0.0).options() == {
        "topology": "ring",
        "compression": "int8",
        "sync_every": 8,
    }
    assert Candidate("ring", "topk:0.01:int2", 8, 1, 0.0).options() == {
        "topology": "ring",
        "compression": "topk:0.01:int2",
        "sync_every": 8,
        "sync_delay": 1,
    }
    assert Candidate("ring", "int8", 8, 1, 0.0).method == "ring~h8d1@int8"


@pytest.mark.pure
def test_a_fast_network_gets_per_step_uncompressed_gossip():
    # 100 MB over 100 Gbit/s: 8 ms of a 100 ms step
    found = recommend(1e8, ComputeTimes(0.1, "none"), Network(Link(100e9)), 8)
    assert found.hides and found.chosen.method == "ring" and found.ruled_out == 0
    assert found.throughput == pytest.approx(1.0)
    assert found.chosen.options() == {"topology": "ring"}


@pytest.mark.pure
def test_the_slow_link_gets_the_first_candidate_that_hides_and_nothing_before_it_does():
    found = recommend(**SLOW)
    assert found.hides and found.throughput >= 0.9
    order = candidates("ring", 4e9, 16)
    position = order.index(found.chosen)
    simulated = {c: t for c, t in found.tried}
    for earlier in order[:position]:
        if earlier in simulated:
            assert simulated[earlier] < 0.9
        else:  # ruled out by the bound: the simulator agrees it cannot reach the target
            assert 8 * earlier.sent_bytes / 100e6 > 1.0 / 0.9
    assert found.ruled_out == position - (len(found.tried) - 1)
    # an independent simulation of the chosen setting gives the throughput reported
    assert _throughput(found.chosen, **SLOW) == pytest.approx(found.throughput, rel=1e-12)
    # DDP moves 2 (k - 1) / k of 4 GB each step over 100 Mbit/s: hundreds of steps' compute
    assert found.ddp_throughput < 0.01


@pytest.mark.pure
@pytest.mark.parametrize("method", ["ring@topk:0.01:int2", "ring~h64d64@int8", "ring~h32d32@int4"])
def test_the_link_bound_rules_out_only_what_the_simulator_also_rejects(method):
    candidate = next(c for c in candidates("ring", 4e9, 16) if c.method == method)
    assert 8 * candidate.sent_bytes / 100e6 > 1.0 / 0.9  # ruled out on the slow link
    assert _throughput(candidate, **SLOW) < 0.9


@pytest.mark.pure
def test_a_link_nothing_hides_on_says_so_and_gives_the_fastest():
    found = recommend(4e9, ComputeTimes(0.1, "none"), Network(Link(1e6)), 4, target=0.95)
    assert not found.hides and found.throughput < 0.95
    assert found.chosen.method == "ring~h64d64@topk:0.01:int2"  # the fewest bytes, overlapped whole
    assert found.ruled_out == len(candidates("ring", 4e9, 4))


@pytest.mark.pure
def test_restricting_the_formats():
    found = recommend(**SLOW, formats=[None, "int8"])
    assert found.chosen.compression in (None, "int8") and not found.hides
    with pytest.raises(ValueError, match=r"formats=\['int3'\] names none"):
        recommend(**SLOW, formats=["int3"])
    with pytest.raises(ValueError, match=r"target must be in \(0, 1\].*got 1.5"):
        recommend(**SLOW, target=1.5)


@pytest.mark.pure
def test_command_line(capsys):
    argv = ["recommend", "--model-bytes", "4G", "--compute-ms", "1000", "--bandwidth", "100mbit"]
    assert main([*argv, "--nodes", "16"]) == 0
    out = capsys.readouterr().out
    found = recommend(**SLOW)
    assert f"recommended: {found.chosen.method} (hides the exchange)" in out
    keywords = ", ".join(f"{k}={v!r}" for k, v in found.chosen.options().items())
    assert f"DecentOptimWrapper(optimizer, {keywords})" in out
    assert "outer optimizer" in out and f"{found.ruled_out} settings sending more ruled out" in out
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--nodes", "16", "--target", "0"])
    assert exit_info.value.code == 2
    assert "target must be in (0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--nodes", "0"])
    assert "--nodes >= 1" in capsys.readouterr().err


# -- runs on the pool --------------------------------------------------------------------------------
def _train_with(options: dict) -> torch.Tensor:
    model = tiny_model(dtype=torch.float32)
    optimizer = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), **options)
    train_steps(model, optimizer, dist.get_rank(), range(2 * options.get("sync_every", 1)))
    optimizer.engine.wait_all()
    return flat(model)


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_what_it_recommends_the_wrapper_takes_and_trains_with(pool):
    slow = recommend(**SLOW).chosen.options()
    fast = recommend(1e8, ComputeTimes(0.1, "none"), Network(Link(100e9)), 8).chosen.options()
    for options in (slow, fast):
        results = pool(4).run(_train_with, options)
        assert all(torch.isfinite(r).all() for r in results)
