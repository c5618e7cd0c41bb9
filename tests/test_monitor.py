"""Status records and the monitor's views, on recorded data and on a store of this process.

The records are built, sealed and read back through a dictionary standing in for the store (the
calls the records make: ``set``, ``get``, ``check``, ``add``, ``delete_key``); the views are built
from records written out here; the command line's bad input is checked against a real ``TCPStore``
hosted by this process (no process group).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import pytest

from decent_optim_wrapper.engine import ForgedEntryError, Seal, read_fleet
from decent_optim_wrapper.engine.fleet.heartbeats import beat
from decent_optim_wrapper.engine.fleet.status import MAX_EVENTS, StatusBoard, pointer_key, status_key
from decent_optim_wrapper.monitor import cli, fleet_view
from decent_optim_wrapper.monitor.terminal import render
from decent_optim_wrapper.monitor.web import PAGE, serve

pytestmark = pytest.mark.pure

SECRET = b"a-secret-of-the-monitor-test-0123"
PREFIX = "decent-optim-wrapper/run0"


class DictStore:
    """The store calls the records make, over a dict (values as bytes, as the store returns them)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


class Engine:
    """What a board reads of an engine: its fields (held weakly, so kept alive by the test)."""

    def __init__(self) -> None:
        self.step = 0

    def status_fields(self) -> dict[str, Any]:
        return {"rank": 0, "world_size": 4, "step": self.step, "bytes_per_step": 100.0, "guard": {}}


def _board(store: DictStore, member: int, members: list[int], seal: Seal, engine: Engine) -> StatusBoard:
    board = StatusBoard("watch")
    board.attach(engine.status_fields)
    board.placed(PREFIX, member, 0, members, seal)
    store.add(f"{PREFIX}/beat/{member}", 1)
    return board


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "sealed"])
def test_a_record_round_trips_through_the_store_and_names_its_members(secret):
    store, seal, engine = DictStore(), Seal(secret), Engine()
    boards = [_board(store, m, [0, 1, 2, 3], seal, engine) for m in range(4)]
    for board in boards:
        board.publish(store)
    engine.step = 10
    time.sleep(0.01)
    boards[2].publish(store)  # the rate is the steps between two records over the time between them
    found = read_fleet(store, "watch", seal)
    assert found is not None and found.prefix == PREFIX
    assert sorted(found.records) == [0, 1, 2, 3]
    record = found.records[2]
    assert record["member"] == 2 and record["members"] == [0, 1, 2, 3] and record["step"] == 10
    assert record["steps_per_s"] > 0 and record["bytes_sent"] == 1000.0
    # JSON of plain values, sealed when the job has a secret
    raw = store.get(status_key(PREFIX, 2)).decode()
    assert raw.startswith("s:" if secret else "p:")
    assert json.loads(seal.open_bytes(store.get(status_key(PREFIX, 2)), status_key(PREFIX, 2)))["pid"] > 0


def test_a_record_is_bounded_and_a_stopped_member_withdraws_it():
    store, seal, engine = DictStore(), Seal(), Engine()
    board = _board(store, 0, [0, 1], seal, engine)
    for k in range(3 * MAX_EVENTS):
        board.event("lost", step=k, generation=k, members=[1], world_size=1)
    board.publish(store)
    size = len(store.get(status_key(PREFIX, 0)))
    assert len(board.record()["events"]) == MAX_EVENTS  # type: ignore[index]
    assert size < 8000, size
    board.withdraw(store)
    assert not store.check([status_key(PREFIX, 0)])


def test_the_heartbeat_publishes_the_record_and_withdraws_it_when_stopped():
    store, engine = DictStore(), Engine()
    board = _board(store, 0, [0], Seal(), engine)
    stopped = threading.Event()
    thread = threading.Thread(target=beat, args=(store, f"{PREFIX}/beat/0", PREFIX, stopped, None, board))
    thread.start()
    deadline = time.monotonic() + 30
    while board.published == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.check([status_key(PREFIX, 0), pointer_key("watch")])
    stopped.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert not store.check([status_key(PREFIX, 0)])


