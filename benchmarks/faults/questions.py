"""The fault driver's questions: each a name, what it asks, its options' defaults (which set their
types) and, for grow-back, the choices of ``--runs``. What each measures: its module's docstring."""

from __future__ import annotations

CPU_VM = "2-core Intel Xeon VM, CPU, gloo"
GROW_BACK_RUNS = ("steady", "grow-back", "restart")


#: What both soaks share; each soak then sets the defaults that differ.
SOAK = dict(workers=8, seed=0, average_every=10, kill_window_ms=4.0, machine=CPU_VM)

# fmt: off
QUESTIONS = {
    "kills": (
        "workers killed, frozen or hung down to a floor over seeded runs: failures survived, "
        "steps lost, recovery time, corruption",
        dict(SOAK, floor=4, spacing=40, timeout_s=3.0, deadline_s=150.0, runs=17),
    ),
    "rejoins": (
        "the soak on an elastic job, every victim restarted and joining again: joins, losses, "
        "steps lost, corruption, join time, the members' pause",
        dict(SOAK, floor=6, spacing=30, timeout_s=5.0, deadline_s=2400.0, machine="2-core VM, CPU, gloo",
             cycles=48, overlap=0.35, step_time_s=0.02, max_steps=20_000, slow_factor=1.0,
             restart_window_s=4.0),
    ),
    "lost-worker": (
        "accuracy of the averaged model when one of 8 workers is killed at mid-training, "
        "against 7 workers from the start",
        dict(seeds=[0, 1, 2], steps=600, kill_at=300, batch_size=32, lr=0.05, timeout_s=10.0,
             deadline_s=300.0, machine=CPU_VM),
    ),
    "joining": (
        "a live join's costs: the members' pause, the joiner's time to its first step, the "
        "per-step cost of a job open to joiners (and of forged applications), transfer against the link",
        dict(ranks=[4, 8, 16], params=1e6, steps=60, join_after=15, timeout=30.0, step_time=0.05,
             overhead_ranks=4, rounds=3, forged_per_s=10.0, links=[], sizes_mb=[1.0, 10.0, 100.0],
             cluster="", deadline_s=300.0),
    ),
    "grow-back": (
        "losing 2 workers and getting them back by a live join, against no failure and a "
        "restart of every worker from a checkpoint",
        dict(workers=8, params=250_000, steps=300, lose_at=140, checkpoint_every=50, step_time=0.05,
             lr=2e-3, timeout=10.0, link="1gbit", local=False, runs=list(GROW_BACK_RUNS),
             deadline_s=600.0),
        {"runs": dict(nargs="*", choices=GROW_BACK_RUNS, default=list(GROW_BACK_RUNS))},
    ),
    "node-check": (
        "what a job of nodes pays per step to survive a lost node: the node check",
        dict(nodes=2, shards=2, width=512, depth=4, buckets=4, steps=60, warmup=10, step_time=0.02,
             checks=200, rounds=3),
    ),
}
# fmt: on
