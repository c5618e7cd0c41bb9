"""Test tiers, and the pools of gloo workers shared by the whole session (tests/README.md).

Tiers: every test ends up with exactly one of the markers ``pure``, ``dist``, ``fleet``, ``examples``
and ``cuda`` (registered in pyproject.toml), so ``pytest -m <tier>`` runs one tier. The closest marker
counts: a module's ``pytestmark`` sets the tier of its tests, a test or a parameter may set its own.
A test marked none of them is ``dist``, so an unmarked test lands in the slow tier rather than
slowing the fast one down. ``cuda`` tests are skipped without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from workers import WorkerPool

MAX_WORLD_SIZE = 4
TIERS = ("pure", "dist", "fleet", "examples", "cuda")
POOL_FIXTURES = ("pool", "resume_pool")


def _tier(item: pytest.Item) -> str:
    """The tier marker closest to ``item`` (its parameters, then the function, class, module); else dist."""
    for node in reversed(item.listchain()):
        names = sorted({mark.name for mark in node.own_markers if mark.name in TIERS})
        if len(names) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {' and '.join(names)}: give it one tier")
        if names:
            return names[0]
    return "dist"


# tryfirst: before pytest's own `-m` deselection, which must see each test's final tier
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = [_tier(item) for item in items]
    for item, tier in zip(items, tiers, strict=True):
        pools = [name for name in POOL_FIXTURES if name in getattr(item, "fixturenames", ())]
        if tier == "pure" and pools:
            raise pytest.UsageError(f"{item.nodeid} is marked pure but uses the worker pool ({pools[0]})")
        skips = [m for m in item.iter_markers() if m.name in ("skip", "skipif")]
        says_gpu = [m for m in skips if any(w in str(m.kwargs.get("reason", "")) for w in ("GPU", "CUDA"))]
        if tier != "cuda" and says_gpu:
            raise pytest.UsageError(f"{item.nodeid} is skipped without a GPU but not marked cuda")
        if tier == "cuda" and not skips and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        # The tier moves from the module (or class) onto the test itself: `-m pure` then selects
        # exactly the tests whose tier is pure, not a module's CUDA parameter too.
        for node in item.listchain():
            node.own_markers[:] = [mark for mark in node.own_markers if mark.name not in TIERS]
    for item, tier in zip(items, tiers, strict=True):
        item.add_marker(tier)


class World:
    """``pool(n).run(fn, ...)``: run ``fn`` on ``n`` ranks of the shared pool."""

    def __init__(self, owner: SharedPool, world_size: int) -> None:
        self._owner, self._world_size = owner, world_size

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self._owner.get().run(self._world_size, fn, *args, **kwargs)


class SharedPool:
    """A ``WorkerPool`` spawned on first use, and again after a failure broke it."""

    def __init__(self) -> None:
        self._pool: WorkerPool | None = None

    def get(self) -> WorkerPool:
        if self._pool is None or self._pool.broken:
            if self._pool is not None:
                self._pool.close(kill=True)
            self._pool = WorkerPool(MAX_WORLD_SIZE)
        return self._pool

    def __call__(self, world_size: int) -> World:
        return World(self, world_size)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close(kill=self._pool.broken)


@pytest.fixture(scope="session")
def pool() -> Iterator[SharedPool]:
    """``pool(n).run(fn, *args)``: run ``fn`` on ``n`` gloo ranks (workers spawned once per session)."""
    shared = SharedPool()
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def resume_pool() -> Iterator[SharedPool]:
    """A second pool, used only to resume runs (tests/resume.py): processes that never ran the part
    of a run that saved the checkpoint they load, so state kept outside the checkpoint shows."""
    shared = SharedPool()
    yield shared
    shared.close()
