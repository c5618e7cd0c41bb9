"""The engine and the optimizer front-end's contract with torch: per-bucket gossip, errors, hooks, waits.

Pure tests (no process group) prove which wait and which GradScaler path is taken for which device
and optimizer; multi-process tests check per-bucket gossip against whole rounds, checkpoints that
are rejected without side effects, and step hooks firing once.
"""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer
from helpers import bare_and_wrapped, batch, flat, set_distinct, tiny_model, train_steps
from torch import nn
from workers import spawn

import decent_optim_wrapper
from decent_optim_wrapper import (
    DecentError,
    DecentOptimWrapper,
    GlobalAverageError,
    GossipEngine,
    GossipError,
)
from decent_optim_wrapper.engine.fleet.comm import wait_all
from decent_optim_wrapper.front_ends.inner_step import GLOBAL_HOOK_REGISTRIES, scaled_step


# -- pure: which wait, which GradScaler path -------------------------------------------------------
class _RecordingWork:
    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []

    def wait(self, *args: object) -> bool:
        self.calls.append(args)
        return True


def _never(cause: BaseException | None) -> Exception:
    raise AssertionError(f"no failure expected, got {cause}")


@pytest.mark.pure
def test_cpu_tensors_wait_with_the_timeout_on_the_host():
    work, timeout = _RecordingWork(), timedelta(seconds=7)
    wait_all([work], torch.device("cpu"), timeout, _never)
    assert work.calls == [(timeout,)]


@pytest.mark.pure
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_accelerator_tensors_use_the_stream_ordered_wait_without_timeout(device):
    # Work.wait(timeout) on NCCL busy-waits the host: a sync per step. wait() only orders the stream.
    work = _RecordingWork()
    wait_all([work], torch.device(device), timedelta(seconds=7), _never)
    assert work.calls == [()]


@pytest.mark.pure
def test_a_failed_wait_raises_the_named_error():
    class Failing:
        def wait(self, *args: object) -> bool:
            raise RuntimeError("connection reset")

    with pytest.raises(GossipError, match="connection reset"):
        wait_all([Failing()], torch.device("cpu"), timedelta(seconds=1), lambda c: GossipError(str(c)))
    with pytest.raises(GossipError, match="False"):
        wait_all([_FalseWork()], torch.device("cpu"), timedelta(seconds=1), lambda c: GossipError("False"))


class _FalseWork:
    def wait(self, *args: object) -> bool:
        return False


def _grads_model() -> nn.Module:
    model = tiny_model()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    return model


@pytest.mark.pure
def test_fused_optimizer_gets_grad_scale_and_found_inf_and_no_host_read(monkeypatch):
    model = _grads_model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    seen = {}
    inner.register_step_pre_hook(lambda opt, a, k: seen.update(scale=opt.grad_scale, inf=opt.found_inf))
    found_inf, scale = torch.zeros(()), torch.full((), 4.0)  # the shapes GradScaler passes

    def host_read(*args: object) -> None:
        raise AssertionError("a tensor was read on the host")

    monkeypatch.setattr(torch.Tensor, "item", host_read)
    monkeypatch.setattr(torch.Tensor, "__bool__", host_read)
    scaled_step(inner, None, scale, found_inf)
    monkeypatch.undo()
    assert seen["scale"] is scale and seen["inf"] is found_inf
    assert not hasattr(inner, "grad_scale") and not hasattr(inner, "found_inf")  # removed afterwards


@pytest.mark.pure
def test_other_optimizers_read_found_inf_once_and_skip_on_inf():
    model = _grads_model()
    before = flat(model)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    reads = []

    class Counted(torch.Tensor):
        def item(self):  # type: ignore[override]
            reads.append(1)
            return super().item()

    assert scaled_step(inner, None, torch.full((), 2.0), torch.ones(()).as_subclass(Counted)) is None
    assert reads == [1] and torch.equal(flat(model), before)  # skipped
    scaled_step(inner, None, torch.full((), 2.0), torch.zeros(()).as_subclass(Counted))
    # unscaled by 2 then stepped with lr 0.1: every parameter moved by exactly 0.05
    assert reads == [1, 1] and torch.equal(flat(model), before - 0.05)


@pytest.mark.pure
def test_error_types_are_exported_with_one_base_class():
    for name in ("DecentError", "GossipError", "GlobalAverageError", "GossipEngine"):
        assert name in decent_optim_wrapper.__all__
    assert issubclass(GossipError, DecentError) and issubclass(GlobalAverageError, DecentError)
    assert issubclass(DecentError, RuntimeError)


# -- multi-process ----------------------------------------------------------------------------------
def _wide_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 3))


