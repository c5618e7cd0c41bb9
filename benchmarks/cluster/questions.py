"""The questions ``benchmarks/cluster/run.py`` answers: a help line and the options' defaults each
(``QUESTION --name value`` overrides one); the options reach ``rank.py`` as one JSON config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from decent_optim_wrapper.plan import JITTERS

#: What every timed run's ranks train, and how, unless a question says otherwise (``rank.py``).
MODEL = {"inputs": 512, "width": 1024, "depth": 3, "compute": "real", "compute_ms": 200.0}
TIMED = MODEL | {"rounds": 3, "warmup": 3, "iters": 20, "forward_fraction": 1 / 3, "scenarios": []}
TIMED |= {"sigma": 0.5, "slow_factor": 1.5, "seed": 0, "fresh_batches": False, "flush_denormal": False}
SPEED_METHODS = ("nocomm", "ddp", "ddp-bf16", "ring", "ring@bf16", "ring@int8", "ring-module")
SPEED_METHODS += ("ring-module@bf16", "one-peer-exp", "one-peer-exp@bf16")
LOW_COMM_METHODS = ("nocomm", "ddp", "ddp-bf16", "avg~h8", "ring", "ring~h8n", "ring~h8n@bf16")
LOW_COMM_METHODS += ("ring~h8nd0", "ring~h32n", "torchft~h8", "torchft~h8d7")


@dataclass(frozen=True)
class Question:
    """``help``: one line for ``--help``; ``defaults``: its options; ``root``: builds the emulated cluster."""

    help: str
    defaults: dict[str, Any] = field(default_factory=dict)
    root: bool = True


QUESTIONS = {
    "speed": Question(
        "2 nodes, a sweep of link rates: no communication, DDP (bf16 too), gossip (compressed or not)",
        TIMED
        | {"nodes": 2, "workers_per_node": 1, "bandwidths": ["unlimited", "200mbit"], "batch": 2048}
        | {"iters": 15, "link_check_mb": 20.0, "run_seconds": 420.0, "max_seconds": 900.0}
        | {"methods": [*SPEED_METHODS]},
    ),
    "low_comm": Question(
        "2 nodes whose link takes --exchange-steps steps' compute per model: DDP, periodic averaging, "
        "low-communication gossip, torchft's DiLoCo",
        TIMED
        | {"nodes": 2, "workers_per_node": 1, "exchange_steps": 8.0, "rate": "", "rounds": 2, "batch": 512}
        | {"warmup": 32, "iters": 64, "run_seconds": 900.0, "fresh_batches": True, "flush_denormal": True}
        | {"methods": [*LOW_COMM_METHODS]},
    ),
    "accelerate": Question(
        "an Accelerate loop on 4 nodes: Accelerator (DDP), LocalSGD every K steps, gossip every K",
        TIMED
        | {"nodes": 4, "workers_per_node": 1, "bandwidths": ["200mbit", "50mbit"], "batch": 1024}
        | {"loop": "accelerate", "every": 8, "iters": 24, "warmup": 8, "link_check_mb": 0.0}
        | {"run_seconds": 900.0, "max_seconds": 3600.0}
        | {"methods": ["nocomm", "ddp", "local-sgd", "gossip-complete", "gossip-ring"]},
    ),
    "uneven": Question(
        "workers of unequal speed (half 2x slower, one 3x, the slow one changing): the fleet's steps per "
        "second with paced rounds, synchronous gossip and DDP against the sum of own rates",
        {"nodes": [8], "bandwidth": "200mbit", "scenarios": ["half2x", "one3x", "shift"], "rounds": 30}
        | {"methods": ["nocomm", "ddp", "sync", "paced"], "sync_every": 8, "compute_ms": 40.0}
        | {"shift_s": 6.0, "nocomm_s": 5.0, "inputs": 256, "width": 512, "depth": 2, "run_seconds": 900.0},
    ),
    "scaling": Question(
        "2 to 16 nodes of sleeping compute under constant compute, jitter and a straggler (one size a run)",
        TIMED
        | {"nodes": 2, "workers_per_node": 1, "bandwidth": "20mbit", "compute": "emulated"}
        | {"compute_ms": 199.0, "forward_fraction": 0.39, "scenarios": list(JITTERS), "inputs": 256}
        | {"width": 256, "batch": 24576, "rounds": 2, "iters": 15, "link_check_mb": 2.0, "run_seconds": 540.0}
        | {"methods": ["nocomm", "ddp", "ddp-bf16", "ring", "one-peer-exp", "ring@bf16"]},
    ),
    "report": Question(
        "the scaling runs' tables, the simulator replayed on each, docs/figures/scaling.png, predictions",
        {"results": "benchmarks/results/scaling", "figure": "docs/figures/scaling.png", "sigma": 0.2}
        | {"predict_nodes": [32, 64, 256, 1024]},
        root=False,
    ),
    "link_sharing": Question(
        "how two overlapping all-reduces share a link, and the planner's SharingModel fitted to it",
        {"bandwidth": "20mbit", "deltas": [-1.0, 0.0, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2]}
        | {"reps": 10, "numel": 134154, "run_seconds": 300.0, "fit": ""},
        root=False,  # --fit needs none; a run checks for root itself
    ),
    "hsdp": Question(
        "decentralized HSDP against whole replicas and torch's HSDP: memory per rank (no root), step time "
        "on 4 nodes x 2 ranks",
        TIMED
        | {"part": "all", "shards": 2, "replicas": 2, "memory_seconds": 120.0, "topology": "ring"}
        | {"memory_configs": ["whole", "whole@bf16", "gossip-hsdp", "gossip-hsdp@bf16", "torch-hsdp"]}
        | {"mem_inputs": 1024, "mem_width": 1024, "mem_depth": 8, "mem_batch": 32, "mem_steps": 4}
        | {"nodes": 4, "bandwidth": "40mbit", "compute": "emulated", "compute_ms": 400.0, "width": 512}
        | {"iters": 12, "link_check_mb": 5.0, "run_seconds": 360.0}
        | {"methods": ["fsdp", "torch-hsdp", "ring", "one-peer-exp", "ring@bf16"]},
        root=False,  # the memory part runs on loopback; the cluster part checks for root itself
    ),
}
