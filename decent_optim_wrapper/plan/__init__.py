"""Plan a run before renting the cluster: bytes per step, and step times predicted by simulation.

``python -m decent_optim_wrapper.plan`` prints the predicted step time of every gossip topology (with
and without compression) and of DDP for a model size, compute time and network
(:mod:`~decent_optim_wrapper.plan.cli`, :func:`.predict`); ``python -m decent_optim_wrapper.plan bytes
NAME -n N`` the bytes a topology sends per parameter (:mod:`.traffic`). Underneath: compute-time
distributions (:mod:`.compute`), the network and collective cost model (:mod:`.costs`), links shared in
time between the transfers in flight (:mod:`.sharing`), a round's processor time timed on this machine
(:mod:`.round_cost`), schemes built from them (:mod:`.schemes`) and the simulator of the step dependency
graph (:mod:`.simulator`); ``python -m decent_optim_wrapper.plan recommend`` picks the setting that
sends the most while the exchange stays hidden (:mod:`.recommend`). It sits above the engine and the
topologies, whose byte rules it uses; nothing below imports it.
"""

from decent_optim_wrapper.plan.cli import main
from decent_optim_wrapper.plan.compute import JITTERS, ComputeTimes
from decent_optim_wrapper.plan.costs import HostCopy, Link, Network, ddp_buckets, gossip_round_bytes
from decent_optim_wrapper.plan.predict import Prediction, predict
from decent_optim_wrapper.plan.recommend import Candidate, Recommendation, recommend
from decent_optim_wrapper.plan.round_cost import RoundCost, measure_round_cost
from decent_optim_wrapper.plan.schemes import allreduce_scheme, gossip_scheme
from decent_optim_wrapper.plan.sharing import (
    LinkSharing,
    SharedLink,
    SharingModel,
    Transfer,
    transfer_seconds,
)
from decent_optim_wrapper.plan.simulator import AllReduce, Gossip, NoComm, Run, Scheme, paced_steps, simulate
from decent_optim_wrapper.plan.traffic import bytes_per_parameter

__all__ = [
    "JITTERS",
    "AllReduce",
    "Candidate",
    "ComputeTimes",
    "Gossip",
    "HostCopy",
    "Link",
    "LinkSharing",
    "Network",
    "NoComm",
    "Prediction",
    "Recommendation",
    "RoundCost",
    "Run",
    "Scheme",
    "SharedLink",
    "SharingModel",
    "Transfer",
    "allreduce_scheme",
    "bytes_per_parameter",
    "ddp_buckets",
    "gossip_round_bytes",
    "gossip_scheme",
    "main",
    "measure_round_cost",
    "paced_steps",
    "predict",
    "recommend",
    "simulate",
    "transfer_seconds",
]
