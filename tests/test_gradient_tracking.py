"""Multi-process: gradient tracking follows DSGT's recursion, tracks the mean gradient, resumes bitwise.

The rule (decent_optim_wrapper.engine.rules.tracking): per step, after mixing the round launched at the
previous step, ``y_i <- sum_j W_ij y_j + g_i - g_i_prev``, the inner optimizer steps with ``y_i``,
then parameters and trackers are launched to this step's group.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from helpers import bare_and_wrapped, batch, flat, gather, tiny_model, train_steps
from resume import Resumable, assert_resume_is_bitwise
from simulation import Simulation, sgd_replicas
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel


class _Tracking(Simulation):
    """DSGT with the dense mixing matrix: x and the trackers y mixed alike, y_i += g_i - g_i_prev, and
    the inner SGD steps with y_i in place of the gradient."""

    def __init__(self, topology: str, world_size: int) -> None:
        super().__init__(topology, *sgd_replicas(world_size, torch.float64))
        numel = self.vector(0).numel()
        self.trackers = [torch.zeros(numel, dtype=torch.float64) for _ in range(world_size)]
        self.previous = [torch.zeros(numel, dtype=torch.float64) for _ in range(world_size)]

    def mix(self, step: int) -> None:
        w, n = self.topo.mixing_matrix(step).double(), self.world_size
        for i in range(n):
            self.set_vector(i, sum(w[i, j] * self.sent_x[j] for j in range(n)))
        self.trackers = [sum(w[i, j] * self.sent_y[j] for j in range(n)) for i in range(n)]

    def local_step(self, grads: list[torch.Tensor]) -> None:
        for i, model in enumerate(self.models):
            self.trackers[i] = self.trackers[i] + grads[i] - self.previous[i]
            self.previous[i] = grads[i]
            offset = 0
            for p in model.parameters():
                p.grad.copy_(self.trackers[i][offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
        super().local_step(grads)

    def launch(self, step: int) -> None:
        self.sent_x = [self.vector(i) for i in range(self.world_size)]
        self.sent_y = [t.clone() for t in self.trackers]


def _tracked_training(topology: str, steps: int) -> torch.Tensor:
    model = tiny_model(dtype=torch.float64)
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), topology=topology, gradient_tracking=True
    )
    train_steps(model, opt, dist.get_rank(), range(steps))
    return flat(model)


@pytest.mark.parametrize(
    ("world_size", "topology"), [(2, "ring"), (4, "ring"), (4, "one-peer-exp"), (3, "complete")]
)
def test_tracking_equals_the_independent_simulation(pool, world_size, topology):
    got = pool(world_size).run(_tracked_training, topology, 8)
    expected = _Tracking(topology, world_size).run(8)
    # fp64; the simulation mixes with the dense matrix (other summation order, a few fp64 roundings)
    for rank in range(world_size):
        torch.testing.assert_close(got[rank], expected[rank], rtol=0, atol=1e-12)


def _tracker_mean(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    rank = dist.get_rank()
    model = tiny_model(dtype=torch.float64)
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1),
        topology="ring",
        bucket_cap_mb=0.0001,
        gradient_tracking=True,
    )
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        x, y = batch(rank, step, torch.float64)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        own_gradient = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        opt.step()  # the gradients are now the trackers
    trackers = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return gather(trackers), gather(own_gradient)


def test_the_trackers_average_is_the_average_gradient(pool):
    trackers, gradients = pool(4).run(_tracker_mean, 9)[0]
    # DSGT's invariant: mean_i y_i = mean_i g_i at every step (doubly stochastic W). fp64 with values
    # of order 1 accumulated over 9 steps: 1e-12 allows thousands of roundings.
    torch.testing.assert_close(trackers.mean(0), gradients.mean(0), rtol=0, atol=1e-12)
    assert (trackers - gradients).abs().max() > 1e-3  # yet each rank steps with more than its own


def test_world_size_one_with_tracking_is_the_bare_optimizer(pool):
    bare, wrapped = pool(1).run(bare_and_wrapped, gradient_tracking=True)[0]
    assert torch.equal(bare, wrapped)


def _average_and_revert(average: bool, wire: str | None) -> torch.Tensor:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        topology="ring",
        gradient_tracking=True,
        compression=wire,
    )
    train_steps(model, opt, rank, range(5))
    if average:
        opt.global_avg()
        averaged = gather(flat(model))
        assert all(torch.equal(averaged[0], a) for a in averaged)
        opt.revert_global_avg()
    train_steps(model, opt, rank, range(5, 10))
    return flat(model)


@pytest.mark.parametrize("wire", [None, "bf16"])
def test_global_avg_and_revert_leave_tracking_bit_for_bit(pool, wire):
    plain = pool(4).run(_average_and_revert, False, wire)
    reverted = pool(4).run(_average_and_revert, True, wire)
    for rank in range(4):
        assert torch.equal(plain[rank], reverted[rank]), f"rank {rank}"


@dataclass(frozen=True)
class _TrackedRun(Resumable):
    front_end: str

    def build(self, seed: int):
        model = tiny_model(seed=seed)
        if self.front_end == "module":
            ddp = DecentralizedDataParallel(
                model,
                lambda named: torch.optim.AdamW([p for _, p in named], lr=0.01),
                topology="ring",
                bucket_size_in_mb=0.0001,
                gradient_tracking=True,
            )
            return ddp, None
        opt = DecentOptimWrapper(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            topology="ring",
            gradient_tracking=True,
        )
        return model, opt

    def train(self, run, steps: range) -> None:
        model, opt = run
        if opt is not None:
            train_steps(model, opt, dist.get_rank(), steps)
            return
        for step in steps:
            x, y = batch(dist.get_rank(), step)
            nn.functional.cross_entropy(model(x), y).backward()

    def state_dict(self, run) -> dict:
        model, opt = run
        if opt is None:
            return model.training_state_dict()
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    def load_state_dict(self, run, state: dict) -> None:
        model, opt = run
        if opt is None:
            model.load_training_state_dict(state)
        else:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])

    def result(self, run) -> torch.Tensor:
        return flat(run[0])


@pytest.mark.parametrize("front_end", ["optimizer", "module"])
def test_resume_with_tracking_is_bitwise(pool, resume_pool, tmp_path, front_end):
    assert_resume_is_bitwise(pool, resume_pool, 4, _TrackedRun(front_end), tmp_path, total=10, save_at=6)


def _bytes(tracking: bool) -> float:
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), gradient_tracking=tracking)
    return opt.engine.bytes_sent_per_step()


def test_tracking_doubles_the_bytes(pool):
    assert pool(4).run(_bytes, True)[0] == 2 * pool(4).run(_bytes, False)[0]


def _misuse(kind: str) -> str:
    model = tiny_model()
    try:
        if kind == "flag":
            DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), gradient_tracking="yes")
        elif kind == "disagree":
            DecentOptimWrapper(
                torch.optim.SGD(model.parameters(), lr=0.1), gradient_tracking=dist.get_rank() == 0
            )
        else:
            opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), gradient_tracking=True)
            before = flat(model)
            x, y = batch(dist.get_rank(), 0)

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss

            try:
                opt.step(closure)
            finally:
                assert torch.equal(flat(model), before)  # refused before anything changed
    except (TypeError, ValueError) as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("flag", "gradient_tracking must be True or False, got 'yes'"),
        ("disagree", "gradient_tracking differs between rank 0 and rank(s) [1]"),
        ("closure", "step(closure) with gradient_tracking=True"),
    ],
)
def test_tracking_misuse_is_a_clear_error(pool, kind, message):
    for got in pool(2).run(_misuse, kind):
        assert message in got


def _unused_parameter() -> tuple[torch.Tensor, bool]:
    # A head that no loss reaches: without tracking AdamW leaves it alone, and so it must with it.
    model = tiny_model()
    unused = nn.Linear(3, 3)
    before = unused.weight.detach().clone()
    params = [*model.parameters(), *unused.parameters()]
    opt = DecentOptimWrapper(torch.optim.AdamW(params, lr=0.01), topology="ring", gradient_tracking=True)
    train_steps(model, opt, dist.get_rank(), range(4))
    return unused.weight.detach() - before, unused.weight in opt.state


def test_a_parameter_without_gradients_is_not_stepped(pool):
    for change, has_state in pool(2).run(_unused_parameter):
        assert torch.equal(change, torch.zeros_like(change)) and not has_state


def _sparse() -> str:
    embedding = nn.Embedding(10, 4, sparse=True)
    opt = DecentOptimWrapper(torch.optim.SGD(embedding.parameters(), lr=0.1), gradient_tracking=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    before = embedding.weight.detach().clone()
    try:
        opt.step()
    except ValueError as err:
        assert torch.equal(embedding.weight.detach(), before)
        return str(err)
    return "no error"


def test_sparse_gradients_are_refused_by_name(pool):
    for message in pool(2).run(_sparse):
        assert "cannot track the sparse gradient of param_groups[0]['params'][0] (shape (10, 4))" in message
