"""An emulated cluster on one machine (root): network namespaces on a bridge, links shaped with ``tc tbf``;
:func:`run_ranks` starts one process per rank inside its node and collects their results."""

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
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

PREFIX = "dow-"
BRIDGE_NS = f"{PREFIX}br"
SUBNET = "10.213.7"
WORKER = Path(__file__).parents[1] / "cluster" / "rank.py"
#: How long any collective of a rank may wait for a peer before raising (the drivers also kill at a deadline).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def sh(*cmd: str, timeout: float = 20.0) -> str:
    """Run ``ip``/``tc``; raise with its stderr if it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout


def remove_namespaces() -> None:
    """Delete every namespace this module creates (their veths and qdiscs go with them)."""
    for line in sh("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        if name == BRIDGE_NS or (name.startswith(f"{PREFIX}n") and name[len(PREFIX) + 1 :].isdigit()):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


class Cluster:
    """``nodes`` namespaces (``dow-n0``, ...) with a veth each to a bridge namespace (``dow-br``); removed
    on exit, error or Ctrl-C. Ranks of one node talk over loopback, unshaped."""

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
        br = f"-n {BRIDGE_NS}"
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
        """Bytes the links of ``nodes`` (default: all) have sent so far, headers and acks included."""
        total = 0
        for node in range(self.nodes) if nodes is None else nodes:
            out = sh("ip", "-n", self.namespace(node), "-s", "-j", "link", "show", self.ifname(node))
            total += int(json.loads(out)[0]["stats64"]["tx"]["bytes"])
        return total

    def shape(self, rate: str | None, burst: int | None = None, latency: str = "100ms") -> None:
        """Every link to ``rate`` (tc's units) both ways, None: unshaped. ``burst``: the bucket's bytes
        (default 4 ms at the rate, at least a 64 KiB GSO packet); ``latency``: tc's queueing limit."""
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
    for unit, scale in {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}.items():
        if rate.lower().endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: use tc units such as 200mbit or 1gbit")


# The receiver ends the measurement after the whole stream or `window` seconds after its first byte,
# so that a link moving less than its rate yields a low figure instead of a sender blocked in sendall.
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
#: How a client (``LINK_SENDER``, ``ECHO_CLIENT``) starts: connected to the server.
CONNECT = """
import socket, statistics, sys, time
for _ in range(200):
    try: conn = socket.create_connection((sys.argv[1], int(sys.argv[2]))); break
    except OSError: time.sleep(0.05)
else: sys.exit("the server never listened")
"""
LINK_SENDER = """
try: conn.sendall(bytes(int(sys.argv[3])))
except OSError: pass  # the receiver closed the stream: its window had passed
conn.close()
"""
ECHO_SERVER = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2]))); server.settimeout(20)
conn, _ = server.accept(); conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(64):
    conn.sendall(data)
"""
ECHO_CLIENT = """
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); times = []
for _ in range(50):
    start = time.perf_counter(); conn.sendall(b"x"); conn.recv(64); times.append(time.perf_counter() - start)
