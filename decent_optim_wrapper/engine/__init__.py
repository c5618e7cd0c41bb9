"""The engine: everything decentralized training needs besides the local update.

Modules, each importing only those listed before it:

* :mod:`~decent_optim_wrapper.engine.errors` -- what a collective that cannot complete raises.
* :mod:`~decent_optim_wrapper.engine.world` -- the gossip world: the whole job, or one dimension of a
  device mesh or a process group.
* :mod:`~decent_optim_wrapper.engine.shards` -- sharded (DTensor) parameters: local shards and their checks.
* :mod:`~decent_optim_wrapper.engine.buckets` -- flat parameter buckets that parameters become views of.
* :mod:`~decent_optim_wrapper.engine.comm` -- cross-rank agreement, process groups, and how to wait for a
  collective (timed on CPU, stream-ordered on CUDA).
* :mod:`~decent_optim_wrapper.engine.admission` -- a running job's applicants: how a worker started
  later applies through the store and how the members decide.
* :mod:`~decent_optim_wrapper.engine.membership` -- opt-in survival of a lost peer: who is still here,
  agreed through the job's store, and a new process group over the survivors.
* :mod:`~decent_optim_wrapper.engine.compression` -- opt-in compressed gossip: wire formats and which
  groups compress.
* :mod:`~decent_optim_wrapper.engine.options` -- the engine's options and what every rank must agree on.
* :mod:`~decent_optim_wrapper.engine.gossip` -- asynchronous gossip, one round in flight per bucket.
* :mod:`~decent_optim_wrapper.engine.tracking` -- opt-in gradient tracking.
* :mod:`~decent_optim_wrapper.engine.adam_step` -- Adam's and AdamW's step with the rule's denominator,
  torch's own moments bit for bit.
* :mod:`~decent_optim_wrapper.engine.second_moment` -- Adam's second moment of the average gradient:
  which optimizers take it, and their local step with it.
* :mod:`~decent_optim_wrapper.engine.pacing` -- paced rounds for uneven fleets: how many inner steps
  each rank takes per round, from measured speeds.
* :mod:`~decent_optim_wrapper.engine.local_steps` -- opt-in low-communication gossip: local steps, an
  outer optimizer, anchors gossiped behind the next inner steps.
* :mod:`~decent_optim_wrapper.engine.averaging` -- exact global averaging, its snapshot, consensus distance.
* :mod:`~decent_optim_wrapper.engine.transfer` -- a replica handed to a joiner, checked by its digest.
* :mod:`~decent_optim_wrapper.engine.growth` -- joins: donating replicas, what a join does to the mean,
  the record of joins and their hooks.
* :mod:`~decent_optim_wrapper.engine.survival` -- going on without a lost peer: the recovery loop, the
  rounds settled and the topology over the survivors, the record of failures and their hooks.
* :mod:`~decent_optim_wrapper.engine.checkpoint` -- the engine's part of a checkpoint.
* :mod:`~decent_optim_wrapper.engine.resize` -- what each rank loads from a checkpoint of another world
  size: the average of the saved replicas.
* :mod:`~decent_optim_wrapper.engine.engine` -- :class:`GossipEngine`, the object front-ends drive.
* :mod:`~decent_optim_wrapper.engine.front_end` -- what every front-end reports of its engine.
"""

from decent_optim_wrapper.engine.admission import JoinRejectedError
from decent_optim_wrapper.engine.buckets import Bucket
from decent_optim_wrapper.engine.compression import CompressionSpec, GossipCompression
from decent_optim_wrapper.engine.engine import DEFAULT_TIMEOUT, STATE_VERSION, GossipEngine, TopologySpec
from decent_optim_wrapper.engine.errors import DecentError, GlobalAverageError, GossipError, PeerFailureError
from decent_optim_wrapper.engine.front_end import EngineFrontEnd
from decent_optim_wrapper.engine.gossip import Gossip
from decent_optim_wrapper.engine.local_steps import OuterFactory
from decent_optim_wrapper.engine.membership import PeerFailure, PeerJoin
from decent_optim_wrapper.engine.pacing import PaceReport, Pacing, PacingSpec

__all__ = [
    "DEFAULT_TIMEOUT",
    "STATE_VERSION",
    "Bucket",
    "CompressionSpec",
    "DecentError",
    "EngineFrontEnd",
    "GlobalAverageError",
    "Gossip",
    "GossipCompression",
    "GossipEngine",
    "GossipError",
    "JoinRejectedError",
    "OuterFactory",
    "PaceReport",
    "Pacing",
    "PacingSpec",
    "PeerFailure",
    "PeerFailureError",
    "PeerJoin",
    "TopologySpec",
]
