"""What both framework integrations share: the gossip config, the version check, global averaging.

A framework integration wraps each optimizer the framework builds in a
:class:`~decent_optim_wrapper.DecentOptimWrapper` with one :class:`~decent_optim_wrapper.GossipConfig`
(``framework_config``, ``wrap_optimizer``), evaluates and exports the
exact global average of the replicas and then restores each rank's own replica bit for bit
(:class:`Replicas`), and refuses a framework version it was not tested with (``require_version``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from decent_optim_wrapper.engine import GossipConfig, is_sharded
from decent_optim_wrapper.front_ends import DecentOptimWrapper

__all__ = [
    "Replicas",
    "ensure_process_group",
    "framework_config",
    "replicas_per_node",
    "require_version",
    "wrap_optimizer",
]


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


def framework_config(
    framework: str,
    config: GossipConfig | None,
    options: Mapping[str, Any],
    local_world_size: int | None = None,
) -> GossipConfig:
    """The config an integration wraps every optimizer with: ``config`` and the keywords ``options``
    (:meth:`~decent_optim_wrapper.GossipConfig.merge`), the processes per node the framework knows unless
    the user set them, and refused up front where the framework's loop cannot follow gossip.

    Refused: paced rounds, whose ranks take different numbers of steps per round while the framework
    counts the same steps on every rank (the last rounds would wait for steps never taken); and
    survival and joins, which need a launcher that restarts one process and keeps the others, where the
    frameworks' launchers stop the whole job when a process dies.
    """
    merged = GossipConfig.merge(config, options)
    if merged.rounds.pacing is not None:
        raise ValueError(
            f"{framework} counts the same steps on every rank, but pacing={merged.rounds.pacing!r} lets each "
            "rank take as many steps per round as its speed allows, so the last rounds would wait for steps "
            "a slower rank never takes. Pass pacing=None (sync_every=H keeps low-communication gossip), or "
            "train with DecentOptimWrapper in a loop that counts rounds (optimizer.round_count)."
        )
    if merged.elasticity.survives:
        raise ValueError(
            f'on_peer_failure="continue" keeps training when a process dies and admits restarted ones, but '
            f"{framework}'s launchers stop the whole job when a process dies. Pass "
            'on_peer_failure="raise" (the default) and resume from a checkpoint, or train with '
            "DecentOptimWrapper in a plain loop started by init_elastic and the node launcher "
            "(python -m decent_optim_wrapper.node_launcher; the failures page of the docs)."
        )
    if merged.placement.local_world_size is None and local_world_size is not None:
        merged = merged.with_options(local_world_size=local_world_size)
    return merged


def replicas_per_node(processes: int, shards: int) -> int:
    """The gossip world's processes per node (``local_world_size``) where each replica is sharded over
    ``shards`` consecutive ranks: one per replica held on the node, or 1 where a replica spans nodes."""
    return processes // shards if processes % shards == 0 else 1


def ensure_process_group(world_size: int, fix: str) -> None:
    """A one-process gloo group where the framework runs one process without one (the wrapper needs a
    group); ``RuntimeError`` naming ``fix`` if the framework counts several processes but none exists."""
    if dist.is_initialized():
        return
    if world_size != 1:
        raise RuntimeError(f"world_size is {world_size} but torch.distributed is not initialized; {fix}.")
    store = dist.HashStore()  # type: ignore[attr-defined]  # exported, not declared; one process
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def wrap_optimizer(
    optimizer: Optimizer, config: GossipConfig, wrapper: type[DecentOptimWrapper] = DecentOptimWrapper
) -> DecentOptimWrapper:
    """``optimizer`` wrapped in ``wrapper`` with ``config`` (a collective: all ranks call it, in order)."""
    return wrapper(optimizer, config=config)


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
        """``module.state_dict()`` of the global average (copied); the replica is left as it was.

        A sharded parameter (DTensor) is gathered whole (``full_tensor()``, a collective over its
        mesh, entry by entry in the same order on every rank), so the export loads in an unsharded
        model as any other state dict.
        """
        if not self.wrappers or self._averaged:
            return {
                key: (value.full_tensor() if is_sharded(value) else value.clone())
                if isinstance(value, torch.Tensor)
                else value
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
