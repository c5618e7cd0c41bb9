"""Decentralized HSDP against whole replicas and torch's HSDP: the ranks' methods and memory counts.

Decentralized HSDP shards each replica over a node's ranks with FSDP2 (mesh dimension ``"shard"``) and
gossips every shard across the replicas (``device_mesh=mesh["replicate"]``); torch's HSDP all-reduces
each gradient shard across the replicas in every backward; ``fsdp`` never talks across replicas.
"""

from __future__ import annotations

import functools
import gc
import os
import resource
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from benchmarks.harness.common import build_mlp
from benchmarks.harness.emulated_cluster import COLLECTIVE_TIMEOUT, write_atomically
from benchmarks.harness.methods import parse_method
from decent_optim_wrapper import DecentOptimWrapper

SHARDED_BASELINES = ("fsdp", "torch-hsdp")
HELD_COLUMNS = ("params", "grads", "optimizer_state", "engine_copy", "gossip_buffers", "total")
MMAP_THRESHOLD = 128 * 1024
#: The planner's names for the methods that are not gossip.
PLANNER_NAMES = {"torch-hsdp": "ddp", "fsdp": "nocomm"}


@functools.cache
def hsdp_mesh(replicas: int, shards: int) -> DeviceMesh:
    """The (replicate, shard) mesh, once per process: every build creates new process groups."""
    return init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 over ``mesh``: every Linear its own unit (gathered only while it runs), then the root."""
    for layer in [m for m in model.modules() if isinstance(m, nn.Linear)]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def shard_bytes(model: nn.Module) -> int:
    return sum(local(p).numel() * local(p).element_size() for p in model.parameters())


def sharded_training(model: nn.Module, kind: str, mesh: DeviceMesh | None, gossip: str | None) -> Any:
    """``model`` sharded for ``kind`` (``whole``: not, ``torch-hsdp``: over the mesh, else over the node)
    and AdamW, wrapped in ``gossip`` across the replicas (``mesh`` None: the world)."""
    if kind != "whole":
        shard_model(model, mesh if kind == "torch-hsdp" else mesh["shard"])  # type: ignore[index]
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if gossip is None:
        return adamw
    spec = parse_method(gossip)
    if spec.module or spec.topology is None:
        raise ValueError(f"method {gossip!r}: HSDP gossip is topology[@compression] (no -module)")
    options: dict[str, Any] = {"compression": spec.compression} if spec.compression else {}
    if mesh is not None:
        options["device_mesh"] = mesh["replicate"]
    return DecentOptimWrapper(adamw, topology=spec.topology, timeout=COLLECTIVE_TIMEOUT, **options)


def link_tx_bytes() -> int | None:
    """Bytes this node has sent over its link (``ip netns exec`` mounts the namespace's /sys)."""
    path = Path(f"/sys/class/net/{os.environ.get('GLOO_SOCKET_IFNAME')}/statistics/tx_bytes")
    return int(path.read_text()) if "GLOO_SOCKET_IFNAME" in os.environ and path.exists() else None


def build(method: str, model: nn.Module, cfg: Any) -> tuple[nn.Module, Any, Callable[[], Any]]:
    """``model`` sharded for ``method``, its optimizer, and ``sent()``: bytes ``counted`` per step and rank
    (torch's HSDP: a ring all-reduce of the gradient shard), ``shard_bytes``, the veth's ``tx_bytes``."""
    shards = cfg.local_world_size
    replicas = cfg.world_size // shards
    kind = {"nocomm": "whole", "fsdp": "fsdp", "torch-hsdp": "torch-hsdp"}.get(method, "gossip-hsdp")
    gossip = None if method in ("nocomm", *SHARDED_BASELINES) else method
    optimizer = sharded_training(model, kind, hsdp_mesh(replicas, shards), gossip)
    start, steps = link_tx_bytes(), cfg.warmup + cfg.iters

    def sent() -> dict[str, float | None]:
        own = shard_bytes(model)
        if method == "torch-hsdp":
            counted = own * 2 * (replicas - 1) / replicas
        else:
            counted = float(optimizer.engine.bytes_sent_per_step()) if hasattr(optimizer, "engine") else 0.0
        end = link_tx_bytes()
        link = None if start is None or end is None else (end - start) / steps
        return {"counted": counted, "shard_bytes": float(own), "link_tx_per_step": link}

    return model, optimizer, sent


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages under ``tensors`` not in ``seen`` (which they join): a view counts once."""
    total = 0
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            storage = local(tensor).untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def gossip_buffer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The engine's gossip buffers as its ``state_dict()`` shows them (sums, payloads, references)."""
    if not isinstance(optimizer, DecentOptimWrapper):
        return []
    gossip = optimizer.engine.state_dict()["gossip"] or {}
    tensors = [t for t in gossip.get("buffers", []) + gossip.get("gathered", []) if t is not None]
    for entry in gossip.get("references", []):
        tensors += [t for t in entry["tensors"] if t is not None]
    return tensors


def held_tensor_bytes(model: nn.Module, optimizer: Any) -> dict[str, int]:
    """Bytes of the tensors this rank holds, by kind, each storage once (first kind wins: whole replicas'
    parameters are views of the buckets, FSDP2's shards are copied into them)."""
    seen: set[int] = set()
    params = list(model.parameters())
    held = {
        "params": storage_bytes(params, seen),
        "grads": storage_bytes((p.grad for p in params), seen),
        "optimizer_state": storage_bytes((v for s in optimizer.state.values() for v in s.values()), seen),
    }
    engine = optimizer.engine if isinstance(optimizer, DecentOptimWrapper) else None
    held["engine_copy"] = storage_bytes((b.data for b in engine.buckets), seen) if engine else 0
    held["gossip_buffers"] = sum(t.numel() * t.element_size() for t in gossip_buffer_tensors(optimizer))
    held["total"] = sum(held.values())
    return held


def train(cfg: Any, width: int, steps: int) -> tuple[nn.Module, Any]:
    """``steps`` AdamW steps of the MLP of ``width`` in configuration ``cfg.config``."""
    kind, _, compression = cfg.config.partition("@")
    torch.manual_seed(0)
    model = build_mlp(cfg.mem_inputs, width, cfg.mem_depth, 10)
    mesh = None if kind == "whole" else hsdp_mesh(cfg.world_size // cfg.shards, cfg.shards)
    gossip = None if kind == "torch-hsdp" else cfg.topology + (f"@{compression}" if compression else "")
    optimizer = sharded_training(model, kind, mesh, gossip)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(cfg.mem_batch, cfg.mem_inputs, generator=generator)
    y = torch.randint(0, 10, (cfg.mem_batch,), generator=generator)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model, optimizer


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_rank(cfg: Any) -> None:
    """``mem_steps`` steps of ``config`` after a tiny model's warm-up (imports, threads, the mesh's groups:
    not in the growth); write what this rank held."""
    train(cfg, width=8, steps=2)
    gc.collect()
    baseline = rss_bytes()
    model, optimizer = train(cfg, cfg.mem_width, cfg.mem_steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params, held = sum(p.numel() for p in model.parameters()), held_tensor_bytes(model, optimizer)
    result = {"config": cfg.config, "rank": dist.get_rank(), "params": params, "held": held}
    result["peak_rss_growth"] = peak - baseline
    dist.barrier()
    write_atomically(cfg.out, result)


def memory_rows(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per configuration: the largest rank's bytes of each kind and peak RSS growth."""
    rows = {}
    for config, ranks in results.items():
        row: dict[str, float] = {kind: max(r["held"][kind] for r in ranks) for kind in HELD_COLUMNS}
        row |= {"peak_rss_growth": max(r["peak_rss_growth"] for r in ranks), "ranks": len(ranks)}
        rows[config] = row
    return rows


def cluster_rows(runs: dict[str, Any], shards: int) -> dict[str, dict[str, float | None]]:
    """Per method: the median step (ms) and bytes per step and rank on the slow link (``link_bytes``: the
    mean over nodes of a node's ranks' mean reading over ``shards``)."""
    rows: dict[str, dict[str, float | None]] = {}
    for method, run in runs.items():
        sent = run["bytes_sent_per_step"]  # one dict per rank, in rank order
        readings = [s["link_tx_per_step"] for s in sent]
        row = rows[method] = {"median_ms": 1e3 * run["median_s"], "link_bytes": None}
        row["counted_bytes"] = max(s["counted"] for s in sent)
        row["shard_bytes"] = max(s["shard_bytes"] for s in sent)
        if None not in readings:
            nodes = [sum(readings[i : i + shards]) / shards / shards for i in range(0, len(readings), shards)]
            row["link_bytes"] = sum(nodes) / len(nodes)
    return rows
