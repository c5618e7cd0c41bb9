"""examples/join.py as its docstring launches it: a store hosted outside the workers, the same command
for every worker; a crashed worker is brought back with that command and joins the running job, and
one more worker started the same way grows the job beyond its starting size."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.examples

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 160  # starting 5 workers (seconds each on 2 cores) and 240 steps of 0.1 s
# The members do not wait for joiners: after the crash at step 20 a joiner has the remaining 22 s of
# steps to start (importing torch takes seconds, tens on a loaded 2-core machine) and apply.
STEPS = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.timeout(DEADLINE_S + 30)
def test_a_crashed_worker_comes_back_with_the_same_command_and_another_grows_the_job(tmp_path):
    port = _free_port()
    script = [sys.executable, "examples/join.py"]
    store = subprocess.Popen([*script, "--host-store", "--port", str(port)], cwd=ROOT)
    workers: dict[str, subprocess.Popen[str]] = {}
    logs: dict[str, Path] = {}

    def start(name: str, rank: int) -> None:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank)}
        env |= {"WORLD_SIZE": "3", "OMP_NUM_THREADS": "1"}
        logs[name] = tmp_path / f"{name}.log"
        with logs[name].open("w") as log:
            command = [
                *script,
                "--steps",
                str(STEPS),
                "--step-time",
                "0.1",
                "--crash",
                "1:20",
                "--timeout",
                "10",
            ]
            workers[name] = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
            )

    try:
        time.sleep(1)  # the store listens
        for rank in range(3):
            start(f"rank{rank}", rank)
        deadline = time.monotonic() + DEADLINE_S
        while workers["rank1"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert workers["rank1"].returncode == 1, logs["rank1"].read_text()
        start("rank1-again", 1)  # the same command brings it back
        start("extra", 0)  # and once more (any RANK below WORLD_SIZE): the job grows beyond its start
        for name, worker in workers.items():
            worker.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert name == "rank1" or worker.returncode == 0, logs[name].read_text()
    finally:
        for worker in [*workers.values(), store]:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    out = {name: path.read_text() for name, path in logs.items()}
    assert "injected failure: the worker started as rank 1 exits at step 20" in out["rank1"]
    for name in ("rank1-again", "extra"):
        assert re.search(r"joined the running job at step \d+ as rank \d of [34]", out[name]), out[name]
    finals = [
        re.search(rf"finished at step {STEPS} as rank (\d) of (\d)", text)
        for name, text in out.items()
        if name != "rank1"
    ]
    assert all(finals), out
    assert sorted(int(m.group(1)) for m in finals) == [0, 1, 2, 3]
    assert {int(m.group(2)) for m in finals} == {4}
    for name in ("rank0", "rank2"):
        assert re.search(r"lost 1, admitted 2", out[name]), out[name]
    accuracy = float(re.search(r"averaged model's accuracy ([0-9.]+)", out["rank0"]).group(1))
    assert accuracy > 0.2  # it learns: chance is 0.1 on 10 balanced classes
