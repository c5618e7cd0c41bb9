"""Small models and utilities that test functions run inside workers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
from torch import nn

from decent_optim_wrapper import TopologyFactory


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def batch(rank: int, step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch that differs per rank and step (so replicas drift apart)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 6, generator=g, dtype=dtype), torch.randint(0, 3, (5,), generator=g)


def train_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: range, scheduler=None
) -> None:
    loss_fn = nn.CrossEntropyLoss()
    for step in steps:
        x, y = batch(rank, step, next(model.parameters()).dtype)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def bare_and_wrapped(steps: int = 5, **wrapper_options: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The parameters after ``steps`` AdamW steps, bare and inside a DecentOptimWrapper(**options)."""
    from decent_optim_wrapper import DecentOptimWrapper

    results = []
    for wrap in (False, True):
        model = tiny_model()
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        opt = DecentOptimWrapper(inner, **wrapper_options) if wrap else inner  # type: ignore[arg-type]
        train_steps(model, opt, 0, range(steps))
        results.append(flat(model))
    return results[0], results[1]


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def set_distinct(model: nn.Module, rank: int, dyadic: bool = False) -> None:
    """Give this replica its own values, in place (so the bucket views stay intact)."""
    g = torch.Generator().manual_seed(7 + rank)
    with torch.no_grad():
        for p in model.parameters():
            values = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if dyadic:
                # integers that are multiples of 12: x/2, x/3, x/4 and their sums are exact in fp64
                values = (values * 1000).round() * 12
            p.copy_(values)


def gather(t: torch.Tensor) -> torch.Tensor:
    """All ranks' ``t`` stacked along dim 0."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.stack(out)


def load_script(path: Path) -> ModuleType:
    """The script at ``path`` (e.g. examples/quickstart.py) as a module, loaded once per process.

    It is registered in ``sys.modules`` (as ``script_<stem>``) before it runs: dataclasses look their
    module up there. Its ``if __name__ == "__main__"`` block does not run.
    """
    name = f"script_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def reference_algorithm(world_size: int, topology: str, steps: int) -> list[torch.Tensor]:
    """decent-optim-wrapper 0.1.1's algorithm, simulated for all replicas in one process.

    Per step t and replica i: (1) x_i <- sum of x_j / k over i's group of step t-1, as sent at step
    t-1; (2) the inner SGD step with the gradient computed before step() (at the un-mixed x_i);
    (3) send x_i / k to the group of step t.
    """
    topo = TopologyFactory.create(topology, world_size)
    models = [tiny_model() for _ in range(world_size)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    sent: list[list[torch.Tensor]] | None = None
    for step in range(steps):
        for rank, (model, opt) in enumerate(zip(models, optimizers, strict=True)):
            x, y = batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        with torch.no_grad():
            if sent is not None:
                for rank, model in enumerate(models):
                    group = topo.group(rank, step - 1)
                    for p, *received in zip(model.parameters(), *(sent[j] for j in group.ranks), strict=True):
                        total = received[0].clone()
                        for other in received[1:]:
                            total += other
                        p.copy_(total)
        for opt in optimizers:
            opt.step()
        with torch.no_grad():
            sent = [
                [p.detach() / topo.group(rank, step).size for p in model.parameters()]
                for rank, model in enumerate(models)
            ]
    return [flat(m) for m in models]
