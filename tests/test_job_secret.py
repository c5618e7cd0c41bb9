"""A job only its members can enter: the job secret seals the store's entries and the replicas' digests.

Pure tests on an in-process store: the seal itself, a joiner without the secret or with another job's,
an application forged in the store, a decision forged in the store while the survivors agree, a
replica whose digest was not made with the secret. The fleet tests with real workers are in
``test_joining.py`` (a joiner without the secret is refused while the job trains on).
"""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from decent_optim_wrapper import JoinRejectedError, init_elastic
from decent_optim_wrapper.engine.fleet.admission import JoinRequest, admit, slot_key
from decent_optim_wrapper.engine.fleet.jobs import JobInfo, job_running, publish_job, run_prefix
from decent_optim_wrapper.engine.fleet.membership import Decision, Membership, Report
from decent_optim_wrapper.engine.fleet.sealing import SECRET_ENV, ForgedEntryError, Seal, resolve_secret
from decent_optim_wrapper.engine.fleet.transfer import TransferCorruptedError, pack, unpack

pytestmark = pytest.mark.pure

SECRET = b"0123456789abcdef-the-job"
OTHER = b"fedcba9876543210-another"
SIGNATURE = (("topology", "ring"),)


# -- the seal ------------------------------------------------------------------------------------------
def test_a_sealed_entry_opens_only_with_the_same_secret_at_the_same_key():
    seal = Seal(SECRET)
    entry = seal.seal({"x": 1}, "k/1")
    assert seal.open(entry.encode(), "k/1") == {"x": 1}
    with pytest.raises(ForgedEntryError, match="does not carry this job's secret"):
        Seal(OTHER).open(entry.encode(), "k/1")  # another job's
    with pytest.raises(ForgedEntryError, match="does not carry this job's secret"):
        seal.open(entry.encode(), "k/2")  # replayed under another key
    with pytest.raises(ForgedEntryError, match="does not carry this job's secret"):
        seal.open(Seal().seal({"x": 1}, "k/1").encode(), "k/1")  # written without a secret
    with pytest.raises(ForgedEntryError, match="this process has none"):
        Seal().open(entry.encode(), "k/1")
    tampered = entry[:-2] + ("00" if entry[-2:] != "00" else "01")
    with pytest.raises(ForgedEntryError):
        seal.open(tampered.encode(), "k/1")
    assert Seal().open(Seal().seal([1, 2], "k").encode(), "k") == [1, 2]  # no secret: plain, as before


def test_a_forged_entry_is_refused_before_anything_is_unpickled():
    class Boom:
        def __reduce__(self):
            return (pytest.fail, ("unpickled a forged entry",))

    forged = "s:" + "0" * 64 + ":" + pickle.dumps(Boom()).hex()
    with pytest.raises(ForgedEntryError):
        Seal(SECRET).open(forged.encode(), "k")


def test_the_secret_comes_from_the_argument_or_the_environment_and_must_be_long_enough(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert resolve_secret() is None
    assert resolve_secret("x" * 16) == b"x" * 16
    monkeypatch.setenv(SECRET_ENV, "y" * 20)
    assert resolve_secret() == b"y" * 20
    assert resolve_secret(b"z" * 16) == b"z" * 16  # the argument wins
    with pytest.raises(ValueError, match=r"secret is 5 bytes; a job secret must have at least 16.*token_hex"):
        resolve_secret("short")
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=rf"\${SECRET_ENV} is 5 bytes"):
        resolve_secret()
    with pytest.raises(TypeError, match="secret must be a str or bytes"):
        resolve_secret(12345)


def test_init_elastic_refuses_a_short_secret_before_any_rendezvous():
    with pytest.raises(ValueError, match="a job secret must have at least 16"):
        init_elastic(dist.HashStore(), 0, 2, job="x", secret="short")
    assert not dist.is_initialized()


def test_a_replica_digest_made_without_the_secret_is_refused():
    data, digest = pack({"w": torch.arange(4.0)}, Seal(SECRET))
    assert torch.equal(unpack(data, digest, Seal(SECRET))["w"], torch.arange(4.0))
    forged, forged_digest = pack({"w": torch.zeros(4)}, Seal())  # SHA-256: anyone can compute it
    with pytest.raises(TransferCorruptedError, match="HMAC"):
        unpack(forged, forged_digest, Seal(SECRET))
    with pytest.raises(TransferCorruptedError):
        unpack(data, digest, Seal(OTHER))


# -- joiners and applications --------------------------------------------------------------------------
def _live_job(store: dist.Store, seal: Seal) -> threading.Event:
    publish_job(store, "x", JobInfo("run-x", 4, SIGNATURE), seal)
    stop = threading.Event()

    def members_beat() -> None:  # the members' shared heartbeat, as a live job's
        while not stop.wait(0.05):
            store.add(f"{run_prefix('run-x')}/alive", 1)

    threading.Thread(target=members_beat, daemon=True).start()
    return stop


