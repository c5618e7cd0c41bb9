"""CUDA: compressed gossip and gradient tracking on GPU tensors do what they do on CPU.

Two ranks share one GPU through gloo, which moves CUDA tensors (NCCL refuses two ranks on one
device); the engine's kernels (differences, encoding, decoding, mixing) run on the GPU.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers import batch, tiny_model
from workers import spawn

from decent_optim_wrapper import DecentOptimWrapper, GossipEngine, Pacing
from decent_optim_wrapper.engine.wire.compression import codec

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 8


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-8, 3, 1000, dtype=torch.float64)
    return (torch.randn(1000, generator=g, dtype=torch.float64) * magnitudes).float()


@pytest.mark.parametrize(
    "name",
    [
        "exact",
        "bf16",
        "fp16",
        "int8",
        "int4",
        "int2",
        "topk:0.01:int2",
        "topk:0.03:int4:4096",
        "randk:0.03:int2",
    ],
)
def test_codecs_on_cuda_equal_cpu_bit_for_bit(name):
    coder, values = codec(name), _values()
    payloads, decoded = [], []
    for device in ("cpu", "cuda"):
        payload = torch.empty(
            coder.payload_bytes(values.numel(), values.dtype), dtype=torch.uint8, device=device
        )
        coder.encode(values.to(device).clone(), payload, 42)
        payloads.append(payload.cpu())
        decoded.append(coder.decode(payload, values.numel(), values.dtype, 42).cpu())
    assert torch.equal(payloads[0], payloads[1]) and torch.equal(decoded[0], decoded[1])


def _mix_with_local_changes(rank: int, device: str, wire: str) -> list[torch.Tensor]:
    """Replicas (gathered) after each of ``STEPS`` rounds, with the same local changes on any device."""
    model = tiny_model().to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)).to(device))
    engine = GossipEngine(list(model.named_parameters()), topology="ring", compression=wire)
    noise = torch.Generator().manual_seed(100 + rank)
    history = []
    with torch.no_grad():
        for _ in range(STEPS):

            def local_update() -> None:  # runs after every bucket is mixed
                own = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                everyone = [torch.empty_like(own) for _ in range(2)]
                dist.all_gather(everyone, own)
                history.append(torch.stack(everyone).cpu())
                for p in model.parameters():  # a local update, drawn on the CPU so both devices get it
                    p.add_(torch.randn(p.shape, generator=noise).to(device), alpha=0.03)

            engine.step(local_update)
    return history


def _worker(rank: int, wire: str, directory: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=2)
    try:
        results = {device: _mix_with_local_changes(rank, device, wire) for device in ("cpu", "cuda")}
        torch.save(results, f"{directory}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


#: Two wire steps of a difference below 0.5 (see the test): bf16 2^-8 * 0.5, int8 0.5 / 127, int4
#: 0.5 / 7, int2 (ternary) 0.5 itself; an ulp may also swap which of two near-equal differences top-k
#: sends, which moves each of them by at most itself (below 0.5).
_WIRE_STEP = {"bf16": 0.005, "int8": 0.005, "topk:0.1:int4": 0.5, "randk:0.1:int2": 0.5}


@pytest.mark.parametrize("wire", list(_WIRE_STEP))
def test_compressed_gossip_on_cuda_tensors_matches_cpu(tmp_path, wire):
    spawn(_worker, (wire, str(tmp_path)), nprocs=2)  # killed, with its stacks, if it hangs
    results = torch.load(tmp_path / "rank0.pt", weights_only=True)
    for step, (on_gpu, on_cpu) in enumerate(zip(results["cuda"], results["cpu"], strict=True)):
        # The GPU may fuse a multiply and an add that the CPU rounds twice (fp32 ulps), and an ulp
        # can move a difference across a wire rounding boundary: that element then differs by one
        # wire step of a difference. Differences stay below 0.5 here (local changes of 0.03 N(0, 1),
        # replicas that agree to within them after the exact first round). Such elements are rare:
        # the mean error stays below 1e-3, where a wrong slot, reference or sign would put every
        # element off by the differences themselves (about 0.03 and more).
        error = (on_gpu - on_cpu).abs()
        assert error.max().item() <= 2 * _WIRE_STEP[wire], (
            f"step {step}: the GPU's replicas differ by {error.max():.3g}"
        )
        assert error.mean().item() <= 1e-3, f"step {step}: mean difference {error.mean():.3g}"


def _tracked_training(rank: int, device: str) -> torch.Tensor:
    model = tiny_model(dtype=torch.float64).to(device)
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), topology="ring", gradient_tracking=True
    )
    for step in range(STEPS):
        x, y = batch(rank, step, torch.float64)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])


def _tracking_worker(rank: int, directory: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=2)
    try:
        results = {device: _tracked_training(rank, device) for device in ("cpu", "cuda")}
        torch.save(results, f"{directory}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_gradient_tracking_on_cuda_tensors_matches_cpu(tmp_path):
    spawn(_tracking_worker, (str(tmp_path),), nprocs=2)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        # fp64 and no quantization: only the GPU's other summation orders (1e-16 relative per op)
        torch.testing.assert_close(results["cuda"], results["cpu"], rtol=0, atol=1e-12)


def _paced_training(rank: int, device: str) -> tuple[torch.Tensor, list[int], float | None]:
    """Measured paced rounds on ``device``: rank 0 sleeps 20 ms a step, rank 1 none; 10 rounds."""
    model = tiny_model(dtype=torch.float64).to(device)
    opt = DecentOptimWrapper(
        torch.optim.SGD(model.parameters(), lr=0.1),
        topology="ring",
        sync_every=4,
        pacing=Pacing(repace_every=1),
    )
    while opt.round_count < 10:
        x, y = batch(rank, opt.step_count, torch.float64)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
        if rank == 0:
            time.sleep(0.02)
    report = opt.pace_report()
    assert report is not None
    return (
        torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]),
        [opt.step_count],
        report.round_seconds,
    )


def _paced_worker(rank: int, directory: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=2)
    try:
        torch.save(_paced_training(rank, "cuda"), f"{directory}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_measured_pacing_exchanges_its_messages_on_cuda(tmp_path):
    # The pace messages travel in tensors on the buckets' device (NCCL takes CUDA tensors only): the
    # ranks agree on one round length and the slow rank takes fewer steps.
    spawn(_paced_worker, (str(tmp_path),), nprocs=2)
    (_, slow, slow_tau), (_, fast, fast_tau) = (
        torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)
    )
    assert slow_tau is not None and slow_tau == fast_tau
    assert fast[0] > slow[0]
