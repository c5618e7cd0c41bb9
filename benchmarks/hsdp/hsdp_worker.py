"""One rank of ``benchmarks/hsdp/hsdp.py``: decentralized HSDP against torch's HSDP, memory or step time.

Two modes:

* ``hsdp_worker.py memory --config NAME ...``: build one training setup, train a few steps of a real
  MLP, and write to ``--out`` what this rank holds: the bytes of its tensors by kind (parameters,
  gradients, optimizer state, the engine's bucket copies, gossip buffers) and its peak RSS growth.
  Configurations: ``whole`` (``DecentOptimWrapper`` without a mesh: every rank a whole replica),
  ``gossip-hsdp`` (FSDP2 over the ``"shard"`` mesh dimension, gossip along ``"replicate"``) and
  ``torch-hsdp`` (FSDP2 over the 2-D mesh); ``@bf16`` after a gossip one compresses its gossip.
* otherwise the rank of an emulated cluster that ``emulated_cluster.run_workers`` starts:
  ``cluster_worker.py``'s rounds, timing and output, with its model building replaced by the HSDP
  methods below. The world is ``--world-size / --local-world-size`` nodes (replicas) of
  ``--local-world-size`` ranks (shards), so a shard group is a node and a replicate group holds one
  rank per node. Methods: ``fsdp`` (sharded inside the node, no communication between replicas: the
  floor), ``torch-hsdp``, ``nocomm`` (whole model alone; ``cluster_worker`` warms up with it) and the
  gossip methods ``topology[@compression]``. Beside the bytes each method sends per step it writes the
  bytes its node's link actually carried (the veth's ``tx_bytes``), to check the count.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import resource
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks.harness import cluster_worker
from benchmarks.harness.cluster_worker import COLLECTIVE_TIMEOUT, parse_gossip_method
from benchmarks.harness.common import build_mlp
from benchmarks.harness.methods import COMPRESSIONS
from decent_optim_wrapper import DecentOptimWrapper

MEMORY_KINDS = ("whole", "gossip-hsdp", "torch-hsdp")
#: Methods of the cluster mode that are not gossip.
SHARDED_BASELINES = ("fsdp", "torch-hsdp")


@functools.cache
def hsdp_mesh(replicas: int, shards: int) -> DeviceMesh:
    """The (replicate, shard) mesh, built once per process: every build creates new process groups."""
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 over ``mesh``: every Linear its own unit (gathered only while it runs), then the root."""
    for layer in [m for m in model.modules() if isinstance(m, nn.Linear)]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def shard_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameters (its shards when sharded)."""
    return sum(local(p).numel() * local(p).element_size() for p in model.parameters())


def gossip_optimizer(
    model: nn.Module, topology: str, compression: str | None, mesh: DeviceMesh | None
) -> DecentOptimWrapper:
    options: dict[str, Any] = {"compression": compression} if compression else {}
    if mesh is not None:
        options["device_mesh"] = mesh["replicate"]
    return DecentOptimWrapper(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        topology=topology,
        timeout=COLLECTIVE_TIMEOUT,
        **options,
    )


# -- cluster mode: the methods cluster_worker.run_segment trains -------------------------------------------


def make_training(
    method: str, model: nn.Module, args: argparse.Namespace
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``model`` sharded (or not) for ``method`` and its optimizer; replaces cluster_worker's."""
    shards = args.local_world_size
    mesh = hsdp_mesh(args.world_size // shards, shards)
    if method == "nocomm":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif method in SHARDED_BASELINES:
        # torch's HSDP: FSDP2 over both dimensions, so backward all-reduces the reduce-scattered
        # gradient shards across the replicas; fsdp: over the node's ranks only.
        shard_model(model, mesh if method == "torch-hsdp" else mesh["shard"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        topology, module, compression = parse_gossip_method(method)
        if module:
            raise ValueError(f"method {method!r}: the module front-end is not benchmarked with FSDP2")
        shard_model(model, mesh["shard"])
        optimizer = gossip_optimizer(model, topology, compression, mesh)
    # What bytes_sent_per_step needs, which cluster_worker does not pass it: the node's link counter
    # now (read again once the segment's steps are done), those steps, and the shards per node.
    model.segment = (link_tx_bytes(), args.warmup + args.iters, shards)  # type: ignore[assignment]
    return model, optimizer


def link_tx_bytes() -> int | None:
    """Bytes this node has sent over its link (the veth gloo uses), None outside the emulated cluster.

    ``ip netns exec`` mounts the namespace's own /sys, so this is the node's interface.
    """
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    path = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")
    return int(path.read_text()) if ifname and path.exists() else None


def bytes_sent_per_step(
    method: str, model: nn.Module, optimizer: torch.optim.Optimizer | None, world_size: int
) -> dict[str, float | None]:
    """Replaces cluster_worker's: bytes over the inter-node link per step and rank, and what the link saw.

    ``counted``: for gossip the engine's ``bytes_sent_per_step()``; for torch's HSDP a ring
    all-reduce of the rank's fp32 gradient shard among the R replicas, ``2 (R - 1) / R`` shard bytes
    (FSDP2 reduce-scatters inside the node first, over loopback, which is not counted); 0 for fsdp and
    nocomm. ``link_tx_per_step``: the node's veth ``tx_bytes`` over all the segment's steps, per step:
    warm-up included (and so a compressed group's first round, which is exact), TCP/IP headers
    included; both ranks of the node read the same counter.
    """
    start, steps, shards = model.segment
    replicas = world_size // shards
    own = shard_bytes(model)
    if method == "torch-hsdp":
        counted: float = own * 2 * (replicas - 1) / replicas
    elif method in ("fsdp", "nocomm"):
        counted = 0.0
    else:
        assert isinstance(optimizer, DecentOptimWrapper)
        counted = float(optimizer.engine.bytes_sent_per_step())
    end = link_tx_bytes()
    link = None if start is None or end is None else (end - start) / steps
    return {"counted": counted, "shard_bytes": float(own), "link_tx_per_step": link}


# -- memory mode ---------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident set size of this process now (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Largest resident set size this process has had (``ru_maxrss``, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages under ``tensors`` not in ``seen`` (which they join): a view counts once."""
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        storage = local(tensor).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def gossip_buffer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The engine's gossip buffers, as its public ``state_dict()`` shows them (copies of the same size).

    The received sums of the round in flight, and with compression the gathered payloads and the
    references; the decoding scratch of compressed rounds is not in the state and not counted.
    """
    if not isinstance(optimizer, DecentOptimWrapper):
        return []
    gossip = optimizer.engine.state_dict()["gossip"] or {}
    tensors = [t for t in gossip.get("buffers", []) + gossip.get("gathered", []) if t is not None]
    for entry in gossip.get("references", []):
        tensors += [t for t in entry["tensors"] if t is not None]
    return tensors


def held_tensor_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the tensors this rank holds, by kind, each storage counted once (first kind wins).

    Whole-replica gossip makes the parameters views of its buckets, so its buckets add nothing;
    with FSDP2 the buckets are a copy of the local shards (``engine_copy``).
    """
    seen: set[int] = set()
    params = list(model.parameters())
    held = {
        "params": storage_bytes(params, seen),
        "grads": storage_bytes((p.grad for p in params), seen),
        "optimizer_state": storage_bytes((v for s in optimizer.state.values() for v in s.values()), seen),
    }
    engine = optimizer.engine if isinstance(optimizer, DecentOptimWrapper) else None
    held["engine_copy"] = storage_bytes((b.data for b in engine.buckets), seen) if engine else 0
    # Copies made by state_dict(): summed by size, not by storage.
    held["gossip_buffers"] = sum(t.numel() * t.element_size() for t in gossip_buffer_tensors(optimizer))
    held["total"] = sum(held.values())
    return held


def train(args: argparse.Namespace, width: int, steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``steps`` AdamW steps of the MLP of ``width`` in configuration ``args.config``."""
    kind, _, compression = args.config.partition("@")
    torch.manual_seed(0)
    model = build_mlp(args.inputs, width, args.depth, 10)
    mesh = None if kind == "whole" else hsdp_mesh(args.world_size // args.shards, args.shards)
    if kind == "torch-hsdp":
        shard_model(model, mesh)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        if mesh is not None:
            shard_model(model, mesh["shard"])
        optimizer = gossip_optimizer(model, args.topology, compression or None, mesh)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(args.batch, args.inputs, generator=generator)
    y = torch.randint(0, 10, (args.batch,), generator=generator)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model, optimizer


def memory_run(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.steps`` steps of configuration ``args.config``; what this rank held.

    RSS follows the tensors only if freed memory goes back to the system: the driver sets a fixed
    ``MALLOC_MMAP_THRESHOLD_``, so that glibc maps every large allocation on its own and unmaps it
    when freed (with its default, adaptive threshold, memory FSDP2 frees stays in the heap and the
    RSS of every configuration grows step after step).
    """
    # A run of the same configuration on a tiny model first: the lazy imports, autograd's and gloo's
    # threads and the mesh's process groups then exist before the baseline, not in the growth.
    train(args, width=8, steps=2)
    gc.collect()
    baseline = rss_bytes()
    model, optimizer = train(args, args.width, args.steps)
    steady, peak = rss_bytes(), peak_rss_bytes()  # before held_tensor_bytes, whose copies would count
    return {
        "config": args.config,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "params": sum(p.numel() for p in model.parameters()),
        "held": held_tensor_bytes(model, optimizer),
        "rss_baseline": baseline,
        "rss_growth": steady - baseline,
        "peak_rss_growth": peak - baseline,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


def memory_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="memory mode of hsdp_worker.py")
    parser.add_argument("--config", required=True, help="whole, gossip-hsdp, torch-hsdp; @bf16 for gossip")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--topology", default="ring")
    parser.add_argument("--inputs", type=int, default=1024)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    kind, at, compression = args.config.partition("@")
    if kind not in MEMORY_KINDS or (at and (kind == "torch-hsdp" or compression not in COMPRESSIONS)):
        parser.error(f"--config {args.config!r}: one of {', '.join(MEMORY_KINDS)}, gossip ones with @bf16")
    return args


def memory_main(argv: list[str]) -> None:
    args = memory_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = memory_run(args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    cluster_worker.write_atomically(args.out, result)


def cluster_main() -> None:
    args = cluster_worker.parse_args()
    if args.world_size % args.local_world_size:
        raise SystemExit("--local-world-size (shards per node) must divide --world-size")
    # cluster_worker.run_segment looks both up by name at every segment: its rounds, timing and output
    # stay its own, the models and optimizers are the HSDP methods'.
    cluster_worker.make_training = make_training
    cluster_worker.bytes_sent_per_step = bytes_sent_per_step
    cluster_worker.main()


if __name__ == "__main__":
    if sys.argv[1:2] == ["memory"]:
        memory_main(sys.argv[2:])
    else:
        cluster_main()