print(1e3 * statistics.median(times))
"""


def client_server(cluster: Cluster, server: str, client: str, args: list[str], timeout_s: float) -> str:
    """``server`` in node 0, ``client`` in node 1 (both given ``address port *args``): what the client
    printed, else the server."""
    serve = ["ip", "netns", "exec", cluster.namespace(0), sys.executable, "-c", server, *args]
    served = subprocess.Popen(serve, stdout=subprocess.PIPE, text=True)
    try:
        connect = ["ip", "netns", "exec", cluster.namespace(1), sys.executable, "-c", CONNECT + client]
        printed = sh(*connect, *args, timeout=timeout_s)
        if printed.strip():
            return printed
        out, _ = served.communicate(timeout=timeout_s / 2 + 30.0)
        if served.returncode != 0:
            raise RuntimeError(f"the server in node 0 failed (exit {served.returncode})")
        return out
    finally:
        if served.poll() is None:
            served.kill()
        served.wait()


def measure_link(cluster: Cluster, megabytes: float, port: int, timeout_s: float = 60.0) -> float:
    """Mbit/s of one TCP stream of ``megabytes`` from node 1 to node 0, over at most ``timeout_s / 2`` s."""
    args = [cluster.address(0), str(port), str(int(megabytes * 10**6))]
    return float(client_server(cluster, LINK_RECEIVER, LINK_SENDER, [*args, str(timeout_s / 2)], timeout_s))


def round_trip_ms(cluster: Cluster, port: int) -> float:
    """Median ms of a one-byte TCP round trip node 1 -> node 0 -> node 1 on the idle link."""
    return float(client_server(cluster, ECHO_SERVER, ECHO_CLIENT, [cluster.address(0), str(port)], 30.0))


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
    cluster: Cluster, payload_bytes: int, port: int, goodput_fraction: float = 1.0, rounds: int = 20
) -> float:
    """Bytes one message of a gloo all-reduce costs on a link beyond its payload (``Link.message_bytes``):
    nodes 0 and 1 run ``rounds`` all-reduces of ``payload_bytes`` (two messages per node) between two
    reads of the links' counters; ``(wire bytes per node and round * goodput_fraction - payload) / 2``,
    ``goodput_fraction`` being measured goodput over the shaped rate (the planner's ``Link.bandwidth``)."""
    gate = Path(tempfile.mkdtemp(prefix=PREFIX))
    procs = []
    try:
        for node in (0, 1):
            argv = ["-c", MESSAGE_PROBE, str(node), str(payload_bytes), str(rounds), str(gate)]
            env = node_env(cluster, node, port)
            procs.append(start_in_node(cluster, node, argv, env, gate / f"{node}.log"))
        deadline = time.monotonic() + 300.0

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
    """A process on ``node``'s environment: rank 0's address and ``port``, this node's interface and
    ``NODE_ADDR``, one thread (without a cluster: loopback)."""
    addresses = {"MASTER_ADDR": "127.0.0.1", "NODE_ADDR": "127.0.0.1"}
    if cluster is not None:
        addresses = {"MASTER_ADDR": cluster.address(0), "NODE_ADDR": cluster.address(node)}
        addresses["GLOO_SOCKET_IFNAME"] = cluster.ifname(node)
    return dict(os.environ, MASTER_PORT=str(port), OMP_NUM_THREADS="1", **addresses)


def start_in_node(
    cluster: Cluster | None, node: int, argv: Sequence[str], env: dict[str, str], log: Path
) -> Any:
    """``python argv...`` in ``node``'s namespace (no cluster: here), own session, output to ``log``."""
    command = [sys.executable, *argv]
    if cluster is not None:
        command = ["ip", "netns", "exec", cluster.namespace(node), *command]
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(command, env=env, stdout=out, stderr=out, start_new_session=True)


def stop(procs: list) -> None:
    """Kill the worker sessions this process started (by process group id)."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for(
    procs: Sequence[subprocess.Popen], seconds: float, tick: Callable[[], None] | None = None
) -> bool:
    """Wait until all have exited, one failed or ``seconds`` passed, calling ``tick`` between looks;
    whether the time ran out with one running."""
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            break
        if tick is not None:
            tick()
        time.sleep(0.2)
    return time.monotonic() >= deadline and any(p.poll() is None for p in procs)


def run_ranks(
    cluster: Cluster | None,
    port: int,
    ranks: int,
    per_node: int,
    seconds: float,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]] | None:
    """``ranks`` processes of ``rank.py ... *extra``, ``per_node`` to a node, for up to ``seconds``: every
    rank's JSON (a rank killed at the deadline: what it wrote last), or None with a log tail printed."""
    outdir = Path(tempfile.mkdtemp(prefix=PREFIX))
    procs = []
    try:
        for rank in range(ranks):
            flags = ["--rank", rank, "--world-size", ranks, "--local-world-size", per_node]
            argv = [str(WORKER), *map(str, flags), "--out", str(outdir / f"rank{rank}.json"), *extra]
            node = rank // per_node
            node_vars = node_env(cluster, node, port) | (env or {})
            procs.append(start_in_node(cluster, node, argv, node_vars, outdir / f"rank{rank}.log"))
        timed_out = wait_for(procs, seconds)
        failed = [r for r, p in enumerate(procs) if p.poll() not in (0, None)]
        stop(procs)
        written = [outdir / f"rank{r}.json" for r in range(ranks)]
        if failed or not all(path.exists() for path in written):
            status = f"timed out after {seconds:.0f} s before a round ended" if timed_out else "failed"
            rank = failed[0] if failed else 0
            tail = (outdir / f"rank{rank}.log").read_text()[-1500:]
            print(f"  rank(s) {failed or 'all'} {status}; rank {rank} log tail:\n{tail}", flush=True)
            return None
        return [json.loads(path.read_text()) for path in written]
    finally:
        stop(procs)
        shutil.rmtree(outdir, ignore_errors=True)


def run_workers(
    cluster: Cluster,
    port: int,
    seconds: float,
    args: Any,
    extra: Sequence[str] = (),
    keys: Sequence[str] = (),
) -> dict | None:
    """Timed ranks; per key (default: the methods) the :func:`summarize` of the rounds all finished."""
    per_node = args.workers_per_node
    ranks = run_ranks(cluster, port, args.nodes * per_node, per_node, seconds, extra)
    if ranks is None:
        return None
    rounds = min(len(r["round_medians"]) for r in ranks)
    if rounds < args.rounds:
        print(f"  timed out after {seconds:.0f} s: keeping the {rounds} of {args.rounds} rounds all finished")
    return {key: summarize(key, ranks, rounds, args.iters) for key in keys or args.methods}


def summarize(method: str, ranks: list[dict[str, Any]], rounds: int, iters: int) -> dict[str, Any]:
    """Over all ranks' first ``rounds`` rounds of ``method``: median and mean step, each round's median,
    each rank's mean step and bytes sent per step, and what the ranks measured besides (``measured``)."""
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
    """Whether this process can build the cluster (says why not); if so SIGTERM exits, removing it."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("skipped: needs root for network namespaces (and iproute2's ip and tc)")
        return False
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return True


def write_atomically(path: str, result: object) -> None:
    """Replace ``path`` in one rename: a rank killed at its deadline never leaves half a file."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(result, f)
    os.replace(partial, path)
