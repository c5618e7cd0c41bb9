"""Decentralized data-parallel training for PyTorch: wrap any optimizer, gossip instead of all-reduce.

Layout (each layer imports only the ones above it):

* :mod:`~decent_optim_wrapper.topo` -- topologies: which ranks average together at each step (pure logic).
* :mod:`~decent_optim_wrapper.engine` -- the engine, :class:`~decent_optim_wrapper.engine.GossipEngine`:
  buckets, process groups, the step protocol, gossip (optionally compressed), gradient tracking,
  global averaging and its snapshot, its part of a checkpoint.
* :mod:`~decent_optim_wrapper.optim` -- optimizers (:class:`AccumAdam`, :class:`AccumAdamW`) and the
  decent-dp factories (``optim_fn_*``, :func:`lr_scheduler_fn_cosine_with_warmup`); torch only.
* :mod:`~decent_optim_wrapper.front_ends` -- the front doors, which translate a user's API into engine
  calls: :class:`DecentOptimWrapper` (any ``torch.optim.Optimizer``; public path
  ``decent_optim_wrapper.wrapper``) and :class:`DecentralizedDataParallel` (decent-dp's API, each bucket
  updated inside backward); the integrations (:mod:`~decent_optim_wrapper.integrations`) sit above them.
* Above them: :mod:`~decent_optim_wrapper.metrics` (consensus distance), :mod:`~decent_optim_wrapper.plan`
  (``python -m decent_optim_wrapper.plan``: predicted step times, bytes per step),
  :mod:`~decent_optim_wrapper.launch` (:func:`initialize_dist`).
"""

from loguru import logger

from decent_optim_wrapper.engine import (
    ClippedGossip,
    DecentError,
    Elasticity,
    GlobalAverageError,
    GossipCompression,
    GossipConfig,
    GossipEngine,
    GossipError,
    GuardEvent,
    HostStagingError,
    JoinRejectedError,
    NonFiniteReplicaError,
    PaceReport,
    Pacing,
    PeerFailure,
    PeerFailureError,
    PeerJoin,
    Placement,
    QuarantinedError,
    Robustness,
    Rounds,
    Transport,
)
from decent_optim_wrapper.front_ends import DecentOptimWrapper, DecentralizedDataParallel
from decent_optim_wrapper.launch import init_elastic, initialize_dist, node_mesh
from decent_optim_wrapper.metrics import consensus_distance
from decent_optim_wrapper.optim import (
    LR_SCHEDULER_FN_TYPE,
    OPTIM_FN_TYPE,
    AccumAdam,
    AccumAdamW,
    lr_scheduler_fn_cosine_with_warmup,
    optim_fn_accum_adam,
    optim_fn_accum_adamw,
    optim_fn_adam,
    optim_fn_adamw,
)
from decent_optim_wrapper.topo import (
    AlternatingExpRingTopology,
    CompleteTopology,
    Edge,
    Group,
    HierarchicalTopology,
    OnePeerExpTopology,
    RingTopology,
    Topology,
    TopologyFactory,
    TopologyReg,
)

# Libraries stay silent unless the user opts in: logger.enable("decent_optim_wrapper").
logger.disable("decent_optim_wrapper")
# ... except the warnings that a worker was lost and the others went on without it, and that a
# worker's values were not finite and were kept out of the replicas (once per kind and sender), and
# that someone without the job's secret wrote into its store (once per key).
logger.enable("decent_optim_wrapper.engine.survival")
logger.enable("decent_optim_wrapper.engine.exchange.guard")
logger.enable("decent_optim_wrapper.engine.fleet.refusals")

__all__ = [
    "Transport",
    "Rounds",
    "Robustness",
    "Placement",
    "GossipConfig",
    "Elasticity",
    "LR_SCHEDULER_FN_TYPE",
    "OPTIM_FN_TYPE",
    "AccumAdam",
    "AccumAdamW",
    "AlternatingExpRingTopology",
    "CompleteTopology",
    "ClippedGossip",
    "DecentError",
    "DecentOptimWrapper",
    "DecentralizedDataParallel",
    "Edge",
    "GlobalAverageError",
    "GossipEngine",
    "GossipCompression",
    "GossipError",
    "GuardEvent",
    "HostStagingError",
    "Group",
    "HierarchicalTopology",
    "JoinRejectedError",
    "NonFiniteReplicaError",
    "OnePeerExpTopology",
    "PaceReport",
    "Pacing",
    "PeerFailure",
    "PeerFailureError",
    "QuarantinedError",
    "PeerJoin",
    "RingTopology",
    "Topology",
    "TopologyFactory",
    "TopologyReg",
    "consensus_distance",
    "init_elastic",
    "initialize_dist",
    "node_mesh",
    "lr_scheduler_fn_cosine_with_warmup",
    "optim_fn_accum_adam",
    "optim_fn_accum_adamw",
    "optim_fn_adam",
    "optim_fn_adamw",
]