@pytest.mark.parametrize("theirs", [None, OTHER], ids=["without a secret", "with another job's"])
def test_a_joiner_without_the_jobs_secret_is_refused_with_the_fix(theirs):
    store = dist.HashStore()
    stop = _live_job(store, Seal(SECRET))
    try:
        with pytest.raises(JoinRejectedError, match=r"cannot verify it.*secret.*DECENT_JOB_SECRET"):
            job_running(store, "x", Seal(theirs))
        info = job_running(store, "x", Seal(SECRET))
        assert info is not None and info.run == "run-x"
    finally:
        stop.set()


def test_an_application_forged_in_the_store_is_rejected_and_the_next_one_decided():
    store, seal = dist.HashStore(), Seal(SECRET)
    prefix = run_prefix("run-x")
    forged = Seal().seal(JoinRequest(1, 4, SIGNATURE), slot_key(prefix, 1))  # written without the secret
    store.set(slot_key(prefix, 1), forged)
    admission = admit(store, prefix, 0, SIGNATURE, donors=[0], blocked=False, seal=seal)
    assert admission.rejected == ((1, "its application does not carry the job's secret"),)
    assert admission.joiners == () and admission.handled == 1


def test_a_decision_forged_in_the_store_is_ignored_and_the_members_agree_on_their_own():
    store, seal = dist.HashStore(), Seal(SECRET)
    members = [Membership(store, "run-x", rank, 2, timedelta(seconds=20), seal=seal) for rank in range(2)]
    try:
        decision_key = f"{run_prefix('run-x')}/g0/decision"
        planted = Decision(0, (Report(0, 0, 99, ()),))  # only rank 0 goes on, from step 99
        store.set(decision_key, Seal().seal(planted, decision_key))
        decided: dict[int, Decision] = {}

        def agree(rank: int) -> None:
            decided[rank] = members[rank].agree(Report(rank, rank, 7, ()), RuntimeError("a peer was lost"))

        threads = [threading.Thread(target=agree, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert set(decided) == {0, 1}
        assert decided[0] == decided[1]
        assert decided[0].members == (0, 1) and {r.position for r in decided[0].reports} == {7}
        assert seal.open(store.get(decision_key), decision_key) == decided[0]
    finally:
        for membership in members:
            membership.close()


def test_a_joiner_passes_over_verdicts_that_do_not_verify_and_waits_for_the_members():
    from decent_optim_wrapper.engine.fleet.admission import Applicant, Verdict, verdict_key, write_verdicts
    from decent_optim_wrapper.engine.fleet.jobs import JobInfo
    from decent_optim_wrapper.engine.fleet.refusals import REFUSALS

    store, seal = dist.HashStore(), Seal(SECRET)
    prefix = run_prefix("run-x")
    key = verdict_key(prefix, 1, seal)
    genuine = Verdict(True, "", 0, (0, 1, 2, 3), 0, 5, 1, (3,), (0,))
    stop = threading.Event()

    def members() -> None:
        while not store.check([slot_key(prefix, 1)]):  # the job is alive until the joiner applied
            store.add(f"{prefix}/alive", 1)
            time.sleep(0.05)
        # A genuine verdict of another run replayed here, then a plain one (the worst case: at the
        # private key, which an outsider cannot compute), then the members' own.
        other = verdict_key(run_prefix("run-y"), 1, seal)
        store.set(key, seal.seal(Verdict(False, "replayed"), other))
        for value in (None, Seal().seal(Verdict(False, "forged"), key), None):
            if value is not None:
                store.set(key, value)
            for _ in range(6):
                store.add(f"{prefix}/alive", 1)
                time.sleep(0.05)
        write_verdicts(store, prefix, {1: genuine}, seal)
        while not stop.is_set():
            store.add(f"{prefix}/alive", 1)
            time.sleep(0.05)

    thread = threading.Thread(target=members)
    thread.start()
    before = REFUSALS.counts["forged_verdict"]
    applicant = Applicant(store, JobInfo("run-x", 3, SIGNATURE), SIGNATURE, 5.0, seal=seal)
    try:
        assert applicant.apply() == genuine
    finally:
        applicant.withdraw()
        stop.set()
        thread.join()
    assert REFUSALS.counts["forged_verdict"] - before == 1  # logged and counted once per key


def test_a_joiner_whose_application_an_outsider_overwrote_applies_again_instead_of_giving_up():
    from decent_optim_wrapper.engine.fleet.admission import (
        FORGED_APPLICATION,
        Applicant,
        ApplyAgainError,
        Verdict,
        write_verdicts,
    )
    from decent_optim_wrapper.engine.fleet.jobs import JobInfo

    store, seal = dist.HashStore(), Seal(SECRET)
    prefix = run_prefix("run-x")
    stop = threading.Event()

    def members() -> None:  # alive; once the slot is taken, refuse what they read there (forged)
        while not stop.is_set():
            store.add(f"{prefix}/alive", 1)
            if store.check([slot_key(prefix, 1)]):
                write_verdicts(store, prefix, {1: Verdict(False, FORGED_APPLICATION)}, seal)
            time.sleep(0.05)

    thread = threading.Thread(target=members)
    thread.start()
    applicant = Applicant(store, JobInfo("run-x", 3, SIGNATURE), SIGNATURE, 5.0, seal=seal)
    try:
        with pytest.raises(ApplyAgainError, match="overwritten in the store by a process without"):
            applicant.apply()
    finally:
        applicant.withdraw()
        stop.set()
        thread.join()
