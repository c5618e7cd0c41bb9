"""torchft's ``DiLoCo`` as the benchmarks' external peer: one replica group per emulated node, a
``Manager`` per segment, the lighthouse on rank 0. Step-0 sync is off: every replica builds the model
from one seed, and the sync would fetch it from a host name a network namespace cannot resolve.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from torch import nn

#: The lighthouse's port; then a store and a manager port per segment and rank.
TORCHFT_PORTS = int(os.environ.get("TORCHFT_PORT_BASE", "29700"))
_lighthouse: list[object] = []  # the lighthouse server of rank 0, kept for the process's life
_segments = [0]


class TorchftDiLoCo:
    """torchft's DiLoCo over ``model``, ``outer`` every ``every`` steps (``delay``, ``update_alpha``:
    ``fragment_sync_delay``, ``fragment_update_alpha``); ``NODE_ADDR``, ``MASTER_ADDR`` from the env."""

    def __init__(
        self, model: nn.Module, inner: torch.optim.Optimizer, outer: torch.optim.Optimizer, every: int,
        delay: int, rank: int, world_size: int, update_alpha: float = 0.0,
        timeout: timedelta = timedelta(seconds=120),
    ) -> None:  # fmt: skip
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        host, lighthouse = os.environ["NODE_ADDR"], os.environ["MASTER_ADDR"]
        if rank == 0 and not _lighthouse:
            from torchft._torchft import LighthouseServer

            _lighthouse.append(LighthouseServer(bind=f"[::]:{TORCHFT_PORTS}", min_replicas=world_size))
        segment = _segments[0]
        _segments[0] += 1
        port = TORCHFT_PORTS + 1 + 2 * (segment * world_size + rank)  # distinct on one host too
        self.store = TCPStore(host, port, 1, True)
        self.inner = inner
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world_size, replica_id=f"node{rank}",
            load_state_dict=lambda state: model.load_state_dict(state["model"]),
            state_dict=lambda: {"model": model.state_dict()},
            store_addr=host, store_port=port, rank=0, world_size=1, port=port + 1, hostname=host,
            lighthouse_addr=f"http://{lighthouse}:{TORCHFT_PORTS}", timeout=timeout,
            use_async_quorum=False, init_sync=False,
        )  # fmt: skip
        every_ = {"sync_every": every, "fragment_sync_delay": delay, "fragment_update_alpha": update_alpha}
        self.context = DiLoCo(self.manager, [model], inner, outer, **every_)
        self.context.__enter__()

    def close(self) -> None:
        self.context.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
