"""Shared fixtures: one pool of gloo workers for the whole session, re-formed per world size.

Also the test tiers: a test marked ``pure`` (no process group, no worker processes) runs in the fast
tier, ``pytest -m "not dist"``; every other test is marked ``dist`` here, so a test that is marked
neither lands in the slow tier rather than slowing the fast one down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from workers import WorkerPool

MAX_WORLD_SIZE = 4


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("pure") is None:
            item.add_marker(pytest.mark.dist)
            continue
        uses_pool = "pool" in getattr(item, "fixturenames", ())
        if uses_pool or item.get_closest_marker("dist") is not None:
            why = "uses the worker pool" if uses_pool else "is also marked dist"
            raise pytest.UsageError(f"{item.nodeid} is marked pure but {why}")


class World:
    """``pool(n).run(fn, ...)``: run ``fn`` on ``n`` ranks of the shared pool."""

    def __init__(self, owner: SharedPool, world_size: int) -> None:
        self._owner, self._world_size = owner, world_size

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        return self._owner.get().run(self._world_size, fn, *args, **kwargs)


class SharedPool:
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
