"""Host-staged gossip (``host_staging=True``) forced on CPU tensors: bitwise equal to the direct path.

Staging moves a round's payload into host buffers and launches its collective from a thread of its
own (the path GPU buckets take over gloo); on CPU tensors the collective then sums the same values in
the same order from other memory, so every replica, every global average and every checkpoint must
equal the direct path's bit for bit. The unit tests check the staging machinery alone, with fake
collectives: order, copies, errors and timeouts.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import batch, flat, train_steps
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel
from decent_optim_wrapper.engine.exchange.staging import HostStaging, HostStagingError, host_buffer
from decent_optim_wrapper.engine.options import resolve_host_staging


# -- the staging machinery alone (no process group) ------------------------------------------------
class _DoneWork:
    """A completed collective that records when it was waited for."""

    def __init__(self) -> None:
        self.waited = False

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waited = True
        return True


@pytest.mark.pure
def test_rounds_launch_in_order_from_host_copies_and_copy_back_when_waited():
    staging, launched = HostStaging(), []
    devices = [torch.full((4,), float(i)) for i in range(5)]
    hosts = [host_buffer(d) for d in devices]

    def launch(i: int):
        def run():
            assert torch.equal(hosts[i], devices[i]), "the launch must see the copy out"
            hosts[i].mul_(10)  # what the collective "received"
            launched.append(i)
            return _DoneWork()

        return run

    works = [
        staging.start([(hosts[i], devices[i])], launch(i), copy_back=(devices[i], hosts[i])) for i in range(5)
    ]
    for i, work in enumerate(works):
        assert work.wait(timedelta(seconds=10)) is True
        assert torch.equal(devices[i], torch.full((4,), 10.0 * i)), "copied back once waited for"
    assert launched == [0, 1, 2, 3, 4]
    works[0].wait()  # waiting again does not copy again
    assert torch.equal(devices[0], torch.zeros(4))
    staging.close()


@pytest.mark.pure
def test_a_launch_that_fails_raises_on_the_waiting_thread_and_later_rounds_still_launch():
    staging = HostStaging()
    source = torch.ones(3)
    host = host_buffer(source)

    def broken():
        raise RuntimeError("connection closed by peer")

    failed = staging.start([(host, source)], broken, copy_back=None)
    fine = staging.start([(host, source)], _DoneWork, copy_back=None)
    assert fine.wait(timedelta(seconds=10)) is True  # launched in order: the failed one came first
    assert failed.is_completed()  # completed with an error: a wait raises it
    with pytest.raises(HostStagingError, match="could not start: connection closed by peer"):
        failed.wait(timedelta(seconds=10))
    staging.close()


@pytest.mark.pure
def test_a_launch_held_back_times_out_instead_of_hanging_and_drain_waits_for_it():
    staging, release = HostStaging(), threading.Event()
    source = torch.ones(3)

    def held():
        release.wait(10)
        return _DoneWork()

    work = staging.start([(host_buffer(source), source)], held, copy_back=None)
    start = time.monotonic()
    assert work.wait(timedelta(seconds=0.2)) is False
    assert not work.is_completed()
    assert time.monotonic() - start < 5
    with pytest.raises(HostStagingError, match="not launched within"):
        staging.drain(timedelta(seconds=0.1))
    release.set()
    staging.drain(timedelta(seconds=10))
    assert work.is_completed() and work.wait() is True
    staging.close()


@pytest.mark.pure
def test_host_staging_resolves_from_the_devices_and_backend_and_refuses_nccl():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_host_staging(None, [cpu], "gloo") is False
    assert resolve_host_staging(None, [cpu, gpu], "gloo") is True
    assert resolve_host_staging(None, [gpu], "nccl") is False
    assert resolve_host_staging(True, [cpu], "gloo") is True
    assert resolve_host_staging(False, [gpu], "gloo") is False
    with pytest.raises(ValueError, match=r"host_staging=True .* use 'nccl'.*host_staging=None"):
        resolve_host_staging(True, [gpu], "nccl")
    with pytest.raises(TypeError, match=r"host_staging must be None .* got 'yes'"):
        resolve_host_staging("yes", [cpu], "gloo")


# -- staged against direct, on gloo ranks -----------------------------------------------------------
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 3))


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


#: Buckets of 120 fp32 elements: the model in several buckets, so rounds of several buckets interleave.
SPLIT_MB = 120 * 4 / 2**20


def _staged_or_direct(front_end: str, staged: bool, steps: int, **options: object) -> dict[str, torch.Tensor]:
    """Train, average globally, revert, checkpoint and train on; every figure the test compares."""
    rank, model = dist.get_rank(), _model()
    options = {"bucket_cap_mb" if front_end == "optimizer" else "bucket_size_in_mb": SPLIT_MB, **options}
    out: dict[str, torch.Tensor] = {}
    if front_end == "optimizer":
        opt = DecentOptimWrapper(_sgd(model.parameters()), host_staging=staged, **options)
        front, run = opt, lambda r: train_steps(model, opt, rank, r)
    else:
        front = DecentralizedDataParallel(
            model, lambda named: _sgd([p for _, p in named]), host_staging=staged, **options
        )

        def run(r: range) -> None:
            for step in r:
                x, y = batch(rank, step)
                nn.functional.cross_entropy(front(x), y).backward()

    assert front.engine.host_staging is staged
    run(range(steps))
    out["trained"] = flat(model)
    front.global_avg()
    out["averaged"] = flat(model)
    front.revert_global_avg()
    out["reverted"] = flat(model)
    state = front.state_dict()
    front.load_state_dict(state)  # a round in flight saved and restored as received-but-not-mixed
    run(range(steps, 2 * steps))
    front.engine.wait_all()
    out["resumed"] = flat(model)
    return out


CASES = {
    "ring": {"topology": "ring"},
    "complete": {"topology": "complete"},  # its group spans the world: staged gossip gets its own
    "int8": {"topology": "ring", "compression": "int8"},
    "sparse": {"topology": "ring", "compression": "topk:0.1:int8"},
    "tracking": {"topology": "ring", "gradient_tracking": True},
    "low-communication": {"topology": "ring", "sync_every": 4, "compression": "randk:0.1:int4"},
}


@pytest.mark.parametrize("front_end", ["optimizer", "module"])
@pytest.mark.parametrize("case", list(CASES))
def test_staged_gossip_equals_direct_gossip_bit_for_bit(pool, case, front_end):
    direct = pool(4).run(_staged_or_direct, front_end, False, 12, **CASES[case])
    staged = pool(4).run(_staged_or_direct, front_end, True, 12, **CASES[case])
    for rank in range(4):
        for what in direct[rank]:
            assert torch.equal(staged[rank][what], direct[rank][what]), f"rank {rank}: {what}"
    assert not torch.equal(direct[0]["trained"], direct[1]["trained"]), "replicas must differ to test mixing"


def test_a_staged_pair_gathers_compressed_rounds_by_xor_bit_for_bit(pool):
    # Two ranks gather a compressed round with a bitwise-XOR all-reduce, seeded on the host copy.
    direct = pool(2).run(_staged_or_direct, "optimizer", False, 10, topology="ring", compression="int4")
    staged = pool(2).run(_staged_or_direct, "optimizer", True, 10, topology="ring", compression="int4")
    for rank in range(2):
        for what in direct[rank]:
            assert torch.equal(staged[rank][what], direct[rank][what]), f"rank {rank}: {what}"


@pytest.mark.pure
def test_a_copy_to_the_host_that_never_completes_fails_with_a_named_error():
    from decent_optim_wrapper.engine.exchange.staging import _wait_for_copy

    class NeverDone:
        def query(self) -> bool:
            return False

    start = time.monotonic()
    with pytest.raises(HostStagingError, match="did not complete within 0 s: the device is stuck"):
        _wait_for_copy(NeverDone(), None, 0.2)
    assert time.monotonic() - start < 5
