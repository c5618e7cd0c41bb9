"""Multi-process: DecentralizedDataParallel, the module front-end that updates inside backward.

Each decent-dp 0.2.3 bug the module front-end must not have is a test here that its behaviour
fails: parameters without a gradient in iteration 1, per-bucket clipping, per-bucket inf skipping,
a first round mixed with the wrong phase's weights, global_avg before iteration 2, a revert without
snapshot restoring stale values, an average thrown away at the next step, construction that passes
a parameter-list prefix, a division by zero at world size 1.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer
from helpers import bare_and_wrapped, batch, flat, gather, set_distinct, tiny_model
from resume import Resumable, assert_resume_is_bitwise
from simulation import reference_algorithm
from torch import nn

from decent_optim_wrapper import Group, Topology
from decent_optim_wrapper.data_parallel import DecentralizedDataParallel

# Several buckets for the tiny model (6x8+8, 8x3+3 parameters): about one tensor per bucket.
SMALL_BUCKETS_MB = 40 * 4 / 2**20


def sgd_fn(params, lr=0.1, momentum=0.9):
    return torch.optim.SGD([p for _, p in params], lr=lr, momentum=momentum)


def adamw(params, lr=0.01):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)


def adamw_fn(named_params, lr=0.01):
    return adamw([p for _, p in named_params], lr=lr)


def _train(ddp: DecentralizedDataParallel, rank: int, steps: range, scaler=None) -> None:
    dtype = next(ddp.parameters()).dtype
    for step in steps:
        x, y = batch(rank, step, dtype)
        loss = nn.functional.cross_entropy(ddp(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()


# -- the recursion -------------------------------------------------------------------------------------
def _module_run(topology: str, steps: int, bucket_mb: float) -> torch.Tensor:
    model = tiny_model()
    ddp = DecentralizedDataParallel(model, sgd_fn, topology=topology, bucket_size_in_mb=bucket_mb)
    _train(ddp, dist.get_rank(), range(steps))
    ddp.engine.wait_all()
    return flat(model)


@pytest.mark.parametrize(("world_size", "topology"), [(2, "ring"), (4, "ring"), (2, "complete")])
def test_trajectory_equals_the_independent_simulation(pool, world_size, topology):
    # The simulation applies the recursion to whole models in one process; pairs and rings of
    # pairs sum two terms, so the module front-end must match it bit for bit, bucket by bucket.
    reference = reference_algorithm(world_size, topology, steps=6)
    for bucket_mb in (25, SMALL_BUCKETS_MB):
        results = pool(world_size).run(_module_run, topology, 6, bucket_mb)
        for rank in range(world_size):
            assert torch.equal(results[rank], reference[rank]), f"rank {rank}, buckets of {bucket_mb} MB"


def _complete_with_identical_data(world_size_unused: int) -> tuple[torch.Tensor, torch.Tensor]:
    def run(model, opt):  # opt None: the module front-end, which steps inside backward
        for step in range(6):
            x, y = batch(0, step)  # the same data on every rank
            if opt is not None:
                opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if opt is not None:
                opt.step()
        if opt is None:
            model.engine.wait_all()
        return flat(model)

    # Identical data breaks the premise of second_moment="average" (independent noise on each rank), so
    # that rule is not plain training here; the mechanics under test are the gossip's.
    return bare_and_wrapped(
        run, adamw, "module", topology="complete", bucket_size_in_mb=SMALL_BUCKETS_MB, second_moment="local"
    )


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_complete_with_identical_data_is_plain_training(pool, world_size):
    # the average of identical replicas is the replica itself: x/2 + x/2 and 4 * (x/4) are exact
    for bare, trained in pool(world_size).run(_complete_with_identical_data, world_size):
        assert torch.equal(bare, trained)


def _clip_and_scaler_at_world_size_one(mode: str) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    def bare_loop(model, opt, scaler):
        scales = []
        for step in range(6):
            x, y = batch(0, step)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                if step == 2:
                    model[0].weight.grad[0, 0] = math.inf
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                loss.backward()
                nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                opt.step()
        return scales

    def module_loop(ddp):
        ddp_scales = []
        overflow = {"now": False}
        ddp.module[0].weight.register_hook(lambda g: torch.full_like(g, math.inf) if overflow["now"] else g)
        for step in range(6):
            x, y = batch(0, step)
            loss = nn.functional.cross_entropy(ddp(x), y)
            if scaler is None:
                loss.backward()
                continue
            overflow["now"] = step == 2
            scaler.scale(loss).backward()
            ddp_scales.append(scaler.get_scale())
        return ddp_scales

    def run(model, opt):  # opt None: the module front-end, with the scaler and clipping it was given
        if opt is None:
            return flat(model), module_loop(model)
        bare_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if mode == "scaler" else None
        return flat(model), bare_loop(model, opt, bare_scaler)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if mode == "scaler" else None
    (bare, scales), (trained, ddp_scales) = bare_and_wrapped(
        run, adamw, "module", scaler=scaler, grad_clip_norm=0.05, bucket_size_in_mb=SMALL_BUCKETS_MB
    )
    assert ddp_scales == scales
    return bare, trained, scales


@pytest.mark.parametrize("mode", ["clip", "scaler"])
def test_global_norm_clipping_and_one_scaler_decision_match_the_bare_loop(pool, mode):
    # decent-dp clips each bucket to the norm (sqrt(#buckets) too much in total) and skips only the
    # bucket holding an inf; with several buckets only the global decisions match the bare loop.
    ((bare, trained, scales),) = pool(1).run(_clip_and_scaler_at_world_size_one, mode)
    assert torch.equal(bare, trained)
    if mode == "scaler":
        assert scales[2] == scales[1] / 2


def _inf_on_one_rank_skips_its_whole_update() -> dict[str, object]:
    rank = dist.get_rank()
    model = tiny_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ddp = DecentralizedDataParallel(
        model, adamw_fn, topology="ring", scaler=scaler, bucket_size_in_mb=SMALL_BUCKETS_MB
    )
    _train(ddp, rank, range(2), scaler)
    steps_before = [int(s["step"]) for o in ddp.optimizers for s in o.state.values()]
    if rank == 1:
        model[2].bias.register_hook(lambda g: torch.full_like(g, math.inf))  # one bucket only
    replica_before = flat(model)
    x, y = batch(rank, 2)
    scaler.scale(nn.functional.cross_entropy(ddp(x), y)).backward()
    steps_after = [int(s["step"]) for o in ddp.optimizers for s in o.state.values()]
    moved = not torch.equal(flat(model), replica_before)  # rank 1: by mixing alone
    ddp.engine.wait_all()  # hangs (and the test fails) if a rank did not launch this round
    return {
        "before": steps_before,
        "after": steps_after,
        "scale": scaler.get_scale(),
        "count": ddp.step_count,
        "moved": moved,
    }


def test_an_inf_anywhere_skips_the_whole_local_update_but_not_the_gossip(pool):
    results = pool(2).run(_inf_on_one_rank_skips_its_whole_update)
    for rank, r in enumerate(results):
        assert r["count"] == 3 and r["moved"] and len(r["before"]) == 4
        if rank == 1:
            assert r["after"] == r["before"]  # no bucket stepped, yet the replica was mixed
            assert r["scale"] == 2.0**7
        else:
            assert all(a == b + 1 for a, b in zip(r["after"], r["before"], strict=True))
            assert r["scale"] == 2.0**8


# -- construction ---------------------------------------------------------------------------------------
class LateBranch(nn.Module):
    """``late`` gets a gradient only from iteration 2 on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.late = nn.Linear(6, 3), nn.Linear(6, 3)
        self.use_late = False

    def forward(self, x):
        out = self.body(x)
        return out + self.late(x) if self.use_late else out


