"""The main job end to end on a few steps, and the benchmarks' runner behind the convergence driver.

examples/quickstart.py runs as a user runs it (a subprocess that starts its own gloo workers, with a hard
deadline); the benchmarks' runner (benchmarks/harness/runner.py) trains on the shared pool. The
convergence driver's questions, grammar, splits and verdicts are tested in test_bench_convergence.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import helpers
import pytest
import torch.distributed as dist

from benchmarks.convergence import classification
from benchmarks.harness import runner

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.examples

QUICKSTART_METHODS = ["ring", "ring-module", "ring@bf16", "one-peer-exp", "complete", "ddp"]
SCRIPT_DEADLINE_S = 150  # a script's whole run: starting 2 workers (seconds each on 2 cores) and training


def run_script(*argv: str) -> str:
    """What the script prints, run from the repository's root with the deadline above."""
    return helpers.run_script(*argv, deadline_s=SCRIPT_DEADLINE_S)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> SimpleNamespace:
    """One short run of the main job on 2 workers: what it printed, its results and its figure."""
    directory = tmp_path_factory.mktemp("quickstart")
    figure, results = directory / "quickstart.png", directory / "results.json"
    short = ["--workers", "2", "--steps", "30", "--batch-size", "16"]
    output = run_script("examples/quickstart.py", *short, "--figure", str(figure), "--json", str(results))
    return SimpleNamespace(
        output=output, figure=figure, results=[SimpleNamespace(**r) for r in json.loads(results.read_text())]
    )


@pytest.mark.timeout(SCRIPT_DEADLINE_S + 30)
def test_quickstart_trains_every_method_and_writes_a_table_and_a_figure(quickstart):
    results = quickstart.results
    assert [r.method for r in results] == QUICKSTART_METHODS
    by_method = {r.method: r for r in results}
    # the two front-ends run the same recursion with the same optimizer: the same losses
    assert by_method["ring-module"].losses == by_method["ring"].losses
    # the engine counts what bf16 gossip sends: half the bytes of fp32 gossip (the exact first round
    # of each group is left out of the count)
    assert by_method["ring@bf16"].bytes_per_step == by_method["ring"].bytes_per_step / 2
    for r in results:
        assert len(r.losses) == 30 and r.losses[-1] < r.losses[0]  # it learns
        assert 0.0 <= r.accuracy <= 1.0 and r.ms_per_iteration > 0 and r.bytes_per_step > 0
        final_distance = r.distances[-1][1]
        assert (final_distance == 0.0) == (r.method == "ddp")
    table = quickstart.output[quickstart.output.index("Results (2 workers") :]
    assert "avg-model acc" in table and "bytes sent/rank/step" in table
    for r in results:  # one row per method, with the numbers of its results
        assert f"{r.method:>13} | {r.final_loss:>10.4f} | {r.accuracy:>13.4f} |" in table
    assert f"Figure written to {quickstart.figure}" in quickstart.output
    assert quickstart.figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _short_run(methods: list[str], steps: int = 30, log_every: int = 10, **data) -> list[dict]:
    results = runner.run(methods, steps=steps, batch_size=16, lr=0.05, log_every=log_every, **data)
    return [asdict(r) for r in results] if dist.get_rank() == 0 else []


@pytest.mark.timeout(SCRIPT_DEADLINE_S + 60)
def test_benchmark_runner_trains_the_quickstarts_methods_to_the_same_numbers(pool, quickstart):
    # The convergence benchmark's runner and the main job train the same task with the same seeds:
    # the same method gives the same losses, bit for bit, in either.
    # (the quickstart measures the consensus distance every 50 steps: so does the runner here)
    results = [SimpleNamespace(**r) for r in pool(2).run(_short_run, QUICKSTART_METHODS, log_every=50)[0]]
    for ours, theirs in zip(quickstart.results, results, strict=True):
        assert ours.method == theirs.method
        assert ours.losses == theirs.losses
        assert ours.final_loss == theirs.final_loss and ours.accuracy == theirs.accuracy
        assert ours.bytes_per_step == theirs.bytes_per_step
        assert [d for _, d in ours.distances] == theirs.distances
        assert (theirs.split, theirs.alpha) == ("iid", None)


def test_benchmark_runner_trains_compressed_gossip_on_a_label_skewed_split(pool, capsys):
    methods = ["ring@bf16", "ring", "ddp"]
    results = pool(2).run(_short_run, methods, steps=10, split="dirichlet", alpha=0.1)[0]
    results = [SimpleNamespace(**r) for r in results]
    assert [r.method for r in results] == methods
    by_method = {r.method: r for r in results}
    for r in results:
        assert (r.split, r.alpha) == ("dirichlet", 0.1)
        assert len(r.losses) == 10 and all(map(math.isfinite, r.losses))
        assert 0.0 <= r.accuracy <= 1.0
    # the engine counts what bf16 gossip sends: fewer bytes than the same topology uncompressed
    assert 0 < by_method["ring@bf16"].bytes_per_step < by_method["ring"].bytes_per_step
    print(
        classification.table(
            results, 2, SimpleNamespace(steps=10, batch_size=16, lr=0.05, adam_lr=3e-3, task="synthetic")
        )
    )
    out = capsys.readouterr().out
    assert "dirichlet(alpha=0.1) split" in out and "ring@bf16" in out


