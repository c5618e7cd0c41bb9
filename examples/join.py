"""A job that loses workers and gets them back live: the same command starts a worker or brings one back.

    # the store, on a machine that stays (here: this one), for as long as the job runs
    python examples/join.py --host-store --port 29500 &
    # the workers that start the job, each with its place among them
    for r in 0 1 2; do MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=$r WORLD_SIZE=3 \\
        python examples/join.py --crash 1:40 & done
    # rank 1 exits at step 40 (a lost node); the two others go on. Bring it back with the same
    # command: the job is running, so the worker joins it, takes a member's replica and goes on
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 RANK=1 WORLD_SIZE=3 python examples/join.py --crash 1:40
    # or grow beyond the starting size: the same command once more (any RANK below WORLD_SIZE)

The quickstart's task (an MLP on a synthetic 10-class problem) trained with ``DecentOptimWrapper`` on
a ring with ``on_peer_failure="continue"``. ``initialize_dist(elastic=True)`` forms the job with the
workers that start together, or, when the job already runs, leaves the process in a world of its own
until its front-end joins. Each worker's data shard follows its rank and the world size, re-cut in the
hooks whenever the world changes; the LR scheduler reaches a joiner through ``register_join_state``.
``--step-time`` adds a pause per step, standing in for real compute, so that a restarted worker
finds the job still running. Docs: joining a running job.
"""

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from quickstart import make_data, make_model  # the quickstart's task, next to this script
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper, PeerFailure, PeerJoin, initialize_dist


def parse_args() -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument(
        "--host-store", action="store_true", help="host the job's store (the launcher's part)"
    )
    parser.add_argument("--port", type=int, default=29500, help="the store's port, with --host-store")
    parser.add_argument("--steps", type=int, default=150, help="total training steps (of the whole job)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of pause per step")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds before a silent peer is lost")
    parser.add_argument("--crash", default="", help="RANK:STEP: that starting worker exits at that step")
    return parser.parse_args()


def host_store(port: int) -> None:
    """Host the store the workers meet in, until interrupted: it must outlive every worker."""
    store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)
    print(f"store listening on port {port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        del store


def main() -> None:
    args = parse_args()
    if args.host_store:
        host_store(args.port)
        return
    torch.set_num_threads(1)
    initialize_dist(elastic=True)
    crash = tuple(int(v) for v in args.crash.split(":")) if args.crash else None
    started_as = int(os.environ.get("RANK", "0"))

    train_x, train_y, test_x, test_y = make_data()
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = DecentOptimWrapper(
        sgd, topology="ring", timeout=timedelta(seconds=args.timeout), on_peer_failure="continue"
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    optimizer.register_join_state("scheduler", scheduler)
    joined = optimizer.joined
    if joined is not None:
        donor = joined.donors[joined.joined.index(joined.rank)]
        where = f"at step {optimizer.step_count} as rank {joined.rank} of {joined.world_size}"
        print(f"joined the running job {where} (replica from rank {donor})", flush=True)

    shard: list[torch.Tensor] = []

    def reshard(event: PeerFailure | PeerJoin | None = None) -> None:
        rank, world = optimizer.rank, optimizer.world_size
        shard[:] = [train_x[rank::world], train_y[rank::world]]
        if event is not None and rank == 0:
            print(f"step {optimizer.step_count}: the world is {world} workers now", flush=True)

    optimizer.register_peer_failure_hook(reshard)
    optimizer.register_join_hook(reshard)
    reshard()

    loss_fn = nn.CrossEntropyLoss()
    for step in range(optimizer.step_count, args.steps):
        if crash == (started_as, step) and joined is None:
            print(
                f"injected failure: the worker started as rank {started_as} exits at step {step}", flush=True
            )
            os._exit(1)  # no clean-up, as a crash
        g = torch.Generator().manual_seed(1000 * step + optimizer.rank)
        index = torch.randint(len(shard[0]), (args.batch_size,), generator=g)
        optimizer.zero_grad()
        loss_fn(model(shard[0][index]), shard[1][index]).backward()
        optimizer.step()
        scheduler.step()
        time.sleep(args.step_time)

    optimizer.global_avg(may_revert=False)
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    lost = sum(len(f.lost) for f in optimizer.peer_failures)
    admitted = sum(len(j.joined) for j in optimizer.peer_joins)
    print(
        f"finished at step {optimizer.step_count} as rank {optimizer.rank} of {optimizer.world_size}; "
        f"lost {lost}, admitted {admitted}; averaged model's accuracy {accuracy:.3f}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
