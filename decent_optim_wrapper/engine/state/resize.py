r"""Resuming a checkpoint written by ``N`` ranks in a run of ``M`` ranks: what each new rank starts from.

A checkpoint of decentralized training is ``N`` per-rank files, one replica each, and the replicas
differ. When a job comes back with another number of workers (an elastic restart with fewer nodes, a
larger allocation), each of the ``M`` new ranks needs one state to start from. The rule:

* **Same world size and topology** (``M = N``): new rank ``r`` loads saved rank ``r``'s state as it
  is, and the run continues bit for bit
  (:meth:`~decent_optim_wrapper.engine.GossipEngine.load_state_dict`).
* **Otherwise every new rank starts from the exact average of the saved replicas**,

  .. math::
      x_r = \mathrm{round}_{\text{dtype}}\Big(\frac{1}{N} \sum_{i=0}^{N-1} x_i\Big)
      \quad\text{for every new rank } r,

  summed in float64 in saved-rank order and rounded once to the bucket's dtype, so every new rank
  holds the same bits: the new run starts at consensus, as after ``global_avg()``. The inner
  optimizer's floating state (momentum, ``exp_avg``, ``exp_avg_sq``, ...) is averaged the same way,
  and so are the anchors and the outer optimizer's state of low-communication gossip; counters
  (tensors named ``step``, integer tensors, plain numbers) must agree across the saved ranks and are
  kept; param groups (learning rates, ...) are saved rank 0's, identical in a run.

Why the average rather than "new rank ``r`` takes saved rank ``r mod N``": mapping duplicates some
replicas (two new ranks start identical, which gossip then counts twice) and drops others (a
shrink throws away what the missing replicas learnt), privileging the ranks that happen to be kept;
and the mean of the replicas, the quantity decentralized training drives and ``global_avg()``
evaluates, would jump. The average keeps that mean exactly and starts from the best single model
the checkpoint holds. Averaging the optimizer state too keeps it consistent with the parameters it
now belongs to: a replica's momentum averaged over the replicas is the momentum of the averaged
trajectory for momentum SGD (the update is linear in it), where one rank's buffer would steer the
average model by that rank's data alone.

What does not carry over to another world size, and why:

* **Gossip rounds in flight** are dropped. Mixing keeps the mean of the replicas (the mixing
  matrices are doubly stochastic), so averaging the replicas before or after the round gives the
  same average: nothing is lost. The same holds for the anchors' round still to be folded in.
* **Compression references** are reset: they belong to the old groups; each new group's first round
  is exact and sets its reference.
* **Gradient trackers** restart from the next gradient (``y = g``). Their invariant, ``sum_i y_i =
  sum_i g_i``, holds over the old world's ranks and gradients; averaged trackers would not satisfy
  it for the new ranks' gradients, and the tracker error would never decay.
* **A global average's snapshot** is dropped: the saved replicas are all equal to the average then,
  the new run starts from it, and there is no replica of the old world to revert to.

The step count is kept (it must agree across the saved ranks), so LR schedules and the phase of
low-communication rounds continue; the topology's schedule is the new run's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from loguru import logger

from decent_optim_wrapper.engine.exchange.buckets import check_saved_tensors
from decent_optim_wrapper.engine.state.checkpoint import STATE_VERSION, RunIdentity, check_entry_keys

__all__ = [
    "average_nested",
    "average_optimizer_states",
    "average_tensors",
    "averaged_engine_state",
    "check_saved_world",
]

#: Keys whose values count something and must agree across the saved ranks (Adam's ``step``).
COUNTER_KEYS = frozenset({"step"})


def average_tensors(tensors: Sequence[torch.Tensor], what: str = "tensor") -> torch.Tensor:
    """The mean of ``tensors`` (one per saved rank), summed in float64 in order and rounded once.

    Every caller holding the same tensors gets the same bits. Non-floating tensors are not averaged:
    they must be equal (``ValueError`` naming ``what`` and the ranks otherwise) and are returned as is.
    """
    first = tensors[0]
    for rank, tensor in enumerate(tensors[1:], start=1):
        if not isinstance(tensor, torch.Tensor) or tensor.shape != first.shape or tensor.dtype != first.dtype:
            got = _describe(tensor)
            raise ValueError(
                f"{what} of saved rank {rank} ({got}) does not match saved rank 0's ({_describe(first)}): "
                "the checkpoint's files come from different runs or layouts; pass the files of one "
                "checkpoint."
            )
    if not first.is_floating_point():
        _check_equal_tensors(tensors, what)
        return first.clone()
    total = first.to(torch.float64, copy=True)
    for tensor in tensors[1:]:
        total.add_(tensor.to(device=total.device, dtype=torch.float64))
    return total.div_(len(tensors)).to(first.dtype)


def _check_equal_tensors(tensors: Sequence[torch.Tensor], what: str) -> None:
    first = tensors[0]
    differ = [rank for rank, t in enumerate(tensors) if not torch.equal(t.to(first.device), first)]
    if differ:
        raise ValueError(
            f"{what} must be the same on every saved rank to resume at another world size, but saved "
            f"rank(s) {differ} differ from saved rank 0 ({_short(first)} there, "
            f"{_short(tensors[differ[0]])} on rank {differ[0]}); such a checkpoint resumes only at the world "
            "size that saved it."
        )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}, dtype {value.dtype}"
    return f"a {type(value).__name__}"


def _short(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return repr(value.item()) if value.numel() == 1 else f"a tensor of shape {tuple(value.shape)}"
    return repr(value)


def average_nested(values: Sequence[object], what: str = "state", *, counter: bool = False) -> object:
    """The saved ranks' ``values`` (dicts, lists and tensors, alike in structure) merged into one.

    Floating tensors are averaged (:func:`average_tensors`); tensors under a key named ``step``,
    integer tensors and plain values (numbers, strings, None) must be equal on every saved rank and
    are kept. Raises ``ValueError`` naming the key (``what``) and the ranks that differ.
    """
    first = values[0]
    if isinstance(first, Mapping):
        keys = list(first)
        for rank, value in enumerate(values):
            if not isinstance(value, Mapping) or set(value) != set(keys):
                got = sorted(map(str, value)) if isinstance(value, Mapping) else type(value).__name__
                raise ValueError(
                    f"{what} of saved rank {rank} has keys {got} but saved rank 0's has "
                    f"{sorted(map(str, keys))}; the files come from different runs or optimizers."
                )
        return {
            key: average_nested(
                [v[key] for v in values],  # type: ignore[index]
                f"{what}[{key!r}]",
                counter=counter or key in COUNTER_KEYS,
            )
            for key in keys
        }
    if isinstance(first, list | tuple):
        for rank, value in enumerate(values):
            if not isinstance(value, list | tuple) or len(value) != len(first):
                raise ValueError(
                    f"{what} of saved rank {rank} does not have saved rank 0's {len(first)} entries; the "
                    "files come from different runs or layouts."
                )
        merged = [
            average_nested([v[i] for v in values], f"{what}[{i}]", counter=counter)  # type: ignore[index]
            for i in range(len(first))
        ]
        return merged if isinstance(first, list) else tuple(merged)
    if isinstance(first, torch.Tensor):
        if counter:
            _check_equal_tensors(values, what)  # type: ignore[arg-type]
            return first.clone()
        return average_tensors(values, what)  # type: ignore[arg-type]
    differ = [rank for rank, value in enumerate(values) if value != first]
    if differ:
        raise ValueError(
            f"{what} must be the same on every saved rank to resume at another world size, but saved "
            f"rank {differ[0]} has {values[differ[0]]!r} and saved rank 0 has {first!r}; such a checkpoint "
            "resumes only at the world size that saved it."
        )
    return first


def average_optimizer_states(states: Sequence[Mapping[str, Any]], what: str = "optimizer") -> dict[str, Any]:
    """One ``torch.optim.Optimizer`` state dict from the saved ranks' (:func:`average_nested` on ``"state"``).

    ``"param_groups"`` and any other entry are saved rank 0's: hyperparameters are the same on every
    rank of a run.
    """
    for rank, state in enumerate(states):
        if not isinstance(state, Mapping) or "state" not in state or "param_groups" not in state:
            raise ValueError(
                f"{what} state of saved rank {rank} is not an optimizer's state_dict() (with 'state' and "
                "'param_groups')."
            )
    merged = dict(states[0])
    merged["state"] = average_nested([s["state"] for s in states], f"{what} state")
    return merged


def check_saved_world(states: Sequence[Any], run: RunIdentity) -> bool:
    """Check the engine entries of one checkpoint, in saved-rank order; True if they resume as they are.

    They must be ``N = len(states)`` entries of the same version, saved by ranks ``0..N-1`` of one
    run (world size ``N``, one topology and parameter layout, one step). True when this run has the
    saved world size and topology (new rank ``r`` then loads ``states[r]``, bit for bit); False when
    it must start from the average (:func:`averaged_engine_state`).

    Raises:
        ValueError: naming the entry, its value and the fix.
    """
    if isinstance(states, Mapping) or not isinstance(states, Sequence) or not states:
        raise ValueError(
            "states must be a non-empty sequence of the per-rank state dicts of one checkpoint, in "
            f"saved-rank order (rank 0's first), got {type(states).__name__}."
        )
    count = len(states)
    for index, state in enumerate(states):
        check_entry_keys(state, f"states[{index}]")
        if state["version"] != STATE_VERSION:
            raise ValueError(
                f"states[{index}] has version {state['version']!r}; this version of the library loads "
                f"version {STATE_VERSION}."
            )
        if state["world_size"] != count:
            raise ValueError(
                f"states[{index}] was saved in a run of world_size={state['world_size']!r}, but {count} "
                "states were given; pass every rank's state of the checkpoint, one per saved rank."
            )
        if state["rank"] != index:
            raise ValueError(
                f"states[{index}] was saved by rank {state['rank']!r}; pass the states in saved-rank order "
                "(rank 0's first)."
            )
    first = states[0]
    for index, state in enumerate(states):
        for key in ("topology", "schedule", "buckets", "step"):
            if state[key] != first[key]:
                raise ValueError(
                    f"states[{index}] has {key}={_brief(state[key])} but states[0] has "
                    f"{key}={_brief(first[key])}: the states come from different checkpoints or runs; pass "
                    "the files of one checkpoint."
                )
    if first["buckets"] != run.buckets:
        raise ValueError(
            "checkpoint's parameter layout (shapes, dtypes, order or bucket_cap_mb) differs from this run's; "
            "build the same model and optimizer with the same bucket_cap_mb before loading."
        )
    return count == run.world_size and first["topology"] == run.topology and first["schedule"] == run.schedule


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def averaged_engine_state(states: Sequence[Mapping[str, Any]], run: RunIdentity) -> dict[str, Any]:
    """The engine state every rank of ``run`` starts from: the average of the saved replicas.

    ``states`` are checked by :func:`check_saved_world`. The result carries ``run``'s identity (rank,
    world size, topology, schedule), the saved step, the averaged parameters and, with
    low-communication gossip, the averaged anchors and outer optimizer state; no gossip in flight,
    no compression references, no gradient trackers and no global-average snapshot (the module
    docstring says why). It passes
    :meth:`~decent_optim_wrapper.engine.GossipEngine.check_state_dict` of the run.
    """
    check_saved_world(states, run)
    first = states[0]
    if run.rank == 0:
        logger.info(
            f"resuming a checkpoint of {len(states)} ranks (step {first['step']}) on {run.world_size} ranks: "
            "every rank starts from the average of the saved replicas; gossip in flight, compression "
            "references, gradient trackers and any global-average snapshot start afresh."
        )
    layout = [(p.shape, p.dtype) for p in first["params"]]
    for index, state in enumerate(states):
        check_saved_tensors(f"params of saved rank {index}", state["params"], layout)
    params = [average_tensors([s["params"][b] for s in states], f"params[{b}]") for b in range(len(layout))]
    mixing = average_nested([s.get("mixing_factor", 1.0) for s in states], "mixing_factor")
    return {
        **run.as_state(),
        "step": first["step"],
        "params": params,
        "gossip": None,
        "snapshot": None,
        "mixing_factor": mixing,
        "compression": first.get("compression"),
        "tracking": None,
        "local_steps": _averaged_local_steps([s.get("local_steps") for s in states], layout),
    }


def _averaged_local_steps(
    saved: Sequence[Any], layout: Sequence[tuple[torch.Size, torch.dtype]]
) -> dict[str, Any] | None:
    """Low-communication gossip's part: anchors and outer state averaged, the round in flight dropped."""
    present = [index for index, state in enumerate(saved) if state is not None]
    if not present:
        return None
    if len(present) != len(saved) or not all(isinstance(s, Mapping) for s in saved):
        raise ValueError(
            f"only saved ranks {present} of {len(saved)} hold low-communication gossip state: the states "
            "come from different runs; pass the files of one checkpoint."
        )
    for key in ("sync_every", "sync_delay"):
        average_nested([s.get(key) for s in saved], f"local_steps[{key!r}]")
    for index, state in enumerate(saved):
        check_saved_tensors(f"anchors of saved rank {index}", state.get("anchors"), layout)
    anchors = [average_tensors([s["anchors"][b] for s in saved], f"anchors[{b}]") for b in range(len(layout))]
    outers = [s.get("outer") for s in saved]
    if any(o is None for o in outers) and not all(o is None for o in outers):
        raise ValueError(
            "only some saved ranks hold an outer optimizer's state; pass the files of one checkpoint."
        )
    outer = None if outers[0] is None else average_optimizer_states(outers, "outer optimizer")
    first = saved[0]
    return {
        "sync_every": first["sync_every"],
        "sync_delay": first["sync_delay"],
        "anchors": anchors,
        "outer": outer,
        "gossip": None,
    }
