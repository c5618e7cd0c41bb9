r"""Asynchronous gossip averaging of flat buckets along a topology's schedule, bucket by bucket.

Every bucket has at most one round in flight. For bucket ``b`` launched at step ``t``:

* :meth:`Gossip.launch` stages ``c * x_b`` into the bucket's communication buffer and starts a
  non-blocking all-reduce (sum) in the rank's group ``G_t``;
* :meth:`Gossip.wait` waits until the sum ``S = sum_{j in G_t} c * x_{j,b}`` has arrived;
* :meth:`Gossip.mix` applies ``x_b <- (w - c) * x_b + S``, i.e. ``x_{i,b} <- sum_j W_ij x_{j,b}``
  with the weights of the phase the round was launched in (``w`` self-weight, ``c`` peer weight;
  uniform groups give ``x_b <- S``).

A front-end launches a bucket as soon as its values are final and mixes it just before it next
changes the bucket, so the optimizer front-end runs whole rounds (all buckets) once per step, and a
module front-end can launch each bucket as its gradients become ready. Between launch and mix the
bucket may change (a local optimizer step does): the received sum is of the values at launch,
mixed into the values at mix, which is the overlap this library is for.

fp16 and bf16 buckets travel and accumulate in fp32 buffers (:func:`~.comm.reduction_dtype`), so a
group average of low-precision parameters is within one rounding of the exact average. A peer that
died or stopped responding makes :meth:`Gossip.wait` raise a :class:`~.errors.GossipError` naming
the step and the group instead of hanging (on CPU after ``timeout``; on CUDA through the process
group's timeout, see :func:`~.comm.wait_all`).

With a :class:`~.compression.CompressionPlan`, the groups it names gossip compressed instead: a
round gathers every member's small difference to the group's shared reference (see
:mod:`~decent_optim_wrapper.engine.compression` for the update and its guarantees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from decent_optim_wrapper.engine.buckets import misfit
from decent_optim_wrapper.engine.comm import ProcessGroups, reduction_dtype, wait_all
from decent_optim_wrapper.engine.compression import WIRE_FORMATS, CompressionPlan, codec
from decent_optim_wrapper.engine.errors import GossipError
from decent_optim_wrapper.topo import Group, Topology

__all__ = ["Gossip"]


@dataclass
class _Round:
    """A bucket's round that has been launched (or restored) and not mixed yet."""

    step: int
    group: Group
    work: dist.Work | None  # None once waited for (or when restored from a checkpoint)
    codec: str | None = None  # a gathered round's codec; None: an all-reduce of the weighted values
    xor_slot: int | None = None  # a pair gathered by XOR: this slot holds peer ^ own until waited for
    reference_applied: bool = False  # its update of the group's reference is done (see settle_references)


