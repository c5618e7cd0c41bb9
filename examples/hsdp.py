"""Decentralized HSDP: shard each replica over a node's ranks with FSDP2, gossip between the replicas.

    uv run examples/hsdp.py                       # 4 CPU processes: 2 replicas x 2 shards, gossip on a ring
    uv run examples/hsdp.py --compare             # the same run with torch's HSDP (all-reduce) beside it
    torchrun --nproc-per-node 8 examples/hsdp.py --worker --shards 8   # on a node of 8 GPUs, N nodes

A stack of residual MLP blocks learns a fixed random teacher; every rank draws its own batches. The
mesh is (replicas, shards) with dimensions ``"replicate"`` and ``"shard"``: ``fully_shard`` splits
every block over ``mesh["shard"]`` (the ranks of a node), and ``DecentOptimWrapper(...,
device_mesh=mesh["replicate"])`` gossips each rank's shards with the ranks holding the same shards in
the other replicas. ``--trainer hsdp`` trains the same model with torch's HSDP instead (``fully_shard``
over the 2-D mesh: gradients all-reduced across replicas every step). At the end every replica is set
to the exact average (``global_avg``) and evaluated; the script prints the validation loss, time per
step, the bytes each rank sends per step across replicas, and the bytes of tensors a rank holds
(gossip holds more: a copy of its shards in the buckets, and the state of Adam's second-moment rule).
The big models page of the docs explains the recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from decent_optim_wrapper import DecentOptimWrapper
from decent_optim_wrapper.launch import initialize_dist

WIDTH, DEPTH, BATCH, INPUTS = 128, 4, 32, 32


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(INPUTS, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (batch, 1), not squeezed: FSDP2 warns of a module that returns a view


def teacher(x: torch.Tensor) -> torch.Tensor:
    """The target: a fixed random two-layer network, the same on every rank."""
    generator = torch.Generator().manual_seed(1234)
    w1 = torch.randn(INPUTS, 64, generator=generator) / INPUTS**0.5
    w2 = torch.randn(64, generator=generator) / 8
    return torch.tanh(x @ w1) @ w2.unsqueeze(-1)  # (batch, 1), the model's output shape


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, INPUTS, generator=torch.Generator().manual_seed(100_000 * rank + step))
    return x, teacher(x)


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, extra: list[torch.Tensor]) -> int:
    """Bytes of the tensors this rank holds for training: parameter shards, gradients, optimizer state,
    and ``extra`` (the gossip buckets' copies of the shards)."""
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()] + extra
    tensors += [g.to_local() if hasattr(g, "to_local") else g for g in (p.grad for p in model.parameters())]
    for state in optimizer.state.values():
        tensors += [v.to_local() if hasattr(v, "to_local") else v for v in state.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    rank, world_size = initialize_dist()
    shards = args.shards
    if world_size % shards:
        raise SystemExit(f"--shards {shards} must divide the {world_size} processes")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world_size // shards, shards), mesh_dim_names=("replicate", "shard"))
    model = Net().to(device)
    # torch's HSDP shards over "shard" and all-reduces over "replicate"; gossip shards over "shard" only.
    shard_over = mesh if args.trainer == "hsdp" else mesh["shard"]
    for block in model.blocks:
        fully_shard(block, mesh=shard_over)
    fully_shard(model, mesh=shard_over)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if args.trainer == "hsdp":
        optimizer: torch.optim.Optimizer = inner
    else:
        optimizer = DecentOptimWrapper(
            inner, topology=args.topology, compression=args.compression, device_mesh=mesh["replicate"]
        )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.steps)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = (t.to(device) for t in batch(step, rank))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if rank == 0 and (step + 1) % max(1, args.steps // 5) == 0:
            print(f"step {step + 1}: train loss {loss.item():.4f}", flush=True)
    ms_per_step = 1000 * (time.perf_counter() - start) / args.steps
    buckets: list[torch.Tensor] = []
    if isinstance(optimizer, DecentOptimWrapper):
        buckets = [bucket.data for bucket in optimizer.buckets]
        sent = optimizer.engine.bytes_sent_per_step()
        optimizer.global_avg(may_revert=False)  # every replica is now the exact average
    else:
        # HSDP all-reduces this rank's gradient shard across the replicas: ~2(R-1)/R shards sent.
        replicas = mesh["replicate"].size()
        shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        sent = 2 * (replicas - 1) / replicas * shard_bytes
    with torch.no_grad():
        x = torch.randn(1024, INPUTS, generator=torch.Generator().manual_seed(-1 % 2**31)).to(device)
        val_loss = nn.functional.mse_loss(model(x), teacher(x.cpu()).to(device)).item()
    result = {
        "trainer": args.trainer,
        "val_loss": val_loss,
        "ms_per_step": ms_per_step,
        "bytes_sent_per_step": sent,
        "held_bytes": held_bytes(model, inner, buckets),
    }
    if rank == 0:
        print(f"{args.trainer}: " + "  ".join(f"{k} {v:.4g}" for k, v in result.items() if k != "trainer"))
        if args.json:
            Path(args.json).write_text(json.dumps(result))
    dist.destroy_process_group()


def launch(args: argparse.Namespace, trainer: str, out: str | None) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.processes)]
    command += [__file__, "--worker", "--trainer", trainer, "--steps", str(args.steps)]
    command += ["--shards", str(args.shards), "--topology", args.topology, "--lr", str(args.lr)]
    command += ["--compression", args.compression] if args.compression else []
    command += ["--json", out] if out else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the processes share the CPU cores
    subprocess.run(command, check=True, timeout=3600, env=env)


def compare(args: argparse.Namespace) -> None:
    results = {}
    for trainer in ("gossip", "hsdp"):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
            out = handle.name
        launch(args, trainer, out)
        results[trainer] = json.loads(Path(out).read_text())
        os.unlink(out)
    print(f"\n{args.processes} processes as {args.processes // args.shards} replicas x {args.shards} shards:")
    print(f"{'trainer':<22}{'val_loss':>10}{'ms/step':>9}{'bytes sent/step':>17}{'bytes held':>12}")
    for trainer, r in results.items():
        label = f"gossip ({args.topology})" if trainer == "gossip" else "torch HSDP"
        print(
            f"{label:<22}{r['val_loss']:>10.4f}{r['ms_per_step']:>9.1f}"
            f"{r['bytes_sent_per_step']:>17,.0f}{r['held_bytes']:>12,}"
        )


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--trainer", choices=("gossip", "hsdp"), default="gossip")
    parser.add_argument("--processes", type=int, default=4, help="processes to start (without --worker)")
    parser.add_argument("--shards", type=int, default=2, help="ranks each replica is sharded over")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--topology", default="ring")
    parser.add_argument("--compression", default=None, help="e.g. bf16")
    parser.add_argument("--compare", action="store_true", help="run gossip and torch's HSDP, print a table")
    parser.add_argument("--worker", action="store_true", help="train in this process (started by a launcher)")
    parser.add_argument("--json", help="write the final metrics here (rank 0)")
    args = parser.parse_args()
    if args.worker:
        torch.set_num_threads(1)
        train(args)
    elif args.compare:
        compare(args)
    else:
        launch(args, args.trainer, args.json)


if __name__ == "__main__":
    main()
