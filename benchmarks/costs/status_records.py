"""What the status records cost (the records ``python -m decent_optim_wrapper.monitor`` reads).

Every 2 s a member's heartbeat thread builds its record (the engine's counters, its last changes of
members), seals it with the job secret and writes it and the job's pointer into the store. Two
measurements, each side by side in one run:

(a) **One record.** ``StatusBoard.publish`` into a ``TCPStore`` hosted by this process, sealed, for
    jobs of 4, 64 and 512 members (a record lists them) with a full record of events: the median
    time of a record, its size, and what it costs a member per second of training (the median over
    the 2 s between records), as a share of one core.

(b) **A training step with records on and off.** A 2-rank elastic job (``init_elastic``, a store
    hosted here, ``on_peer_failure="continue"``, a ring, AdamW on an MLP) trains ``--steps`` steps
    with the records on and, as a second job, with ``DECENT_STATUS_RECORDS=0`` (the heartbeats beat
    in both: only the records differ); the two alternate over ``--rounds`` rounds, the order
    swapped every round, so that a drift of the machine affects both alike. Reported: each job's
    median step time on rank 0, the ratio on/off per round, and the median ratio with its spread
    (min to max over the rounds).

Run: ``uv run benchmarks/costs/status_records.py [--json PATH]`` (about 5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.harness.common import build_mlp, collect_from_ranks
from decent_optim_wrapper import DecentOptimWrapper, init_elastic
from decent_optim_wrapper.engine import RECORD_S, RECORDS_ENV, Seal
from decent_optim_wrapper.engine.fleet.status import MAX_EVENTS, StatusBoard, status_key

SECRET = "the-secret-of-the-cost-benchmark-0123"


# -- (a) one record ---------------------------------------------------------------------------------
class _Fields:
    """A member's engine fields as the engine reports them (``GossipEngine.status_fields``)."""

    def __init__(self, world: int) -> None:
        self.world, self.step = world, 0

    def fields(self) -> dict[str, Any]:
        self.step += 100
        return {
            "rank": 1, "world_size": self.world, "step": self.step, "round": self.step, "topology": "ring",
            "bytes_per_step": 6.3e6, "compression": None, "wait_s": 12.5, "losses": 1, "joins": 2,
            "guard": {"withheld": 0, "refused": 0, "healed": 0}, "pace_round_s": None, "pace_step_s": None,
            "consensus": 0.0123, "consensus_step": self.step,
        }  # fmt: skip


def one_record(world: int, repeats: int) -> dict[str, float]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    engine = _Fields(world)
    board = StatusBoard("cost")
    board.attach(engine.fields)
    board.placed("decent-optim-wrapper/cost", 1, 3, list(range(world)), Seal(SECRET.encode()))
    for k in range(MAX_EVENTS):  # a full record: its last changes of members
        board.event("lost", step=k, generation=k, members=[k % world], world_size=world - 1)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        board.publish(store)
        times.append(time.perf_counter() - started)
    size = len(store.get(status_key("decent-optim-wrapper/cost", 1)))
    median = statistics.median(times)
    return {"world": world, "median_us": median * 1e6, "bytes": size, "share_of_a_core": median / RECORD_S}


# -- (b) a training step with records on and off --------------------------------------------------------
def _rank(rank: int, port: int, records: bool, job: str, args: dict[str, Any], results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ[RECORDS_ENV] = "1" if records else "0"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    init_elastic(store, rank, 2, job=job, secret=SECRET, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = build_mlp(args["width"], args["width"], 3, 10)
    opt = DecentOptimWrapper(
        torch.optim.AdamW(model.parameters(), lr=1e-3), topology="ring", on_peer_failure="continue"
    )
    x = torch.randn(args["batch"], args["width"], generator=torch.Generator().manual_seed(rank))
    times = []
    for step in range(args["warmup"] + args["steps"]):
        started = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step >= args["warmup"]:
            times.append(time.perf_counter() - started)
    results.put(
        (rank, {"median_ms": statistics.median(times) * 1e3, "mean_ms": statistics.fmean(times) * 1e3})
    )
    dist.destroy_process_group()


def one_job(records: bool, job: str, args: dict[str, Any]) -> dict[str, Any]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = collect_from_ranks(
        2, _rank, lambda rank, _port, results: (rank, store.port, records, job, args, results), 600, job
    )
    return ranks[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000, help="timed steps of each job")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=200, help="records timed in (a)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, gloo on loopback")
    print(f"(a) one record, sealed, into a TCPStore on loopback; {args.repeats} records each")
    part_a = [one_record(world, args.repeats) for world in (4, 64, 512)]
    for row in part_a:
        print(
            f"    {row['world']:4d} members: {row['median_us']:8.1f} us a record, {row['bytes']:6d} bytes, "
            f"{100 * row['share_of_a_core']:.4f}% of a core (one record every {RECORD_S:g} s)"
        )
    settings = {k: getattr(args, k) for k in ("steps", "warmup", "width", "batch")}
    print(
        f"(b) 2 ranks, ring, AdamW, MLP width {args.width} x3, batch {args.batch}, {args.steps} timed steps "
        f"a job, records on and off alternating"
    )
    rounds = []
    for k in range(args.rounds):
        order = (True, False) if k % 2 == 0 else (False, True)
        run = {on: one_job(on, f"cost-{k}-{'on' if on else 'off'}", settings) for on in order}
        ratio = run[True]["median_ms"] / run[False]["median_ms"]
        rounds.append(
            {"on": run[True], "off": run[False], "ratio": ratio, "first": "on" if order[0] else "off"}
        )
        print(
            f"    round {k}: on {run[True]['median_ms']:.3f} ms, off {run[False]['median_ms']:.3f} ms "
            f"(median step, rank 0; {'on' if order[0] else 'off'} first), ratio on/off {ratio:.4f}"
        )
    ratios = [r["ratio"] for r in rounds]
    print(
        f"    median ratio on/off {statistics.median(ratios):.4f}, spread {min(ratios):.4f} to "
        f"{max(ratios):.4f} over {len(ratios)} rounds"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"one_record": part_a, "rounds": rounds, "settings": settings}, f, indent=2)
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
