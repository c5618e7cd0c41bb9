"""GPU fleets: the fleet features on CUDA models, the groups between nodes on gloo, rounds staged on the host.

Runnable on one GPU: several processes share it, each a node of its own (``init_elastic(..., shards=1)``
forms its NCCL group of one; NCCL refuses two ranks of one group on one device), and the engine's
groups between the nodes are gloo's, which gossip reaches through pinned host buffers
(:mod:`~decent_optim_wrapper.engine.exchange.staging`). The runs are the fleet tier's own
(``test_joining``, ``test_pacing_elastic``) with the model on the GPU, so they check what those check:
the joiner equal to its donor bit for bit (parameters, AdamW's moments, the scheduler), the world
back to its size, gossip alone contracting the replicas and keeping their sum, ``global_avg`` the
same bits on every rank. The CPU twin of the nodes of one process runs in the fleet tier
(``test_joining.test_nodes_of_one_process_survive_a_kill_and_take_it_back``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from workers import spawn

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _nesterov(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.5, nesterov=True)


#: What the fleet must survive on the GPU: AdamW on staged exact gossip, a sparse format (encoded on
#: the GPU, only its bytes staged), low-communication gossip with an outer optimizer.
CASES: dict[str, dict[str, Any]] = {
    "adamw": {},
    "sparse": {"compression": "topk:0.1:int4"},
    "low-communication": {"sync_every": 3, "outer_optimizer": _nesterov},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_nodes_survive_a_kill_and_the_restarted_worker_joins_bit_for_bit(case):
    from failures import run_elastic
    from test_joining import _by_rank, _check_transfers, _check_world, _train

    options = CASES[case]
    plan = {
        "front": "optimizer",
        "kill": (1, 6),
        "request_at": 6,
        "requesters": (),
        "node_backend": "nccl",
        "device": "cuda",
        "options": options,
    }
    outcome = run_elastic(_train, 3, (plan,), deadline_s=240, restart_killed=1, restart_after_noted=2)
    assert outcome.exitcodes[1] == -9
    results = _by_rank(outcome)
    assert len(results) == 3
    _check_world(results, 3, mixing_only="outer_optimizer" not in options, node_size=1)
    _check_transfers(results)


@pytest.mark.timeout(200)
def test_paced_rounds_on_gpu_nodes_take_in_a_joiner():
    from failures import run_elastic
    from test_pacing_elastic import _check_average, _grow

    outcome = run_elastic(_grow, 3, ("optimizer", "cuda"), deadline_s=180)
    assert not outcome.errors, outcome.errors
    results = sorted(outcome.results.values(), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for result in results:
        assert result["losses"][-1] < result["losses"][0], result["losses"]
        assert result["contracted"] < 0.1 * result["spread"]
    _check_average(results)


def _staged_step_worker(rank: int, directory: str) -> None:
    from helpers import batch, tiny_model

    from decent_optim_wrapper import DecentOptimWrapper

    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=2)
    try:
        for compression in (None, "topk:0.1:int4"):
            model = tiny_model().cuda()
            opt = DecentOptimWrapper(
                torch.optim.AdamW(model.parameters(), lr=0.01, fused=True),
                topology="ring",
                compression=compression,
            )
            assert opt.engine.host_staging, "CUDA buckets over gloo are staged by default"
            for step in range(6):
                x, y = batch(rank, step)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x.cuda()), y.cuda()).backward()
                # Any synchronizing call inside step() raises: the copies to and from the host are
                # queued on streams, the launch waits on another thread.
                torch.cuda.set_sync_debug_mode("error")
                try:
                    opt.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            opt.engine.wait_all()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def test_a_staged_step_makes_no_host_sync(tmp_path):
    spawn(_staged_step_worker, (str(tmp_path),), nprocs=2)


def _staged_against_cpu_worker(rank: int, directory: str) -> None:
    from helpers import set_distinct, tiny_model

    from decent_optim_wrapper import GossipEngine

    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=2)
    try:
        results = {}
        for device in ("cpu", "cuda"):
            model = tiny_model()
            set_distinct(model, rank, dyadic=True)  # every average of these is exact in fp32
            model = model.to(device)
            engine = GossipEngine(list(model.named_parameters()), topology="ring")
            assert engine.host_staging == (device == "cuda")
            history = []
            with torch.no_grad():
                for _ in range(6):
                    engine.step(lambda: None)
                    history.append(torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]))
            engine.wait_all()
            results[device] = torch.stack(history)
        torch.save(results, f"{directory}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_staged_rounds_on_the_gpu_equal_the_cpu_path_bit_for_bit(tmp_path):
    # Exact rounds on dyadic replicas: scaling, summing and mixing round nothing, wherever they run, so
    # the staged path (scaled on the GPU, summed by gloo on the host, mixed on the GPU) must give the
    # CPU path's bits at every step.
    spawn(_staged_against_cpu_worker, (str(tmp_path),), nprocs=2)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert torch.equal(results["cuda"], results["cpu"]), f"rank {rank}"
        assert not torch.equal(results["cpu"][0], results["cpu"][-1]), "the rounds must mix something"