def _per_bucket_equals_whole_rounds(topology: str) -> tuple[bool, int, float]:
    """The same run twice: whole rounds through the wrapper; bucket by bucket through the engine."""
    rank = dist.get_rank()
    cap_mb = 1700 * 4 / 2**20  # one Linear layer per bucket: three buckets
    whole_model, bucket_model = _wide_model(), _wide_model()
    whole = DecentOptimWrapper(
        torch.optim.SGD(whole_model.parameters(), lr=0.05), topology=topology, bucket_cap_mb=cap_mb
    )
    engine = GossipEngine(list(bucket_model.named_parameters()), topology=topology, bucket_cap_mb=cap_mb)
    per_bucket = [torch.optim.SGD(b.params, lr=0.05) for b in engine.buckets]
    loss_fn = nn.CrossEntropyLoss()
    for step in range(6):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(8, 40, generator=g), torch.randint(0, 3, (8,), generator=g)
        whole.zero_grad()
        loss_fn(whole_model(x), y).backward()
        whole.step()

        for opt in per_bucket:
            opt.zero_grad()
        loss_fn(bucket_model(x), y).backward()
        engine.begin_step()
        # last bucket first, as a module front-end would (gradients of the last layers are ready first)
        for b in reversed(range(len(engine.buckets))):
            engine.step_bucket(b, per_bucket[b].step)
        engine.end_step()
    whole.global_avg(may_revert=True)  # finishes the rounds in flight too
    engine.global_avg(may_revert=True)
    averaged_equal = torch.equal(flat(whole_model), flat(bucket_model))
    whole.revert_global_avg()
    engine.revert_global_avg()
    replica_equal = torch.equal(flat(whole_model), flat(bucket_model))
    spread = float((flat(whole_model) - flat(bucket_model)).abs().max())
    return averaged_equal and replica_equal, len(engine.buckets), spread


@pytest.mark.parametrize("topology", ["ring", "one-peer-exp", "alternating-exp-ring"])
def test_per_bucket_gossip_equals_whole_rounds_bit_for_bit(pool, topology):
    for equal, buckets, spread in pool(4).run(_per_bucket_equals_whole_rounds, topology):
        assert buckets >= 3
        assert equal, f"{topology}: per-bucket and whole-round runs differ by up to {spread}"


def _bad_gossip_checkpoint_changes_nothing() -> list[str]:
    rank = dist.get_rank()
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.AdamW(model.parameters(), lr=0.01), topology="ring")
    train_steps(model, opt, rank, range(3))
    state = opt.state_dict()
    assert state["decent"]["gossip"] is not None
    train_steps(model, opt, rank, range(3, 5))
    params_before, moments_before = flat(model), [s["exp_avg"].clone() for s in opt.state.values()]
    gossip_before = opt.engine.state_dict()["gossip"]
    errors = []
    corruptions = {
        "gossip buffer shape": lambda d: d["gossip"]["buffers"].__setitem__(0, torch.zeros(3)),
        "params shape": lambda d: d["params"].__setitem__(0, torch.zeros(5)),
        "snapshot": lambda d: d.__setitem__("snapshot", {"params": [torch.zeros(2)], "gossip": None}),
    }
    for what, corrupt in corruptions.items():
        bad = {**state, "decent": {**state["decent"], "params": list(state["decent"]["params"])}}
        bad["decent"]["gossip"] = {"step": 2, "buffers": list(state["decent"]["gossip"]["buffers"])}
        corrupt(bad["decent"])
        try:
            opt.load_state_dict(bad)
        except ValueError as err:
            errors.append(f"{what}: {err}")
        else:
            errors.append(f"{what}: accepted")
        assert torch.equal(flat(model), params_before), what
        assert all(
            torch.equal(s["exp_avg"], m) for s, m in zip(opt.state.values(), moments_before, strict=True)
        ), what
        gossip_now = opt.engine.state_dict()["gossip"]
        assert gossip_now["step"] == gossip_before["step"], what
        assert all(
            torch.equal(a, b) for a, b in zip(gossip_now["buffers"], gossip_before["buffers"], strict=True)
        )
    return errors


def test_rejected_checkpoint_leaves_parameters_gossip_and_optimizer_state_untouched(pool):
    for errors in pool(2).run(_bad_gossip_checkpoint_changes_nothing):
        assert len(errors) == 3
        assert "gossip buffers[0] has shape (3,)" in errors[0] and "different parameter layout" in errors[0]
        assert "params[0] has shape (5,)" in errors[1]
        assert "snapshot params[0] has shape (2,)" in errors[2]


