"""Independent simulations of decentralized update rules: every replica in one process.

``Simulation`` is the outer loop every rule shares; a rule is a subclass that writes its mixing and
its sending from the formula (the gossip rule here; compressed gossip in test_compression.py,
gradient tracking in test_gradient_tracking.py). Nothing here calls the library's engine: only the
topology's schedule (which groups meet at which step) comes from the library.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from helpers import batch, tiny_model
from torch import nn

from decent_optim_wrapper import TopologyFactory

Data = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def sgd_replicas(
    world_size: int, dtype: torch.dtype = torch.float32, lr: float = 0.1, momentum: float = 0.9
) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """``world_size`` identical tiny models, each with its own SGD."""
    models = [tiny_model(dtype=dtype) for _ in range(world_size)]
    return models, [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]


class Simulation:
    """Per step t and replica i: the gradient at the un-mixed x_i (``gradients``); the round launched
    at step t-1 mixed in (``mix``); the inner optimizer's step (``local_step``); round t launched
    (``launch``). Subclasses implement ``mix`` and ``launch``.
    """

    def __init__(
        self,
        topology: str,
        models: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        data: Data | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy,
    ) -> None:
        self.world_size = len(models)
        self.topo = TopologyFactory.create(topology, self.world_size)
        self.models, self.optimizers, self.loss_fn = models, optimizers, loss_fn
        self.data = data if data is not None else self._batch

    def _batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return batch(rank, step, next(self.models[0].parameters()).dtype)

    def vector(self, i: int) -> torch.Tensor:
        """Replica ``i``'s parameters as one flat tensor (a copy)."""
        return torch.cat([p.detach().reshape(-1) for p in self.models[i].parameters()])

    def set_vector(self, i: int, values: torch.Tensor) -> None:
        torch.nn.utils.vector_to_parameters(values, self.models[i].parameters())

    def gradients(self, step: int) -> list[torch.Tensor]:
        """Every replica's gradient of its batch of ``step``, left in ``.grad``; returned flat."""
        grads = []
        for rank, (model, opt) in enumerate(zip(self.models, self.optimizers, strict=True)):
            x, y = self.data(rank, step)
            opt.zero_grad()
            self.loss_fn(model(x), y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        return grads

    def mix(self, step: int) -> None:
        """Mix the round launched at ``step`` into the replicas."""
        raise NotImplementedError

    def local_step(self, grads: list[torch.Tensor]) -> None:
        for opt in self.optimizers:
            opt.step()

    def launch(self, step: int) -> None:
        """Record what each replica sends to its group of ``step``."""
        raise NotImplementedError

    def run(self, steps: int) -> list[torch.Tensor]:
        """Every replica's flat parameters after ``steps`` steps."""
        for step in range(steps):
            grads = self.gradients(step)
            with torch.no_grad():
                if step > 0:
                    self.mix(step - 1)
                self.local_step(grads)
                self.launch(step)
        return [self.vector(i) for i in range(self.world_size)]


class Gossip(Simulation):
    """decent-optim-wrapper 0.1.1's rule: replica i sends x_i / k to its group of k; the round sets
    x_i to the sum of what its group sent, added in the group's rank order."""

    def launch(self, step: int) -> None:
        self.sent = [self.vector(i) / self.topo.group(i, step).size for i in range(self.world_size)]

    def mix(self, step: int) -> None:
        for i in range(self.world_size):
            first, *others = self.topo.group(i, step).ranks
            total = self.sent[first].clone()
            for j in others:
                total += self.sent[j]
            self.set_vector(i, total)


class BlockingGossip(Gossip):
    """Per-step gossip that blocks (``sync_every=1, sync_delay=0``): round t is mixed in right after
    step t, so the next gradient is taken at the mixed point."""

    def run(self, steps: int) -> list[torch.Tensor]:
        for step in range(steps):
            grads = self.gradients(step)
            with torch.no_grad():
                self.local_step(grads)
                self.launch(step)
                self.mix(step)
        return [self.vector(i) for i in range(self.world_size)]


def reference_algorithm(world_size: int, topology: str, steps: int) -> list[torch.Tensor]:
    """Every replica after ``steps`` steps of SGD (lr 0.1, momentum 0.9) with the gossip rule."""
    return Gossip(topology, *sgd_replicas(world_size)).run(steps)
