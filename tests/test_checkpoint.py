"""Multi-process: a run resumed from per-rank checkpoints in fresh processes continues bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from helpers import flat, tiny_model, train_steps
from resume import Resumable, assert_resume_is_bitwise

from decent_optim_wrapper import DecentOptimWrapper

TOTAL, SAVE_AT = 8, 5


def _build(optimizer_name: str, seed: int = 0):
    model = tiny_model(seed=seed)
    if optimizer_name == "adamw":
        inner = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    opt = DecentOptimWrapper(inner, topology="ring")
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, scheduler


@dataclass(frozen=True)
class _Run(Resumable):
    """Ring, SGD with Nesterov momentum or AdamW, StepLR; saved with gossip in flight."""

    optimizer_name: str

    def build(self, seed: int):
        return _build(self.optimizer_name, seed)

    def train(self, run, steps: range) -> None:
        model, opt, scheduler = run
        train_steps(model, opt, dist.get_rank(), steps, scheduler)

    def state_dict(self, run) -> dict:
        model, opt, scheduler = run
        state = {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": scheduler.state_dict(),
        }
        assert state["optimizer"]["decent"]["gossip"] is not None  # the save happens with gossip in flight
        return state

    def load_state_dict(self, run, state: dict) -> None:
        model, opt, scheduler = run
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    def result(self, run) -> torch.Tensor:
        return flat(run[0])


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_resume_in_fresh_processes_is_bitwise(pool, resume_pool, tmp_path, optimizer_name):
    # Save with gossip in flight, then resume in other processes from a different initialisation:
    # the result must match to the last bit.
    assert_resume_is_bitwise(pool, resume_pool, 4, _Run(optimizer_name), tmp_path, TOTAL, SAVE_AT)


def _mismatches() -> dict[str, str]:
    rank = dist.get_rank()
    model, opt, _ = _build("sgd")
    train_steps(model, opt, rank, range(2))
    good = opt.state_dict()
    before = flat(model)
    errors = {}

    def attempt(label, state, target=opt):
        try:
            target.load_state_dict(state)
        except ValueError as err:
            errors[label] = str(err)

    other_rank = {**good, "decent": {**good["decent"], "rank": (rank + 1) % dist.get_world_size()}}
    attempt("rank", other_rank)
    attempt("world_size", {**good, "decent": {**good["decent"], "world_size": 8}})
    attempt("plain", opt.optimizer.state_dict())
    attempt("missing", {**good, "decent": {k: v for k, v in good["decent"].items() if k != "params"}})
    complete_model = tiny_model()
    complete = DecentOptimWrapper(
        torch.optim.SGD(complete_model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
        topology="complete",
    )
    attempt("topology", good, complete)
    bigger = torch.nn.Linear(6, 9)
    other_layout = DecentOptimWrapper(torch.optim.SGD(bigger.parameters(), lr=0.05), topology="ring")
    attempt("layout", good, other_layout)
    errors["untouched"] = str(torch.equal(flat(model), before))
    return errors


def test_mismatched_checkpoints_are_clear_errors(pool):
    for errors in pool(2).run(_mismatches):
        assert "rank=" in errors["rank"] and "same rank" in errors["rank"]
        assert "world_size=8" in errors["world_size"]
        assert "no 'decent' entry" in errors["plain"]
        assert "lacks ['params']" in errors["missing"]
        assert "topology" in errors["topology"] and "'ring'" in errors["topology"]
        assert "layout" in errors["layout"]
        assert errors["untouched"] == "True"
