"""Claims (one tuner per bucket per store, one measurer per device), the agreement rule and adopting agreed
decisions, in one process: other processes are played by child processes that only lend their pid."""

import doctest
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import torch
from fakes import FakeBackend, small_call, timed_with_fakes

import inductor_attn
from inductor_attn.backends import Takes, only_backends
from inductor_attn.device import DeviceInfo
from inductor_attn.store.db import get_store
from inductor_attn.tuning import decisions, ranks
from inductor_attn.tuning.decisions import (
    adopt_decisions,
    decide,
    decision_entries,
    forget_decisions,
)

DEV = DeviceInfo("cpu", (0, 0), 2)


@pytest.fixture
def fakes(monkeypatch):
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"x=1": (0.5, 0.01)})
    timed_with_fakes(monkeypatch, a, b)
    with only_backends(a, b), inductor_attn.tuning_mode("autotune"):
        yield a, b


@pytest.fixture
def other_process():
    """A live process of this host that is not us (holds claims in these tests)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


def _stored_row_of_a_tune(call) -> dict:
    """What another process would store for ``call``: tune it once, then forget it here."""
    decide(call, DEV, "forward")
    (row,) = get_store().rows()
    get_store().clear()
    forget_decisions()
    return row


def _claims() -> list[tuple]:
    with sqlite3.connect(get_store().path) as conn:
        return conn.execute("SELECT name, pid FROM claims").fetchall()


def test_doctest_examples_hold():
    assert doctest.testmod(ranks).failed == 0


def test_a_rank_waits_for_a_live_claim_and_uses_the_decision_it_stores(fakes, other_process, caplog):
    a, b = fakes
    row = _stored_row_of_a_tune(small_call())
    runs = a.calls + b.calls
    store = get_store()
    assert store.claim(row["key"], ranks._HOST, other_process.pid, lambda h: False) is None
    threading.Timer(0.4, store.put, args=(row,)).start()
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger=ranks.__name__):
        assert decide(small_call(), DEV, "forward") == "b:x=1"
    assert time.monotonic() - start >= 0.4
    assert a.calls + b.calls == runs + 1  # it waited instead of tuning, then gated the other rank's winner
    assert f"pid {other_process.pid}" in caplog.text and "waiting for the tune of decision" in caplog.text


def test_a_claim_whose_process_died_is_ignored_at_once(fakes):
    a, b = fakes
    row = _stored_row_of_a_tune(small_call())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    get_store().claim(row["key"], ranks._HOST, dead.pid, lambda h: False)
    runs = a.calls + b.calls
    start = time.monotonic()
    assert decide(small_call(), DEV, "forward") == "b:x=1"
    assert time.monotonic() - start < 5 and a.calls + b.calls > runs
    assert _claims() == []  # taken over, then released


def test_a_claim_whose_process_was_killed_but_not_yet_reaped_is_ignored_at_once(fakes, monkeypatch):
    """A zombie still answers kill(pid, 0): its claim made the other ranks wait the whole claim timeout."""
    monkeypatch.setenv(ranks.TIMEOUT_ENV, "8")  # a test that fails, fails in seconds
    a, b = fakes
    row = _stored_row_of_a_tune(small_call())
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        zombie.kill()
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # dead, and left unreaped
        get_store().claim(row["key"], ranks._HOST, zombie.pid, lambda h: False)
        runs = a.calls + b.calls
        start = time.monotonic()
        assert decide(small_call(), DEV, "forward") == "b:x=1"
        assert time.monotonic() - start < 5 and a.calls + b.calls > runs
    finally:
        zombie.wait()


def test_waiting_is_bounded_by_the_timeout_then_the_rank_tunes_and_says_so(fakes, other_process, monkeypatch,
                                                                           caplog):
    a, b = fakes
    row = _stored_row_of_a_tune(small_call())
    monkeypatch.setenv(ranks.TIMEOUT_ENV, "0.5")
    get_store().claim(row["key"], ranks._HOST, other_process.pid, lambda h: False)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=ranks.__name__):
        assert decide(small_call(), DEV, "forward") == "b:x=1"
    assert 0.5 <= time.monotonic() - start < 5
    assert "waited 0.5 s (INDUCTOR_ATTN_CLAIM_TIMEOUT_S)" in caplog.text and "going ahead here" in caplog.text
    assert _claims() == []


def test_a_claim_from_another_host_counts_until_it_is_older_than_the_timeout(monkeypatch):
    monkeypatch.setenv(ranks.TIMEOUT_ENV, "60")
    old = {"host": "elsewhere", "pid": 1, "created": time.time() - 61}
    new = {"host": "elsewhere", "pid": 1, "created": time.time()}
    assert ranks._stale(old, ranks.claim_timeout_s()) and not ranks._stale(new, ranks.claim_timeout_s())
    store = get_store()
    store.claim("k", "elsewhere", 1, lambda h: False)
    assert store.claim("k", ranks._HOST, 2, lambda h: False)["host"] == "elsewhere"
    assert store.claim("k", ranks._HOST, 2, lambda h: True) is None


def test_ranks_on_one_device_take_turns_measuring(fakes, other_process, monkeypatch):
    """Another process measuring on this CPU makes a tune of another bucket wait for its turn."""
    token = f"device:{ranks.device_token(torch.device('cpu'))}"
    store = get_store()
    store.claim(token, ranks._HOST, other_process.pid, lambda h: False)
    threading.Timer(0.4, store.release, args=(token, ranks._HOST, other_process.pid)).start()
    start = time.monotonic()
    assert decide(small_call(), DEV, "forward") == "b:x=1"
    assert time.monotonic() - start >= 0.4
    assert _claims() == []


def test_claims_are_released_when_the_tune_fails(fakes):
    a, b = fakes
    a.fail.add("default")
    b.fail.add("x=1")
    with pytest.raises(RuntimeError, match="no candidate could run"):
        decide(small_call(), DEV, "forward")
    assert _claims() == []


def test_a_broken_store_never_makes_a_rank_wait(fakes, tmp_path, monkeypatch):
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "decisions.sqlite").write_bytes(b"this is not a database" * 100)
    monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(bad))
    with pytest.warns(RuntimeWarning, match="unusable"):
        assert decide(small_call(), DEV, "forward") == "b:x=1"


def test_a_bad_timeout_is_named_in_the_error(monkeypatch):
    monkeypatch.setenv(ranks.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="INDUCTOR_ATTN_CLAIM_TIMEOUT_S must be a positive number of seconds, "
                                         "got 'soon'"):
        ranks.claim_timeout_s()


def test_the_lowest_measured_rank_wins_else_the_lowest_rank():
    row = {"winner": "b:x=1"}
    per_rank = [[("k1", "a:default", None), ("k2", "a:default", None)],
                [("k1", "b:x=1", row), ("k3", "c:default", None)],
                [("k1", "a:default", {"winner": "a:default"}), ("k2", "b:x=2", None)]]
    assert ranks.agree(per_rank) == {"k1": ("b:x=1", row), "k2": ("a:default", None), "k3": ("c:default", None)}


def test_an_adopted_decision_is_used_without_measuring_and_written_to_the_store(fakes):
    a, b = fakes
    decide(small_call(), DEV, "forward")
    ((memo_key, choice, row),) = decision_entries()  # the memo key is private: take it from a decision
    assert choice == "b:x=1" and row["winner"] == "b:x=1"
    forget_decisions()
    get_store().clear()
    runs = a.calls + b.calls
    agreed_row = {**row, "winner": "a:default"}
    assert adopt_decisions({memo_key: ("a:default", agreed_row)}) == 0  # this rank had not decided it
    assert get_store().get(row["key"])["winner"] == "a:default"
    assert decide(small_call(lq=30), DEV, "forward") == "a:default"  # same bucket, another length
    assert a.calls + b.calls == runs + 1  # not measured: the agreed winner gated once here
    assert decision_entries() == [(memo_key, "a:default", agreed_row)]


def test_adopting_another_choice_changes_this_rank_and_counts_it(fakes):
    decide(small_call(), DEV, "forward")
    ((memo_key, choice, row),) = decision_entries()
    assert choice == "b:x=1"
    assert adopt_decisions({memo_key: ("a:default", None)}) == 1
    assert decide(small_call(), DEV, "forward") == "a:default"
    assert adopt_decisions({memo_key: ("a:default", None)}) == 0


def test_an_agreed_choice_that_cannot_run_here_is_ignored_with_a_warning(fakes, caplog):
    decide(small_call(), DEV, "forward")
    ((memo_key, _, _),) = decision_entries()
    adopt_decisions({memo_key: ("fa4:tile=128", None)})
    with caplog.at_level(logging.WARNING, logger=decisions.__name__):
        assert decide(small_call(), DEV, "forward") == "b:x=1"
    assert "fa4:tile=128" in caplog.text and "cannot run" in caplog.text


def test_sync_decisions_without_torch_distributed_does_nothing(fakes):
    decide(small_call(), DEV, "forward")
    assert inductor_attn.sync_decisions() == 0
    assert decide(small_call(), DEV, "forward") == "b:x=1"


def test_an_agreed_backward_choice_must_take_the_lse_gradient_where_the_bucket_needs_it(fakes, monkeypatch, caplog):
    a, b = fakes
    monkeypatch.setattr(b, "takes", Takes(backward=True, grad_lse=False), raising=False)
    assert decide(small_call(), DEV, "backward", grad_lse=True) == "a:default"
    ((memo_key, _, _),) = decision_entries()
    adopt_decisions({memo_key: ("b:x=1", None)})
    with caplog.at_level(logging.WARNING, logger=decisions.__name__):
        assert decide(small_call(), DEV, "backward", grad_lse=True) == "a:default"
    assert "b:x=1" in caplog.text and "cannot run" in caplog.text


def test_an_agreed_choice_that_was_this_ranks_provisional_one_stays_when_its_tune_lands(fakes, monkeypatch):
    """Background mode: this rank decided the bucket without a measurement and queued its tune; the ranks agreed
    on that choice. The tune landing later must not move this rank alone off what every rank runs."""
    monkeypatch.setattr("inductor_attn.tuning.background.schedule", lambda *args: True)  # lands below
    monkeypatch.setattr(decisions, "RECHECK_S", 0.0)
    row = _stored_row_of_a_tune(small_call())
    with inductor_attn.tuning_mode("background"):
        first = decide(small_call(), DEV, "forward")
        ((memo_key, choice, _),) = decision_entries()
        assert first == choice != row["winner"]
        adopt_decisions({memo_key: (choice, None)})
        get_store().put(row)
        assert decide(small_call(), DEV, "forward") == first


def test_an_agreed_choice_survives_a_compile_that_follows_the_store(fakes):
    """A compile keys its graph on the store's token and forgets the choices the store no longer backs; the one the
    ranks agreed on is no store's to take back (docs/ranks.md: warm up, sync_decisions(), then compile)."""
    decide(small_call(), DEV, "forward")
    ((memo_key, choice, _),) = decision_entries()
    adopt_decisions({memo_key: ("a:default", None)})
    assert decide(small_call(), DEV, "forward") == "a:default"
    decisions.follow_store(lambda: "a token the store never had")
    assert decide(small_call(), DEV, "forward") == "a:default"


def test_an_agreed_choice_first_called_inside_a_cuda_graph_capture_still_answers_after_it(fakes, monkeypatch):
    """A call inside a capture is answered and not remembered; the choice the ranks agreed on must still answer
    the next call outside it (it was taken from the agreed set, and this rank then decided on its own)."""
    decide(small_call(), DEV, "forward")
    ((memo_key, _, _),) = decision_entries()
    adopt_decisions({memo_key: ("a:default", None)})
    capturing = [True]
    monkeypatch.setattr(decisions, "_capturing", lambda call: capturing[0])
    assert decide(small_call(), DEV, "forward") == "a:default"
    capturing[0] = False
    assert decide(small_call(), DEV, "forward") == "a:default"
