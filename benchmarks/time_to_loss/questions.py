"""The questions of ``run.py``: each a few defaults, every one of them a ``--flag`` of its question.

The language model of ``harness/lm_task.py`` (width 64, depth 2: 120,576 parameters) with AdamW lr 3e-3
throughout; ``steps`` is the cosine's length, ``eval_every`` how often the ranks write their parameters.
"""

from __future__ import annotations

from typing import Any

SPARSE = "ring~h8d1@topk:0.03:int4"
LM: dict[str, Any] = {"width": 64, "depth": 2, "adam_lr": 3e-3, "warmup": 0, "timeout_s": 120.0}
ADAM = "benchmarks/results/adam/lm-iid-"
POWER_SGD = ["ddp-psgd1", "ddp-psgd2", "ddp-psgd4"]
TORCHFT = ["torchft~h8", "torchft~h8d7", "torchft~h8d7a0.5"]
OURS = ["ring~h8d1", "ring~h8d1@int8", SPARSE, "ring~h4d1@topk:0.03:int4"]

#: slow-link's defaults, and the flags of both questions on shaped links.
LINKS: dict[str, Any] = {
    "nodes": [2, 4],
    "methods": ["nocomm", "ddp", *POWER_SGD, *TORCHFT, *OURS],  # on the shaped links
    "ours": "",  # one more of ours to train there and judge ('planner': the planner's recommendation)
    "topology": "one-peer-exp",  # the planner's topology for --ours planner
    "baselines": [],  # trained on fast links for their loss, then timed on the shaped links
    "timed_steps": 2,  # baselines' steps timed on the shaped links (PowerSGD: after 2; torchft: a period)
    "ddp_ratio": 12.0,  # the links make DDP's ring all-reduce take this many steps...
    "link_steps": 0.0,  # ... or one fp32 model this many steps, if set
    "burst_frames": 0,  # the token bucket's frames (0: tc's default, 4 ms at the rate)
    "queue_s": 0.1,  # seconds a packet may queue at a shaped link
    "message_bytes": 0.0,  # the planner's cost per message beyond its payload (< 0: probe the links)
    "target_loss": 2.2,  # 0: DDP's final loss, and the highest final loss among the methods
    "sooner": 2.0,  # target: ours this many times sooner than the best PowerSGD and torchft runs
    "compute_ms": 40.0,  # a step's compute, topped up by sleep
    "steps": 600,
    "budget_s": 240.0,  # per method: caps its steps at what this allows at its expected pace (0: none)
    "eval_every": 20,
    "batch": 16,
    **LM,
}

# fmt: off
QUESTIONS: dict[str, dict[str, Any]] = {
    "slow-link": {"help": "time to a validation loss on 2 and 4 nodes whose link makes DDP's all-reduce take "
        "--ddp-ratio times a step: DDP, PowerSGD, torchft's DiLoCo, ours; the planner's step times",
        **LINKS},
    "scale-model": {"help": "16 nodes on links that move one fp32 model per --link-steps steps: the "
        "baselines' loss on fast links, timed on the slow ones, against ours (the planner's pick) on them",
        **LINKS,
        "nodes": [16], "methods": ["nocomm"], "ours": "planner", "target_loss": 0.0, "sooner": 1.0,
        "baselines": ["ddp", "ddp-psgd1", "ddp-psgd4", "torchft~h8", "torchft~h32"],
        "link_steps": 320.0, "burst_frames": 4, "message_bytes": -1.0, "budget_s": 0.0,
        "queue_s": 10.0,  # at tens of kbit/s a 100 ms queue dropped the start-up's bursts
        "compute_ms": 400.0, "eval_every": 50, "batch": 8, "warmup": 60,
        "timeout_s": 1800.0},  # one DDP all-reduce takes minutes on these links
    "uneven": {"help": "one worker 3x slower: time to DDP's final loss of paced rounds, synchronous gossip "
        "and DDP, the fleet's steps per second beside the planner's simulation",
        "nodes": [4, 8, 16], "methods": ["nocomm", "ddp", "sync", "paced"], "bandwidth": "200mbit",
        "compute_ms": 150.0,  # x the rank's factor
        "gossip": "ring~h8d1",  # sync and paced: a '~hH' method
        "steps": 240,  # DDP's
        "budget": 2.0,  # gossip: this many times DDP's samples
        "eval_every": 8,  # gossip: every eval_every / H rounds
        "nocomm_steps": 24, "batch": 8,
        "deadline_s": 600.0,  # a method's ranks are killed after this
        **LM},
    "lm": {"help": "steps to DDP's loss in convergence lm --eval-every results times the planner's step time",
        "results": [f"{ADAM}{n}.json" for n in (2, 4, 8)]
        + [f"{ADAM}{n}-blocking.json" for n in (2, 4, 8)]
        + [f"{ADAM}8-blocking-local.json", f"{ADAM}16.json", f"{ADAM}16-blocking-h200cpu.json"],
        "compute_ms": 18.0,
        "bandwidth": 0.0,  # bits/s per node and direction; 0: one fp32 model per --link-steps' compute
        "link_steps": 1.0,
        "message_bytes": 0.0,  # the link's cost per message beyond its payload (the probe's, scale-model)
        "reference": [],  # convergence lm JSONs: the target is the best of their ddp+adamw (DDP's best lr)
        "tolerance": 1.02},  # reach DDP's final loss times this
}
# fmt: on
