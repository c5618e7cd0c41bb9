"""What both framework integrations share: the gossip options, the version check, global averaging.

A framework integration wraps each optimizer the framework builds in a
:class:`~decent_optim_wrapper.DecentOptimWrapper` (``GossipOptions``), evaluates and exports the
exact global average of the replicas and then restores each rank's own replica bit for bit
(:class:`Replicas`), and refuses a framework version it was not tested with (``require_version``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch.optim import Optimizer

from decent_optim_wrapper.engine import DEFAULT_TIMEOUT, CompressionSpec, TopologySpec
from decent_optim_wrapper.wrapper import DecentOptimWrapper

__all__ = ["GossipOptions", "Replicas", "require_version"]


def require_version(package: str, version: str, minimum: tuple[int, int], below: tuple[int, int]) -> None:
    """Raise ``RuntimeError`` unless ``minimum <= version < below`` (major, minor), naming both."""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        found = (0, 0)
    if not minimum <= found < below:
        lo, hi = ".".join(map(str, minimum)), ".".join(map(str, below))
        raise RuntimeError(
            f"decent_optim_wrapper's {package} integration supports {package} >= {lo}, < {hi}; found "
            f"{package} {version}. Install a supported version: pip install '{package}>={lo},<{hi}'."
        )


@dataclass(frozen=True)
class GossipOptions:
    """The engine's options an integration passes on to every optimizer it wraps.

    Each is described once, on :class:`~decent_optim_wrapper.engine.GossipEngine`.
    """

    topology: TopologySpec = "ring"
    bucket_cap_mb: float = 25
    timeout: timedelta = DEFAULT_TIMEOUT
    compression: CompressionSpec = None
    gradient_tracking: bool = False
    second_moment: str = "average"
    local_world_size: int | None = field(default=None)

    def wrap(
        self, optimizer: Optimizer, wrapper: type[DecentOptimWrapper] = DecentOptimWrapper
    ) -> DecentOptimWrapper:
        """``optimizer`` wrapped in ``wrapper`` (a collective: all ranks call it, in the same order)."""
        return wrapper(
            optimizer,
            local_world_size=self.local_world_size,
            topology=self.topology,
            bucket_cap_mb=self.bucket_cap_mb,
            timeout=self.timeout,
            compression=self.compression,
            gradient_tracking=self.gradient_tracking,
            second_moment=self.second_moment,
        )


class Replicas:
    """The wrapped optimizers of a run, and whether the model currently holds the global average.

    :meth:`average` replaces every rank's replica (parameters and floating buffers of ``module``) by
    the exact average of all replicas, keeping a snapshot; :meth:`restore` puts the replica back bit
    for bit, with the gossip it had in flight; :meth:`settle` averages for good (end of training).
    Each is a collective over all ranks, except :meth:`restore`.
    """

    def __init__(self) -> None:
        self.wrappers: list[DecentOptimWrapper] = []
        self._averaged = False

    @property
    def training(self) -> bool:
        """Whether optimizers are wrapped (a fit is set up), so replicas may differ."""
        return bool(self.wrappers)

    @property
    def averaged(self) -> bool:
        """Whether the model holds the global average, to be restored by :meth:`restore`."""
        return self._averaged

    def average(self, module: torch.nn.Module) -> None:
        """Set every replica to the exact global average, restorably (no-op if already averaged)."""
        if self._averaged or not self.wrappers:
            return
        for i, wrapper in enumerate(self.wrappers):
            # buffers belong to no optimizer: the first wrapper averages and restores them
            wrapper.global_avg(may_revert=True, buffers=module if i == 0 else None)
        self._averaged = True

    def restore(self) -> None:
        """Restore each rank's own replica, bit for bit (local; no-op if not averaged)."""
        if not self._averaged:
            return
        for wrapper in self.wrappers:
            wrapper.revert_global_avg()
        self._averaged = False

    def settle(self, module: torch.nn.Module) -> None:
        """Set every replica to the global average for good (the model a user tests and deploys)."""
        self.restore()
        for i, wrapper in enumerate(self.wrappers):
            wrapper.global_avg(may_revert=False, buffers=module if i == 0 else None)

    def averaged_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` of the global average (copied); the replica is left as it was."""
        if not self.wrappers or self._averaged:
            return {
                key: value.clone() if isinstance(value, torch.Tensor) else value
                for key, value in module.state_dict().items()
            }
        self.average(module)
        try:
            return self.averaged_state_dict(module)
        finally:
            self.restore()

    def clear(self) -> None:
        self.restore()
        self.wrappers = []