def test_a_record_that_cannot_be_built_leaves_the_heartbeat_beating():
    class Broken(Engine):
        def status_fields(self) -> dict[str, Any]:
            return {"step": object()}  # not JSON

    store, engine = DictStore(), Broken()
    board = _board(store, 0, [0], Seal(), engine)
    board.publish(store)  # logged once, nothing written, nothing raised
    assert not store.check([status_key(PREFIX, 0)])


def test_records_of_a_job_with_a_secret_refuse_a_reader_without_it():
    store, engine = DictStore(), Engine()
    _board(store, 0, [0], Seal(SECRET), engine).publish(store)
    with pytest.raises(ForgedEntryError):
        read_fleet(store, "watch", Seal())
    with pytest.raises(ForgedEntryError):
        read_fleet(store, "watch", Seal(b"another-secret-of-16-bytes-or-more"))
    assert read_fleet(store, "another job", Seal(SECRET)) is None


def _recorded(now: float) -> dict[int, dict[str, Any]]:
    """4 members; member 1 lost at step 10 (generation 1), member 4 joined from donor 0 at step 17."""
    lost = {"kind": "lost", "time": now - 20, "step": 10, "generation": 1, "members": [1], "world_size": 3}
    joined = {
        "kind": "joined", "time": now - 10, "step": 17, "generation": 2, "members": [4], "donors": [0],
        "world_size": 4,
    }  # fmt: skip

    def record(member: int, generation: int, members: list[int], events: list[Any]) -> dict[str, Any]:
        return {
            "version": 1, "member": member, "host": "node", "pid": 100 + member, "time": now - 1,
            "generation": generation, "members": members, "step": 30, "steps_per_s": 4.0, "rank": member,
            "world_size": len(members), "bytes_sent": 1e6, "guard": {"withheld": 1}, "events": events,
        }  # fmt: skip

    current = [0, 2, 3, 4]
    records = {m: record(m, 2, current, [lost, joined]) for m in (0, 2, 3)}
    records[1] = {**record(1, 0, [0, 1, 2, 3], []), "time": now - 30, "step": 10}  # killed: its last record
    records[4] = record(4, 2, current, [joined])
    records[0].update(consensus=0.25, consensus_step=28)  # the newest consensus_distance() reported
    records[2].update(consensus=0.5, consensus_step=20)
    return records