def _count_hooks(world_size_one_scheduler_on: str) -> dict[str, object]:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    model = tiny_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = DecentOptimWrapper(inner, topology="ring")
    seen: dict[str, list[str]] = {"global_pre": [], "global_post": [], "wrapper": [], "inner": []}
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: seen["global_pre"].append(type(o).__name__)),
        register_optimizer_step_post_hook(lambda o, a, k: seen["global_post"].append(type(o).__name__)),
        opt.register_step_post_hook(lambda o, a, k: seen["wrapper"].append(type(o).__name__)),
        inner.register_step_pre_hook(lambda o, a, k: seen["inner"].append(type(o).__name__)),
    ]
    target = opt if world_size_one_scheduler_on == "wrapper" else inner
    scheduler = torch.optim.lr_scheduler.StepLR(target, step_size=2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
            train_steps(model, opt, dist.get_rank(), range(3), scheduler)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("scheduler_on", ["wrapper", "inner"])
def test_global_step_hooks_fire_once_per_step_for_the_wrapper(pool, scheduler_on):
    (seen,) = pool(1).run(_count_hooks, scheduler_on)
    assert seen["global_pre"] == ["DecentOptimWrapper"] * 3
    assert seen["global_post"] == ["DecentOptimWrapper"] * 3
    assert seen["wrapper"] == ["DecentOptimWrapper"] * 3  # per-instance hooks keep working
    assert seen["inner"] == ["SGD"] * 3


@pytest.mark.pure
def test_torch_keeps_the_global_step_hook_registries_the_front_ends_suspend():
    # If a torch release moves them, inner steps would fire the global hooks a second time.
    assert GLOBAL_HOOK_REGISTRIES is not None
    pre, post = GLOBAL_HOOK_REGISTRIES
    handle = torch_optimizer.register_optimizer_step_pre_hook(lambda *_: None)
    try:
        assert handle.id in pre and not post
    finally:
        handle.remove()


def _fused_under_grad_scaler(optimizer: str) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    def run(model, opt):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        scales = []
        for step in range(6):
            x, y = batch(0, step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if step == 2:
                next(model.parameters()).grad[0, 0] = float("inf")  # this step must be skipped
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return flat(model), scales

    def build(params):
        cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
        kwargs = {"momentum": 0.9} if optimizer == "sgd" else {}
        return cls(params, lr=0.01, fused=True, **kwargs)

    (bare, bare_scales), (wrapped, scales) = bare_and_wrapped(run, build, topology="ring")
    assert scales == bare_scales
    return bare, wrapped, scales


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_fused_optimizers_under_grad_scaler_match_the_bare_optimizer_at_world_size_one(pool, optimizer):
    ((bare, wrapped, scales),) = pool(1).run(_fused_under_grad_scaler, optimizer)
    assert scales[2] == scales[1] / 2  # the inf step was seen and skipped
    assert torch.equal(bare, wrapped)


def _engine_from_named_parameters() -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]:
    model = tiny_model(dtype=torch.float64)
    engine = GossipEngine(list(model.named_parameters()), topology="complete")
    set_distinct(model, dist.get_rank(), dyadic=True)
    own = flat(model)
    engine.global_avg()
    averaged = flat(model)
    engine.revert_global_avg()
    return repr(engine), own, averaged, flat(model)


def test_engine_built_from_named_parameters_averages_exactly_and_reverts(pool):
    results = pool(3).run(_engine_from_named_parameters)
    # dyadic multiples of 12: the sum of three and its division by 3 are exact in float64
    mean = torch.stack([own for _, own, _, _ in results]).sum(0) / 3
    for rank, (text, own, averaged, reverted) in enumerate(results):
        assert text.startswith(f"GossipEngine(topology='complete', rank={rank}, world_size=3")
        assert torch.equal(averaged, mean) and torch.equal(reverted, own)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_makes_no_host_sync_on_cuda(tmp_path):
    # One process per GPU (NCCL when there are two or more); under torch.cuda.set_sync_debug_mode
    # ("error"), any synchronizing call inside step() raises.
    world_size = min(2, torch.cuda.device_count())
    spawn(_cuda_no_sync_worker, (world_size, str(tmp_path)), nprocs=world_size)


def _cuda_no_sync_worker(rank: int, world_size: int, directory: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world_size
    )
    try:
        model = tiny_model().cuda()
        opt = DecentOptimWrapper(torch.optim.AdamW(model.parameters(), lr=0.01, fused=True), topology="ring")
        scaler = torch.amp.GradScaler("cuda")
        for step in range(4):
            x, y = batch(rank, step)
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x.cuda()), y.cuda())
            scaler.scale(loss).backward()
            torch.cuda.set_sync_debug_mode("error")
            try:
                scaler.step(opt)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            scaler.update()
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def _state_dict_hooks_fire() -> list[str]:
    model = tiny_model()
    opt = DecentOptimWrapper(torch.optim.SGD(model.parameters(), lr=0.1), topology="ring")
    fired: list[str] = []
    opt.register_state_dict_pre_hook(lambda o: fired.append("save-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: fired.append("save-post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: fired.append("load-pre"))
    opt.register_load_state_dict_post_hook(lambda o: fired.append("load-post"))
    opt.load_state_dict(opt.state_dict())
    return fired


def test_the_wrappers_state_dict_hooks_fire(pool):
    assert pool(1).run(_state_dict_hooks_fire)[0] == ["save-pre", "save-post", "load-pre", "load-post"]
