"""A joiner gets in however often the members average and however uneven their speeds.

The scenario users met: members evaluate every few steps on the exact average (``global_avg``, then
``revert_global_avg``), one member much slower than the others. The fast members spend nearly all
their time inside ``global_avg`` waiting for the slow one, so an applicant is almost always announced
while a collective of the whole world runs, and deferred. Deferred again at every later evaluation,
such a joiner used to starve (dozens of re-formations, then its deadline). Now a deferral by a
collective is recorded in the decision and decided once: the applicants are admitted at the first
step boundary after the redone collective (``decent_optim_wrapper/engine/fleet/admission.py``, "Deferred
by a collective"). The bound checked here: each join costs the members at most two changes of
membership (a deferral and the admission), and every joiner gets in.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from failures import request_worker, run_elastic
from helpers import flat
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper, init_elastic

pytestmark = pytest.mark.fleet

TIMEOUT = timedelta(seconds=5)
MEMBERS = 3
SLOW = 2  # this member's steps take SLOW_STEP_S longer: 15x or more the others' on this model
SLOW_STEP_S = 0.3
EVAL_EVERY = 4  # global_avg, evaluate, revert_global_avg after every fourth step
JOIN_REQUESTS = {5: "first", 21: "second"}  # step after which member 0 starts a joiner
STEPS = 48


def _train(index: int, world_size: int, port: int, workdir: str) -> dict[str, Any]:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    joining = init_elastic(store, index, world_size, job="test", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    inner = torch.optim.AdamW(model.parameters(), lr=0.02)
    opt = DecentOptimWrapper(inner, topology="ring", timeout=TIMEOUT, on_peer_failure="continue")
    averages: list[torch.Tensor] = []
    reverted_exactly = True
    for t in range(opt.step_count, STEPS):
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1000 * index + t), dtype=torch.float64)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if index == SLOW and not joining:
            time.sleep(SLOW_STEP_S)
        if index == 0 and t in JOIN_REQUESTS and len(opt.peer_joins) == list(JOIN_REQUESTS).index(t):
            request_worker(workdir, JOIN_REQUESTS[t])
        if t % EVAL_EVERY == EVAL_EVERY - 1:
            before = flat(model)
            opt.global_avg()
            averages.append(flat(model))
            opt.revert_global_avg()
            reverted_exactly &= torch.equal(flat(model), before)
    return {
        "index": index,
        "joining": joining,
        "rank": opt.rank,
        "world_size": opt.world_size,
        "joins": opt.peer_joins,
        "failures": opt.peer_failures,
        "recoveries": len(opt.engine.survival.pauses),
        "last_average": averages[-1],
        "reverted_exactly": reverted_exactly,
        "admission_s": opt.engine.growth.join_seconds.get("admission"),
    }


@pytest.mark.timeout(240)
def test_joiners_get_in_within_two_changes_each_while_members_average_every_three_steps():
    outcome = run_elastic(_train, MEMBERS, deadline_s=200)
    assert not outcome.errors, outcome.errors
    results = sorted(outcome.results.values(), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(MEMBERS + len(JOIN_REQUESTS))), results
    members = [r for r in results if not r["joining"]]
    for member in members:
        assert member["failures"] == [], member["failures"]  # nobody was lost
        assert [j.world_size for j in member["joins"]] == [4, 5]
        # The bound: per join one deferral by a collective (at most) and the admission.
        assert member["recoveries"] <= 2 * len(JOIN_REQUESTS), member["recoveries"]
    for joiner in (r for r in results if r["joining"]):
        # From its application to its verdict, well inside its first deadline (2 * 5 s + 6 s): it
        # did not give up and apply again.
        assert joiner["admission_s"] < 16.0, joiner["admission_s"]
    for result in results:
        assert result["world_size"] == MEMBERS + len(JOIN_REQUESTS)
        assert result["reverted_exactly"]
        assert torch.equal(result["last_average"], results[0]["last_average"])  # one average, every rank