def test_the_view_of_a_recorded_job_shows_the_loss_and_the_join_with_its_donor():
    from decent_optim_wrapper.engine import FleetRecords

    now = 1e9
    found = FleetRecords(PREFIX, _recorded(now), {m: 5 for m in range(5)})
    view = fleet_view(found, job="watch", address="h:1", moved={0: True, 2: True, 3: False, 4: True}, now=now)
    states = {row["member"]: row["state"] for row in view["members"]}
    assert states == {0: "member", 1: "lost", 2: "member", 3: "silent", 4: "member"}
    assert view["current"] == [0, 2, 3, 4] and view["world_size"] == 4 and view["generation"] == 2
    assert [(e["kind"], e["members"]) for e in view["events"]] == [("lost", [1]), ("joined", [4])]
    assert view["events"][1]["donors"] == [0]
    assert view["consensus"] == 0.25 and view["consensus_step"] == 28
    json.dumps(view)  # plain values only
    text = render(view)
    assert "member(s) 1 lost" in text and "member(s) 4 joined (donor(s) 0)" in text
    assert text.count("\n  ") >= 2 and "withheld=1" in text and "1.0 MB" in text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_bad_input_is_one_line_naming_the_option_the_value_and_the_fix(capsys):
    from torch.distributed import TCPStore

    port = _free_port()
    assert cli.main(["--store", f"127.0.0.1:{port}", "--json", "--connect-timeout", "0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--store 127.0.0.1:{port}" in err and "init_elastic" in err
    assert cli.main(["--store", "nohostport", "--json"]) == 2
    assert "--store 'nohostport' is not HOST:PORT" in capsys.readouterr().err
    assert cli.main(["--store", "h:1", "--secret", "short"]) == 2
    assert "--secret" in capsys.readouterr().err
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{store.port}"
    assert cli.main(["--store", address, "--job", "nothing", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--job 'nothing'" in err and "init_elastic(job=...)" in err
    engine = Engine()
    _board(store, 0, [0], Seal(SECRET), engine).publish(store)  # type: ignore[arg-type]
    assert cli.main(["--store", address, "--job", "watch", "--json", "--secret", "x" * 20]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--job 'watch'" in err and "do not verify" in err and "SECRET" in err


def test_serve_says_which_port_is_taken(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve(lambda: {}, "127.0.0.1", port, 1.0) == 2
    err = capsys.readouterr().err.strip()
    taken_message = f"port {port} is already in use on 127.0.0.1; give --serve a free port."
    assert err == f"monitor: --serve {port}: {taken_message}"


def test_the_page_needs_no_build_and_nothing_from_outside():
    assert "<script src" not in PAGE and "http://" not in PAGE and "https://" not in PAGE
    assert "status.json" in PAGE and "<svg" in PAGE


def test_a_member_lost_before_its_first_record_still_has_a_row():
    from decent_optim_wrapper.engine import FleetRecords

    now = 1e9
    records = _recorded(now)
    del records[1]  # killed within its first 2 s: it never published
    view = fleet_view(FleetRecords(PREFIX, records), job="watch", address="h:1", now=now)
    row = next(r for r in view["members"] if r["member"] == 1)
    assert row["state"] == "lost" and row["step"] is None and row["age_s"] is None
    assert any(line.split()[:2] == ["1", "lost"] for line in render(view).splitlines())


def test_an_address_where_something_else_listens_is_a_timeout_not_a_hang(capsys):
    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        started = time.monotonic()
        assert cli.main(["--store", f"127.0.0.1:{port}", "--json", "--connect-timeout", "0.5"]) == 2
        assert time.monotonic() - started < 30
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--store 127.0.0.1:{port}: no store answered within 0.5 s" in err
    assert "init_elastic" in err
    for thread in cli.STUCK:  # the listener closed: the handshake fails and the thread ends
        thread.join(timeout=60)
        assert not thread.is_alive()


def test_a_host_that_does_not_resolve_and_a_timeout_that_is_not_one_are_named(capsys):
    assert cli.main(["--store", "no-such-host.invalid:29400", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--store no-such-host.invalid:29400: the host 'no-such-host.invalid' does not resolve" in err
    assert cli.main(["--store", "h:1", "--connect-timeout", "0"]) == 2
    assert "--connect-timeout 0 must be > 0 seconds." in capsys.readouterr().err
    assert cli.main(["--store", "h:1", "--serve", "http"]) == 2
    assert "--serve: invalid int value: 'http'" in capsys.readouterr().err


def test_records_are_named_as_torchrun_names_the_job_and_can_be_turned_off(monkeypatch):
    from decent_optim_wrapper.engine import RECORDS_ENV, default_job

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert default_job() == "default"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-7")
    assert default_job() == "rdzv-7"
    store, engine = DictStore(), Engine()
    monkeypatch.setenv(RECORDS_ENV, "0")
    board = _board(store, 0, [0], Seal(), engine)
    board.publish(store)
    assert not board.enabled and board.published == 0 and not store.check([status_key(PREFIX, 0)])


def test_no_job_of_that_name_says_how_to_name_a_torchrun_job(capsys):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    assert cli.main(["--store", f"127.0.0.1:{store.port}", "--job", "none", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--rdzv-id" in err and "MASTER_ADDR:MASTER_PORT" in err
    assert "on_peer_failure='continue'" in err and "DECENT_STATUS_RECORDS=0" in err
