"""An emulated cluster on one machine: network namespaces on a bridge, links shaped with ``tc tbf``.

:class:`Cluster` builds ``nodes`` Linux network namespaces (``dow-n0``, ``dow-n1``, ...), each with one
veth link to a bridge that lives in a namespace of its own (``dow-br``), addresses ``10.213.7.0/24``,
and removes them on exit, error or Ctrl-C; :meth:`Cluster.shape` sets every link to one rate in both
directions (the node-side veth shapes what the node sends, the bridge-side one what it receives) and
:func:`measure_link` checks it with one TCP stream; :func:`measure_message_bytes` measures what a small
all-reduce costs beyond its payload (the planner's ``Link.message_bytes``). Ranks of one node talk over
the node's own address, through loopback: unshaped. :func:`launch` starts one process per rank inside
its node's namespace (or on loopback without a cluster), :func:`collect` waits for them within a
deadline and :func:`run_workers` pools their step times (:func:`summarize`). Building it needs root:
:func:`ready_to_emulate` says whether this process can.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PREFIX = "dow-"
BRIDGE_NS = f"{PREFIX}br"
SUBNET = "10.213.7"
#: The emulated cluster's timed rank (``run_workers``' default).
WORKER = Path(__file__).parents[1] / "cluster" / "rank.py"


def sh(*cmd: str, timeout: float = 20.0) -> str:
    """Run a command (``ip``/``tc``), raise with its stderr if it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout


def remove_namespaces() -> None:
    """Delete every namespace this module creates (their veths and qdiscs go with them)."""
    names = [line.split()[0] for line in sh("ip", "netns", "list").splitlines() if line.strip()]
    for name in names:
        if name == BRIDGE_NS or (name.startswith(f"{PREFIX}n") and name[len(PREFIX) + 1 :].isdigit()):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


class Cluster:
    """``nodes`` namespaces on one bridge; a context manager that always removes them."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes

    @staticmethod
    def namespace(node: int) -> str:
        return f"{PREFIX}n{node}"

    @staticmethod
    def ifname(node: int) -> str:
        return f"dow{node}"

    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> Cluster:
        remove_namespaces()  # leftovers of a run that was killed with SIGKILL
        br = f"-n {BRIDGE_NS}"  # the bridge's namespace
        commands = [f"netns add {BRIDGE_NS}", f"{br} link add dowbr type bridge", f"{br} link set dowbr up"]
        for node in range(self.nodes):
            ns, dev, peer = self.namespace(node), self.ifname(node), f"dow{node}br"
            commands += [f"netns add {ns}", f"-n {ns} link set lo up"]
            commands += [f"-n {ns} link add {dev} type veth peer name {peer} netns {BRIDGE_NS}"]
            commands += [f"-n {ns} addr add {self.address(node)}/24 dev {dev}", f"-n {ns} link set {dev} up"]
            commands += [f"{br} link set {peer} master dowbr", f"{br} link set {peer} up"]
        try:
            for command in commands:
                sh("ip", *command.split())
        except BaseException:
            remove_namespaces()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        remove_namespaces()

    def sent_bytes(self, nodes: Sequence[int] | None = None) -> int:
        """Bytes the links of ``nodes`` (default: all) have sent so far, by the kernel's counters:
        every header and acknowledgement included, which a count of payloads leaves out."""
        total = 0
        for node in range(self.nodes) if nodes is None else nodes:
            out = sh("ip", "-n", self.namespace(node), "-s", "-j", "link", "show", self.ifname(node))
            total += int(json.loads(out)[0]["stats64"]["tx"]["bytes"])
        return total

    def shape(self, rate: str | None, burst: int | None = None, latency: str = "100ms") -> None:
        """Every link to ``rate`` (a tc rate such as ``1gbit``) both ways; None removes the shaping.

        ``burst``: the token bucket's bytes (default: 4 ms at the rate, at least 64 KiB, a GSO
        packet). A link of tens of kbit/s wants a few packets' worth instead: 64 KiB would pass
        seconds of its traffic at the bridge's speed (tbf splits a larger GSO packet itself).
        ``latency``: how long a packet may wait in the bucket's queue before it is dropped (tc's
        ``latency``); at tens of kbit/s 100 ms queue a few KB, less than one start-up burst."""
        if rate is not None and burst is None:
            burst = max(64 * 1024, rate_bits(rate) // 8 // 250)
        for node in range(self.nodes):
            for ns, dev in ((self.namespace(node), self.ifname(node)), (BRIDGE_NS, f"dow{node}br")):
                tc = ["ip", "netns", "exec", ns, "tc", "qdisc"]
                subprocess.run([*tc, "del", "dev", dev, "root"], capture_output=True, timeout=20)
                if rate is not None:
                    sh(*tc, *f"add dev {dev} root tbf rate {rate} burst {burst} latency {latency}".split())


def rate_bits(rate: str) -> int:
    """``"200mbit"`` -> 200_000_000."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: use tc units such as 200mbit or 1gbit")


