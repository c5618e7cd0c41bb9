"""Watch an elastic job: every worker, its step and rate, and the job's joins, losses and guard events.

    python -m decent_optim_wrapper.monitor --store HOST:PORT [--job NAME]            # a terminal view
    python -m decent_optim_wrapper.monitor --store HOST:PORT [--job NAME] --json     # once, for scripts
    python -m decent_optim_wrapper.monitor --store HOST:PORT [--job NAME] --serve 8080   # a web page

``--store`` is the store the job's workers meet in (the node launcher's ``--store``, the store given to
``init_elastic``), ``--job`` the job's name there (``init_elastic(job=...)``, the launcher's ``--job``;
default ``$TORCHELASTIC_RUN_ID``, else ``"default"``, as ``init_elastic`` takes it). A job with a
secret needs it: ``$DECENT_JOB_SECRET`` (or ``--secret``, which other users of the machine can read).

The monitor only reads. Its records are those the members publish every 2 s
(:mod:`decent_optim_wrapper.engine.fleet.status`) when they train with ``on_peer_failure="continue"``:
a job started with ``init_elastic`` (or the node launcher), or by ``torchrun`` alone. A ``torchrun``
job's members meet in torchrun's store: ``--store MASTER_ADDR:MASTER_PORT --job RDZV_ID`` (the
``--rdzv-id`` it was given, ``$TORCHELASTIC_RUN_ID`` in its workers; ``torchrun --standalone`` makes
one up and prints it). With ``on_peer_failure="raise"`` (the default) a job has no membership, so no
records: there is nothing to watch.

Exit codes: 0, or 2 for bad input (no store at that address, no job of that name, a wrong secret, a
port in use), printed as one line naming the option, its value and the fix.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NoReturn

from decent_optim_wrapper.engine import (
    RECORDS_ENV,
    SECRET_ENV,
    ForgedEntryError,
    Seal,
    default_job,
    resolve_secret,
)
from decent_optim_wrapper.monitor.terminal import render
from decent_optim_wrapper.monitor.view import read_view

__all__ = ["STUCK", "MonitorError", "connect", "main", "snapshot"]


class MonitorError(ValueError):
    """Bad input to the monitor: one line naming the option, its value and the fix."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise MonitorError(f"{message} (see --help)")


def _parser() -> _Parser:
    parser = _Parser(
        prog="python -m decent_optim_wrapper.monitor",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--store", required=True, metavar="HOST:PORT", help="the job's store")
    parser.add_argument(
        "--job",
        default=default_job(),
        help="the job's name in the store (default $TORCHELASTIC_RUN_ID, else 'default')",
    )
    parser.add_argument("--secret", default=None, help=f"the job's secret (default ${SECRET_ENV})")
    parser.add_argument("--json", action="store_true", help="print the view once as JSON and exit")
    parser.add_argument("--serve", type=int, default=None, metavar="PORT", help="serve a web page on PORT")
    parser.add_argument("--host", default="127.0.0.1", help="where --serve listens (default localhost only)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to reach the store")
    return parser


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MonitorError(
            f"--store {text!r} is not HOST:PORT; give the job's store, e.g. --store node0:29400."
        )
    return host, int(port)


#: Threads still inside a store client's handshake that the monitor gave up on (see :func:`connect`).
STUCK: list[threading.Thread] = []


def connect(address: str, timeout_s: float = 5.0) -> Any:
    """A client of the store at ``address`` (``HOST:PORT``), or :class:`MonitorError` naming the fix.

    Bounded by ``timeout_s`` whatever answers there: a store client's handshake with a server that
    accepts the connection but never answers (not a store) would wait forever, so it runs on a thread
    of its own, given up on at the deadline (and left in :data:`STUCK`)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    host, port = _address(address)
    fix = (
        "give the address the job's workers meet at (the node launcher's --store, the store passed to "
        "init_elastic)."
    )
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        raise MonitorError(f"--store {address}: the host {host!r} does not resolve ({err}); {fix}") from err
    outcome: list[Any] = []

    def reach() -> None:
        try:
            outcome.append(TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s)))
        except Exception as err:  # DistNetworkError, RuntimeError
            outcome.append(err)

    thread = threading.Thread(target=reach, name="decent-monitor-connect", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)  # the client's own timeout, and a second for it to say so
    if outcome and not isinstance(outcome[0], Exception):
        return outcome[0]
    if not outcome:
        STUCK.append(thread)
        reason = "no answer as a store: something else listens there, or the store is overloaded"
    else:
        failed = outcome[0]
        reason = str(failed).strip().splitlines()[0] if str(failed).strip() else type(failed).__name__
    raise MonitorError(f"--store {address}: no store answered within {timeout_s:g} s ({reason}); {fix}")


def _seal(secret: str | None) -> Seal:
    try:
        return Seal(resolve_secret(secret))
    except (TypeError, ValueError) as err:
        raise MonitorError(f"--secret: {err}") from err


def snapshot(store: Any, job: str, seal: Seal, address: str) -> dict[str, Any]:
    """The job's view now, or :class:`MonitorError` saying why there is none (no job, a wrong secret)."""
    try:
        view = read_view(store, job, seal, address)
    except ForgedEntryError as err:
        given = "the secret given" if seal.enabled else "no secret"
        raise MonitorError(
            f"--job {job!r}: its status records in the store at {address} do not verify with {given} "
            f"({err}) Give the job's secret in ${SECRET_ENV} (or --secret)."
        ) from err
    if view is None:
        raise MonitorError(
            f"--job {job!r}: no job of that name has published status records in the store at {address}. "
            "Give the name the workers pass to init_elastic(job=...) (the node launcher's --job; a torchrun "
            "job's --rdzv-id, $TORCHELASTIC_RUN_ID in its workers, with --store MASTER_ADDR:MASTER_PORT). "
            "Members publish every 2 s once they train with on_peer_failure='continue' (unless "
            f"{RECORDS_ENV}=0); with on_peer_failure='raise', the default, a job publishes none."
        )
    return view


def main(argv: Sequence[str] | None = None) -> int:
    """Run the monitor on the command line ``argv``; returns its exit code (the module's docstring)."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
        if args.interval <= 0:
            raise MonitorError(f"--interval {args.interval:g} must be > 0 seconds.")
        if args.connect_timeout <= 0:
            raise MonitorError(f"--connect-timeout {args.connect_timeout:g} must be > 0 seconds.")
        seal = _seal(args.secret)
        store = connect(args.store, args.connect_timeout)
        view = snapshot(store, args.job, seal, args.store)
        if args.json:
            print(json.dumps(view, indent=1, sort_keys=True))
            return 0

        def read() -> dict[str, Any]:
            return snapshot(store, args.job, seal, args.store)

        if args.serve is not None:
            from decent_optim_wrapper.monitor.web import serve

            return serve(read, args.host, args.serve, args.interval)
        return _watch(read, view, args.interval)
    except MonitorError as err:
        print(f"monitor: {err}", file=sys.stderr)
        return 2


def _watch(read: Any, view: dict[str, Any], interval: float) -> int:
    """Redraw the terminal view every ``interval`` seconds until interrupted."""
    try:
        while True:
            sys.stdout.write("\x1b[H\x1b[2J" + render(view) + "\n")
            sys.stdout.flush()
            time.sleep(max(0.0, interval - 1.0))  # reading the view takes about 1 s (the heartbeats)
            view = read()
    except KeyboardInterrupt:
        return 0
