"""What a bucket's gossip keeps between launch and mix: its channel (buffers, references) and its round.

A :class:`Channel` is one bucket's gossip state, owned by :class:`~.gossip.Gossip` and read and
written by the round kind that runs each of its rounds (:mod:`~.plain`, :mod:`~.gathered`); a
:class:`Round` is what was launched and not mixed yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.fleet.comm import reduction_dtype
from decent_optim_wrapper.topo import Group

__all__ = ["Channel", "Round"]


@dataclass
class Round:
    """A bucket's round that has been launched (or restored) and not mixed yet."""

    step: int
    group: Group
    work: dist.Work | None  # None once waited for (or when restored from a checkpoint)
    codec: str | None = None  # a gathered round's codec; None: an all-reduce of the weighted values
    xor_slot: int | None = None  # a pair gathered by XOR: this slot holds peer ^ own until waited for
    reference_applied: bool = False  # its update of the group's reference is done (see settle_references)
    withheld: bool | None = False  # this rank's values were not finite and not sent (None: told by the flags)
    staged: bool = False  # its sums arrived in the host copy (a round restored from a state did not)
    tracks_reference: bool = True  # a compressed round (clipped gossip's uncompressed rounds have none)


@dataclass
class Channel:
    """One bucket's gossip: the tensor it averages and the buffers and references its rounds need."""

    tensor: torch.Tensor  # read at launch, written at mix
    index: int  # the bucket's number, not its position (with the round's step, it seeds random-k's draws)
    flag_slots: int = 0  # the largest group's size: one withheld-flag slot per member after the values
    buffer: torch.Tensor | None = (
        None  # staged values and flags, then the group sums (allocated at first use)
    )
    round: Round | None = None  # launched (or restored) and not mixed yet
    gathered: torch.Tensor | None = None  # gathered rounds: every member's payload, rank order
    decoded: torch.Tensor | None = None  # gathered rounds: decoding scratch
    # group ranks -> the reference every member of that group holds bit for bit
    references: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    # the point every rank held when the buckets were broadcast: the reference of a group that has not
    # met yet (dropped once all this rank's groups have references; None: such a group meets exactly)
    start: torch.Tensor | None = None
    launched: int | None = None  # the step of the latest round launched (recovery compares them)
    discarded: int | None = None  # the step of the latest round dropped unmixed

    def _storage(self) -> torch.Tensor:
        if self.buffer is None:
            numel = self.tensor.numel() + self.flag_slots
            self.buffer = torch.empty(
                numel, dtype=reduction_dtype(self.tensor.dtype), device=self.tensor.device
            )
        return self.buffer

    def sum_buffer(self) -> torch.Tensor:
        """The values part of the buffer: the staged values, then the group sum."""
        return self._storage()[: self.tensor.numel()].view(self.tensor.shape)

    def round_buffer(self, size: int) -> torch.Tensor:
        """What a plain round of ``size`` members all-reduces: the values, then one flag per member."""
        return self._storage()[: self.tensor.numel() + size]

    def flags(self, size: int) -> torch.Tensor:
        """The members' withheld flags of a plain round (in group order), after the values."""
        numel = self.tensor.numel()
        return self._storage()[numel : numel + size]

    def payloads(self, size: int) -> torch.Tensor:
        """The gathered payloads of a round of ``size`` members, one row per member in group order."""
        assert self.gathered is not None  # a pending gathered round has its payloads
        return self.gathered.view(size, -1)
