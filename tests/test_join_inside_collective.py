"""A join announced while members are inside a collective of the whole world drops nobody.

The race: members 0 and 1 have finished step ``EVAL_AT`` and go into ``global_avg`` (or
``consensus_distance``); member 2 is a step behind, at the boundary of that same step, when a worker
applies. It announces the applicant and waits for the others' reports in the agreement; they wait
inside the collective for member 2's part. Were they not to follow the announcement there, member 2's
``timeout`` would run out first (it started waiting first) and it would go on alone, dropping two live
members. Following it, they report phase "collective", the applicant is deferred, the groups re-form
over the same three members, the collective is redone over them, and the joiner is admitted at a
later step boundary.

The pure tests check the rules that keep announcements and collectives apart on two memberships
sharing one store: an announcer waits until every member completed its latest collective of the
whole world, and a collective that cannot be redone (``add_param_group``) is entered through a gate
that an announcement and an entering rank cannot both pass unseen.

The process test orders the race through its own store keys: member 2 waits at the boundary until its
watch flags the applicant and says so under ``"announcing"``; members 0 and 1 enter the collective
0.3 s after that, so that they enter it after the announcement, as a member slow to reach it does.
"""

from __future__ import annotations

import math
import os
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from failures import request_worker, run_elastic
from helpers import flat
from torch import nn

from decent_optim_wrapper import DecentOptimWrapper, DecentralizedDataParallel, init_elastic
from decent_optim_wrapper.engine.fleet.admission import Admission, JoinRequest
from decent_optim_wrapper.engine.fleet.membership import Membership, MembershipChange
from decent_optim_wrapper.engine.fleet.sealing import Seal

TIMEOUT = timedelta(seconds=5)
EVAL_AT = 4  # the step after which every member calls the collective
LAGGARD = 2
STEPS = EVAL_AT + 16  # members sleep 1 s a step until the joiner is in: time for the deferred admission
WAIT_S = 60.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _inputs(index: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * index + step)
    return torch.randn(16, 6, generator=generator, dtype=torch.float64)


def _wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def _train(index: int, world_size: int, port: int, workdir: str, plan: dict[str, Any]) -> dict[str, Any]:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    joining = init_elastic(store, index, world_size, job="test", timeout=timedelta(seconds=60))
    model = _model()
    common: dict[str, Any] = dict(topology="ring", timeout=TIMEOUT, on_peer_failure="continue")
    if plan["front"] == "module":
        front_end: Any = DecentralizedDataParallel(
            model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.05), **common
        )

        def step(x: torch.Tensor) -> None:
            front_end(x).square().mean().backward()  # the step runs inside backward
    else:
        inner = torch.optim.SGD(model.parameters(), lr=0.05)
        front_end = DecentOptimWrapper(inner, **common)

        def step(x: torch.Tensor) -> None:
            front_end.zero_grad()
            model(x).square().mean().backward()
            front_end.step()

    watch = front_end.engine.survival.membership.watch
    result: dict[str, Any] = {"index": index, "joining": joining}
    for t in range(front_end.step_count, STEPS):
        if not joining and index == LAGGARD and t == EVAL_AT:
            # Held at the boundary of the step the others have finished, until it will announce there.
            _wait_for(watch.due, "the applicant to be flagged")
            store.set("announcing", "1")
        step(_inputs(index, t))
        if not joining and t == EVAL_AT:
            if index == 0:
                request_worker(workdir, "joiner")
            if index != LAGGARD:
                _wait_for(lambda: store.check(["announcing"]), "member 2 to announce")
                time.sleep(0.3)
            result["before"] = flat(model)
            if plan["collective"] == "global_avg":
                front_end.global_avg()
                result["averaged"] = flat(model)
                front_end.revert_global_avg()
                result["reverted"] = flat(model)
            else:
                result["distance"] = front_end.consensus_distance()
        if not joining and t > EVAL_AT and not front_end.peer_joins:
            time.sleep(1.0)  # a step boundary a second: the deferred applicant is announced again
    result.update(
        rank=front_end.rank,
        world_size=front_end.world_size,
        joins=front_end.peer_joins,
        failures=front_end.peer_failures,
        recoveries=len(front_end.engine.survival.pauses),
    )
    front_end.global_avg()  # a collective over the grown world
    result["final"] = flat(model)
    return result


