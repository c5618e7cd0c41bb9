"""The engine's part of a checkpoint: the ``"decent"`` entry of a front-end's state dict.

Checking a saved entry against the running engine (everything, before anything changes), and the
pieces :meth:`~decent_optim_wrapper.engine.GossipEngine.state_dict` builds it from. Layout::

    {
        "version": 1,
        "step": 120,  # completed steps
        "rank": 0, "world_size": 4, "local_world_size": 1,
        "topology": "ring",
        "schedule": [...],  # the topology's groups and weights, phase by phase
        "buckets": [...],  # per bucket: dtype, device type, numel, shapes, offsets
        "params": [tensor, ...],  # this replica's parameters, one flat tensor per bucket
        "gossip": {"step": 119, "buffers": [tensor, ...]} or None,  # received, not mixed yet
        "snapshot": None,  # or {"params": [...], "gossip": ...} while globally averaged
        "mixing_factor": 1.0,  # a in x <- (1 - a) x + a W x
        "compression": None,  # or the wire format, e.g. "bf16" (informative)
        "tracking": None,  # with gradient tracking: trackers, previous gradients, their gossip
        "local_steps": None,  # low-communication gossip: sync_every, sync_delay, anchors,
                              # the outer optimizer's state, the anchors' round still to fold in
    }

With compression, ``"gossip"`` also holds the payloads of compressed rounds not mixed yet and the
groups' references (:meth:`~decent_optim_wrapper.engine.exchange.gossip.Gossip.state_dict`). The parameters
are saved because they differ between replicas (building an engine broadcasts rank 0's); loading
restores this replica's own. A resumed run continues bit for bit at the same world size and topology.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from decent_optim_wrapper.engine.exchange.buckets import Bucket, check_saved_tensors
from decent_optim_wrapper.engine.exchange.gossip import Gossip
from decent_optim_wrapper.engine.rules.local_steps import LocalSteps
from decent_optim_wrapper.engine.rules.tracking import GradientTracker
from decent_optim_wrapper.engine.state.averaging import Snapshot

__all__ = [
    "STATE_VERSION",
    "RunIdentity",
    "check_engine_state",
    "check_entry_keys",
    "plain",
    "snapshot_from_state",
    "snapshot_state",
]

#: Version of the engine's checkpoint entry. Keys added since (gossip references, tracking,
#: mixing_factor) are optional, so every checkpoint of this version still loads.
STATE_VERSION = 1

_REQUIRED_KEYS = ("version", "step", "rank", "world_size", "topology", "schedule", "buckets", "params")


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must share with the run that loads it, in the form it is saved in."""

    rank: int
    world_size: int
    local_world_size: int
    topology: str
    schedule: object  # the topology's fingerprint, as nested lists
    buckets: object  # the buckets' signatures, as nested lists

    def as_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "topology": self.topology,
            "schedule": self.schedule,
            "buckets": self.buckets,
        }


def plain(value: object) -> object:
    """Nested tuples to lists, so a checkpoint round-trips through torch.save unchanged."""
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    return value


def check_entry_keys(state: Any, what: str = "state_dict['decent']") -> None:
    """Raise ``ValueError`` unless ``state`` is a dict with every key an engine entry must have."""
    if not isinstance(state, dict):
        raise ValueError(f"{what} must be a dict from GossipEngine.state_dict(), got {type(state).__name__}.")
    missing = [key for key in _REQUIRED_KEYS if key not in state]
    if missing:
        raise ValueError(f"{what} lacks {missing}; the checkpoint is incomplete or corrupt.")


def check_engine_state(
    state: Any,
    run: RunIdentity,
    buckets: Sequence[Bucket],
    gossip: Gossip,
    tracker: GradientTracker | None,
    local: LocalSteps | None = None,
) -> None:
    """Raise ``ValueError`` naming the mismatch if ``state`` cannot be loaded into the running engine."""
    check_entry_keys(state)
    expected = run.as_state()
    for key in ("version", "world_size", "rank", "topology"):
        if state[key] != expected[key]:
            raise ValueError(
                f"checkpoint has {key}={state[key]!r} but this run has {key}={expected[key]!r}; resume with "
                f"the same {key} as the run that saved it (and load each rank's own file)."
            )
    if state["schedule"] != run.schedule:
        raise ValueError(
            f"checkpoint's topology {state['topology']!r} has a different schedule (world size, "
            "local_world_size, groups or weights) than this run's; resume with the same topology."
        )
    if state["buckets"] != run.buckets:
        raise ValueError(
            "checkpoint's parameter layout (shapes, dtypes, order or bucket_cap_mb) differs from this "
            "run's; build the same model and optimizer with the same bucket_cap_mb before loading."
        )
    layout = [(b.data.shape, b.data.dtype) for b in buckets]
    check_saved_tensors("params", state["params"], layout)
    gossip.check_state_dict(state.get("gossip"))
    if tracker is not None and state.get("tracking") is not None:
        tracker.check_state_dict(state["tracking"])
    saved_local = state.get("local_steps")
    if local is not None:
        local.check_state_dict(saved_local)
    elif saved_local is not None:
        raise ValueError(
            "checkpoint was saved with low-communication gossip (sync_every="
            f"{saved_local.get('sync_every')!r}) but this run gossips every step; resume with the same "
            "sync_every, sync_delay and outer_optimizer."
        )
    snapshot = state.get("snapshot")
    if snapshot is not None:
        check_saved_tensors("snapshot params", snapshot["params"], layout)
        gossip.check_state_dict(snapshot["gossip"])
        if local is not None and snapshot.get("local") is not None:
            check_saved_tensors("snapshot anchors", snapshot["local"]["anchors"], layout)


def snapshot_state(snapshot: Snapshot | None) -> dict[str, Any] | None:
    """A global average's snapshot as saved in a checkpoint (its buffers belong to the model's state)."""
    if snapshot is None:
        return None
    params = [p.clone() for p in snapshot.params]
    return {"params": params, "gossip": snapshot.gossip, "local": snapshot.local}


def snapshot_from_state(state: dict[str, Any], buckets: Sequence[Bucket]) -> Snapshot | None:
    """The snapshot a checked checkpoint holds (taken while globally averaged), on the buckets' devices."""
    saved = state.get("snapshot")
    if saved is None:
        return None
    params = [p.to(b.data.device).clone() for p, b in zip(saved["params"], buckets, strict=True)]
    local = saved.get("local")
    if local is not None:
        anchors = [a.to(b.data.device).clone() for a, b in zip(local["anchors"], buckets, strict=True)]
        local = {**local, "anchors": anchors}
    return Snapshot(params=params, gossip=saved["gossip"], local=local)
