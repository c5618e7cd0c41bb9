"""The node launcher: one command per node that brings back a process that dies and leaves the others be.

The unit tests run the launcher on small Python commands (no torch in them): its variables, its
restarts, its limits and its errors. The end-to-end test runs ``examples/join.py`` under it: a worker
that crashes is started again, joins the running job, and the others keep their processes.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import run_script

from decent_optim_wrapper.node_launcher import (
    LaunchConfig,
    NodeLauncher,
    main,
    parse_config,
    worker_environment,
)

ROOT = Path(__file__).resolve().parent.parent


def _config(command: list[str], nproc: int = 2, **options) -> LaunchConfig:
    return LaunchConfig(tuple(command), nproc, 1, 3, "head", 29500, **options)


@pytest.mark.pure
def test_each_process_gets_its_place_in_the_job_and_its_restart_count():
    env = worker_environment(_config(["true"], nproc=4, job="lm"), local_rank=2, restarts=3)
    assert env == {
        "MASTER_ADDR": "head",
        "MASTER_PORT": "29500",
        "RANK": "6",  # node 1 of 4 processes each, local rank 2
        "WORLD_SIZE": "12",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "TORCHELASTIC_RESTART_COUNT": "3",
        "TORCHELASTIC_RUN_ID": "lm",
    }


@pytest.mark.pure
@pytest.mark.timeout(60)
def test_a_process_that_fails_is_started_again_alone_and_the_others_keep_their_pids(tmp_path):
    # Local rank 1 fails on its first two starts; local rank 0 runs once, for longer than those restarts.
    script = (
        "import os, sys, time\n"
        "rank, restarts = int(os.environ['LOCAL_RANK']), int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        f"open(os.path.join({str(tmp_path)!r}, f'{{rank}}-{{restarts}}-{{os.getpid()}}'), 'w').close()\n"
        "if rank == 1 and restarts < 2: sys.exit(3)\n"
        "time.sleep(1.5 if rank == 0 else 0)\n"
    )
    launcher = NodeLauncher(_config([sys.executable, "-c", script], restart_delay_s=0.05))
    assert launcher.run() == 0
    started = sorted(p.name for p in tmp_path.iterdir())
    assert [s.rsplit("-", 1)[0] for s in started] == ["0-0", "1-0", "1-1", "1-2"]
    rank0, rank1 = launcher.slots
    assert len(rank0.pids) == 1 and rank0.restarts == 0, "the healthy process was never touched"
    assert len(rank1.pids) == 3 and rank1.restarts == 2
    assert started[0] == f"0-0-{rank0.pids[0]}"


@pytest.mark.pure
@pytest.mark.timeout(60)
def test_a_process_out_of_restarts_fails_the_launch_without_stopping_the_others(capfd):
    script = "import os, sys, time\nsys.exit(5) if os.environ['LOCAL_RANK'] == '1' else time.sleep(0.5)\n"
    launcher = NodeLauncher(_config([sys.executable, "-c", script], max_restarts=1, restart_delay_s=0))
    assert launcher.run() == 1
    rank0, rank1 = launcher.slots
    assert (rank0.outcome, rank1.outcome) == ("done", "failed")
    assert len(rank1.pids) == 2  # the first start and one restart
    err = capfd.readouterr().err
    assert "local rank 1" in err and "exited with code 5; not started again: no restarts left" in err


@pytest.mark.pure
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--store", "head", "--", "python", "x.py"], "--store='head' must be HOST:PORT"),
        (["--store", "head:29500"], "no command to run"),
        (["--store", "h:1", "--node", "2", "--nodes", "2", "--", "x"], r"--node=2 must be in 0\.\.1"),
        (["--store", "h:1", "--nproc-per-node", "0", "--", "x"], "--nproc-per-node=0 must be >= 1"),
        (["--store", "h:1", "--max-restarts", "-1", "--", "x"], "--max-restarts=-1 must be >= 0"),
        (["--store", "h:70000", "--", "x"], "port 70000 must be in 1..65535"),
    ],
)
def test_bad_options_are_named_with_the_fix(argv, message, capfd):
    with pytest.raises(ValueError, match=message):
        parse_config(argv)
    assert main(argv) == 2
    assert "node_launcher:" in capfd.readouterr().err


@pytest.mark.pure
def test_the_command_follows_the_double_dash():
    config, host_store = parse_config(
        ["--store", "h:29500", "--host-store", "--", sys.executable, "train.py", "--lr", "1"]
    )
    assert config.command == (sys.executable, "train.py", "--lr", "1") and host_store


@pytest.mark.pure
def test_without_a_double_dash_the_command_starts_at_the_first_argument_that_is_no_option_or_value():
    # Option values that look like options or commands stay with their option; the command keeps its `--`.
    config, host_store = parse_config(
        ["--job", "python", "--max-restarts", "0", "--store=h:29500", sys.executable, "x.py", "--", "-v"]
    )
    assert config.command == (sys.executable, "x.py", "--", "-v") and not host_store
    assert (config.job, config.max_restarts, config.store_port) == ("python", 0, 29500)


@pytest.mark.pure
def test_torchruns_underscore_spellings_and_abbreviations_are_read_as_the_options():
    # torchrun's spelling first: argparse's REMAINDER took it for the command, then asked for --store.
    argv = ["--nproc_per_node", "2", "--max_restarts=3", "--stop_grace", "5", "--store", "h:1", "--"]
    config, _ = parse_config([*argv, sys.executable])
    assert (config.nproc_per_node, config.max_restarts, config.stop_grace_s) == (2, 3, 5.0)
    config, _ = parse_config(["--nproc", "4", "--store", "h:1", sys.executable])  # argparse's abbreviation
    assert config.nproc_per_node == 4


@pytest.mark.pure
@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["--nprocs", "2", "--store", "h:1", "--", "x"],
            "unknown option '--nprocs': did you mean --nproc-per-node? (the options go before '--', "
            "the command after it)",
        ),
        (
            ["--nnodes", "2", "--store", "h:1", "--", "x"],
            "unknown option '--nnodes': torchrun's --nnodes is --nodes here",
        ),
        (
            ["--store", "h:1", "--master_port", "1", "--", "x"],
            "torchrun's --master_port is --store HOST:PORT here",
        ),
        (
            ["--store", "h:1", "--bogus", "python", "x.py"],
            "unknown option '--bogus': see --help for the options",
        ),
        (
            ["--nproc-per-node", "two", "--store", "h:1", "--", "x"],
            "argument --nproc-per-node: invalid int value: 'two'",
        ),
        (["--", sys.executable], "the following arguments are required: --store (see --help)"),
        (
            ["--store", "h:1", "--", "no-such-command"],
            "command 'no-such-command' is neither a program on PATH",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_value_and_the_fix(argv, line, capfd):
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("node_launcher: ") and line in err, err


def _launch(*argv: str) -> subprocess.CompletedProcess[str]:
    """The launcher run as a user runs it; a deadline only against a hang (it imports torch: seconds)."""
    command = [sys.executable, "-m", "decent_optim_wrapper.node_launcher", *argv]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.mark.pure
@pytest.mark.timeout(300)
def test_an_unknown_option_before_the_command_is_named_not_taken_for_the_command():
    # argparse's REMAINDER took `--nprocs 2 ...` for the command and asked for --store.
    result = _launch("--nprocs", "2", "--store", "127.0.0.1:1", "--", sys.executable, "-c", "")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "node_launcher: unknown option '--nprocs': did you mean --nproc-per-node? (the options go before "
        "'--', the command after it)"
    ]


@pytest.mark.pure
@pytest.mark.timeout(300)
def test_a_command_that_does_not_exist_is_one_line_not_a_traceback():
    result = _launch("--store", "127.0.0.1:1", "--", "no-such-command", "--lr", "1")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "node_launcher: command 'no-such-command' is neither a program on PATH nor an executable file: "
        "check its spelling, or start it with the program that runs it, e.g. -- python train.py"
    ]


@pytest.mark.pure
@pytest.mark.timeout(300)
def test_hosting_the_store_on_a_port_in_use_is_one_line_naming_the_port_and_the_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _launch("--store", f"127.0.0.1:{port}", "--host-store", "--", sys.executable, "-c", "")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"node_launcher: --host-store cannot listen on port {port} (--store 127.0.0.1:{port}): the port is "
        "already in use on this machine; give --store a free port, or drop --host-store and point --store "
        "at the store already running there."
    ]


@pytest.mark.pure
@pytest.mark.timeout(300)
def test_a_launcher_stopped_by_a_signal_exits_with_128_plus_its_number(tmp_path):
    # The process exits 0 on the SIGINT passed on; the launcher still says it was stopped, not done.
    started = tmp_path / "started"
    script = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *_: sys.exit(0))\n"
        f"open({str(started)!r}, 'w').close()\n"
        "time.sleep(120)\n"
    )
    command = [sys.executable, "-m", "decent_optim_wrapper.node_launcher", "--store", "127.0.0.1:1"]
    with subprocess.Popen(
        [*command, "--", sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.PIPE, text=True
    ) as launcher:
        deadline = time.monotonic() + 240  # against a hang only: the launcher imports torch first
        while not started.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists(), "the launcher did not start its process"
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, err
    assert "stopped by SIGINT: exit code 130" in err


@pytest.mark.pure
def test_help_ends_with_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.index("options:") < out.index("Exit codes") and "128+N   stopped by signal N" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.examples
@pytest.mark.timeout(240)
def test_a_crashed_worker_under_the_launcher_comes_back_and_joins_the_running_job():
    # examples/join.py: the worker started as rank 1 exits at step 40 (a crash); the launcher starts it
    # again with the same command, and it joins the job the other two kept running.
    command = [
        sys.executable, "-m", "decent_optim_wrapper.node_launcher", "--nproc-per-node", "3",
        "--store", f"127.0.0.1:{_free_port()}", "--host-store", "--restart-delay", "0.5", "--",
        sys.executable, "examples/join.py", "--crash", "1:40", "--steps", "200", "--step-time", "0.1",
    ]  # fmt: skip
    output = run_script(*command[1:], deadline_s=200)  # the launcher's log and the workers', merged
    started = dict(re.findall(r"local rank (\d) \(RANK \d\) started: pid (\d+)", output))
    restarted = re.findall(
        r"local rank (\d) \(RANK \d\) started again \(restart 1 of 10\): pid (\d+)", output
    )
    assert sorted(started) == ["0", "1", "2"] and [r for r, _ in restarted] == ["1"], output
    assert "local rank 1 (pid {}) exited with code 1".format(started["1"]) in output
    for rank in ("0", "2"):
        assert f"local rank {rank} (pid {started[rank]}) finished" in output, (
            "the others keep their processes"
        )
    assert f"local rank 1 (pid {restarted[0][1]}) finished" in output
    assert re.search(r"joined the running job at step \d+ as rank 2 of 3", output), output
    assert len(re.findall(r"finished at step 200 as rank \d of 3; lost \d, admitted \d", output)) == 3, output


@pytest.mark.pure
@pytest.mark.timeout(60)
def test_stop_passes_the_signal_on_and_kills_what_ignores_it_after_the_grace():
    # Local rank 0 stops on SIGTERM; local rank 1 ignores it and is killed after the grace period.
    script = (
        "import os, signal, time\n"
        "if os.environ['LOCAL_RANK'] == '1': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "time.sleep(60)\n"
    )
    launcher = NodeLauncher(_config([sys.executable, "-c", script], stop_grace_s=1.0))
    threading.Timer(1.5, launcher.stop).start()
    start = time.monotonic()
    assert launcher.run() == 128 + signal.SIGTERM  # stopped before finishing: the signal's exit code
    assert time.monotonic() - start < 20
    assert [slot.outcome for slot in launcher.slots] == ["failed", "failed"]
    assert [len(slot.pids) for slot in launcher.slots] == [1, 1], "nothing is started again once stopping"
