"""initialize_dist: plain python, a torchrun-like launch of two processes, and bad environments.

The launch tests run in fresh processes of their own (a process group is per process), with the
torchrun variables removed from the environment and then set as each test needs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from decent_optim_wrapper.launch import LaunchPlan, plan_launch

REPO = Path(__file__).resolve().parents[1]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PROCESS_TIMEOUT_S = 60

# Prints rank and world size, all-reduces a one (on the GPU under NCCL), and checks that a second
# call returns the existing group instead of initializing again.
SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from decent_optim_wrapper.launch import initialize_dist
    rank, world_size = initialize_dist()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    total = torch.ones(1, device=device)
    dist.all_reduce(total)
    assert initialize_dist() == (rank, world_size)
    print("RESULT", rank, world_size, int(total.item()), dist.get_backend(), flush=True)
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env(**launch: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in LAUNCH_VARS}
    env.update(launch, OMP_NUM_THREADS="1")
    return env


def _result(done: subprocess.CompletedProcess[str]) -> tuple[int, int, int, str]:
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    rank, world_size, total, backend = line.split()[1:]
    return int(rank), int(world_size), int(total), backend


# ---- in subprocesses ----------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_plain_python_is_a_world_of_one():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        check=False,
    )
    rank, world_size, total, _ = _result(done)
    assert (rank, world_size, total) == (0, 1, 1)


@pytest.mark.timeout(120)
def test_torchrun_variables_make_a_world_of_two():
    port = str(_free_port())
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT],
            # no GPUs: two processes on one host would need two of them under NCCL
            env=_env(
                RANK=str(rank),
                WORLD_SIZE="2",
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                CUDA_VISIBLE_DEVICES="",
            ),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=PROCESS_TIMEOUT_S)
            results.append(
                _result(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
            )
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert results == [(0, 2, 2, "gloo"), (1, 2, 2, "gloo")]


@pytest.mark.timeout(90)
def test_bad_environment_fails_before_any_rendezvous():
    # RANK without WORLD_SIZE: an error at once, not a wait for peers that never come.
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=_env(RANK="1"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        check=False,
    )
    assert done.returncode != 0
    assert "ValueError: RANK=1 is set but WORLD_SIZE is not" in done.stderr


# ---- the checks, without processes --------------------------------------------------------------

GOOD_ENVIRONMENTS: dict[str, tuple[dict[str, str], int, LaunchPlan]] = {
    "plain python, CPU": ({}, 0, LaunchPlan("gloo", 0, 1, None, rendezvous=False)),
    "plain python, GPU": ({}, 2, LaunchPlan("nccl", 0, 1, 0, rendezvous=False)),
    "torchrun, CPU": (
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "29500",
        },
        0,
        LaunchPlan("gloo", 3, 4, None, rendezvous=True),
    ),
    "torchrun, GPU": (
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h",
            "MASTER_PORT": "29500",
        },
        2,
        LaunchPlan("nccl", 3, 4, 1, rendezvous=True),
    ),
    "torchrun, one process": (
        {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
        1,
        LaunchPlan("nccl", 0, 1, 0, rendezvous=False),
    ),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", list(GOOD_ENVIRONMENTS))
def test_plan_for_good_environments(case):
    env, gpus, expected = GOOD_ENVIRONMENTS[case]
    assert plan_launch(env, gpus) == expected


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
BAD_ENVIRONMENTS: dict[str, tuple[dict[str, str], int, list[str]]] = {
    "RANK without WORLD_SIZE": ({"RANK": "0"}, 0, ["RANK=0 is set but WORLD_SIZE is not", "torchrun"]),
    "WORLD_SIZE without RANK": ({"WORLD_SIZE": "2"}, 0, ["WORLD_SIZE=2 is set but RANK is not"]),
    "RANK not an integer": ({**TORCHRUN, "RANK": "one"}, 0, ["RANK='one' is not an integer"]),
    "RANK past the world": ({**TORCHRUN, "RANK": "2"}, 0, ["RANK=2 must be < WORLD_SIZE=2"]),
    "negative LOCAL_RANK": ({**TORCHRUN, "LOCAL_RANK": "-1"}, 0, ["LOCAL_RANK=-1 must be >= 0"]),
    "zero WORLD_SIZE": ({**TORCHRUN, "WORLD_SIZE": "0"}, 0, ["WORLD_SIZE=0 must be >= 1"]),
    "no MASTER_ADDR": (
        {key: value for key, value in TORCHRUN.items() if key != "MASTER_ADDR"},
        0,
        ["MASTER_ADDR is not set but WORLD_SIZE=2", "torchrun sets them"],
    ),
    "bad MASTER_PORT": ({**TORCHRUN, "MASTER_PORT": "http"}, 0, ["MASTER_PORT='http' is not an integer"]),
    "LOCAL_RANK past LOCAL_WORLD_SIZE": (
        {**TORCHRUN, "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
        0,
        ["LOCAL_RANK=2 must be < LOCAL_WORLD_SIZE=2"],
    ),
    "LOCAL_WORLD_SIZE past WORLD_SIZE": (
        {**TORCHRUN, "LOCAL_WORLD_SIZE": "3"},
        0,
        ["LOCAL_WORLD_SIZE=3 exceeds WORLD_SIZE=2"],
    ),
    "LOCAL_RANK past the GPUs": (
        {**TORCHRUN, "LOCAL_RANK": "1"},
        1,
        ["LOCAL_RANK=1 needs 2 GPUs but this process sees 1", "--nproc-per-node", "CUDA_VISIBLE_DEVICES"],
    ),
    "more processes than GPUs on the node": (
        {**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
        1,
        ["LOCAL_WORLD_SIZE=2 needs 2 GPUs but this process sees 1"],
    ),
    "no LOCAL_RANK on a GPU host": (TORCHRUN, 4, ["LOCAL_RANK is not set but WORLD_SIZE=2", "picks its GPU"]),
}


@pytest.mark.pure
@pytest.mark.parametrize("case", list(BAD_ENVIRONMENTS))
def test_bad_environments_are_named(case):
    env, gpus, fragments = BAD_ENVIRONMENTS[case]
    with pytest.raises(ValueError) as info:
        plan_launch(env, gpus)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


# -- the node's group of a job started with init_elastic ---------------------------------------------
@pytest.mark.pure
@pytest.mark.parametrize(
    ("backend", "shards", "env", "gpus", "planned"),
    [
        (None, None, {}, 8, ("gloo", None)),  # one process per node: the job's group, on gloo
        ("gloo", None, {}, 8, ("gloo", None)),
        (None, 4, {"LOCAL_RANK": "2"}, 4, ("nccl", 2)),  # GPU nodes: NCCL inside the node
        (None, 4, {}, 4, ("nccl", 0)),
        (None, 4, {"LOCAL_RANK": "2"}, 0, ("gloo", None)),  # CPU nodes
        ("gloo", 4, {"LOCAL_RANK": "2"}, 4, ("gloo", None)),  # chosen
        ("nccl", 1, {"LOCAL_RANK": "0"}, 1, ("nccl", 0)),  # processes sharing a GPU, a node each
    ],
)
def test_a_node_group_is_nccl_when_its_processes_hold_gpus(backend, shards, env, gpus, planned):
    from decent_optim_wrapper.launch import plan_node_backend

    assert plan_node_backend(backend, shards, env, gpus) == planned


@pytest.mark.pure
def test_an_elastic_start_needs_a_store_outside_the_workers(monkeypatch):
    from decent_optim_wrapper import initialize_dist

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match=r"elastic=True\) needs a job of more than one worker.*WORLD_SIZE=1"):
        initialize_dist(elastic=True)