# The receiver ends the measurement: after the whole stream, or once `window` seconds have passed since
# its first byte, whichever comes first, so that a link moving less than its shaped rate (TCP backing
# off on a tiny tbf queue of a loaded machine) yields a low figure within the window instead of a
# sender still blocked in sendall when the caller's timeout strikes.
LINK_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2]))); server.settimeout(20)
conn, _ = server.accept(); conn.settimeout(5.0); total, start = 0, None
budget, window = int(sys.argv[3]), float(sys.argv[4])
while total < budget:
    try: chunk = conn.recv(1 << 20)
    except TimeoutError: break
    if not chunk: break
    now = time.perf_counter(); start = start or now; total += len(chunk)
    if now - start > window: break
if start is None: sys.exit("nothing arrived within 5 s of the connection")
print(total * 8 / (time.perf_counter() - start) / 1e6); conn.close()
"""
LINK_SENDER = """
import socket, sys, time
for _ in range(200):
    try: conn = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
else: sys.exit("the link's receiver never listened")
try: conn.sendall(bytes(int(sys.argv[3])))
except OSError: pass  # the receiver closed the stream: its window had passed
conn.close()
"""


def measure_link(cluster: Cluster, megabytes: float, port: int, timeout_s: float = 60.0) -> float:
    """Mbit/s of one TCP stream of ``megabytes`` from node 1 to node 0 (checks that the shaping
    works), measured over the whole stream or its first ``timeout_s / 2`` seconds, whichever ends
    first: it returns within about ``timeout_s``."""
    addr, window = cluster.address(0), timeout_s / 2
    budget = str(int(megabytes * 10**6))
    inside = ["ip", "netns", "exec", cluster.namespace(0)]
    receive = [*inside, sys.executable, "-c", LINK_RECEIVER, addr, str(port), budget, str(window)]
    receiver = subprocess.Popen(receive, stdout=subprocess.PIPE, text=True)
    try:
        sender = [sys.executable, "-c", LINK_SENDER, addr, str(port), budget]
        sh("ip", "netns", "exec", cluster.namespace(1), *sender, timeout=timeout_s)
        # The sender returns once its kernel buffers hold the stream: on a slow link most of it is
        # still on its way, so the receiver gets what is left of its window.
        out, _ = receiver.communicate(timeout=window + 30.0)
        if receiver.returncode != 0:
            raise RuntimeError(f"measuring the link node 1 -> 0 failed (receiver exit {receiver.returncode})")
        return float(out)
    finally:
        if receiver.poll() is None:
            receiver.kill()


ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2]))); server.settimeout(20)
conn, _ = server.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(64):
    conn.sendall(data)
"""
ECHO_CLIENT = """
import socket, statistics, sys, time
for _ in range(100):
    try: conn = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); times = []
for _ in range(50):
    start = time.perf_counter(); conn.sendall(b"x"); conn.recv(64); times.append(time.perf_counter() - start)
print(1e3 * statistics.median(times))
"""


def round_trip_ms(cluster: Cluster, port: int) -> float:
    """Median round trip of a one-byte TCP message node 1 -> node 0 -> node 1 on the idle link, in ms."""
    addr = cluster.address(0)
    inside = ["ip", "netns", "exec", cluster.namespace(0)]
    server = subprocess.Popen([*inside, sys.executable, "-c", ECHO_SERVER, addr, str(port)])
    try:
        client = [sys.executable, "-c", ECHO_CLIENT, addr, str(port)]
        return float(sh("ip", "netns", "exec", cluster.namespace(1), *client, timeout=30))
    finally:
        server.kill()
        server.wait()


