"""The engine: everything decentralized training needs besides the local update.

Its rooms, each a sub-package whose docstring says its job and what it may import, in layer order
(each imports only from the layers before it; none reaches into another's private names):

* :mod:`~decent_optim_wrapper.engine.errors` -- what a collective that cannot complete raises.
* :mod:`~decent_optim_wrapper.engine.wire` -- the wire formats of compressed gossip.
* :mod:`~decent_optim_wrapper.engine.fleet` -- who is in the job: the gossip world, process groups and
  agreement, survival of a lost peer, joins.
* :mod:`~decent_optim_wrapper.engine.exchange` -- flat buckets and the gossip rounds over them.
* :mod:`~decent_optim_wrapper.engine.rules` -- the update rules beside the gossip and their clocks:
  Adam's second moment, gradient tracking, low-communication gossip, paced rounds.
* :mod:`~decent_optim_wrapper.engine.state` -- exact global averaging and its snapshot, the checkpoint,
  resuming at another world size.

Coordination, at this level:

* :mod:`~decent_optim_wrapper.engine.config` -- the options as one value, :class:`GossipConfig`, of
  self-checking parts; :mod:`~decent_optim_wrapper.engine.option_docs` describes each option once.
* :mod:`~decent_optim_wrapper.engine.options` -- the options' checks and what every rank must agree on.
* :mod:`~decent_optim_wrapper.engine.layout` -- what one rank builds from the options before its first
  collective.
* :mod:`~decent_optim_wrapper.engine.survival` -- going on without a lost peer: the recovery loop.
* :mod:`~decent_optim_wrapper.engine.progress` -- where a rank's steps stand.
* :mod:`~decent_optim_wrapper.engine.counters` -- the counters a logger reads: what happened since the
  last read, as plain numbers.
* :mod:`~decent_optim_wrapper.engine.wiring` -- the communication over the current members, built once
  and rebuilt over new ones.
* :mod:`~decent_optim_wrapper.engine.member_changes` -- the engine's side of a change of members:
  recovering, settling rounds, rewiring, opening to joiners.
* :mod:`~decent_optim_wrapper.engine.checkpointing` -- the engine's part of a checkpoint: saving,
  loading bit for bit, resuming at another world size.
* :mod:`~decent_optim_wrapper.engine.engine` -- :class:`GossipEngine`, the object the front-ends
  (:mod:`decent_optim_wrapper.front_ends`) drive.

For a monitor (:mod:`decent_optim_wrapper.monitor`): the members' status records
(:mod:`~decent_optim_wrapper.engine.fleet.status`), read with :func:`read_fleet` and the job's
:class:`Seal`.
"""

from decent_optim_wrapper.engine.config import (
    Elasticity,
    GossipConfig,
    GossipOptions,
    KeywordOptions,
    Placement,
    Robustness,
    Rounds,
    Transport,
    given,
)
from decent_optim_wrapper.engine.counters import METRIC_NAMES
from decent_optim_wrapper.engine.engine import DEFAULT_TIMEOUT, STATE_VERSION, GossipEngine, TopologySpec
from decent_optim_wrapper.engine.errors import (
    DecentError,
    GlobalAverageError,
    GossipError,
    PeerFailureError,
    QuarantinedError,
)
from decent_optim_wrapper.engine.exchange.buckets import Bucket
from decent_optim_wrapper.engine.exchange.clipping import ClippedGossip, ClippedGossipSpec
from decent_optim_wrapper.engine.exchange.gossip import Gossip
from decent_optim_wrapper.engine.exchange.guard import GuardEvent, NonFiniteReplicaError, drop_state
from decent_optim_wrapper.engine.exchange.shards import (
    is_sharded,
    load_local_module_state,
    local_module_state,
    local_optimizer_state,
    placed_optimizer_state,
)
from decent_optim_wrapper.engine.exchange.staging import HostStagingError
from decent_optim_wrapper.engine.fleet.comm import agree, check_identical
from decent_optim_wrapper.engine.fleet.growth import JoinHook, Stateful
from decent_optim_wrapper.engine.fleet.jobs import JoinRejectedError
from decent_optim_wrapper.engine.fleet.membership import PeerFailure, PeerJoin
from decent_optim_wrapper.engine.fleet.sealing import SECRET_ENV, ForgedEntryError, Seal, resolve_secret
from decent_optim_wrapper.engine.fleet.status import (
    RECORD_S,
    RECORDS_ENV,
    STATUS_VERSION,
    FleetRecords,
    default_job,
    read_fleet,
)
from decent_optim_wrapper.engine.option_docs import document_options
from decent_optim_wrapper.engine.rules.local_steps import OuterFactory
from decent_optim_wrapper.engine.rules.pacing import PaceReport, Pacing, PacingSpec
from decent_optim_wrapper.engine.state.averaging import tensors_consensus_distance
from decent_optim_wrapper.engine.state.resize import average_nested, average_optimizer_states
from decent_optim_wrapper.engine.survival import PeerFailureHook
from decent_optim_wrapper.engine.wire.compression import CompressionSpec, GossipCompression

__all__ = [
    "Transport",
    "Rounds",
    "Robustness",
    "Placement",
    "KeywordOptions",
    "GossipOptions",
    "GossipConfig",
    "Elasticity",
    "DEFAULT_TIMEOUT",
    "STATE_VERSION",
    "Bucket",
    "ClippedGossip",
    "ClippedGossipSpec",
    "CompressionSpec",
    "DecentError",
    "GlobalAverageError",
    "Gossip",
    "GossipCompression",
    "GossipEngine",
    "GossipError",
    "GuardEvent",
    "HostStagingError",
    "JoinRejectedError",
    "NonFiniteReplicaError",
    "OuterFactory",
    "PaceReport",
    "Pacing",
    "PacingSpec",
    "PeerFailure",
    "PeerFailureError",
    "QuarantinedError",
    "PeerJoin",
    # for the front doors' hooks
    "JoinHook",
    "PeerFailureHook",
    "Stateful",
    "TopologySpec",
    "drop_state",
    # for the front doors: building a front-end's options, docstring and checkpoint
    "agree",
    "average_nested",
    "average_optimizer_states",
    "check_identical",
    "document_options",
    "given",
    "is_sharded",
    "load_local_module_state",
    "local_module_state",
    "local_optimizer_state",
    "placed_optimizer_state",
    "tensors_consensus_distance",
    # for a logger: the names metrics() returns
    "METRIC_NAMES",
    # for a monitor: the members' status records
    "RECORDS_ENV",
    "RECORD_S",
    "SECRET_ENV",
    "STATUS_VERSION",
    "FleetRecords",
    "ForgedEntryError",
    "Seal",
    "default_job",
    "read_fleet",
    "resolve_secret",
]
