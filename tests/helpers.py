"""Small models and utilities that test functions run inside workers."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")


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


def adamw(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01)


def five_steps(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> torch.Tensor:
    """The flat parameters after 5 steps of ``train_steps`` on rank 0's batches."""
    assert optimizer is not None, "the module front-end needs a run of its own (forward and backward)"
    train_steps(model, optimizer, 0, range(5))
    return flat(model)


def bare_and_wrapped(
    run: Callable[[nn.Module, torch.optim.Optimizer | None], T] = five_steps,
    make_optimizer: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer] = adamw,
    front_end: str = "optimizer",
    **options: Any,
) -> tuple[T, T]:
    """What ``run`` returns for the bare optimizer, and for the same training inside a front-end.

    Each run gets a fresh ``tiny_model()``. Bare: ``run(model, make_optimizer(params))``. Optimizer
    front-end: ``run(model, DecentOptimWrapper(make_optimizer(params), **options))``. Module front-end:
    ``run(DecentralizedDataParallel(model, optim_fn, **options), None)``, where ``optim_fn`` applies
    ``make_optimizer`` to each bucket's parameters; ``run`` then only does forward and backward.
    """
    from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel

    bare_model = tiny_model()
    bare = run(bare_model, make_optimizer(bare_model.parameters()))
    model = tiny_model()
    if front_end == "module":
        ddp = DecentralizedDataParallel(model, lambda named: make_optimizer([p for _, p in named]), **options)
        return bare, run(ddp, None)
    assert front_end == "optimizer", front_end
    return bare, run(model, DecentOptimWrapper(make_optimizer(model.parameters()), **options))


class EmulatedClock:
    """Seconds that pass only when the test says so: ``Pacing(clock=clock)`` reads it, and the test
    calls ``clock.advance(s)`` after each step, so that measured pacing plans from the step times the
    test emulates, exactly, whatever the machine's load (waits for peers take no emulated time)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def advance(self, seconds: float) -> None:
        self.seconds += seconds


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


def forget_start_point(front: Any) -> None:
    """Reload an optimizer front-end's own state without its gossip's common starting point, as from a
    checkpoint saved without one: each compressed group then first meets with an exact round."""
    state = front.state_dict()
    gossip = state["decent"]["gossip"]
    assert gossip is not None and "start" in gossip, "a fresh compressed run keeps the broadcast point"
    del gossip["start"]
    front.load_state_dict(state)


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


@contextlib.contextmanager
def launched_by_torchrun() -> Iterator[None]:
    """This pool rank looks to Lightning and Accelerate like a process torchrun started (env restored)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = {
        "TORCHELASTIC_RUN_ID": "pool",
        "RANK": str(rank),
        "GROUP_RANK": "0",
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",  # never used: the process group exists already
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


#: The repository's root: scripts run from here unless told otherwise.
ROOT = Path(__file__).resolve().parents[1]


def run_script(
    *argv: str, cwd: Path = ROOT, env: dict[str, str] | None = None, deadline_s: float = 150
) -> str:
    """Run ``python *argv`` as a user would and return what it printed (stdout and stderr).

    The script runs in a process group of its own: past ``deadline_s`` the whole group (the script and
    the workers it started) is killed and the test fails with the output so far; a non-zero exit fails
    it with the output.
    """
    import pytest

    with subprocess.Popen(
        [sys.executable, *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            output, _ = process.communicate(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            pytest.fail(f"{argv[0]} ran past {deadline_s} s; it printed:\n{output}")
    assert process.returncode == 0, f"{argv[0]} exited with {process.returncode}:\n{output}"
    return output


def run_ranks(
    script: Path, ranks: int, flags: list[str], out: Path, env: dict[str, str], deadline_s: float = 120
) -> list[Path]:
    """Run ``ranks`` copies of a benchmark worker ``script --rank r --out out/r.json *flags`` side by side.

    Every rank must exit 0 within ``deadline_s`` (each is killed after, so a hung rank cannot outlive
    the test); returns the JSON paths, in rank order.
    """
    paths = [out / f"{r}.json" for r in range(ranks)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "--rank", str(r), "--out", str(path), *flags],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r, path in enumerate(paths)
    ]
    try:
        outputs = [p.communicate(timeout=deadline_s)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0] * ranks, outputs
    return paths


def build_parts_on_rank_0(named_params, ranks: int, **options):
    """What the engine builds on rank 0 of ``ranks`` from ``options`` (the rest at their defaults), before
    any collective: :func:`~decent_optim_wrapper.engine.layout.build_parts` without a process group."""
    from decent_optim_wrapper import GossipConfig
    from decent_optim_wrapper.engine.fleet.world import GossipWorld
    from decent_optim_wrapper.engine.layout import build_parts

    subgroup = options.pop("subgroup", False)
    world = GossipWorld(tuple(range(ranks)), 0, 1, subgroup=subgroup)
    config = GossipConfig.from_options(**{"bucket_cap_mb": 1, **options})
    return build_parts(list(named_params), world, config, params_as_views=False)


# -- the framework integrations' tests -----------------------------------------------------------------
def _nesterov(anchors: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(anchors, lr=0.7, momentum=0.9, nesterov=True)


#: Options each framework's test runs inside the framework's own loop and replays in a plain loop:
#: low-communication gossip with an outer optimizer, compression, clipping.
FEATURES: dict[str, dict[str, Any]] = {
    "low-communication": {"sync_every": 2, "sync_delay": 1, "outer_optimizer": _nesterov},
    "compression": {"compression": "int8"},
    "clipped": {"clipped_gossip": True},
}
