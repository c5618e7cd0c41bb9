"""One command per node for a job that loses and regains workers: start the node's processes, bring
back any that dies, and never touch the others.

torchrun's agent restarts every worker of its group when one fails; a job built with
``on_peer_failure="continue"`` wants the opposite: the survivors go on, and the lost worker, started
again with the same command, joins the running job (:func:`~decent_optim_wrapper.init_elastic`). This
launcher runs ``--nproc-per-node`` copies of a command, one per GPU, each with the variables
:func:`~decent_optim_wrapper.initialize_dist` reads::

    MASTER_ADDR, MASTER_PORT   the job's store (--store)
    RANK                       node * nproc_per_node + local_rank: its place among the starting workers
    WORLD_SIZE                 nodes * nproc_per_node
    LOCAL_RANK                 its index on the node (its GPU)
    LOCAL_WORLD_SIZE           nproc_per_node
    TORCHELASTIC_RUN_ID        the job's name (--job), if given
    TORCHELASTIC_RESTART_COUNT how often this local rank has been started again

A process that exits with 0 is done. One that exits otherwise (a crash, a kill, an out-of-memory) is
started again with the same command and variables after ``--restart-delay`` seconds, at most
``--max-restarts`` times; the job is running, so it joins. The launcher ends when every local rank is
done (exit code 0) or has used up its restarts (exit code 1). The processes run in sessions of their
own, so a terminal's Ctrl-C reaches them once, through the launcher: SIGINT and SIGTERM are passed on,
a process still running ``--stop-grace`` seconds later is killed, and the launcher exits with 128 + the
signal's number.

A process that exits after the job has ended (every member done) finds no running job when it comes
back, and waits to start a new one: give ``--max-restarts 0`` to a last short stretch, or stop the
launcher.

The store must outlive every worker: ``--host-store`` makes this launcher host it (on the node that
stays; the other nodes point ``--store`` at it), or host it yourself (the joining page of the docs).
A store hosted here lives as long as this launcher, which ends when its own processes have: put it on
a node that runs to the end.

Example, two nodes of 4 GPUs, the store on the first::

    python -m decent_optim_wrapper.node_launcher --nproc-per-node 4 --node 0 --nodes 2 \\
        --store head:29500 --host-store -- python train.py
    python -m decent_optim_wrapper.node_launcher --nproc-per-node 4 --node 1 --nodes 2 \\
        --store head:29500 -- python train.py

The command follows ``--``, or starts at the first argument that is neither an option nor an option's
value. torchrun's spellings of these options, with underscores (``--nproc_per_node``,
``--max_restarts``), are accepted.

Exit codes::

    0       every local rank finished (its process exited with 0)
    1       a local rank used up its --max-restarts (the others ran to their end)
    2       bad input, found before any process started: an unknown option or a bad value,
            a command that is not found, a --host-store port already in use
    128+N   stopped by signal N, passed on to the processes (130: Ctrl-C, 143: SIGTERM)
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, NoReturn

__all__ = ["LaunchConfig", "NodeLauncher", "main", "worker_environment"]

#: How often the launcher looks at its processes, in seconds.
_POLL_S = 0.1


@dataclass(frozen=True)
class LaunchConfig:
    """What one node's launcher runs, checked by :meth:`check`."""

    command: tuple[str, ...]
    nproc_per_node: int
    node: int
    nodes: int
    store_host: str
    store_port: int
    job: str | None = None
    max_restarts: int = 10
    restart_delay_s: float = 1.0
    stop_grace_s: float = 30.0

    def check(self) -> None:
        """Raise ``ValueError`` naming the option, its value and the fix."""
        if not self.command:
            raise ValueError("no command to run: give it after '--', e.g. -- python train.py")
        for name, value, least in (("--nproc-per-node", self.nproc_per_node, 1), ("--nodes", self.nodes, 1)):
            if value < least:
                raise ValueError(f"{name}={value} must be >= {least}.")
        if not 0 <= self.node < self.nodes:
            raise ValueError(
                f"--node={self.node} must be in 0..{self.nodes - 1} (--nodes={self.nodes}): the node's place "
                "among the nodes that start the job."
            )
        if not 0 < self.store_port < 65536:
            raise ValueError(f"--store port {self.store_port} must be in 1..65535.")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts={self.max_restarts} must be >= 0.")
        if self.restart_delay_s < 0:
            raise ValueError(f"--restart-delay={self.restart_delay_s} must be >= 0 seconds.")
        if self.stop_grace_s < 0:
            raise ValueError(f"--stop-grace={self.stop_grace_s} must be >= 0 seconds.")


