"""The monitor's web page in a real headless browser, over a recorded job.

A store hosted here holds the records of a recorded job, refreshed as its members' heartbeats would
refresh them (sealed with its secret; steps advancing, rates wobbling, the consensus distance
shrinking; member 1 lost at step 40, member 4 joined from donor 0 at step 90). The monitor runs as a
user runs it (``python -m decent_optim_wrapper.monitor --serve PORT``, a process of its own), and
Chromium (``--headless --dump-dom``) loads the page: the DOM must hold the four members and the lost
one, both events, and the plots' data points. Skipped when no Chromium binary is installed
(``apt-get install chromium``).

Run as a script (``uv run python tests/test_monitor_web.py docs/figures``) it writes the figures of
``docs/watching.md``: the page's screenshot and the terminal view's text.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from decent_optim_wrapper.engine import Seal
from decent_optim_wrapper.engine.fleet.status import pointer_key, status_key

pytestmark = pytest.mark.examples

JOB = "watched"
SECRET = "the-secret-of-the-watched-job-0123"
PREFIX = "decent-optim-wrapper/3f2a9c41d07e5b68"
REPO = Path(__file__).resolve().parents[1]
WAIT_S = 120.0
HISTORY = 8  # refreshes the server has read before the browser loads the page
CHROMIUM = next(
    (b for b in ("chromium", "chromium-browser", "google-chrome", "chrome") if shutil.which(b)), None
)


LOST = {"kind": "lost", "step": 40, "generation": 1, "members": [1], "world_size": 3}
JOINED = {"kind": "joined", "step": 90, "generation": 2, "members": [4], "donors": [0], "world_size": 4}
CURRENT = [0, 2, 3, 4]


class RecordedJob:
    """Five records as four live members and a lost one leave them, refreshed every 0.25 s."""

    def __init__(self, store: TCPStore, seal: Seal) -> None:
        self._store, self._seal = store, seal
        self._started = time.time()
        self._lost = {**LOST, "time": self._started - 60}
        self._joined = {**JOINED, "time": self._started - 20}
        self.stopped = threading.Event()
        self._set(1, self._record(1, 0, 0.0, lost=True))  # killed: its last record stays

    def _set(self, member: int, record: dict[str, Any]) -> None:
        key = status_key(PREFIX, member)
        self._store.set(key, self._seal.seal_bytes(json.dumps(record).encode(), key))

    def _record(self, member: int, tick: int, now: float, lost: bool = False) -> dict[str, Any]:
        rate = 12.0 + 3.0 * math.sin(tick / 3.0 + member) - (4.0 if member == 3 else 0.0)
        step = 40 if lost else 120 + 3 * tick - (member == 3)
        return {
            "version": 1, "member": member, "rank": member if lost else CURRENT.index(member),
            "host": f"node{member // 2}", "pid": 4100 + member, "time": self._started - 62 if lost else now,
            "generation": 0 if lost else 2, "members": [0, 1, 2, 3] if lost else CURRENT,
            "world_size": 4, "step": step, "round": step, "steps_per_s": 11.5 if lost else rate,
            "bytes_sent": 9.4e5 * step, "bytes_per_step": 9.4e5, "compression": None, "topology": "ring",
            "wait_s": 0.02 * step, "joins": 0 if lost else 1, "losses": 0 if lost else 1 - (member == 4),
            "guard": {}, "pace_round_s": None, "pace_step_s": None,
            "consensus": 0.01 + 0.04 * math.exp(-tick / 40.0), "consensus_step": step - step % 5,
            "events": [] if lost else [self._joined] if member == 4 else [self._lost, self._joined],
        }  # fmt: skip

    def run(self) -> None:
        tick = 0
        while not self.stopped.is_set():
            now = time.time()
            for member in CURRENT:
                self._set(member, self._record(member, tick, now))
                self._store.add(f"{PREFIX}/beat/{member}", 1)
            pointer = json.dumps({"version": 1, "prefix": PREFIX, "member": 0}).encode()
            self._store.set(pointer_key(JOB), self._seal.seal_bytes(pointer, pointer_key(JOB)))
            tick += 1
            self.stopped.wait(0.25)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def _serving(page: str, monitor: subprocess.Popen[str]) -> dict[str, Any]:
    """The server's payload once it has read :data:`HISTORY` views (polled, up to :data:`WAIT_S`)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        assert monitor.poll() is None, monitor.communicate()
        try:
            data: dict[str, Any] = _get(page + "status.json")
            if len(data["history"]) >= HISTORY:
                return data
        except OSError:
            pass  # not listening yet: the monitor imports torch first
        assert time.monotonic() < deadline, "the monitor's page never had its history"
        time.sleep(0.2)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _chromium(*args: str) -> str:
    command = [CHROMIUM or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    # Virtual time runs the page's first refresh (a fetch) to completion before the DOM is dumped.
    command += ["--virtual-time-budget=4000", "--window-size=1300,1000", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


class Served:
    """The recorded job in a store, and the monitor serving its page (a context manager)."""

    def __enter__(self) -> Served:
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.job = RecordedJob(self.store, Seal(SECRET.encode()))
        self.feeder = threading.Thread(target=self.job.run, daemon=True)
        self.feeder.start()
        port = _free_port()
        self.address = f"127.0.0.1:{self.store.port}"
        command = [sys.executable, "-m", "decent_optim_wrapper.monitor", "--store", self.address]
        command += ["--job", JOB, "--serve", str(port), "--interval", "0.5"]
        env = {**os.environ, "DECENT_JOB_SECRET": SECRET}
        self.monitor = subprocess.Popen(command, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE)
        self.page = f"http://127.0.0.1:{port}/"
        return self

    def __exit__(self, *exc: object) -> None:
        self.monitor.send_signal(signal.SIGINT)  # Ctrl-C: the server stops
        try:
            self.monitor.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.monitor.kill()
        self.job.stopped.set()
        self.feeder.join(timeout=10)


def _svg(dom: str, name: str) -> str:
    found = re.search(rf'<svg id="{name}"[^>]*>(.*?)</svg>', dom, re.S)
    assert found, f"no svg #{name} in the page"
    return found.group(1)


@pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium binary (chromium, chromium-browser): apt-get install chromium"
)
@pytest.mark.timeout(300)
def test_the_page_shows_the_members_the_events_and_the_plots_in_a_browser(tmp_path):
    with Served() as served:
        data = _serving(served.page, served.monitor)
        assert data["error"] is None and data["view"]["world_size"] == 4
        dom = _chromium("--dump-dom", served.page)
        shot = tmp_path / "page.png"
        _chromium(f"--screenshot={shot}", served.page)
    rows = re.findall(r'<tr class="(\w+)">(.*?)</tr>', dom, re.S)
    assert [state for state, _ in rows].count("member") == 4, rows
    assert [state for state, _ in rows].count("lost") == 1, rows
    assert "<td>node1</td>" in rows[0][1] or "<td>node0</td>" in rows[0][1]
    assert "job watched at 127.0.0.1:" in dom and "4 member(s), generation 2" in dom
    events = re.findall(r'<li class="(\w+)">(.*?)</li>', dom, re.S)
    assert [kind for kind, _ in events] == ["lost", "joined"], events
    assert "member(s) 1 lost" in events[0][1] and "member(s) 4 joined (donor(s) 0)" in events[1][1]
    rate, consensus, world = _svg(dom, "rate"), _svg(dom, "consensus"), _svg(dom, "world")
    assert rate.count('class="series"') == 4 and rate.count('class="point"') >= 4 * HISTORY
    assert consensus.count('class="point"') >= HISTORY and world.count('class="point"') >= HISTORY
    for svg in (rate, consensus, world):  # every point inside the plot's box
        for cx, cy in re.findall(r'cx="([\d.]+)" cy="([\d.]+)"', svg):
            assert 0 <= float(cx) <= 520 and 0 <= float(cy) <= 220
    assert shot.stat().st_size > 20_000  # a page drawn, not a blank one
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def capture(figures: Path) -> None:
    """Write the page's screenshot and the terminal view's text into ``figures``."""
    from decent_optim_wrapper.monitor.terminal import render

    with Served() as served:
        data = _serving(served.page, served.monitor)
        time.sleep(20.0)  # a longer history for the figure (a picture, not a check)
        _chromium(f"--screenshot={figures / 'monitor-web.png'}", served.page)
        view = data["view"]
    text = render(view).replace(served.address, "node0:29400")
    (figures / "monitor-terminal.txt").write_text(text + "\n")


if __name__ == "__main__":
    capture(Path(sys.argv[1]))