def _late_parameters_are_trained() -> tuple[bool, int]:
    rank = dist.get_rank()
    model = LateBranch()
    ddp = DecentralizedDataParallel(model, sgd_fn, topology="ring")
    before = flat(model.late)
    _train(ddp, rank, range(1))
    unchanged_in_iteration_1 = torch.equal(flat(model.late), before)
    model.use_late = True
    _train(ddp, rank, range(1, 3))
    bucketed = sum(len(b.params) for b in ddp.engine.buckets)
    return unchanged_in_iteration_1 and not torch.equal(flat(model.late), before), bucketed


def test_parameters_without_a_gradient_in_iteration_one_are_bucketed_and_trained(pool):
    for trained, bucketed in pool(2).run(_late_parameters_are_trained):
        assert trained and bucketed == 4


def _construction_mismatch() -> str:
    rank = dist.get_rank()
    model = tiny_model() if rank == 0 else nn.Sequential(*tiny_model(), nn.Linear(3, 3))
    try:
        DecentralizedDataParallel(model, sgd_fn)
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_parameter_list_that_differs_is_an_error_on_every_rank(pool):
    # decent-dp compares the lists with zip, so rank 0's list passes as a prefix of rank 1's
    for message in pool(2).run(_construction_mismatch):
        assert "bucket layout" in message and "differs between rank 0 and rank(s) [1]" in message