def worker_environment(config: LaunchConfig, local_rank: int, restarts: int) -> dict[str, str]:
    """The variables local rank ``local_rank`` is started with (added to the launcher's environment)."""
    env = {
        "MASTER_ADDR": config.store_host,
        "MASTER_PORT": str(config.store_port),
        "RANK": str(config.node * config.nproc_per_node + local_rank),
        "WORLD_SIZE": str(config.nodes * config.nproc_per_node),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
        "TORCHELASTIC_RESTART_COUNT": str(restarts),
    }
    if config.job is not None:
        env["TORCHELASTIC_RUN_ID"] = config.job
    return env


@dataclass
class _Slot:
    """One local rank: its current process and how often it has been started again."""

    local_rank: int
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    restart_at: float | None = None  # when to start it again (after a failure)
    outcome: str | None = None  # "done" or "failed", once it will not run again
    pids: list[int] = field(default_factory=list)


class NodeLauncher:
    """Runs one node's processes: :meth:`run` until each is done or out of restarts."""

    def __init__(self, config: LaunchConfig, base_env: Mapping[str, str] | None = None) -> None:
        config.check()
        self.config = config
        self._base_env = dict(os.environ if base_env is None else base_env)
        self.slots = [_Slot(local_rank) for local_rank in range(config.nproc_per_node)]
        self._stopping = False
        self._stopped_at: float | None = None
        self._signal = signal.SIGTERM

    def _log(self, message: str) -> None:
        print(f"[node_launcher node {self.config.node}] {message}", file=sys.stderr, flush=True)

    def _start(self, slot: _Slot) -> None:
        env = {**self._base_env, **worker_environment(self.config, slot.local_rank, slot.restarts)}
        # A session of its own: a terminal's signal reaches it once, forwarded by stop().
        slot.process = subprocess.Popen(self.config.command, env=env, start_new_session=True)
        slot.pids.append(slot.process.pid)
        if self._stopping:  # stop() came while it was starting
            slot.process.send_signal(self._signal)
        rank = env["RANK"]
        again = f" again (restart {slot.restarts} of {self.config.max_restarts})" if slot.restarts else ""
        self._log(f"local rank {slot.local_rank} (RANK {rank}) started{again}: pid {slot.process.pid}")

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Pass ``signum`` on to every running process; none is started again, and any still running
        ``stop_grace_s`` later is killed."""
        self._signal = signal.Signals(signum)
        self._stopping = True
        if self._stopped_at is None:
            self._stopped_at = time.monotonic()
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                slot.process.send_signal(signum)

    def _kill_after_grace(self) -> None:
        if self._stopped_at is None or time.monotonic() < self._stopped_at + self.config.stop_grace_s:
            return
        for slot in self.slots:
            if slot.process is not None and slot.process.poll() is None:
                self._log(f"local rank {slot.local_rank} (pid {slot.process.pid}) did not stop: killed")
                slot.process.kill()

    def run(self) -> int:
        """Start every local rank and watch them; returns the launcher's exit code: 0 if all finished
        cleanly, 1 if one used up its restarts, 128 + the signal's number if :meth:`stop` was called."""
        for slot in self.slots:
            self._start(slot)
        try:
            while any(slot.outcome is None for slot in self.slots):
                time.sleep(_POLL_S)
                for slot in self.slots:
                    self._watch(slot)
                self._kill_after_grace()
        finally:  # the launcher failing must not leave its processes behind (they have sessions of their own)
            for slot in self.slots:
                if slot.process is not None and slot.process.poll() is None:
                    slot.process.kill()
        if self._stopping:
            # The shell's code for a process ended by a signal: whoever runs the launcher (a scheduler,
            # systemd) sees the job was stopped, not finished, however its processes exited.
            code = 128 + self._signal
            self._log(f"stopped by {self._signal.name}: exit code {code}")
            return code
        failed = [slot.local_rank for slot in self.slots if slot.outcome == "failed"]
        if failed:
            self._log(f"local ranks {failed} failed; the others finished")
            return 1
        return 0

    def _watch(self, slot: _Slot) -> None:
        if slot.outcome is not None:
            return
        if slot.process is None:  # waiting to be started again
            if self._stopping:
                slot.outcome = "failed"
            elif slot.restart_at is not None and time.monotonic() >= slot.restart_at:
                slot.restart_at = None
                self._start(slot)
            return
        code = slot.process.poll()
        if code is None:
            return
        pid, slot.process = slot.process.pid, None
        if code == 0:
            slot.outcome = "done"
            self._log(f"local rank {slot.local_rank} (pid {pid}) finished")
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        if self._stopping or slot.restarts >= self.config.max_restarts:
            slot.outcome = "failed"
            why = "the launcher is stopping" if self._stopping else "no restarts left"
            self._log(f"local rank {slot.local_rank} (pid {pid}) {how}; not started again: {why}")
            return
        slot.restarts += 1
        slot.restart_at = time.monotonic() + self.config.restart_delay_s
        self._log(f"local rank {slot.local_rank} (pid {pid}) {how}; starting it again with the same command")