class Gossip:
    """Per-bucket gossip over ``tensors`` (flat buckets) for one rank of ``topology``.

    Memory: one communication buffer per bucket, allocated at the bucket's first launch that
    communicates; with compression also the gathered payloads and the references (see
    :mod:`~decent_optim_wrapper.engine.compression`).

    Args:
        tensors: the flat tensors to average; bucket ``b`` is read at ``launch(b)`` and written at
            ``mix(b)``.
        topology: the schedule; step ``t`` uses phase ``t % period``.
        rank: this process's rank.
        process_groups: the topology's process groups.
        timeout: longest CPU-side wait for a round before :class:`GossipError`; None waits for the
            process groups' own timeout.
        plan: which groups gossip compressed; None: none do.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        topology: Topology,
        rank: int,
        process_groups: ProcessGroups,
        timeout: timedelta | None = None,
        plan: CompressionPlan | None = None,
    ) -> None:
        self._tensors = list(tensors)
        self._topology = topology
        self._rank = rank
        self._process_groups = process_groups
        self._timeout = timeout
        self._buffers: list[torch.Tensor | None] = [None] * len(self._tensors)
        self._rounds: list[_Round | None] = [None] * len(self._tensors)
        self._plan = plan
        self._gathered: list[torch.Tensor | None] = [None] * len(self._tensors)  # compressed payloads
        self._decoded: list[torch.Tensor | None] = [None] * len(self._tensors)  # decoding buffers
        # group ranks -> per bucket, the reference every member of the group holds bit for bit
        self._references: dict[tuple[int, ...], list[torch.Tensor | None]] = {}

    @property
    def plan(self) -> CompressionPlan | None:
        return self._plan

    @property
    def num_buckets(self) -> int:
        return len(self._tensors)

    def add_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Gossip these tensors too, as new buckets at the end (nothing is in flight for them)."""
        self._tensors.extend(tensors)
        self._buffers.extend([None] * len(tensors))
        self._rounds.extend([None] * len(tensors))
        self._gathered.extend([None] * len(tensors))
        self._decoded.extend([None] * len(tensors))
        for references in self._references.values():
            references.extend([None] * len(tensors))

    def pending(self, bucket: int) -> int | None:
        """The step bucket ``bucket``'s unmixed round was launched at, or None."""
        round_ = self._rounds[bucket]
        return None if round_ is None else round_.step

    # -- one bucket ------------------------------------------------------------------------------
    def stage(self, bucket: int, step: int) -> Group:
        """Write what bucket ``bucket`` sends at ``step`` into its buffer (no communication).

        Returns the rank's group at ``step``; a group of one sends nothing and stages nothing.
        """
        return self._stage(bucket, step)[0]

    def _stage(self, bucket: int, step: int) -> tuple[Group, str | None]:
        """Stage bucket ``bucket`` for ``step``: its group, and the codec of a gathered round (or None)."""
        group = self._topology.group(self._rank, step)
        if group.size == 1:
            return group, None
        tensor = self._tensors[bucket]
        buffer = self._buffers[bucket]
        if buffer is None:
            buffer = self._buffers[bucket] = _new_buffer(tensor)
        if self._plan is not None and self._plan.compresses(group, tensor.dtype):
            return group, self._stage_gathered(bucket, group, buffer)
        # Division by k is correctly rounded (exact for k a power of two); x * fl(1/k) would round
        # twice. Low-precision tensors are widened into their fp32 buffer here.
        if group.self_weight is None:
            torch.div(tensor, group.size, out=buffer)
        else:
            torch.mul(tensor, group.peer_weight, out=buffer)
        return group, None

    def _stage_gathered(self, bucket: int, group: Group, scratch: torch.Tensor) -> str:
        """Encode this member's part of a compressed round into its slot of the gathered payload."""
        assert self._plan is not None
        tensor = self._tensors[bucket]
        reference = self._references.get(group.ranks, [None] * self.num_buckets)[bucket]
        # A group's first round (no reference yet) sends the values themselves, exactly.
        name = "exact" if reference is None else self._plan.codec.name
        coder = codec(name)
        size = coder.payload_bytes(tensor.numel(), tensor.dtype)
        gathered = self._gathered[bucket]
        if gathered is None or gathered.numel() != group.size * size:
            gathered = self._gathered[bucket] = torch.empty(
                group.size * size, dtype=torch.uint8, device=tensor.device
            )
        slot = group.ranks.index(self._rank)
        own = gathered[slot * size : (slot + 1) * size]
        if reference is None:
            coder.encode(tensor, own)
        else:
            torch.sub(tensor, reference, out=scratch)  # small: what changed since the group last met
            coder.encode(scratch, own)
        return name

    def launch(self, bucket: int, step: int) -> None:
        """Stage bucket ``bucket`` and start its all-reduce in the rank's group at ``step`` (non-blocking).

        A compressed round starts an all-gather of the members' payloads instead.
        """
        pending = self._rounds[bucket]
        if pending is not None:
            raise RuntimeError(
                f"bucket {bucket}: the gossip round launched at step {pending.step} has not been mixed yet; "
                "call mix() or discard() before launching it again."
            )
        group, name = self._stage(bucket, step)
        if group.size == 1:
            return  # nothing to exchange: W_ii = 1
        handle = self._process_groups[group.ranks]
        if name is not None:
            work, xor_slot = self._start_gather(bucket, group, handle)
            self._rounds[bucket] = _Round(step, group, work, name, xor_slot)
            return
        buffer = self._buffers[bucket]
        assert buffer is not None  # staged above
        work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=handle, async_op=True)
        self._rounds[bucket] = _Round(step, group, work)

    def _start_gather(
        self, bucket: int, group: Group, handle: dist.ProcessGroup
    ) -> tuple[dist.Work | None, int | None]:
        """Start gathering the members' staged payloads; returns the work and the XOR slot, if any."""
        gathered = self._gathered[bucket]
        assert gathered is not None  # staged
        slot, size = group.ranks.index(self._rank), gathered.numel() // group.size
        own = gathered[slot * size : (slot + 1) * size]
        if group.size == 2 and dist.get_backend(handle) == "gloo":
            # gloo sends an all-gather's two directions one after the other but pipelines an
            # all-reduce (3.2 MB at 200 Mbit/s: 197 ms vs 132 ms), so a pair gathers with a
            # bitwise-XOR all-reduce of the other slot, seeded with its own payload: it ends as
            # own ^ peer, and wait() XORs its own payload out again. Exact, same bytes.
            other = gathered[(1 - slot) * size : (2 - slot) * size]
            other.copy_(own)
            return dist.all_reduce(
                _as_words(other), op=dist.ReduceOp.BXOR, group=handle, async_op=True
            ), 1 - slot
        # In place: this member's input is its own slot of the output.
        return dist.all_gather_into_tensor(gathered, own, group=handle, async_op=True), None

    def wait(self, bucket: int) -> None:
        """Wait until bucket ``bucket``'s round has arrived; its buffer then holds the group sum."""
        round_ = self._rounds[bucket]
        if round_ is None or round_.work is None:
            return
        work, round_.work = round_.work, None
        try:
            wait_all([work], self._tensors[bucket].device, self._timeout, lambda c: self._failure(round_, c))
        except BaseException:
            self._rounds[bucket] = None  # never mix or save a round that did not arrive
            raise
        if round_.xor_slot is not None:
            gathered = self._gathered[bucket]
            assert gathered is not None
            size = gathered.numel() // 2
            own = gathered[(1 - round_.xor_slot) * size : (2 - round_.xor_slot) * size]
            peer = gathered[round_.xor_slot * size : (round_.xor_slot + 1) * size]
            peer.bitwise_xor_(own)  # (own ^ peer) ^ own = peer
            round_.xor_slot = None

    def mix(self, bucket: int, factor: float = 1.0) -> None:
        """Finish bucket ``bucket``'s round (if any) and mix it in: ``x_i <- sum_j W_ij x_j``.

        With ``factor`` ``a`` below 1, only part of the way: ``x_i <- (1 - a) x_i + a sum_j W_ij x_j``,
        i.e. the doubly stochastic ``(1 - a) I + a W``.
        """
        round_ = self._rounds[bucket]
        if round_ is None:
            return
        self.wait(bucket)
        self._rounds[bucket] = None
        if round_.codec is not None:
            self._mix_gathered(bucket, round_, factor)
            return
        group, tensor, buffer = round_.group, self._tensors[bucket], self._buffers[bucket]
        assert buffer is not None  # a pending round has a buffer
        own = group.own_weight - group.peer_weight
        if factor != 1.0:
            # (1 - a) x + a ((w - c) x + S) = (1 - a + a (w - c)) x + a S
            tensor.mul_(1.0 - factor + factor * (0.0 if group.self_weight is None else own))
            tensor.add_(buffer, alpha=factor)
        elif group.self_weight is None or own == 0.0:
            tensor.copy_(buffer)
        else:
            torch.add(buffer, tensor, alpha=own, out=tensor)

    def _mix_gathered(self, bucket: int, round_: _Round, factor: float) -> None:
        """``x_i <- x_i + a c (s - k q_i)`` and ``r <- r + s / k`` with ``s = sum_j q_j`` in rank order."""
        assert round_.codec is not None
        group, tensor = round_.group, self._tensors[bucket]
        total, scratch = self._gathered_sum(bucket, round_)
        slots = self._slots(bucket, round_)
        codec(round_.codec).decode_into(slots[group.ranks.index(self._rank)], scratch)
        # x <- x + a c (s - k q_i): one pass for s - k q_i, one for the update
        tensor.add_(
            torch.add(total, scratch, alpha=-group.size, out=scratch), alpha=factor * group.peer_weight
        )
        if not round_.reference_applied:
            self._update_reference(bucket, round_, total)

    def _slots(self, bucket: int, round_: _Round) -> torch.Tensor:
        gathered = self._gathered[bucket]
        assert gathered is not None  # a pending gathered round has its payloads
        return gathered.view(round_.group.size, -1)

    def _gathered_sum(self, bucket: int, round_: _Round) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = sum_j q_j`` in rank order (identical on every member), and a scratch buffer.

        Both live in buffers kept per bucket: fresh bucket-sized tensors every step would cost more
        (page faults) than the arithmetic.
        """
        assert round_.codec is not None
        coder, slots = codec(round_.codec), self._slots(bucket, round_)
        total = self._buffers[bucket]
        if total is None:  # a round restored from a checkpoint
            total = self._buffers[bucket] = _new_buffer(self._tensors[bucket])
        scratch = self._decoded[bucket]
        if scratch is None:
            scratch = self._decoded[bucket] = torch.empty_like(total)
        coder.decode_into(slots[0], total)
        for j in range(1, round_.group.size):
            coder.decode_into(slots[j], scratch)
            total.add_(scratch)
        return total, scratch

    def _update_reference(self, bucket: int, round_: _Round, total: torch.Tensor) -> None:
        """``r <- r + s / k`` (a first, exact round: ``r <- s / k``), the same on every member."""
        k = round_.group.size
        references = self._references.setdefault(round_.group.ranks, [None] * self.num_buckets)
        if round_.codec == "exact":
            references[bucket] = total.div(k)  # the members' average: the group's first reference
        else:
            reference = references[bucket]
            if reference is not None:  # dropped by a load without references: the next round is exact
                reference.add_(total.div_(k))
        round_.reference_applied = True

    def settle_references(self) -> None:
        """Apply every pending compressed round's reference update now, without mixing it.

        Global averaging calls this on every rank before it drops the rounds: a rank that later
        reverts (and mixes the restored rounds) and one that does not then hold the same references.
        """
        for bucket, round_ in enumerate(self._rounds):
            if round_ is None or round_.codec is None or round_.reference_applied:
                continue
            self.wait(bucket)
            if self._rounds[bucket] is round_:
                self._update_reference(bucket, round_, self._gathered_sum(bucket, round_)[0])

    def discard(self, bucket: int) -> None:
        """Finish and drop bucket ``bucket``'s round without mixing it (its values are stale)."""
        self.wait(bucket)
        self._rounds[bucket] = None

    # -- every bucket ------------------------------------------------------------------------------
    def wait_all(self) -> None:
        for bucket in range(self.num_buckets):
            self.wait(bucket)

    def discard_all(self) -> None:
        for bucket in range(self.num_buckets):
            self.discard(bucket)

    def _failure(self, round_: _Round, cause: BaseException | None) -> GossipError:
        limit = f"within {self._timeout}" if self._timeout is not None else "within the process group timeout"
        return GossipError(
            f"rank {self._rank}: the gossip round launched at step {round_.step} in group "
            f"{list(round_.group.ranks)} did not complete: a peer died or did not answer {limit}. Check "
            f"the other ranks' logs; restart from the last checkpoint. Cause: {cause}"
        )

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self, references: bool = True) -> dict[str, Any] | None:
        """The rounds still to be mixed (waiting for them first) and the references; None if neither.

        Format::

            {
                "step": t,  # the step every pending round was launched at (None if none is)
                "buffers": [tensor or None per bucket],  # all-reduced sums, not mixed yet
                "gathered": [uint8 tensor or None per bucket],  # compressed rounds' payloads
                "codecs": [str or None per bucket],  # their codecs
                "references": [{"ranks": [...], "tensors": [tensor or None per bucket]}, ...],
            }

        ``None`` marks a bucket with nothing pending. Every pending round must have been launched at
        the same step ``t`` (true between two steps of either front-end). With ``references=False``
        the references are left out (a global average's snapshot: they do not change until its
        revert).
        """
        steps = {r.step for r in self._rounds if r is not None}
        if len(steps) > 1:
            raise RuntimeError(
                f"buckets have gossip in flight from different steps {sorted(steps)}: save between two "
                "steps (after step() / after backward), not in the middle of one."
            )
        saved_references = self._references_state() if references else []
        if not steps and not saved_references:
            return None
        self.wait_all()
        buffers: list[torch.Tensor | None] = []
        gathered: list[torch.Tensor | None] = []
        codecs: list[str | None] = []
        for round_, buffer, payload in zip(self._rounds, self._buffers, self._gathered, strict=True):
            plain = round_ is not None and round_.codec is None
            buffers.append(buffer.clone() if plain and buffer is not None else None)
            compressed = round_ is not None and round_.codec is not None and payload is not None
            gathered.append(payload.clone() if compressed and payload is not None else None)
            codecs.append(None if round_ is None else round_.codec)
        while buffers and buffers[-1] is None:
            buffers.pop()  # the layout checkpoints of version 1 used: a prefix of the buckets
        state: dict[str, Any] = {"step": steps.pop() if steps else None, "buffers": buffers}
        if any(c is not None for c in codecs) or saved_references:
            state.update(gathered=gathered, codecs=codecs, references=saved_references)
        return state

    def _references_state(self) -> list[dict[str, Any]]:
        return [
            {"ranks": list(ranks), "tensors": [None if t is None else t.clone() for t in tensors]}
            for ranks, tensors in self._references.items()
            if any(t is not None for t in tensors)
        ]

    def check_state_dict(self, state: dict[str, Any] | None) -> None:
        """Raise ``ValueError`` if ``state`` (from :meth:`state_dict`) does not fit these buckets."""
        if state is None:
            return
        if not isinstance(state, dict) or "step" not in state or "buffers" not in state:
            raise ValueError(f"gossip state must be None or a dict with 'step' and 'buffers', got {state!r}.")
        buffers = state["buffers"]
        if len(buffers) > len(self._tensors):
            raise ValueError(
                f"gossip state has {len(buffers)} buffers but there are {len(self._tensors)} buckets; "
                "it comes from a different parameter layout."
            )
        for bucket, (saved, tensor) in enumerate(zip(buffers, self._tensors, strict=False)):
            if saved is None:
                continue
            dtype = reduction_dtype(tensor.dtype)
            got = misfit(saved, tensor.shape, dtype)
            if got is not None:
                raise ValueError(
                    f"gossip buffer {bucket} of {got} does not fit a bucket of shape {tuple(tensor.shape)} "
                    f"and dtype {dtype}; the checkpoint comes from a different parameter layout."
                )
        self._check_compressed_state(state)

    def _check_compressed_state(self, state: dict[str, Any]) -> None:
        gathered, codecs = state.get("gathered", []), state.get("codecs", [])
        if len(gathered) != len(codecs) or len(gathered) > len(self._tensors):
            raise ValueError(
                f"gossip state has {len(gathered)} gathered payloads and {len(codecs)} codecs for "
                f"{len(self._tensors)} buckets; the checkpoint is corrupt or from a different layout."
            )
        step = state["step"]
        for bucket, (payload, name) in enumerate(zip(gathered, codecs, strict=True)):
            if payload is None and name is None:
                continue
            if name not in ("exact", *WIRE_FORMATS) or payload is None or step is None:
                raise ValueError(
                    f"gossip state of bucket {bucket} has codec {name!r}, payload "
                    f"{'missing' if payload is None else 'present'} and step {step!r}: a pending compressed "
                    "round needs a known codec, its payload and the step it was launched at."
                )
            tensor = self._tensors[bucket]
            group = self._topology.group(self._rank, int(step))
            size = group.size * codec(name).payload_bytes(tensor.numel(), tensor.dtype)
            got = misfit(payload, torch.Size([size]), torch.uint8)
            if got is not None:
                raise ValueError(
                    f"compressed gossip payload {bucket} of {got} does not fit its round ({size} bytes of "
                    f"uint8); the checkpoint comes from a different parameter layout or topology."
                )
        groups = {g.ranks for g in self._topology.distinct_groups()}
        for entry in state.get("references", []):
            ranks = tuple(entry["ranks"])
            if ranks not in groups or self._rank not in ranks:
                raise ValueError(
                    f"the checkpoint has a compression reference for group {list(ranks)}, which is not one "
                    f"of rank {self._rank}'s groups in this topology; resume with the same topology."
                )
            if len(entry["tensors"]) > len(self._tensors):
                raise ValueError(
                    f"group {list(ranks)} has references for {len(entry['tensors'])} buckets but there are "
                    f"{len(self._tensors)}; the checkpoint comes from a different parameter layout."
                )
            for bucket, (saved, tensor) in enumerate(zip(entry["tensors"], self._tensors, strict=False)):
                got = None if saved is None else misfit(saved, tensor.shape, tensor.dtype)
                if got is not None:
                    raise ValueError(
                        f"compression reference of group {list(ranks)}, bucket {bucket}, of {got} does not "
                        f"fit a bucket of shape {tuple(tensor.shape)} and dtype {tensor.dtype}; the "
                        "checkpoint comes from a different parameter layout."
                    )

    def load_state_dict(self, state: dict[str, Any] | None, references: bool = True) -> None:
        """Restore rounds from :meth:`state_dict` as received-but-not-mixed (drops any pending round).

        With ``references`` (a checkpoint), the references are replaced by the state's (none if it
        has none, so that every member of a group starts it again with an exact round); without (a
        global average's snapshot), the current references are kept.
        """
        self.check_state_dict(state)
        self.discard_all()
        if references:
            self._references = {}
        if state is None:
            return
        step = state["step"]
        if references and self._plan is not None:  # without compression, references are of no use
            for entry in state.get("references", []):
                tensors: list[torch.Tensor | None] = [None] * self.num_buckets
                for bucket, saved in enumerate(entry["tensors"]):
                    if saved is not None:
                        tensors[bucket] = saved.to(self._tensors[bucket].device).clone()
                self._references[tuple(entry["ranks"])] = tensors
        if step is None:
            return
        step = int(step)
        group = self._topology.group(self._rank, step)
        for bucket, saved in enumerate(state["buffers"]):
            if saved is None:
                continue
            buffer = self._buffers[bucket]
            if buffer is None:
                buffer = self._buffers[bucket] = _new_buffer(self._tensors[bucket])
            buffer.copy_(saved)
            self._rounds[bucket] = _Round(step, group, None)
        for bucket, (payload, name) in enumerate(
            zip(state.get("gathered", []), state.get("codecs", []), strict=True)
        ):
            if name is None:
                continue
            self._gathered[bucket] = payload.to(self._tensors[bucket].device).clone()
            # A global average's snapshot is restored after its references were settled.
            self._rounds[bucket] = _Round(step, group, None, name, reference_applied=not references)


def _as_words(payload: torch.Tensor) -> torch.Tensor:
    """A uint8 payload as int32 words where its size allows (a quarter of the elements to reduce)."""
    if payload.numel() % 4 == 0 and payload.storage_offset() % 4 == 0:
        return payload.view(torch.int32)
    return payload


def _new_buffer(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=reduction_dtype(tensor.dtype), device=tensor.device)
