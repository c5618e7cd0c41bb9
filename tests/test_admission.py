"""The admission of joiners without workers: what the members decide from the store, what a joiner
is told, and the launcher's checks (a store in this process, no process group)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import build_parts_on_rank_0
from torch import nn

from decent_optim_wrapper import JoinRejectedError, init_elastic, node_mesh
from decent_optim_wrapper.engine.fleet.admission import (
    ADMITTED,
    WITHDRAWN,
    Admission,
    Applicant,
    JoinerWatch,
    JoinRequest,
    Verdict,
    admit,
    claim_fate,
    fate_key,
    joiner_verdicts,
    settle_fates,
    slot_key,
    write_verdicts,
)
from decent_optim_wrapper.engine.fleet.jobs import JobInfo, publish_job, run_prefix
from decent_optim_wrapper.engine.fleet.membership import Decision, Report
from decent_optim_wrapper.engine.fleet.sealing import Seal
from decent_optim_wrapper.engine.fleet.signatures import SignatureEntry, mismatch
from decent_optim_wrapper.engine.layout import join_signature

pytestmark = pytest.mark.pure

PREFIX = "decent-optim-wrapper/test-run"
PLAIN = Seal()  # a job without a secret (tests/test_job_secret.py seals)
SIGNATURE = (
    ("topology", "ring"),
    ("buckets", ((("float32", "cpu"), ((4, 3), (3,))),)),
    ("compression", None),
)


def _apply(
    store: dist.Store, number: int, member: int, signature=SIGNATURE, beating: bool = True, shards: int = 1
) -> threading.Event:
    """Write an application into its slot (a node's, for ``shards`` ranks); with ``beating`` its (rank 0's)
    heartbeat moves until the event is set."""
    request = PLAIN.seal(JoinRequest(number, member, signature, shards), slot_key(PREFIX, number))
    assert store.compare_set(slot_key(PREFIX, number), "", request) == request.encode()
    return _heartbeat(store, member, beating)


def _heartbeat(store: dist.Store, member: int, beating: bool = True) -> threading.Event:
    """``member``'s heartbeat (an applicant's, or a node's other rank's: its rank 0 applies for it)."""
    stop = threading.Event()
    key = f"{PREFIX}/beat/{member}"
    store.add(key, 1)
    if beating:
        threading.Thread(target=_beat, args=(store, key, stop), daemon=True).start()
    return stop


def _beat(store: dist.Store, key: str, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        store.add(key, 1)


def test_a_mismatch_names_the_first_entry_that_differs():
    other = (
        ("topology", "ring"),
        ("buckets", ((("float32", "cpu"), ((5, 3), (3,))),)),
        ("compression", None),
    )
    reason = mismatch(SIGNATURE, other)
    assert reason.startswith(
        "its buckets[0][1][0] differs from the running job's ((5, 3) here, (4, 3) in the job)"
    )
    assert mismatch(SIGNATURE, SIGNATURE) == ""
    assert "does not know" in mismatch(SIGNATURE, (*SIGNATURE, ("extra", 1)))
    assert "its compression differs" in mismatch(SIGNATURE, (*SIGNATURE[:2], ("compression", "int8")))


def _join_signature(model: nn.Module) -> tuple[tuple[str, object], ...]:
    """What a worker training ``model`` (the module front-end's names) publishes or applies with."""
    parts = build_parts_on_rank_0(model.named_parameters(), 3, on_peer_failure="continue")
    return join_signature(parts.layout)


def _mlp(width: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(OrderedDict(fc1=nn.Linear(32, width), act=nn.Tanh(), fc2=nn.Linear(width, 10))).to(
        dtype
    )


def test_a_joiner_whose_layer_is_wider_is_told_the_parameter_by_name_and_shape(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")  # on_peer_failure="continue" checks it
    job = _join_signature(_mlp(48))
    reason = mismatch(job, _join_signature(_mlp(64)))
    print(reason)
    assert reason == (
        "its parameter fc1.weight differs from the running job's: it has shape (64, 32) here and (48, 32) "
        "in the job; start it with the job's code, model and options"
    )
    reason = mismatch(job, _join_signature(_mlp(48, torch.float64)))
    assert "its parameter fc1.weight differs" in reason and "dtype 'torch.float64' here and" in reason
    reason = mismatch(job, _join_signature(nn.Sequential(OrderedDict(fc1=nn.Linear(32, 48)))))
    print(reason)
    assert "its parameters differ from the running job's: 2 here, 4 in the job" in reason
    assert "the first without a counterpart is parameter fc2.weight in the job" in reason
    renamed = nn.Sequential(OrderedDict(a=nn.Linear(32, 48), b=nn.Tanh(), c=nn.Linear(48, 10)))
    assert mismatch(job, _join_signature(renamed)) == ""  # names alone never refuse a worker


def test_a_node_is_told_which_shard_and_parameter_differ():
    def entry(shape: tuple[int, ...]) -> SignatureEntry:
        return SignatureEntry("parameter 0.weight", (("shape", shape), ("dtype", "torch.float64")))

    job = tuple((f"shard {s}", (("parameters", (entry((8, 4)),)),)) for s in range(2))
    node = (job[0], ("shard 1", (("parameters", (entry((6, 4)),)),)))
    assert mismatch(job, node).startswith(
        "its shard 1's parameter 0.weight differs from the running job's: it has shape (6, 4) here and "
        "(8, 4) in the job"
    )


def test_members_admit_live_applicants_in_order_spreading_donors_and_refuse_the_others():
    store = dist.HashStore()
    stops = [
        _apply(store, 1, 3),
        _apply(store, 2, 4, signature=(*SIGNATURE[:2], ("compression", "int8"))),
        _apply(store, 3, 5),
        _apply(store, 4, 6, beating=False),  # applied, then died
    ]
    try:
        admission = admit(store, PREFIX, 0, SIGNATURE, donors=[0, 2], blocked=False, seal=PLAIN)
    finally:
        for stop in stops:
            stop.set()
    assert [j.member for j in admission.joiners] == [3, 5]
    assert admission.donors == (0, 2)  # one joiner each: no donor carries every transfer
    assert [n for n, _ in admission.rejected] == [2, 4]
    assert "compression" in dict(admission.rejected)[2] and "heartbeat" in dict(admission.rejected)[4]
    assert admission.handled == 4 and admission.deferred == 0
    verdicts = joiner_verdicts(admission, generation=7, members=(0, 1, 2, 3, 5), resume=12)
    assert verdicts[1].admitted and verdicts[1].donor == 0 and verdicts[3].donor == 2
    assert (verdicts[1].generation, verdicts[1].resume_step, verdicts[1].joiners) == (7, 12, (3, 5))
    assert not verdicts[2].admitted and not verdicts[4].admitted


def test_applicants_wait_while_nobody_can_donate_or_a_collective_of_the_whole_world_runs():
    store = dist.HashStore()
    stop = _apply(store, 1, 3)
    try:
        for donors, blocked in (([], False), ([0], True)):
            admission = admit(store, PREFIX, 0, SIGNATURE, donors=donors, blocked=blocked, seal=PLAIN)
            assert admission == Admission(handled=0, deferred=1, after_collective=blocked)
    finally:
        stop.set()


def test_the_watch_raises_its_flag_for_the_next_slot_and_holds_it_while_a_transfer_runs():
    store = dist.HashStore()
    watch = JoinerWatch()
    watch.refresh(store, PREFIX)
    assert not watch.due()
    _apply(store, 1, 3, beating=False)
    watch.refresh(store, PREFIX)
    assert watch.due()
    admitted = Admission(joiners=(JoinRequest(1, 3, SIGNATURE),), donors=(0,), handled=1)
    _apply(store, 2, 4, beating=False)
    watch.decided(store, PREFIX, admitted)
    assert watch.waiting and not watch.due()  # joiner 3 does not hold its replica yet
    store.set(f"{PREFIX}/joined/3", "1")
    watch.refresh(store, PREFIX)
    assert watch.due()


def test_a_node_applies_once_for_its_ranks_and_is_refused_whole_if_one_of_them_is_silent():
    store = dist.HashStore()
    # Node 4 (members 8 and 9) beats on both ranks; node 5 (10 and 11) lost its rank 1 before the decision.
    live = [_apply(store, 1, 8, shards=2), _heartbeat(store, 9)]
    half = [_apply(store, 2, 10, shards=2), _heartbeat(store, 11, beating=False)]
    try:
        admission = admit(store, PREFIX, 0, SIGNATURE, donors=[0, 2], blocked=False, seal=PLAIN)
    finally:
        for stop in live + half:
            stop.set()
    assert [j.members for j in admission.joiners] == [(8, 9)]
    assert admission.donors == (0,)  # node 0's first rank: every rank of node 0 donates its shard
    assert [n for n, _ in admission.rejected] == [2] and "heartbeat" in admission.rejected[0][1]
    # The new world lists every rank of the joining node, after the members' (node 4 is rank 2).
    reports = tuple(Report(m, m // 2, 5, (), "idle", m % 2) for m in (0, 1, 2, 3))
    decision = Decision(3, reports, admission, shards=2)
    assert decision.members == (0, 1, 2, 3, 8, 9) and decision.nodes() == [0, 1, 4]
    verdicts = joiner_verdicts(admission, 3, decision.members, decision.resume_step)
    assert verdicts[1].members == decision.members and verdicts[1].donor == 0


def test_the_ranks_of_a_joining_node_follow_the_slot_their_rank_0_claims_and_share_its_verdict():
    store = dist.HashStore()
    info = JobInfo("test-run", 4, SIGNATURE, shards=2)
    prefix = run_prefix("test-run")
    alive = threading.Event()
    threading.Thread(target=_beat, args=(store, f"{prefix}/alive", alive), daemon=True).start()
    verdicts: dict[int, Any] = {}

    def apply(shard: int) -> None:
        node = ("node-key/attempt/1/slot", shard == 0)
        applicant = Applicant(store, info, SIGNATURE, 30.0, member=8 + shard, shards=2, node=node)
        verdicts[shard] = applicant.apply()
        applicant.withdraw()

    threads = [threading.Thread(target=apply, args=(shard,)) for shard in (1, 0)]  # rank 1 first
    for thread in threads:
        thread.start()
    try:
        while not store.check([f"{slot_key(prefix, 1)}"]):
            time.sleep(0.01)
        request = PLAIN.open(store.get(slot_key(prefix, 1)), slot_key(prefix, 1))
        assert (request.member, request.members, request.shards) == (8, (8, 9), 2)
        # both ranks beat
        admission = admit(store, prefix, 0, SIGNATURE, donors=[2], blocked=False, seal=PLAIN)
        assert [j.members for j in admission.joiners] == [(8, 9)]
        members = (0, 1, 2, 3, 8, 9)
        write_verdicts(store, prefix, joiner_verdicts(admission, 0, members, 5), PLAIN)
        for thread in threads:
            thread.join(timeout=10)
    finally:
        alive.set()
    assert verdicts[0] == verdicts[1] and verdicts[0].admitted and verdicts[0].donor == 2


def test_init_elastic_checks_its_arguments_before_any_rendezvous():
    store = dist.HashStore()
    with pytest.raises(ValueError, match=r"rank=3 must be < world_size=2: no job 'x' is running"):
        init_elastic(store, 3, 2, job="x")
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        init_elastic(store, 0, 0, job="x")
    with pytest.raises(TypeError, match=r"store must be a torch\.distributed\.Store"):
        init_elastic("localhost:29500", 0, 2, job="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="job must be a non-empty string"):
        init_elastic(store, 0, 2, job="")
    with pytest.raises(ValueError, match=r"shards must be an int >= 1 \(processes per node\), got 0"):
        init_elastic(store, 0, 4, job="x", shards=0)
    with pytest.raises(ValueError, match="world_size=6 must be a multiple of shards=4"):
        init_elastic(store, 0, 6, job="x", shards=4)
    with pytest.raises(RuntimeError, match=r"node_mesh\(\) needs a job started with init_elastic"):
        node_mesh()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("job_shards", "worker_shards", "message"),
    [
        (1, 2, "running with 1 process\\(es\\) per replica, but this worker was started with shards=2"),
        (2, None, "running with 2 process\\(es\\) per replica, but this worker was started with shards=None"),
        (2, 4, "start it as the job's workers were \\(shards=2\\)"),
    ],
)
def test_a_worker_whose_shards_differ_from_the_running_job_is_refused(job_shards, worker_shards, message):
    store = dist.HashStore()
    publish_job(store, "x", JobInfo("run-x", 4, shards=job_shards), PLAIN)
    stop = threading.Event()

    def members_beat() -> None:  # the members' shared heartbeat, as a live job's
        while not stop.wait(0.05):
            store.add(f"{run_prefix('run-x')}/alive", 1)

    beat = threading.Thread(target=members_beat, daemon=True)
    beat.start()
    try:
        with pytest.raises(JoinRejectedError, match=message):
            init_elastic(store, 0, 4, job="x", shards=worker_shards)
    finally:
        stop.set()
        beat.join()
    assert not dist.is_initialized()


def test_an_applications_fate_is_claimed_once_whoever_comes_first():
    store = dist.HashStore()
    # The members claim it first: the applicant, at its deadline, learns it is admitted and waits on.
    assert claim_fate(store, PREFIX, 1, ADMITTED, PLAIN) == ADMITTED
    assert claim_fate(store, PREFIX, 1, WITHDRAWN, PLAIN) == ADMITTED
    # The applicant withdraws first: every member reads it withdrawn.
    assert claim_fate(store, PREFIX, 2, WITHDRAWN, PLAIN) == WITHDRAWN
    assert claim_fate(store, PREFIX, 2, ADMITTED, PLAIN) == WITHDRAWN
    # With a secret the fate's key is one an outsider cannot compute; a value there that does not
    # carry the secret (it could only be guessed) counts as withdrawn on both sides.
    sealed = Seal(b"the job's secret 0123")
    key = fate_key(PREFIX, 3, sealed)
    assert key.startswith(f"{slot_key(PREFIX, 3)}/fate/") and key != fate_key(PREFIX, 3, Seal(b"x" * 16))
    store.set(f"{slot_key(PREFIX, 3)}/fate", PLAIN.seal(WITHDRAWN, f"{slot_key(PREFIX, 3)}/fate"))
    assert claim_fate(store, PREFIX, 3, ADMITTED, sealed) == ADMITTED  # the predictable key is not it
    store.set(fate_key(PREFIX, 4, sealed), PLAIN.seal(ADMITTED, fate_key(PREFIX, 4, sealed)))
    assert claim_fate(store, PREFIX, 4, ADMITTED, sealed) == WITHDRAWN


def test_every_member_drops_the_joiners_that_withdrew_before_it_re_forms():
    store = dist.HashStore()
    joiners = (JoinRequest(1, 3, SIGNATURE), JoinRequest(2, 4, SIGNATURE), JoinRequest(3, 5, SIGNATURE))
    admission = Admission(joiners=joiners, donors=(0, 1, 2), handled=3)
    assert claim_fate(store, PREFIX, 2, WITHDRAWN, PLAIN) == WITHDRAWN  # joiner 4 gave up first
    settled = [settle_fates(store, PREFIX, admission, PLAIN) for _ in range(3)]  # three members
    assert settled[0] == settled[1] == settled[2]
    assert [j.member for j in settled[0].joiners] == [3, 5] and settled[0].donors == (0, 2)
    assert settled[0].rejected == ((2, "it gave up waiting before it was admitted"),)
    assert settled[0].handled == 3
    decision = Decision(0, (), settled[0])
    assert decision.members == (3, 5)


def test_two_workers_applying_at_once_with_the_same_request_claim_different_slots():
    # Another worker wrote slot 1 with the request this one would write but for its nonce (same number,
    # member and signature) and has not yet raised the count that hints at the next free slot: this
    # applicant must read the slot as taken, not as its own, and claim slot 2 as member 4 (both as
    # member 3 would form the new world with one rank twice, and its group would never connect).
    store = dist.HashStore()
    twin = PLAIN.seal(JoinRequest(1, 3, SIGNATURE), slot_key(PREFIX, 1))
    assert store.compare_set(slot_key(PREFIX, 1), "", twin) == twin.encode()
    stop = threading.Event()

    def members() -> None:  # alive; each application admitted, its verdict naming its slot (as donor)
        while not stop.is_set():
            store.add(f"{PREFIX}/alive", 1)
            for number in (1, 2):
                if store.check([slot_key(PREFIX, number)]):
                    verdict = Verdict(True, generation=0, members=(0, 1, 2, 3, 4), donor=number)
                    write_verdicts(store, PREFIX, {number: verdict}, PLAIN)
            time.sleep(0.05)

    thread = threading.Thread(target=members)
    thread.start()
    applicant = Applicant(store, JobInfo("test-run", 3, SIGNATURE), SIGNATURE, 5.0)
    try:
        verdict = applicant.apply()
    finally:
        applicant.withdraw()
        stop.set()
        thread.join()
    assert (applicant.member, verdict.donor) == (4, 2)
