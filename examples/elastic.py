"""Elastic training: periodic per-rank checkpoints, resumed at whatever world size the job restarts with.

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # for torchrun itself: restarted workers need a fresh store
    # one machine, 3 workers; a worker that fails restarts the group once, from the newest checkpoint
    torchrun --standalone --nproc-per-node 3 --max-restarts 1 examples/elastic.py --ckpt-dir /tmp/elastic
    # then go on with 2 workers: every worker starts from the average of the 3 saved replicas
    torchrun --standalone --nproc-per-node 2 examples/elastic.py --ckpt-dir /tmp/elastic --steps 300
    # several machines, 1 to 4 of them, the same command on each (HOST runs the rendezvous):
    torchrun --nnodes 1:4 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id job1 examples/elastic.py --ckpt-dir /shared/elastic

Without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` torchrun hands the restarted workers the store of the
first attempt, and gloo's set-up of the new process group reads the old workers' addresses and fails
or hangs (pytorch/pytorch#135712).

The quickstart's task (an MLP on a synthetic 10-class problem, each worker its own shard) trained with
``DecentOptimWrapper`` on a ring. Every ``--every`` steps each rank writes its own part,
``ckpt_dir/step_XXXXXXXX/rank_R.pt`` (its replica, optimizer and gossip state, and the LR scheduler);
after a barrier rank 0 writes ``COMPLETE`` (with the world size), so a checkpoint cut short by a failure
is never loaded, and older checkpoints are pruned (``--keep`` are kept). At start every rank loads the
newest complete checkpoint with ``optimizer.load_state_dicts``: at the saved world size each rank gets
its own replica back (bit for bit), at another every rank starts from the exact average of the saved
replicas (docs: elastic restarts).

Fault injection: ``--crash RANK:STEP`` (or ``ELASTIC_CRASH=RANK:STEP``) makes that rank exit at that
step on the first attempt only (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0), so
``--max-restarts`` shows the whole group restarting from the newest complete checkpoint.

How often to checkpoint: a failure loses the steps since the last complete checkpoint (half an interval
on average) plus the restart, so pick the interval that makes that small next to the time between
failures (e.g. every 10 to 30 minutes of training on a large job), and no more often than writing one
costs: each rank writes only its own replica, in parallel with the others, and no rank gathers
anything. To keep it cheaper still, write to local disk and copy off in the background, or hand
``state_dict()`` (it holds fresh copies) to a writer thread and go on training. Loading maps every
saved file (``torch.load(mmap=True)``), so a rank reads only what it averages, bucket by bucket.
"""

import argparse
import json
import os
import shutil
import socket
from pathlib import Path

import torch
import torch.distributed as dist
from quickstart import make_data, make_model  # the quickstart's task, next to this script
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper

MARKER = "COMPLETE"  # written by rank 0 once every rank's file of a checkpoint is on disk


def parse_args() -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--ckpt-dir", type=Path, required=True, help="where checkpoints are written and read")
    parser.add_argument("--steps", type=int, default=200, help="total training steps (of the whole job)")
    parser.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--crash",
        default=os.environ.get("ELASTIC_CRASH"),
        help="RANK:STEP: that rank exits at that step, on the first attempt only (default: $ELASTIC_CRASH)",
    )
    return parser.parse_args()


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in ``directory``, oldest first."""
    found = [d for d in directory.glob("step_*") if (d / MARKER).exists()]
    return sorted(found, key=lambda d: int(d.name.removeprefix("step_")))


def save(directory: Path, step: int, optimizer: DecentOptimWrapper, scheduler: object, keep: int) -> None:
    """Every rank writes its own part; rank 0 marks the checkpoint complete and prunes old ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    target = directory / f"step_{step:08d}"
    target.mkdir(parents=True, exist_ok=True)
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}  # type: ignore[attr-defined]
    part = target / f".rank_{rank}.pt.tmp"
    torch.save(state, part)
    os.replace(part, target / f"rank_{rank}.pt")  # a file is whole or absent
    dist.barrier()  # every rank's file is written
    if rank == 0:
        (target / MARKER).write_text(json.dumps({"step": step, "world_size": world}))
        kept = complete_checkpoints(directory)[-keep:]
        for old in directory.glob("step_*"):
            if old not in kept:
                shutil.rmtree(old, ignore_errors=True)  # older, or left incomplete by a failure


def resume(directory: Path, optimizer: DecentOptimWrapper, scheduler: object, attempt: int) -> int:
    """Load the newest complete checkpoint, at whatever world size this run has; the step to go on from."""
    rank, world = dist.get_rank(), dist.get_world_size()
    newest = [complete_checkpoints(directory)[-1:] if rank == 0 else None]
    dist.broadcast_object_list(newest, src=0)  # every rank loads the same checkpoint
    if not newest[0]:
        if rank == 0:
            print(f"starting from scratch on {world} workers (attempt {attempt})", flush=True)
        return 0
    (checkpoint,) = newest[0]
    saved_world = json.loads((checkpoint / MARKER).read_text())["world_size"]
    files = [checkpoint / f"rank_{r}.pt" for r in range(saved_world)]  # not a glob: stale files stay out
    states = [torch.load(f, mmap=True, weights_only=True) for f in files]
    optimizer.load_state_dicts([s["optimizer"] for s in states])
    scheduler.load_state_dict(states[0]["scheduler"])  # type: ignore[attr-defined]  # the same on every rank
    if rank == 0:
        print(
            f"resumed from {checkpoint.name}: step {optimizer.step_count}, written by {saved_world} workers, "
            f"now {world} workers (attempt {attempt})",
            flush=True,
        )
    return optimizer.step_count


def main() -> None:
    args = parse_args()
    if "RANK" not in os.environ:  # not started by torchrun: one worker
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    crash = tuple(int(v) for v in args.crash.split(":")) if args.crash else None

    train_x, train_y, test_x, test_y = make_data()
    shard_x, shard_y = train_x[rank::world], train_y[rank::world]  # the shards follow the world size
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = DecentOptimWrapper(sgd, topology="ring")
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    start = resume(args.ckpt_dir, optimizer, scheduler, attempt)

    loss_fn = nn.CrossEntropyLoss()
    for step in range(start, args.steps):
        if crash == (rank, step) and attempt == 0:
            print(f"injected failure: rank {rank} exits at step {step}", flush=True)
            os._exit(1)  # no clean-up, as a crash
        g = torch.Generator().manual_seed(1000 * step + rank)
        index = torch.randint(len(shard_x), (args.batch_size,), generator=g)
        optimizer.zero_grad()
        loss = loss_fn(model(shard_x[index]), shard_y[index])
        loss.backward()
        optimizer.step()
        scheduler.step()
        if (step + 1) % args.every == 0 or step + 1 == args.steps:
            save(args.ckpt_dir, step + 1, optimizer, scheduler, args.keep)
            if rank == 0:
                print(f"step {step + 1}: loss {loss.item():.4f} (rank 0), checkpoint written", flush=True)

    optimizer.global_avg(may_revert=False)
    with torch.no_grad():
        accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
    if rank == 0:
        print(f"finished {args.steps} steps on {world} workers; averaged model's accuracy {accuracy:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