MESSAGE_PROBE = """
import os, pathlib, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
rank, size, rounds, gate = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), pathlib.Path(sys.argv[4])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
words = torch.zeros(max(1, size // 4), dtype=torch.int32)
def wait_for(name):
    while not (gate / name).exists(): time.sleep(0.02)
for _ in range(3): dist.all_reduce(words, op=dist.ReduceOp.BXOR)
(gate / f"ready{rank}").touch(); wait_for("go")
for _ in range(rounds): dist.all_reduce(words, op=dist.ReduceOp.BXOR)
(gate / f"done{rank}").touch(); wait_for("exit")
os._exit(0)  # no teardown traffic
"""


def measure_message_bytes(
    cluster: Cluster,
    payload_bytes: int,
    port: int,
    goodput_fraction: float = 1.0,
    rounds: int = 20,
    timeout_s: float = 300.0,
) -> float:
    """Bytes one message of a gloo all-reduce costs on a link beyond its payload, at the goodput's rate.

    Nodes 0 and 1 run ``rounds`` all-reduces of ``payload_bytes`` (a pair's gossip round: each node
    sends one payload, in the all-reduce's two messages) and the links' counters are read around them,
    after a warm-up that the counters leave out. ``goodput_fraction``: the measured goodput over the
    shaped rate (:func:`measure_link` against :meth:`Cluster.shape`'s rate), so that the answer is in
    bytes at the rate the planner's ``Link.bandwidth`` is given in. Returns
    ``(wire bytes per node and round * goodput_fraction - payload_bytes) / 2``.
    """
    gate = Path(tempfile.mkdtemp(prefix=PREFIX))
    procs = []
    try:
        for node in (0, 1):
            argv = ["-c", MESSAGE_PROBE, str(node), str(payload_bytes), str(rounds), str(gate)]
            env = node_env(cluster, node, port)
            procs.append(start_in_node(cluster, node, argv, env, gate / f"{node}.log"))
        deadline = time.monotonic() + timeout_s

        def wait_for(*names: str) -> None:
            while not all((gate / name).exists() for name in names):
                if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    tail = (gate / "0.log").read_text()[-800:]
                    raise RuntimeError(f"the message probe failed or timed out; node 0's log:\n{tail}")
                time.sleep(0.05)

        wait_for("ready0", "ready1")
        before = cluster.sent_bytes((0, 1))
        (gate / "go").touch()
        wait_for("done0", "done1")
        time.sleep(1.0)  # the last acknowledgements (TCP delays them up to 40 ms; a slow link queues them)
        wire = (cluster.sent_bytes((0, 1)) - before) / 2 / rounds
        (gate / "exit").touch()
    finally:
        stop(procs)
        shutil.rmtree(gate, ignore_errors=True)
    return max(0.0, (wire * goodput_fraction - payload_bytes) / 2)


def node_env(cluster: Cluster | None, node: int, port: int) -> dict[str, str]:
    """The environment of a process on ``node``: rank 0's address and ``port`` to meet at, this node's
    interface and address (``NODE_ADDR``), one thread; without a cluster, loopback."""
    if cluster is None:
        addresses: dict[str, str] = {"MASTER_ADDR": "127.0.0.1", "NODE_ADDR": "127.0.0.1"}
    else:
        addresses = {
            "MASTER_ADDR": cluster.address(0),
            "GLOO_SOCKET_IFNAME": cluster.ifname(node),
            "NODE_ADDR": cluster.address(node),
        }
    return dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS="1", **addresses)