def test_benchmark_runner_trains_with_gradient_tracking_on_both_front_ends(pool, capsys):
    # with the runs the convergence table compares them with: ddp and ring-module (untracked)
    methods = classification.with_references(
        ["ring-gt", "ring-module-gt", "ring-gt@bf16", "ring", "ring@bf16"]
    )
    assert methods == ["ring-gt", "ring-module-gt", "ring-gt@bf16", "ring", "ring@bf16", "ddp", "ring-module"]
    results = pool(2).run(_short_run, methods, steps=10, split="dirichlet", alpha=0.1)[0]
    results = [SimpleNamespace(**r) for r in results]
    assert [r.method for r in results] == methods
    by_method = {r.method: r for r in results}
    for r in results:
        assert len(r.losses) == 10 and all(map(math.isfinite, r.losses))
        assert 0.0 <= r.accuracy <= 1.0 and (r.final_distance > 0) == (r.method != "ddp")
    # both front-ends track the same way (the module one per bucket inside backward): the same losses
    assert by_method["ring-module-gt"].losses == by_method["ring-gt"].losses
    # tracking changes the update: the tracked run is not the plain one
    assert by_method["ring-gt"].losses != by_method["ring"].losses
    # the tracker travels beside the parameters, compressed like them: twice the bytes
    assert by_method["ring-gt"].bytes_per_step == 2 * by_method["ring"].bytes_per_step
    assert by_method["ring-gt@bf16"].bytes_per_step == 2 * by_method["ring@bf16"].bytes_per_step
    print(
        classification.table(
            results, 2, SimpleNamespace(steps=10, batch_size=16, lr=0.05, adam_lr=3e-3, task="synthetic")
        )
    )
    assert "ring-module-gt" in capsys.readouterr().out


def test_benchmark_runner_trains_paced_rounds_on_both_front_ends(pool, capsys):
    # half the ranks twice as fast (methods.HalfFastSchedule): 4 rounds of H=4, the samples of 16 steps
    methods = classification.with_references(["ring~h4n0.1p+adamw", "ring-module~h4n0.1p+adamw"])
    unpaced = ["ring~h4n0.1+adamw", "ring-module~h4n0.1+adamw"]
    assert methods == ["ring~h4n0.1p+adamw", "ring-module~h4n0.1p+adamw", "ddp+adamw", *unpaced]
    results = pool(2).run(_short_run, methods, steps=16, log_every=8)[0]
    by_method = {r["method"]: SimpleNamespace(**r) for r in results}
    paced = by_method["ring~h4n0.1p+adamw"]
    # rank 0 fast (5, 6, 5, 5 steps), rank 1 slow (3, 2, 3, 3): each round 2 H steps over the fleet
    assert paced.steps_per_rank == [21, 11] and by_method["ddp+adamw"].steps_per_rank == [16, 16]
    assert len(paced.losses) == 4 and all(map(math.isfinite, paced.losses))  # one loss per round
    # measured at the ends of the rounds holding fleet steps 0 and 8, and of the last round
    assert paced.distance_steps == [3, 11, 15] and paced.final_distance > 0
    assert 0.0 <= paced.accuracy <= 1.0
    # both front-ends take the same paced rounds: the same losses, bit for bit
    assert by_method["ring-module~h4n0.1p+adamw"].losses == paced.losses
    assert by_method["ring-module~h4n0.1p+adamw"].accuracy == paced.accuracy
    # pacing changes the run: not the unpaced twin's
    assert by_method["ring~h4n0.1+adamw"].accuracy != paced.accuracy
    assert by_method["ring-module~h4n0.1+adamw"].losses == by_method["ring~h4n0.1+adamw"].losses
    args = SimpleNamespace(steps=16, batch_size=16, lr=0.05, adam_lr=3e-3, task="synthetic")
    print(classification.table([SimpleNamespace(**r) for r in results], 2, args))
    assert "ring~h4n0.1p+adamw: inner steps per worker 11 to 21, 32 in all" in capsys.readouterr().out


def test_tensorboard_example_writes_the_gossip_counters_as_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the examples group (tensorboard) is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from decent_optim_wrapper.metrics import METRIC_NAMES

    logdir, results = tmp_path / "runs", tmp_path / "totals.json"
    output = run_script(
        "examples/tensorboard_metrics.py",
        *("--workers", "2", "--steps", "20", "--log-every", "5"),
        *("--logdir", str(logdir), "--json", str(results)),
    )
    totals = json.loads(results.read_text())
    assert totals["gossip/steps"] == 20 and totals["gossip/bytes_sent"] > 0 and totals["gossip/wait_s"] >= 0
    assert "rank 1: 20 steps" in output and "waiting for gossip" in output
    for rank in range(2):
        events = EventAccumulator(str(logdir / f"rank{rank}"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert set(METRIC_NAMES) | {"train/loss"} <= tags, sorted(tags)
        steps = [(e.step, e.value) for e in events.Scalars("gossip/steps")]
        assert steps == [(5, 5.0), (10, 5.0), (15, 5.0), (20, 5.0)]  # each read: the steps since the last