def _host_store(host: str, port: int) -> Any:
    """A TCPStore server on ``port``, kept for as long as the launcher runs; ``ValueError`` (bad input,
    exit code 2) if it cannot listen there."""
    # Only the launcher that hosts the store needs torch.
    from torch.distributed import DistNetworkError, TCPStore  # type: ignore[attr-defined]

    try:
        return TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False)
    except DistNetworkError as err:
        if "EADDRINUSE" in str(err):
            raise ValueError(
                f"--host-store cannot listen on port {port} (--store {host}:{port}): the port is already in "
                "use on this machine; give --store a free port, or drop --host-store and point --store at "
                "the store already running there."
            ) from None
        reason = str(err).splitlines()[0]  # torch's first line says why; the rest is its C++ stack
        raise ValueError(
            f"--host-store cannot listen on port {port} (--store {host}:{port}): {reason}"
        ) from None


class _Parser(argparse.ArgumentParser):
    """argparse's errors raised as ``ValueError``: :func:`main` prints each on one line, exit code 2,
    like the launcher's own checks (argparse would print the whole usage first). ``options`` maps every
    option string to its action, for :func:`_split_command` (argparse keeps no public map)."""

    def __init__(self, **kwargs: Any) -> None:
        self.options: dict[str, argparse.Action] = {}  # before argparse adds --help through add_argument
        super().__init__(**kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        self.options.update(dict.fromkeys(action.option_strings, action))
        return action

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"{message} (see --help)")