def _mixed_dtypes() -> list[object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    ddp = DecentralizedDataParallel(model, sgd_fn)
    return [str(b.data.dtype) for b in ddp.engine.buckets] + [str(p.dtype) for p in model.parameters()]


def test_buckets_never_mix_dtypes_and_the_model_keeps_its_dtypes(pool):
    (result,) = pool(2).run(_mixed_dtypes)[:1]
    assert sorted(result[:2]) == ["torch.bfloat16", "torch.float32"]
    assert result[2:] == ["torch.float32"] * 2 + ["torch.bfloat16"] * 2


def _runs_with(topology: str, local_world_size: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    model = tiny_model()
    ddp = DecentralizedDataParallel(model, sgd_fn, topology=topology, _local_world_size=local_world_size)
    _train(ddp, dist.get_rank(), range(4))
    replicas = gather(flat(model))
    ddp.global_avg()
    return ddp.step_count, replicas, gather(flat(model))


@pytest.mark.parametrize(
    ("world_size", "topology", "local"),
    [
        (1, "complete", 1),
        (1, "ring", 1),
        (3, "ring", 1),
        (3, "one-peer-exp", 1),
        (2, "alternating-exp-ring", 1),
    ],
)
def test_world_size_one_odd_sizes_and_one_process_per_node(pool, world_size, topology, local):
    # decent-dp divides by zero at world size 1 and with alternating-exp-ring at one process per node
    for steps, replicas, averaged in pool(world_size).run(_runs_with, topology, local):
        assert steps == 4
        # global_avg: the very same bits on every rank (one all-reduce), and the replicas' mean
        assert all(torch.equal(averaged[0], other) for other in averaged)
        if world_size == 1:
            assert torch.equal(averaged[0], replicas[0])
            continue
        # It first settles the round in flight (which keeps the mean up to k <= n roundings), then
        # sums n fp32 replicas and divides by n (n roundings); each rounding moves an entry by at
        # most u max|x|, so 2n u max|x| = n eps max|x| bounds the distance to the float64 mean.
        atol = world_size * torch.finfo(torch.float32).eps * replicas.abs().max().item()
        torch.testing.assert_close(averaged[0].double(), replicas.double().mean(0), rtol=0, atol=atol)
        assert not torch.equal(replicas[0], replicas[1])  # there was something to average


class TwoWeights(Topology):
    """Pairs (0, 1), (2, 3) with self-weight 0.75, then pairs (1, 2), (3, 0) with self-weight 0.5."""

    def assign_groups(self):
        n = self.world_size
        first = [Group((r - r % 2, r - r % 2 + 1), self_weight=0.75) for r in range(n)]
        second = [Group(tuple(sorted({r, (r + 1) % n if r % 2 else (r - 1) % n})), 0.5) for r in range(n)]
        return [[first[r], second[r]] for r in range(n)]


def _weighted_rounds(factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    rank = dist.get_rank()
    model = tiny_model(dtype=torch.float64)
    ddp = DecentralizedDataParallel(model, partial(sgd_fn, lr=0.0, momentum=0.0), topology=TwoWeights(4))
    if factor != 1.0:
        ddp.set_adaptive_factor(factor)
    set_distinct(model, rank)
    start = gather(flat(model))
    _train(ddp, rank, range(4))  # lr 0: only mixing moves the replicas; rounds 0-2 are mixed
    return start, gather(flat(model))


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_each_round_is_mixed_with_the_weights_of_its_phase(pool, factor):
    # decent-dp mixes the first round with the weights of the wrong phase
    start, end = pool(4).run(_weighted_rounds, factor)[0]
    topo = TwoWeights(4)
    product = torch.eye(4, dtype=torch.float64)
    for step in range(3):
        product = (
            (1 - factor) * torch.eye(4, dtype=torch.float64) + factor * topo.mixing_matrix(step)
        ) @ product
    torch.testing.assert_close(end, product @ start, rtol=0, atol=1e-12)  # float64, 3 rounds of 2 terms


# -- global averaging ---------------------------------------------------------------------------------------
def _global_avg_contract(view: bool) -> dict[str, object]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    model.register_buffer("low_precision", torch.zeros(5, dtype=torch.bfloat16))
    ddp = DecentralizedDataParallel(
        model, sgd_fn, topology="ring", sync_buffer_in_global_avg=True, param_as_bucket_view=view
    )
    model.low_precision.copy_(torch.arange(5) / 3 + rank)  # replicas' buffers differ
    out: dict[str, object] = {}
    try:
        ddp.revert_global_avg()
    except RuntimeError as err:
        out["no_snapshot"] = str(err)
    ddp.global_avg()  # before the first iteration (decent-dp crashes before iteration 2)
    ddp.revert_global_avg()
    _train(ddp, rank, range(3))
    replica, buffers = flat(model), [b.clone() for b in model.buffers()]
    d2c = ddp.global_avg(return_d2c=True)
    averaged = flat(model)
    out["same_on_all_ranks"] = bool((gather(averaged) == averaged).all())
    out["buffers_averaged"] = float(model.low_precision[0]) == 0.5  # (0 + 1) / 2, summed in fp32
    out["d2c"] = (d2c, float((replica.double() - averaged.double()).norm()))
    ddp.revert_global_avg()
    out["reverted"] = torch.equal(flat(model), replica) and all(
        torch.equal(a, b) for a, b in zip(model.buffers(), buffers, strict=True)
    )
    try:
        ddp.revert_global_avg()
    except RuntimeError:
        out["second_revert_refused"] = torch.equal(flat(model), replica)
    ddp.global_avg(will_revert=False)
    averaged = flat(model)
    for optimizer in ddp.optimizers:
        for group in optimizer.param_groups:
            group["lr"] = 0.0  # an iteration that changes nothing locally
    x, y = batch(rank, 9)
    nn.functional.cross_entropy(ddp(x), y).backward()
    # training continues from the average: not thrown away, and no stale gossip mixed in
    out["continued"] = torch.equal(flat(model), averaged)
    out["consensus_after_average"] = ddp.consensus_distance()  # replicas identical: exactly 0
    return out


@pytest.mark.parametrize("view", [True, False])
def test_global_avg_revert_and_continue(pool, view):
    for r in pool(2).run(_global_avg_contract, view):
        assert "nothing to revert" in r["no_snapshot"]
        assert r["same_on_all_ranks"] and r["reverted"] and r["second_revert_refused"]
        assert r["continued"] and r["buffers_averaged"] and r["consensus_after_average"] == 0.0
        d2c, expected = r["d2c"]
        assert math.isclose(d2c, expected, rel_tol=1e-12)


def _view_and_copy_modes_agree(options: dict[str, object]) -> bool:
    rank = dist.get_rank()
    results = []
    for view in (True, False):
        model = tiny_model()
        ddp = DecentralizedDataParallel(
            model,
            adamw_fn,
            topology="ring",
            param_as_bucket_view=view,
            bucket_size_in_mb=SMALL_BUCKETS_MB,
            **options,
        )
        _train(ddp, rank, range(4))
        ddp.global_avg()
        ddp.revert_global_avg()
        _train(ddp, rank, range(4, 6))
        ddp.load_state_dict(ddp.state_dict())  # the checkpoint holds the parameters' values
        _train(ddp, rank, range(6, 8))
        ddp.engine.wait_all()
        results.append(flat(model))
    return torch.equal(*results)


# Copies instead of views (the engine copies once per phase of a bucket, and every part it calls
# writes the bucket as it would a view): the same bits with each rule that writes the buckets.
COPY_MODE_OPTIONS = {
    "plain": {},
    "low-communication": {"sync_every": 2},
    "int8": {"compression": "int8"},
    "gradient-tracking": {"gradient_tracking": True},
}


@pytest.mark.parametrize("options", list(COPY_MODE_OPTIONS.values()), ids=list(COPY_MODE_OPTIONS))
def test_param_as_bucket_view_false_gives_the_same_numbers(pool, options):
    assert all(pool(2).run(_view_and_copy_modes_agree, options))


# -- accumulation, lr, checkpoints ---------------------------------------------------------------------------
def _accumulation(style: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    def run(model, opt):  # opt None: the module front-end
        for update in range(3):
            micro = [batch(0, 3 * update + k) for k in range(3)]
            if opt is not None:
                opt.zero_grad()
                for x, y in micro:
                    (nn.functional.cross_entropy(model(x), y) / 3).backward()
                opt.step()
                continue
            if style == "no_sync":
                with model.no_sync():
                    for x, y in micro[:-1]:
                        (nn.functional.cross_entropy(model(x), y) / 3).backward()
            else:
                model.set_accumulate_grad(True)
                for x, y in micro[:-1]:
                    (nn.functional.cross_entropy(model(x), y) / 3).backward()
                model.set_accumulate_grad(False)
            x, y = micro[-1]
            (nn.functional.cross_entropy(model(x), y) / 3).backward()
        return flat(model), None if opt is not None else model.step_count

    (bare, _), (trained, count) = bare_and_wrapped(run, adamw, "module", bucket_size_in_mb=SMALL_BUCKETS_MB)
    return bare, trained, count


@pytest.mark.parametrize("style", ["no_sync", "set_accumulate_grad"])
def test_accumulation_updates_once_per_round_like_the_bare_optimizer(pool, style):
    ((bare, trained, count),) = pool(1).run(_accumulation, style)
    assert count == 3 and torch.equal(bare, trained)


def _lr_facts() -> list[float]:
    model = tiny_model()
    plain = DecentralizedDataParallel(model, partial(sgd_fn, lr=0.25))
    scheduled = DecentralizedDataParallel(
        tiny_model(),
        partial(sgd_fn, lr=0.5),
        lr_scheduler_fn=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
    )
    before = [plain.get_lr(), scheduled.get_lr()]
    x, y = batch(0, 0)
    nn.functional.cross_entropy(scheduled(x), y).backward()
    return [*before, scheduled.get_lr()]


def test_get_lr_before_the_first_update_and_without_a_scheduler(pool):
    (lrs,) = pool(1).run(_lr_facts)
    assert lrs == [0.25, 0.5, 0.25]


def _build_for_checkpoint(seed: int = 0) -> tuple[nn.Module, DecentralizedDataParallel, torch.amp.GradScaler]:
    model = tiny_model(seed=seed)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ddp = DecentralizedDataParallel(
        model,
        adamw_fn,
        lr_scheduler_fn=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
        topology="ring",
        scaler=scaler,
        bucket_size_in_mb=SMALL_BUCKETS_MB,
    )
    return model, ddp, scaler


class _ModuleRun(Resumable):
    """AdamW per bucket, StepLR, a GradScaler, a ring; saved with gossip in flight."""

    def build(self, seed: int):
        return _build_for_checkpoint(seed)

    def train(self, run, steps: range) -> None:
        _, ddp, scaler = run
        _train(ddp, dist.get_rank(), steps, scaler)

    def state_dict(self, run) -> dict:
        _, ddp, _ = run
        state = ddp.training_state_dict()
        assert state["decent"]["gossip"] is not None  # saved with gossip in flight
        assert next(iter(ddp.state_dict())).startswith("_model.")  # decent-dp's state_dict keys
        return state

    def load_state_dict(self, run, state: dict) -> None:
        run[1].load_training_state_dict(state)

    def result(self, run) -> torch.Tensor:
        model, ddp, _ = run
        ddp.engine.wait_all()
        return flat(model)


def test_resume_in_fresh_processes_is_bitwise(pool, resume_pool, tmp_path):
    assert_resume_is_bitwise(pool, resume_pool, 2, _ModuleRun(), tmp_path, total=8, save_at=5)


class WithPreAverageHook(torch.optim.SGD):
    def pre_average_hook(self, edge, weight):  # decent-dp's optional protocol
        pass


def _pre_average_hook_refused() -> str:
    try:
        DecentralizedDataParallel(tiny_model(), lambda ps: WithPreAverageHook([p for _, p in ps], lr=0.1))
    except ValueError as err:
        return str(err)
    return "accepted"


def test_pre_average_hook_optimizers_are_refused_clearly(pool):
    for message in pool(2).run(_pre_average_hook_refused):
        assert "pre_average_hook" in message and "not support" in message


def _bad_arguments() -> list[str]:
    model = tiny_model()
    cases = {
        "optim_fn": lambda: DecentralizedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1)),
        "grad_clip_norm": lambda: DecentralizedDataParallel(model, sgd_fn, grad_clip_norm=-1.0),
        "model": lambda: DecentralizedDataParallel("model", sgd_fn),  # type: ignore[arg-type]
        "covers": lambda: DecentralizedDataParallel(model, lambda ps: torch.optim.SGD([ps[0][1]], lr=0.1)),
    }
    messages = []
    for name, build in cases.items():
        try:
            build()
        except (TypeError, ValueError) as err:
            messages.append(f"{name}: {err}")
    return messages


def test_bad_arguments_name_the_argument_and_the_fix(pool):
    (messages,) = pool(1).run(_bad_arguments)
    assert len(messages) == 4
    assert "optim_fn must be a function" in messages[0]
    assert "grad_clip_norm must be a finite number >= 0, got -1.0" in messages[1]
    assert "model must be a torch.nn.Module" in messages[2]
    assert "must cover exactly the parameters" in messages[3]


# -- decent-dp users change only their imports ---------------------------------------------------------------
DECENT_DP_NAMES = [
    "DecentralizedDataParallel",
    "OPTIM_FN_TYPE",
    "LR_SCHEDULER_FN_TYPE",
    "optim_fn_adam",
    "optim_fn_adamw",
    "optim_fn_accum_adam",
    "optim_fn_accum_adamw",
    "lr_scheduler_fn_cosine_with_warmup",
    "AccumAdam",
    "AccumAdamW",
    "Topology",
    "TopologyReg",
    "Edge",
    "initialize_dist",
    "CompleteTopology",
    "RingTopology",
    "OnePeerExpTopology",
    "AlternatingExpRingTopology",
]


@pytest.mark.pure
def test_every_decent_dp_name_is_importable_from_the_package_with_its_signature():
    import inspect

    import decent_optim_wrapper

    missing = [name for name in DECENT_DP_NAMES if not hasattr(decent_optim_wrapper, name)]
    assert not missing
    parameters = inspect.signature(DecentralizedDataParallel).parameters
    positional = [n for n, p in parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == [
        "model",
        "optim_fn",
        "lr_scheduler_fn",
        "topology",
        "scaler",
        "grad_clip_norm",
        "param_as_bucket_view",
        "sync_buffer_in_global_avg",
        "bucket_size_in_mb",
        "_local_world_size",
    ]
    defaults = {n: parameters[n].default for n in positional[2:]}
    assert defaults == {
        "lr_scheduler_fn": None,
        "topology": "complete",
        "scaler": None,
        "grad_clip_norm": 0.0,
        "param_as_bucket_view": True,
        "sync_buffer_in_global_avg": False,
        "bucket_size_in_mb": 25,
        "_local_world_size": None,
    }


def _decent_dp_tutorial() -> list[float]:
    """decent-dp's tutorial (optimizer functions, partial, a custom optim_fn, the training loop), with
    only the imports changed; then optim_fn_accum_adamw on a ring."""
    from decent_optim_wrapper import DecentralizedDataParallel as DecentDP
    from decent_optim_wrapper import optim_fn_accum_adamw, optim_fn_adamw

    def my_optim_fn(params):
        return torch.optim.SGD([p for _, p in params], lr=0.01, momentum=0.9)

    rank = dist.get_rank()
    losses = []
    for optim_fn in (optim_fn_adamw, partial(optim_fn_adamw, lr=0.001, weight_decay=0.01), my_optim_fn):
        ddp_model = DecentDP(
            tiny_model(), optim_fn, lr_scheduler_fn=None, topology="complete", bucket_size_in_mb=25
        )
        ddp_model.train()
        for step in range(3):
            data, target = batch(rank, step)
            output = ddp_model(data)
            loss = nn.functional.cross_entropy(output, target)
            ddp_model.zero_grad()
            loss.backward()
        ddp_model.eval()
        with torch.no_grad():
            data, target = batch(rank, 99)
            losses.append(float(nn.functional.cross_entropy(ddp_model(data), target)))
    accum = DecentDP(tiny_model(), partial(optim_fn_accum_adamw, accum_iter=2), topology="ring")
    for step in range(4):
        data, target = batch(rank, step)
        nn.functional.cross_entropy(accum(data), target).backward()
    losses.append(float(accum.step_count))
    return losses


def test_decent_dp_tutorial_runs_with_only_the_imports_changed(pool):
    for losses in pool(2).run(_decent_dp_tutorial):
        assert all(math.isfinite(v) for v in losses[:3]) and losses[3] == 4.0


class FailsOnce(torch.optim.SGD):
    failed = False

    def step(self, closure=None):
        if not FailsOnce.failed:
            FailsOnce.failed = True
            raise RuntimeError("injected failure")
        return super().step(closure)


def _failed_backward_leaves_a_usable_module() -> tuple[str, int]:
    FailsOnce.failed = False
    ddp = DecentralizedDataParallel(tiny_model(), lambda ps: FailsOnce([p for _, p in ps], lr=0.1))
    x, y = batch(0, 0)
    try:
        nn.functional.cross_entropy(ddp(x), y).backward()
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    for step in range(2):
        x, y = batch(0, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
    return message, ddp.step_count


def test_an_error_inside_backward_leaves_the_module_usable(pool):
    ((message, steps),) = pool(1).run(_failed_backward_leaves_a_usable_module)
    assert "injected failure" in message and steps == 2


class _RaiseInBackwardOnce(torch.autograd.Function):
    raised = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if not _RaiseInBackwardOnce.raised:
            _RaiseInBackwardOnce.raised = True
            raise RuntimeError("failure in the middle of backward")
        return grad


class _FailingMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.last = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.last(_RaiseInBackwardOnce.apply(self.first(x)))


def _backward_failing_outside_the_hooks() -> tuple[str, int]:
    _RaiseInBackwardOnce.raised = False
    ddp = DecentralizedDataParallel(_FailingMiddle(), sgd_fn, bucket_size_in_mb=SMALL_BUCKETS_MB)
    x, y = batch(0, 0)
    try:  # the last layer's buckets are updated before the failure; the callback never runs
        nn.functional.cross_entropy(ddp(x), y).backward()
        message = "no error"
    except RuntimeError as err:
        message = str(err)
    _train(ddp, 0, range(1, 3))
    return message, ddp.step_count


def test_a_backward_that_fails_elsewhere_does_not_stop_later_updates(pool):
    ((message, steps),) = pool(1).run(_backward_failing_outside_the_hooks)
    assert "failure in the middle of backward" in message and steps == 2


def _scaler_with_a_bucket_without_gradients() -> tuple[int, float]:
    model = LateBranch()  # `late` has no gradient while use_late is False
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    ddp = DecentralizedDataParallel(model, sgd_fn, scaler=scaler, bucket_size_in_mb=SMALL_BUCKETS_MB)
    _train(ddp, dist.get_rank(), range(3), scaler)
    model.use_late = True
    _train(ddp, dist.get_rank(), range(3, 5), scaler)
    return ddp.step_count, scaler.get_scale()


def test_grad_scaler_with_a_bucket_that_has_no_gradients_keeps_training(pool):
    # GradScaler.step refuses an optimizer whose unscale_ recorded no inf check (no gradients)
    for steps, scale in pool(2).run(_scaler_with_a_bucket_without_gradients):
        assert steps == 5 and scale == 2.0**8


def _bad_training_state_changes_nothing() -> list[str]:
    model = tiny_model()
    ddp = DecentralizedDataParallel(model, adamw_fn, bucket_size_in_mb=SMALL_BUCKETS_MB)
    _train(ddp, 0, range(2))
    state = ddp.training_state_dict()
    _train(ddp, 0, range(2, 4))
    before = flat(model)
    moments = [s["exp_avg"].clone() for o in ddp.optimizers for s in o.state.values()]
    errors = []
    bad_model = {**state, "model": {**state["model"], "2.bias": torch.zeros(5)}}
    first_groups = state["optimizers"][0]["param_groups"]
    bad_optimizer = {
        **state,
        "optimizers": [
            {**state["optimizers"][0], "param_groups": [*first_groups, first_groups[0]]},
            *state["optimizers"][1:],
        ],
    }
    for bad in (bad_model, bad_optimizer):
        try:
            ddp.load_training_state_dict(bad)
        except ValueError as err:
            errors.append(str(err))
        assert torch.equal(flat(model), before)
        after = [s["exp_avg"] for o in ddp.optimizers for s in o.state.values()]
        assert all(torch.equal(a, b) for a, b in zip(after, moments, strict=True))
    return errors


def test_a_rejected_training_state_changes_nothing(pool):
    ((errors),) = pool(1).run(_bad_training_state_changes_nothing)
    assert len(errors) == 2
    assert "does not fit this model" in errors[0] and "2.bias" in errors[0]
    assert "optimizer of bucket 0 has other param groups" in errors[1]


def _count_global_step_hooks() -> dict[str, int]:
    model = tiny_model()
    ddp = DecentralizedDataParallel(model, sgd_fn, bucket_size_in_mb=SMALL_BUCKETS_MB)
    counts = {"pre": 0, "post": 0, "bucket": 0}

    def count(key: str):
        def hook(*_: object) -> None:
            counts[key] += 1

        return hook

    handles = [
        torch_optimizer.register_optimizer_step_pre_hook(count("pre")),
        torch_optimizer.register_optimizer_step_post_hook(count("post")),
        *(o.register_step_post_hook(count("bucket")) for o in ddp.optimizers),
    ]
    try:
        _train(ddp, dist.get_rank(), range(3))
    finally:
        for handle in handles:
            handle.remove()
    counts["buckets"] = len(ddp.optimizers)
    return counts


def test_global_step_hooks_fire_once_per_iteration_and_bucket_hooks_once_per_bucket(pool):
    (counts,) = pool(1).run(_count_global_step_hooks)
    assert counts["buckets"] > 1
    assert counts["pre"] == counts["post"] == 3
    assert counts["bucket"] == 3 * counts["buckets"]


# -- what both front-ends report -------------------------------------------------------------------------
def _front_end_facts() -> list[tuple[object, ...]]:
    from decent_optim_wrapper import DecentOptimWrapper

    model, other = tiny_model(), tiny_model()
    ddp = DecentralizedDataParallel(model, sgd_fn, topology="ring", bucket_size_in_mb=SMALL_BUCKETS_MB)
    wrapper = DecentOptimWrapper(torch.optim.SGD(other.parameters(), lr=0.1), topology="ring")
    _train(ddp, dist.get_rank(), range(3))
    for step in range(2):
        x, y = batch(dist.get_rank(), step, torch.float32)
        wrapper.zero_grad()
        nn.functional.cross_entropy(other(x), y).backward()
        wrapper.step()
    return [
        (f.rank, f.world_size, f.local_world_size, f.topology.name, f.step_count, len(f.buckets))
        for f in (ddp, wrapper)
    ]


def test_both_front_ends_report_rank_world_and_progress(pool) -> None:
    """rank, world_size, topology and step_count come from the engine on both front-ends."""
    reports = pool(2).run(_front_end_facts)
    for rank, (module, optimizer) in enumerate(reports):
        assert module[:4] == optimizer[:4] == (rank, 2, 1, "ring")
        assert (module[4], optimizer[4]) == (3, 2)  # updates done: 3 backward passes, 2 step() calls
        assert module[5] > optimizer[5] == 1  # small buckets on the module, one 25 MiB bucket on the wrapper
