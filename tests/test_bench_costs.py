"""``benchmarks/costs/run.py``: every question end to end at a toy size (one interpreter, so torch is
imported once for all of them), and the pure pieces: the interleaved loop, the options, the seed release."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.examples  # the benchmark end to end, in subprocesses

ROOT = Path(__file__).resolve().parents[1]

#: A stand-in for the seed release's wrapper (same constructor, its own module importing its own
#: sibling, as the release's does), so that ``--seed-path`` is exercised without a download.
STAND_IN = {
    "__init__.py": "",
    "topo.py": "RING = 'ring'\n",
    "wrapper.py": (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from decent_optim_wrapper.topo import RING\n\n"
        "class DecentOptimWrapper(torch.optim.Optimizer):\n"
        "    def __init__(self, optimizer, rank, world_size, local_world_size, topology):\n"
        "        assert topology == RING and rank == dist.get_rank()\n"
        "        super().__init__(optimizer.param_groups, optimizer.defaults)\n"
        "        self._optimizer = optimizer\n\n"
        "    def step(self, closure=None):\n"
        "        self._optimizer.step()\n\n"
        "    def zero_grad(self, set_to_none=True):\n"
        "        self._optimizer.zero_grad(set_to_none=set_to_none)\n"
    ),
}

#: Each question at a toy size, by the name of its JSON file.
TOY = {
    "overhead": "overhead --width 64 --depth 2 --reps 1 --iters 2 --batch 8 --worlds 1 2 --formats bf16",
    "second_moment": "second_moment --width 256 --depth 2 --iters 2 --warmup 1 --memory-steps 2 --seed-path",
    "compression": "compression --width 32 --depth 1 --batch 2 --reps 1 --formats none bf16 topk:0.03:int2",
    "codec": "compression --mode codec --width 32 --depth 1 --batch 2 --reps 1 --formats none topk:0.03:int2",
    "metrics": "metrics --width 32 --iters 4 --warmup 1",
    "status_records": "status_records --rounds 1 --iters 20 --warmup 2 --width 16 --reps 3",
    "import_time": "import_time --reps 1 --budget 0",  # over any budget: exits 1
}
RUN_ALL = (
    "import json, sys\n"
    "from benchmarks.costs.run import main\n"
    "print(json.dumps({name: main(argv.split()) for name, argv in json.loads(sys.argv[1]).items()}))\n"
)


def stand_in_seed(folder: Path) -> Path:
    package = folder / "decent_optim_wrapper"
    package.mkdir(parents=True)
    for name, text in STAND_IN.items():
        (package / name).write_text(text)
    return folder


@pytest.mark.timeout(600)
def test_every_question_runs_end_to_end_and_reports_what_it_measures(tmp_path):
    seed = stand_in_seed(tmp_path / "seed")
    outputs = {name: f" --json {tmp_path / name}.json --table {tmp_path / name}.md" for name in TOY}
    argvs = {
        name: argv.replace("--seed-path", f"--seed-path {seed}") + outputs[name] for name, argv in TOY.items()
    }
    run = subprocess.run(
        [sys.executable, "-c", RUN_ALL, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=580,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    exits = json.loads(run.stdout.strip().splitlines()[-1])
    assert exits == {name: int(name == "import_time") for name in TOY}
    out = {name: json.loads((tmp_path / f"{name}.json").read_text())["results"] for name in TOY}
    for name in TOY:
        table = (tmp_path / f"{name}.md").read_text()
        assert table.startswith("$ uv run ") and "| --- |" in table and "commit" in table

    # overhead: (a) at both world sizes, bf16 on the ring; (b) and (c) against their references
    gossip = out["overhead"]["by_world"]["2"]["0"]["gossip"]
    assert set(gossip) == {"none", "bf16"} and gossip["none"]["engine"] > 0
    assert set(out["overhead"]["by_world"]["1"]["0"]["train_step"]["ratios"]) == {
        "wrapped/bare",
        "module/bare",
    }
    ring = out["overhead"]["by_world"]["2"]["0"]["train_step"]
    assert "ring-accum-average/ring-accum" in ring["ratios"] and "ring-again/ring" in ring["ratios"]
    assert len(ring["ms"]) == 8 and [t["title"][:3] for t in out["overhead"]["tables"]] == [
        "(a)",
        "(b)",
        "(c)",
    ]

    # second_moment: the seed's stand-in timed in the same loop; the rule's state is one model copy
    sm = out["second_moment"]
    assert set(sm["time"]["ms"]) == {"bare", "local", "average", "guard_off", "seed"}
    assert set(sm["time"]["ratios"]) == {
        "local/bare",
        "average/local",
        "average/seed",
        "local/seed",
        "guard_off/average",
    }
    assert set(sm["step"]) == {"single", "foreach", "fused"}
    extra_state = sm["memory"]["average"]["state_mib"] - sm["memory"]["local"]["state_mib"]
    assert extra_state == pytest.approx(sm["time"]["params"] * 4 / 2**20, rel=1e-3)

    # compression: a round per format through the engine on 2 ranks, and the codec's in one process
    rows = out["compression"]["rows"]
    assert [r["format"] for r in rows] == ["none", "bf16", "topk:0.03:int2"]
    assert all(r["wire_bytes"] > 0 and r["median_ms"]["round"] > 0 for r in rows)
    assert [r["extra_mb"] for r in out["codec"]["rows"]] == [None, None]  # memory is measured on CUDA only

    metrics = out["metrics"]["time"]
    assert set(metrics["ms"]) == {"uncounted", "counted", "counted_control", "read_every_step"}
    assert metrics["read_us"] > 0 and metrics["timed_wait_us"] > 0

    records = out["status_records"]
    assert [r["members"] for r in records["one_record"]] == [4, 64, 512]
    assert all(0 < r["bytes"] < 16_000 for r in records["one_record"])
    assert len(records["rounds"]) == 1 and records["rounds"][0]["ratio"] > 0

    assert out["import_time"]["over_budget"] and out["import_time"]["cost_s"] > 0


@pytest.mark.pure
def test_the_loop_rotates_the_order_and_records_a_variant_s_own_parts():
    from benchmarks.costs.questions import interleave, step_table

    calls = []
    variants = {
        "a": lambda i: calls.append(("a", i)),
        "b": lambda i: calls.append(("b", i)) or {"stage": 1.0, "mix": 2.0},
        "c": lambda i: calls.append(("c", i)) or 0.5,
    }
    times = interleave(variants, iters=2, warmup=1)
    assert [name for name, _ in calls] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert (
        set(times) == {"a", "b.stage", "b.mix", "c"}
        and times["b.mix"] == [2.0, 2.0]
        and times["c"] == [0.5] * 2
    )
    result = {
        "ms": {"x": 2.0, "y": 1.0},
        "ratios": {"x/y": {"ms": 2.0, "ratio_of_medians": 2, "median_paired_ratio": 2}},
    }
    assert step_table("t", result)["rows"] == [["x", "y", 2.0, 2, 2], ["y", None, 1.0, None, None]]


@pytest.mark.pure
def test_a_question_refuses_an_option_it_does_not_take_and_defaults_the_rest(capsys):
    from benchmarks.costs.run import parse_args

    args = parse_args(["metrics", "--iters", "3"])
    assert (args.iters, args.width, args.warmup) == (3, 1024, 5) and not hasattr(args, "formats")
    with pytest.raises(SystemExit):
        parse_args(["metrics", "--formats", "bf16"])
    assert "metrics takes no --formats" in capsys.readouterr().err


@pytest.mark.pure
def test_a_seed_path_without_the_release_is_refused_naming_it_and_the_install(tmp_path):
    from benchmarks.costs.questions import load_seed_wrapper

    with pytest.raises(
        FileNotFoundError, match=r"--seed-path .* holds no decent_optim_wrapper/wrapper.py: uv pip"
    ):
        load_seed_wrapper(tmp_path)


@pytest.mark.pure
def test_the_seed_release_loads_beside_this_library(tmp_path):
    import decent_optim_wrapper
    from benchmarks.costs.questions import load_seed_wrapper

    seed_class = load_seed_wrapper(stand_in_seed(tmp_path))
    assert seed_class.__module__ == "decent_optim_wrapper.wrapper"
    assert seed_class is not decent_optim_wrapper.DecentOptimWrapper
    # This library's modules are back in place, and stay the ones later imports get
    import decent_optim_wrapper.wrapper as ours

    assert ours.DecentOptimWrapper is decent_optim_wrapper.DecentOptimWrapper
