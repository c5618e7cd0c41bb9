"""``benchmarks/costs/second_moment_cost.py`` runs end to end at a tiny size, and measures what it says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.examples

ROOT = Path(__file__).resolve().parents[1]


#: A stand-in for the seed release's wrapper (same constructor, its own module importing its own
#: sibling, as the release's does), so the script's ``--seed-path`` is exercised without a download.
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


def stand_in_seed(folder: Path) -> Path:
    package = folder / "decent_optim_wrapper"
    package.mkdir(parents=True)
    for name, text in STAND_IN.items():
        (package / name).write_text(text)
    return folder


@pytest.mark.timeout(300)
def test_second_moment_cost_benchmark_runs_every_part(tmp_path):
    out = tmp_path / "cost.json"
    seed = stand_in_seed(tmp_path / "seed")
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "costs" / "second_moment_cost.py"),
            *("--width", "256", "--depth", "2", "--iters", "2", "--warmup", "1", "--memory-steps", "2"),
            *("--seed-path", str(seed), "--json", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for part in ("(a)", "(b)", "(c)"):
        assert part in run.stdout
    results = json.loads(out.read_text())
    memory = {name: ranks["0"] for name, ranks in results["memory"].items()}
    params = results["time"]["0"]["params"]
    # AdamW's state: exp_avg and exp_avg_sq (and the step counters); the rule adds one signal tensor
    assert memory["average"]["state_mib"] - memory["local"]["state_mib"] == pytest.approx(
        params * 4 / 2**20, rel=1e-3
    )
    assert set(results["step"]) == {"single", "foreach", "fused"}
    # Part (a) times every method in one loop, the seed's stand-in included, with the ratios
    timed = results["time"]["0"]
    assert set(timed["ms"]) == {"bare", "local", "average", "guard_off", "seed"}
    assert set(timed["ratios"]) == {
        "local/bare",
        "average/local",
        "average/seed",
        "local/seed",
        "guard_off/average",
    }
    assert "average/seed" in run.stdout and results["commit"]


@pytest.mark.pure
def test_a_seed_path_without_the_release_is_refused_naming_it_and_the_install(tmp_path):
    from benchmarks.harness.seed_release import load_seed_wrapper

    with pytest.raises(
        FileNotFoundError, match=r"--seed-path .* holds no decent_optim_wrapper/wrapper.py: uv pip"
    ):
        load_seed_wrapper(tmp_path)


@pytest.mark.pure
def test_the_seed_release_loads_beside_this_library(tmp_path):
    import decent_optim_wrapper
    from benchmarks.harness.seed_release import load_seed_wrapper

    seed_class = load_seed_wrapper(stand_in_seed(tmp_path))
    assert seed_class.__module__ == "decent_optim_wrapper.wrapper"
    assert seed_class is not decent_optim_wrapper.DecentOptimWrapper
    # This library's modules are back in place, and stay the ones later imports get
    import decent_optim_wrapper.wrapper as ours

    assert ours.DecentOptimWrapper is decent_optim_wrapper.DecentOptimWrapper
