"""The counters a logger reads (``metrics()``): known values, reset on read, local, on both front-ends.

The pure tests drive :class:`GossipMetrics` and :class:`WaitClock` with made-up totals and waits; the
dist tests train on 2 gloo ranks and compare each read with what the engine says of itself (bytes per
step, world size) and with a peer made slow on purpose (the wait it causes shows in ``gossip/wait_s``).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import batch, tiny_model, train_steps
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper
from decent_optim_wrapper.data_parallel import DecentralizedDataParallel
from decent_optim_wrapper.engine.counters import METRIC_NAMES, CounterTotals, GossipMetrics, WaitClock


def totals(**changes: Any) -> CounterTotals:
    base: dict[str, Any] = {
        "steps": 0,
        "rounds": 0,
        "wait_s": 0.0,
        "bytes_per_step": 100.0,
        "world_size": 4,
        "guard": {},
        "losses": 0,
        "joins": 0,
    }
    return CounterTotals(**{**base, **changes})


class Script:
    """Totals that the test sets before each read."""

    def __init__(self) -> None:
        self.now = totals()

    def __call__(self) -> CounterTotals:
        return self.now


@pytest.mark.pure
def test_a_read_is_the_change_since_the_previous_read_under_the_documented_names():
    script = Script()
    metrics = GossipMetrics(script)
    script.now = totals(
        steps=7,
        rounds=7,
        wait_s=0.25,
        guard={"healed": 2, "forged_verdict": 1, "forged_report": 2},
        losses=1,
        joins=2,
        world_size=3,
    )
    first = metrics.read()
    assert list(first) == list(METRIC_NAMES)
    assert first["gossip/steps"] == 7 and first["gossip/rounds"] == 7
    assert first["gossip/bytes_sent"] == 700.0 and first["gossip/bytes_per_step"] == 100.0
    assert first["gossip/wait_s"] == 0.25
    assert first["guard/healed"] == 2 and first["guard/withheld"] == 0 and first["guard/forged_entries"] == 3
    assert (first["fleet/world_size"], first["fleet/losses"], first["fleet/joins"]) == (3, 1, 2)
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in first.values())

    again = metrics.read()  # nothing happened since: every count is 0, the gauges stay
    assert {k: v for k, v in again.items() if v} == {"gossip/bytes_per_step": 100.0, "fleet/world_size": 3}

    script.now = totals(steps=10, rounds=8, wait_s=0.5, guard={"healed": 3}, losses=1, joins=2, world_size=3)
    third = metrics.read()
    assert (third["gossip/steps"], third["gossip/rounds"], third["gossip/bytes_sent"]) == (3, 1, 300.0)
    assert third["gossip/wait_s"] == pytest.approx(0.25) and third["guard/healed"] == 1


@pytest.mark.pure
def test_totals_that_go_back_read_as_zero_never_negative():
    script = Script()
    script.now = totals(steps=50, rounds=50, wait_s=2.0)
    metrics = GossipMetrics(script)  # construction is the first reference point
    script.now = totals(steps=10, rounds=10, wait_s=2.0)  # a checkpoint of step 10 was loaded
    read = metrics.read()
    assert read["gossip/steps"] == 0 and read["gossip/bytes_sent"] == 0.0 and read["gossip/rounds"] == 0
    script.now = totals(steps=12, rounds=12, wait_s=2.0)
    assert metrics.read()["gossip/steps"] == 2


@pytest.mark.pure
def test_the_wait_clock_adds_each_waits_time_raised_or_not():
    clock = WaitClock()

    def slow(works: Any, device: Any, timeout: Any, failure: Any) -> None:
        time.sleep(0.05)

    def failing(works: Any, device: Any, timeout: Any, failure: Any) -> None:
        time.sleep(0.05)
        raise failure(None)

    clock.timed(slow)([], torch.device("cpu"), None, RuntimeError)
    assert 0.05 <= clock.seconds < 1.0
    with pytest.raises(RuntimeError):
        clock.timed(failing)([], torch.device("cpu"), None, lambda cause: RuntimeError("lost"))
    assert 0.1 <= clock.seconds < 2.0


# -- on 2 gloo ranks ----------------------------------------------------------------------------------------
def _wrapper_reads(slow_rank: int | None) -> dict[str, Any]:
    rank = dist.get_rank()
    model = tiny_model()
    optimizer = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring")
    per_step = optimizer.engine.bytes_sent_per_step()
    at_start = optimizer.metrics()  # nothing yet
    train_steps(model, optimizer, rank, range(5))
    five = optimizer.metrics()
    if rank == 0:  # reads are local: rank 0 alone reading many times changes nothing for rank 1
        for _ in range(10):
            optimizer.metrics()
    nothing = optimizer.metrics()
    if rank == slow_rank:
        time.sleep(0.4)  # its peer's next step waits for this rank's round
    train_steps(model, optimizer, rank, range(5, 8))
    optimizer.engine.wait_all()  # the last step's round has arrived on both ranks
    three = optimizer.metrics()
    return {"per_step": per_step, "start": at_start, "five": five, "nothing": nothing, "three": three}


@pytest.mark.dist
def test_the_wrapper_reads_steps_rounds_bytes_and_world_size_and_resets(pool: Any) -> None:
    for rank, got in enumerate(pool(2).run(_wrapper_reads, None, timeout=120)):
        assert got["per_step"] > 0
        assert got["start"]["gossip/steps"] == 0 and got["start"]["gossip/bytes_sent"] == 0
        five, three = got["five"], got["three"]
        assert (five["gossip/steps"], five["gossip/rounds"]) == (5, 5), rank
        assert five["gossip/bytes_sent"] == 5 * got["per_step"]
        assert five["gossip/bytes_per_step"] == got["per_step"]
        assert five["fleet/world_size"] == 2 and five["fleet/losses"] == 0 and five["fleet/joins"] == 0
        assert five["gossip/wait_s"] >= 0.0
        assert got["nothing"]["gossip/steps"] == 0 and got["nothing"]["gossip/wait_s"] == 0.0
        assert (three["gossip/steps"], three["gossip/bytes_sent"]) == (3, 3 * got["per_step"])
        assert all(v == 0 for k, v in five.items() if k.startswith("guard/"))


@pytest.mark.dist
def test_seconds_waiting_for_a_slow_peer_show_in_wait_s(pool: Any) -> None:
    fast, slow = pool(2).run(_wrapper_reads, 1, timeout=120)
    assert fast["three"]["gossip/wait_s"] >= 0.3  # rank 0 stood still for rank 1's 0.4 s
    assert slow["three"]["gossip/wait_s"] < 0.3  # rank 1 found rank 0's rounds there already


def _module_reads() -> dict[str, Any]:
    rank = dist.get_rank()
    ddp = DecentralizedDataParallel(
        tiny_model(), lambda named: torch.optim.SGD([p for _, p in named], lr=0.1), topology="ring"
    )
    ddp.metrics()
    for step in range(6):
        x, y = batch(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
    read = ddp.metrics()
    return {
        "read": read,
        "steps": ddp.step_count,
        "rounds": ddp.round_count,
        "per_step": ddp.engine.bytes_sent_per_step(),
        "again": ddp.metrics(),
    }


@pytest.mark.dist
def test_the_module_front_end_reads_the_same_counters(pool: Any) -> None:
    for got in pool(2).run(_module_reads, timeout=120):
        read = got["read"]
        assert list(read) == list(METRIC_NAMES)
        assert read["gossip/steps"] == got["steps"] >= 5 and read["gossip/rounds"] == got["rounds"]
        assert read["gossip/bytes_sent"] == got["steps"] * got["per_step"] > 0
        assert read["fleet/world_size"] == 2
        assert got["again"]["gossip/steps"] == 0


def _low_communication_reads() -> dict[str, Any]:
    model = tiny_model()
    optimizer = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring", sync_every=3)
    train_steps(model, optimizer, dist.get_rank(), range(6))
    return optimizer.metrics()


@pytest.mark.dist
def test_low_communication_gossip_reads_one_round_per_sync_every_steps(pool: Any) -> None:
    for read in pool(2).run(_low_communication_reads, timeout=120):
        assert (read["gossip/steps"], read["gossip/rounds"]) == (6, 2)


@pytest.mark.pure
def test_the_metrics_page_lists_every_name_with_its_unit():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    listed = [row.split("`")[1] for row in rows if "/" in row.split("`")[1]]
    assert listed == list(METRIC_NAMES), "docs/metrics.md's table and METRIC_NAMES disagree"
