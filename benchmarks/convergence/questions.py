"""The convergence driver's questions: what each asks, its options' defaults (a type, such as ``float``:
unset by default) and the values some options take."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.lm_task import LM_SPLITS
from benchmarks.harness.synthetic_task import SPLITS
from decent_optim_wrapper import ClippedGossip

# fmt: off
CLASSIFICATION_METHODS = [
    "ring", "one-peer-exp", "complete", "alternating-exp-ring", "hierarchical", "ddp",
    "ring@bf16", "ring@int8", "one-peer-exp@bf16", "one-peer-exp@int8",
    "ring-gt", "one-peer-exp-gt", "ring-gt@bf16", "ring-module+accum-adamw", "ring-module-gt+accum-adamw",
    "ddp+adamw", "ring~h8", "ring~h8n", "ring~h8n0.1", "ring~h8n0.1p", "one-peer-exp~h8n0.1",
    "complete~h8n0.1d0", "ring~h32n0.1", "one-peer-exp~h32n0.1", "complete~h32n0.1d0",
]
LM_METHODS = [
    "ddp+adamw", "ring+adamw", "ring~h8+adamw", "ring~h8n+adamw", "ring~h8n0.2+adamw",
    "one-peer-exp~h8n0.2+adamw", "complete~h8n0.2d0+adamw", "ring~h32n0.2+adamw",
]
RULES = (
    "ddp", "local", "oracle", "oracle-per-tensor", "lag1-floor", "momentum-floor",
    "lag1", "momentum", "lag1-abs", "momentum-abs",
)
ATTACKS = ("none", "scaled", "random", "negated", "alternating", "flipping")
ATTACK_METHODS = ("ddp", "ring", "ring-clipped")
ACCELERATE_METHODS = (
    "ddp", "local-sgd", "gossip-complete", "gossip-ring", "gossip-complete-d1", "gossip-ring-d1",
)

#: name: (what it asks, its options' defaults, the values some options may take)
QUESTIONS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "classification": (
        "accuracy of the averaged model for every method against DDP's, iid and skewed",
        dict(workers=8, methods=CLASSIFICATION_METHODS, splits=list(SPLITS), alpha=0.1, steps=600,
             batch_size=32, lr=0.05, adam_lr=3e-3, task="synthetic", seeds=[0], deadline=14400.0),
        {"splits": SPLITS, "task": ("synthetic", "digits")}),
    "lm": ("validation loss of the language model, gossip with AdamW against DDP",
        dict(workers=4, methods=LM_METHODS, splits=["iid"], steps=600, batch_size=16, adam_lr=3e-3,
             eval_every=0, warmup=0, width=64, depth=2, seed=0, reuse=[], deadline=14400.0),
        {"splits": LM_SPLITS}),
    "adam_rules": ("second-moment rules for Adam under averaging, simulated in one process",
        dict(workers=4, rules=list(RULES), steps=600, batch_size=16, adam_lr=3e-3, split="iid", gossip=str,
             width=64, depth=2, seed=0, ddp_loss=float),
        {"rules": RULES, "split": LM_SPLITS}),
    "seeds": ("each method's loss over its own run's DDP loss across several lm runs (JSON files)",
        dict(target=1.05), {}),
    "attack": ("one Byzantine worker among 8: the honest workers' loss with DDP, plain and clipped gossip",
        dict(workers=8, steps=300, seeds=[0], methods=list(ATTACK_METHODS), attacks=list(ATTACKS),
             task="classification", clip_factor=ClippedGossip.factor, clip_quantile=ClippedGossip.quantile,
             clip_drop=str(ClippedGossip.drop_beyond), clip_audit=str(ClippedGossip.audit_every),
             deadline=1800.0),
        {"methods": ATTACK_METHODS, "attacks": ATTACKS, "task": ("classification", "digits", "lm")}),
    "accelerate": ("an Accelerate loop: Accelerator (DDP), LocalSGD and DecentralizedAccelerator",
        dict(workers=4, every=8, seeds=[0, 1, 2], tasks=["classification", "lm"],
             methods=list(ACCELERATE_METHODS), classification_steps=300, lm_steps=200, deadline=600.0),
        {"methods": ACCELERATE_METHODS, "tasks": ("classification", "lm")}),
}
# fmt: on