def start_in_node(
    cluster: Cluster | None, node: int, argv: Sequence[str], env: dict[str, str], log: Path
) -> Any:
    """Start ``python argv...`` inside ``node``'s namespace (without a cluster: here), in a session of
    its own (``stop`` kills the session), its output to ``log``."""
    command = [sys.executable, *argv]
    if cluster is not None:
        command = ["ip", "netns", "exec", cluster.namespace(node), *command]
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(procs: list) -> None:
    """Kill the worker sessions this process started (by process group id)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def launch(
    cluster: Cluster | None,
    port: int,
    ranks: int,
    per_node: int,
    outdir: Path,
    extra: Sequence[str] = (),
    worker: Path = WORKER,
    env: dict[str, str] | None = None,
) -> list:
    """``ranks`` processes of ``worker --rank R --world-size N --local-world-size L --out DIR/rankR.json
    *extra``, ``per_node`` to a node, each in its node's namespace (``env``: more variables)."""
    procs = []
    for rank in range(ranks):
        flags = ["--rank", rank, "--world-size", ranks, "--local-world-size", per_node]
        argv = [str(worker), *map(str, flags), "--out", str(outdir / f"rank{rank}.json"), *extra]
        node_vars = node_env(cluster, rank // per_node, port) | (env or {})
        procs.append(start_in_node(cluster, rank // per_node, argv, node_vars, outdir / f"rank{rank}.log"))
    return procs


def collect(procs: list, outdir: Path, seconds: float) -> list[dict[str, Any]] | None:
    """Wait for ``procs`` up to ``seconds`` (stop at the first failure), kill what is left; every rank's
    JSON, or None (the tail of a failed rank's log printed). A rank killed at the deadline keeps
    what it wrote last (its rounds so far)."""
    deadline = time.monotonic() + seconds
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
        timed_out = time.monotonic() >= deadline and any(p.poll() is None for p in procs)
        failed = [r for r, p in enumerate(procs) if p.poll() not in (0, None)]
        stop(procs)
        written = [outdir / f"rank{r}.json" for r in range(len(procs))]
        if failed or not all(path.exists() for path in written):
            status = f"timed out after {seconds:.0f} s before a round ended" if timed_out else "failed"
            rank = failed[0] if failed else 0
            tail = (outdir / f"rank{rank}.log").read_text()[-1500:]
            print(f"  rank(s) {failed or 'all'} {status}; rank {rank} log tail:\n{tail}", flush=True)
            return None
        return [json.loads(path.read_text()) for path in written]
    finally:
        stop(procs)


def run_ranks(
    cluster: Cluster | None,
    port: int,
    ranks: int,
    per_node: int,
    seconds: float,
    extra: Sequence[str] = (),
    worker: Path = WORKER,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]] | None:
    """:func:`launch` in a temporary folder, then :func:`collect` within ``seconds``."""
    outdir = Path(tempfile.mkdtemp(prefix=PREFIX))
    try:
        return collect(launch(cluster, port, ranks, per_node, outdir, extra, worker, env), outdir, seconds)
    finally:
        shutil.rmtree(outdir, ignore_errors=True)


def run_workers(
    cluster: Cluster,
    port: int,
    seconds: float,
    args: Any,
    extra: Sequence[str] = (),
    keys: Sequence[str] | None = None,
    worker: Path = WORKER,
) -> dict | None:
    """``args.nodes * args.workers_per_node`` ranks of ``worker``; per result key (default: the
    methods) the summary over all ranks of the rounds every rank finished, or None on failure."""
    world = args.nodes * args.workers_per_node
    ranks = run_ranks(cluster, port, world, args.workers_per_node, seconds, extra, worker)
    if ranks is None:
        return None
    rounds = min(len(r["round_medians"]) for r in ranks)
    if rounds < args.rounds:
        kept = f"{rounds} of {args.rounds}"
        print(f"  timed out after {seconds:.0f} s: keeping the {kept} rounds every rank finished")
    return {key: summarize(key, ranks, rounds, args.iters) for key in keys or args.methods}


def summarize(method: str, ranks: list[dict[str, Any]], rounds: int, iters: int) -> dict[str, Any]:
    """Over all ranks' first ``rounds`` rounds of ``method``: median and mean step, each round's median.

    Also each rank's bytes sent per step (None where the library does not count them), each rank's
    mean step, and what the workers measured besides (``measured``: CPU seconds per rank and round,
    rank 0's machine-wide busy seconds per round, per-step compute times with real compute).
    """
    steps = [r["times"][method][: rounds * iters] for r in ranks]
    pooled = [t for rank_steps in steps for t in rank_steps]
    measured: dict[str, list[Any]] = {}
    for r in ranks:
        for name, values in r.get("measured", {}).get(method, {}).items():
            measured.setdefault(name, []).append(values[:rounds])
    medians = [statistics.median(r["round_medians"][i][method] for r in ranks) for i in range(rounds)]
    summary = {"rank_means_s": list(map(statistics.fmean, steps)), "measured": measured}
    summary |= {"params": ranks[0]["params"], "median_s": statistics.median(pooled)}
    summary |= {"mean_s": statistics.fmean(pooled), "round_medians_s": medians}
    return summary | {"bytes_sent_per_step": [r["bytes_sent_per_step"][method] for r in ranks]}


def ready_to_emulate() -> bool:
    """Whether this process can build the emulated cluster; says why not when it cannot.

    When it can, SIGTERM becomes an exit, so the namespaces are removed (``finally`` / ``__exit__``).
    """
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("skipped: needs root for network namespaces (and iproute2's ip and tc)")
        return False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return True