def _parser() -> _Parser:
    # --help: the module's docstring, its part on the command line and the exit codes after the options.
    description, marker, epilog = (__doc__ or "").partition("\nThe command follows")
    parser = _Parser(
        prog="python -m decent_optim_wrapper.node_launcher",
        usage="%(prog)s [options] --store HOST:PORT [--host-store] [--] COMMAND ...",
        description=description,
        epilog=(marker + epilog).strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes on this node (one per GPU)")
    parser.add_argument("--node", type=int, default=0, help="this node's place among the starting nodes")
    parser.add_argument("--nodes", type=int, default=1, help="how many nodes start the job")
    parser.add_argument("--store", required=True, metavar="HOST:PORT", help="the job's store")
    parser.add_argument("--host-store", action="store_true", help="host the store here, on PORT")
    parser.add_argument("--job", default=None, help="the job's name in the store (TORCHELASTIC_RUN_ID)")
    parser.add_argument("--max-restarts", type=int, default=10, help="restarts per local rank")
    parser.add_argument("--restart-delay", type=float, default=1.0, help="seconds before a restart")
    parser.add_argument(
        "--stop-grace", type=float, default=30.0, help="seconds a stopped process has before it is killed"
    )
    return parser


#: torchrun's options that have another name here (underscores read as dashes).
_TORCHRUN_NAMES = {
    "--nnodes": "--nodes",
    "--node-rank": "--node",
    "--master-addr": "--store HOST:PORT",
    "--master-port": "--store HOST:PORT",
    "--rdzv-endpoint": "--store HOST:PORT",
    "--rdzv-id": "--job",
    "--standalone": "--store 127.0.0.1:PORT --host-store",
}


def _split_command(parser: _Parser, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's options and the command, which follows ``--`` or starts at the first argument that
    is neither an option nor an option's value.

    The options are split off here, not by an argparse REMAINDER: that took an unknown option for the
    start of the command (``--nproc_per_node 2 --store ...`` then asked for ``--store``). Here an unknown
    option before the command is named, with the right spelling.
    """
    known = parser.options
    options: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        name, equals, value = argv[i].partition("=")
        name = name.replace("_", "-")  # torchrun's spelling: --nproc_per_node, --max_restarts
        # An exact name, else a prefix of long ones (argparse's abbreviations; it names an ambiguous one).
        long = name.startswith("--")
        exact = known.get(name)
        actions = [exact] if exact else [a for s, a in known.items() if long and s.startswith(name)]
        if not actions:
            raise _unknown_option(argv[i], name, [s for s in known if s.startswith("--")])
        options.append(name + equals + value)
        i += 1
        if not equals and any(action.nargs != 0 for action in actions) and i < len(argv):
            options.append(argv[i])  # the option's value, whatever it looks like (--max-restarts -1)
            i += 1
    command = argv[i + 1 :] if argv[i : i + 1] == ["--"] else argv[i:]
    return options, list(command)


def _unknown_option(option: str, name: str, known: Sequence[str]) -> ValueError:
    if name in _TORCHRUN_NAMES:
        fix = f"torchrun's {option} is {_TORCHRUN_NAMES[name]} here"
    else:
        fix = f"did you mean {close}?" if (close := _closest(name, known)) else "see --help for the options"
    return ValueError(f"unknown option {option!r}: {fix} (the options go before '--', the command after it)")


def _closest(name: str, known: Sequence[str]) -> str | None:
    """The option ``name`` was likely meant to be: the closest of those that start with the same 4
    letters (--nprocs), else a close spelling (--mx-restarts)."""
    words = {option.removeprefix("--"): option for option in known}  # the dashes would count as alike
    typed = name.lstrip("-")
    same_start = [word for word in words if word[:4] == typed[:4]] if len(typed) >= 4 else []
    close = difflib.get_close_matches(typed, same_start or words, n=1, cutoff=0.0 if same_start else 0.6)
    return words[close[0]] if close else None


def parse_config(argv: Sequence[str]) -> tuple[LaunchConfig, bool]:
    """The launch configuration and whether to host the store, from the command line."""
    parser = _parser()
    options, command = _split_command(parser, argv)
    args = parser.parse_args(options)
    host, sep, port = args.store.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--store={args.store!r} must be HOST:PORT, e.g. head-node:29500.")
    config = LaunchConfig(
        tuple(command),
        args.nproc_per_node,
        args.node,
        args.nodes,
        host,
        int(port),
        args.job,
        args.max_restarts,
        args.restart_delay,
        args.stop_grace,
    )
    config.check()
    # Found here, before a store or a process starts; Popen would raise it from the first start instead.
    # shutil.which searches the PATH the processes get (the launcher's own) as Popen does.
    if shutil.which(command[0]) is None:
        raise ValueError(
            f"command {command[0]!r} is neither a program on PATH nor an executable file: check its "
            "spelling, or start it with the program that runs it, e.g. -- python train.py"
        )
    return config, args.host_store


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher on the command line ``argv``; returns its exit code (the module's docstring)."""
    try:
        config, host_store = parse_config(sys.argv[1:] if argv is None else argv)
        store = _host_store(config.store_host, config.store_port) if host_store else None
    except ValueError as err:
        print(f"node_launcher: {err}", file=sys.stderr)
        return 2
    launcher = NodeLauncher(config)

    def forward(signum: int, frame: FrameType | None) -> None:
        del frame
        launcher.stop(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        return launcher.run()
    finally:
        del store


if __name__ == "__main__":
    sys.exit(main())