@pytest.mark.fleet
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "front, collective",
    [("optimizer", "global_avg"), ("module", "global_avg"), ("optimizer", "consensus_distance")],
)
def test_a_join_announced_while_members_are_inside_a_world_collective_drops_nobody(front, collective):
    outcome = run_elastic(_train, 3, ({"front": front, "collective": collective},), deadline_s=150)
    assert not outcome.errors, outcome.errors
    results = sorted(outcome.results.values(), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    members = [r for r in results if not r["joining"]]
    assert [r["index"] for r in members] == [0, 1, 2]
    for member in members:
        assert member["failures"] == [], member["failures"]  # nobody was lost
        (join,) = member["joins"]
        assert (join.previous_world_size, join.world_size, join.joined) == (3, 4, (3,))
        # The collective was interrupted (the applicant deferred, the groups re-formed), then the
        # admission: two changes of membership on every member.
        assert member["recoveries"] >= 2, member["recoveries"]
    befores = torch.stack([m["before"] for m in members])
    mean = befores.mean(dim=0)
    if collective == "global_avg":
        for member in members:
            # One all-reduce: every member holds the same bits; float64 sums of 3 values in another
            # order than torch's mean differ from it by a few ulps at most.
            assert torch.equal(member["averaged"], members[0]["averaged"])
            torch.testing.assert_close(member["averaged"], mean, rtol=1e-13, atol=1e-15)
            assert torch.equal(member["reverted"], member["before"])  # the revert, bit for bit
    else:
        expected = math.sqrt(float((befores - mean).square().sum(dim=1).mean()))
        for member in members:
            assert member["distance"] == members[0]["distance"]
            assert member["distance"] == pytest.approx(expected, rel=1e-12)
    for result in results:  # the grown world averages as one
        assert torch.equal(result["final"], results[0]["final"])


def _pair() -> tuple[Membership, Membership, dist.Store]:
    """Two members of one job (a store of their own), open to joiners, with an applicant flagged."""
    store = dist.HashStore()
    pair = [Membership(store, "test", rank, 2, timedelta(seconds=0.5)) for rank in (0, 1)]
    for membership in pair:
        membership.watch.open = True
    return pair[0], pair[1], store


def _announced(store: dist.Store) -> bool:
    return bool(store.check(["decent-optim-wrapper/test/g0/join"]))


@pytest.mark.pure
def test_a_member_announces_only_once_every_member_completed_its_latest_world_collective():
    first, second, store = _pair()
    first.collective_done()
    # The second member may still be receiving the last bytes of that all-reduce: following an
    # announcement now, it would redo it over new groups without the first.
    assert not first.try_announce() and not _announced(store)
    # A member behind the collective announces: nobody completed it, whoever is inside redoes it.
    assert second.try_announce() and _announced(store)
    second.collective_done()
    store.delete_key("decent-optim-wrapper/test/g0/join")
    assert first.try_announce() and _announced(store)
    first.close(), second.close()


@pytest.mark.pure
def test_no_member_announces_while_another_is_inside_a_collective_that_cannot_be_redone():
    first, second, store = _pair()
    first.enter_unbroken()
    assert not second.try_announce() and not _announced(store)
    first.leave_unbroken()
    assert second.try_announce() and _announced(store)
    # Announced before the first entered: it follows the announcement first, unmarked.
    with pytest.raises(MembershipChange):
        first.enter_unbroken()
    assert not store.check(["decent-optim-wrapper/test/unbroken/0"])
    first.close(), second.close()


@pytest.mark.pure
def test_a_rank_entering_while_a_member_decides_to_announce_waits_for_the_decision():
    first, second, store = _pair()
    intent = "decent-optim-wrapper/test/announcing/1"
    store.set(intent, "1")  # the second member looked for marks before the first set its own

    def announce_soon() -> None:
        time.sleep(0.2)
        store.set("decent-optim-wrapper/test/g0/join", "1")
        store.delete_key(intent)

    thread = threading.Thread(target=announce_soon)
    thread.start()
    with pytest.raises(MembershipChange):  # it waited for the intent, saw the announcement and follows
        first.enter_unbroken()
    thread.join()
    store.delete_key("decent-optim-wrapper/test/g0/join")
    store.set(intent, "1")  # an intent withdrawn without an announcement (it saw a mark): enter
    threading.Timer(0.2, lambda: store.delete_key(intent)).start()
    start = time.monotonic()
    first.enter_unbroken()
    assert time.monotonic() - start >= 0.15
    first.leave_unbroken()
    first.close(), second.close()


def _applied(store: dist.Store) -> None:
    """An application in slot 1 (plain: the pair's job has no secret)."""
    key = "decent-optim-wrapper/test/joiner/1"
    store.set(key, Seal().seal(JoinRequest(1, 2, ()), key))


def _deferred_by_a_collective(membership: Membership, store: dist.Store) -> None:
    """What a member's watch holds after a decision that deferred one applicant because a member was
    inside a collective of the whole world (the decision's admission says so, on every member)."""
    _applied(store)
    membership.watch.decided(store, "decent-optim-wrapper/test", Admission(deferred=1, after_collective=True))


@pytest.mark.pure
def test_applicants_deferred_by_a_collective_are_due_at_the_first_boundary_after_one_not_before():
    first, second, store = _pair()
    for membership in (first, second):
        _deferred_by_a_collective(membership, store)
        # Not announced again before the members complete a collective (the redone one) ...
        assert membership.watch.waiting and not membership.watch.due()
        assert not membership.admission_due()
    # ... nor after a timed wait: the deferral holds until this rank completes one.
    first.collective_done()
    assert first.admission_due() and not second.admission_due()
    second.collective_done()
    assert second.admission_due()
    first.close(), second.close()


@pytest.mark.pure
def test_after_the_collective_every_member_announces_or_follows_at_its_boundary():
    first, second, store = _pair()
    for membership in (first, second):
        _deferred_by_a_collective(membership, store)
    first.collective_done()
    # The second member is still receiving that all-reduce's last bytes: the first waits for it
    # (a bounded wait: it is inside the collective), then announces.
    threading.Timer(0.3, second.collective_done).start()
    start = time.monotonic()
    assert first.announce_deferred() and _announced(store)
    assert time.monotonic() - start >= 0.25
    # The second, at its own boundary, follows the announcement.
    assert second.admission_due() and second.announce_deferred()
    first.close(), second.close()


@pytest.mark.pure
def test_a_member_that_stays_inside_the_collective_past_timeout_is_not_announced_over():
    first, second, store = _pair()  # timeout 0.5 s
    _deferred_by_a_collective(first, store)
    first.collective_done()
    assert not first.announce_deferred() and not _announced(store)
    assert first.admission_due()  # the next boundary tries again
    first.close(), second.close()


@pytest.mark.pure
def test_a_deferral_for_want_of_a_donor_waits_a_while_then_announces_as_before():
    first, second, store = _pair()
    _applied(store)
    first.watch.decided(store, "decent-optim-wrapper/test", Admission(deferred=1))
    assert not first.admission_due() and not first.watch.due()
    first.watch.not_before = time.monotonic()
    assert first.watch.due()
    first.close(), second.close()
