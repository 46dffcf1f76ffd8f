"""Background tuning (INDUCTOR_ATTN_MODE=background, tuning/background.py): the decision is made at once,
the tune lands in the store later and is used from then on.

Most tests replace the worker process with one that tunes in this process (so the fake backends are
registered); one runs a real worker process on the CPU's Triton interpreter and reference."""

import os
import subprocess
import sys

import pytest
import torch
from fakes import FakeBackend, small_call, timed_with_fakes

import inductor_attn
from inductor_attn.backends import AttnCall, only_backends
from inductor_attn.device import DeviceInfo, device_info
from inductor_attn.store import db
from inductor_attn.store.db import get_store
from inductor_attn.store.layers import LayeredStore
from inductor_attn.tuning import background, decisions, worker
from inductor_attn.tuning.decisions import decide, forget_decisions

DEV = DeviceInfo("cpu", (0, 0), 2)


class InProcessWorker:
    """What the worker process does (its request handler), in this process; counts its tunes."""

    alive, tunes = True, 0

    def request(self, op, timeout_s, **req):
        InProcessWorker.tunes += 1
        return worker._tune(req)

    def close(self):
        pass


@pytest.fixture
def fakes(monkeypatch):
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"x=1": (0.5, 0.01), "x=2": (0.8, 0.01)}, heuristic="x=2")
    timed_with_fakes(monkeypatch, a, b)
    monkeypatch.setattr(background, "_SCHEDULED", set())
    monkeypatch.setattr(background, "_worker", InProcessWorker)
    monkeypatch.setattr("inductor_attn.device._cpu_info", lambda: DEV)  # the worker side describes the device
    monkeypatch.setattr(decisions, "RECHECK_S", 0.0)
    InProcessWorker.tunes = 0
    with only_backends(a, b):
        yield a, b


def test_background_mode_answers_with_the_hand_rule_at_once_and_takes_the_tune_once_it_lands(fakes):
    with inductor_attn.tuning_mode("background"):
        assert decide(small_call(), DEV, "forward") == "b:x=2"  # the hand rule: nothing was measured yet
        assert background.wait(timeout_s=60)
        assert decide(small_call(), DEV, "forward") == "b:x=1"  # the stored tune, from the next call
    assert [row["winner"] for row in get_store().rows()] == ["b:x=1"] and InProcessWorker.tunes == 1


def test_a_new_process_in_background_mode_starts_from_the_stored_decision(fakes):
    with inductor_attn.tuning_mode("background"):
        decide(small_call(), DEV, "forward")
        background.wait(timeout_s=60)
        forget_decisions()
        assert decide(small_call(), DEV, "forward") == "b:x=1"
    assert InProcessWorker.tunes == 1


def test_a_bucket_is_queued_once_per_process(fakes):
    with inductor_attn.tuning_mode("background"):
        decide(small_call(lq=20), DEV, "forward")
        forget_decisions()
        decide(small_call(lq=30), DEV, "forward")  # same bucket
        background.wait(timeout_s=60)
    assert InProcessWorker.tunes == 1


def test_a_bucket_another_live_process_has_claimed_is_left_to_it_until_it_lets_go(fakes, monkeypatch):
    """That process's tune lands in the store, or it ends without a decision (its worker died): then this one
    tunes the bucket, which it would otherwise run on its first guess for good."""
    from inductor_attn.tuning.ranks import _HOST

    schedule, keys = background.schedule, []

    def schedule_after_a_claim(call, direction, key, deterministic):
        get_store().claim(key, _HOST, os.getppid(), lambda holder: False)  # our parent: a live process
        keys.append(key)
        return schedule(call, direction, key, deterministic)

    monkeypatch.setattr(background, "schedule", schedule_after_a_claim)
    monkeypatch.setattr(background, "RETRY_S", 0.05)
    with inductor_attn.tuning_mode("background"):
        assert decide(small_call(), DEV, "forward") == "b:x=2"
        assert not background.wait(timeout_s=0.5) and InProcessWorker.tunes == 0  # left to it
        get_store().release(keys[0], _HOST, os.getppid())  # it ends without storing a decision
        assert background.wait(timeout_s=60)
    assert InProcessWorker.tunes == 1 and [row["winner"] for row in get_store().rows()] == ["b:x=1"]


@pytest.mark.parametrize("full", ["mkdtemp", "save_call"])
def test_a_tune_that_cannot_be_queued_never_fails_the_call(fakes, monkeypatch, tmp_path, caplog, full):
    """A full temporary filesystem: mkdtemp raises OSError, torch.save a RuntimeError ("basic_ios::clear")."""
    def no_space(*args, **kwargs):
        if full == "save_call":
            raise RuntimeError("basic_ios::clear: iostream error")
        raise OSError(28, "No space left on device")

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(background.tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(background.tempfile if full == "mkdtemp" else background, full, no_space)
    with inductor_attn.tuning_mode("background"):
        assert decide(small_call(), DEV, "forward") == "b:x=2"
        assert background.wait(timeout_s=60)
    assert "background tune of decision" in caplog.text and "could not be queued" in caplog.text
    assert InProcessWorker.tunes == 0 and list((tmp_path / "tmp").iterdir()) == []


def test_a_tune_lands_here_when_the_workers_store_is_its_own_memory(fakes, monkeypatch):
    """A read-only store and no writable overlay: the parent and its worker each keep new decisions in their
    own memory, so the worker's decision must come back in its answer."""
    monkeypatch.setitem(db._STORES, db.default_path(), LayeredStore(db.MemoryStore()))

    class OwnMemoryWorker(InProcessWorker):
        def request(self, op, timeout_s, **req):
            with monkeypatch.context() as worker_process:
                worker_process.setattr(db, "_STORES", {db.default_path(): LayeredStore(db.MemoryStore())})
                return super().request(op, timeout_s, **req)

    monkeypatch.setattr(background, "_worker", OwnMemoryWorker)
    with inductor_attn.tuning_mode("background"):
        assert decide(small_call(), DEV, "forward") == "b:x=2"
        assert background.wait(timeout_s=60)
        assert decide(small_call(), DEV, "forward") == "b:x=1"
    assert [row["winner"] for row in get_store().rows()] == ["b:x=1"] and InProcessWorker.tunes == 1


def test_a_worker_that_refuses_the_bucket_leaves_the_first_choice(fakes, caplog, monkeypatch):
    class Refusing(InProcessWorker):
        def request(self, op, timeout_s, **fields):
            return {"error": "RuntimeError: the worker's decision key differs from the parent's", "bug": True}

    monkeypatch.setattr(background, "_worker", Refusing)
    with inductor_attn.tuning_mode("background"):
        assert decide(small_call(), DEV, "forward") == "b:x=2"
        background.wait(timeout_s=60)
        assert decide(small_call(), DEV, "forward") == "b:x=2"
    assert "decision key differs" in caplog.text


def test_the_worker_refuses_a_key_it_computes_otherwise():
    with pytest.raises(RuntimeError, match="the worker's decision key differs from the parent's"):
        decisions.tune_in_worker(small_call(), "forward", "0" * 64, False)


@pytest.mark.slow
def test_a_real_worker_process_tunes_the_bucket_and_the_decision_lands_in_the_store(monkeypatch):
    background._close_worker()  # an idle worker of an earlier test writes to that test's store (its env)
    monkeypatch.setattr(background, "_SCHEDULED", set())
    monkeypatch.setattr(decisions, "RECHECK_S", 0.0)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    call = AttnCall("attention", q, k, v, 0.25, causal=True)
    dev = device_info("cpu")
    with inductor_attn.tuning_mode("background"):
        first = decide(call, dev, "forward")
        assert background.wait(timeout_s=600)
        rows = get_store().rows()
        assert len(rows) == 1 and rows[0]["record"]["search"].startswith("staged")
        assert decide(call, dev, "forward") == rows[0]["winner"]
    assert first.startswith("triton:")  # no hand rule for this problem: the default, at once
    background._close_worker()


def test_a_worker_started_under_other_settings_is_replaced(monkeypatch, tmp_path):
    """A worker takes the parent's environment at its start: after the store's directory changed, a tune
    must not go to the worker that still writes into the old store."""
    started, closed = [], []

    class Handle:
        def __init__(self):
            self.settings = background.settings_env()
            self.alive = True
            started.append(self)

        def close(self):
            self.alive = False
            closed.append(self)

    monkeypatch.setattr(background, "Worker", Handle)
    monkeypatch.setitem(background._STATE, "worker", None)
    monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(tmp_path / "one"))
    first = background._worker()
    assert background._worker() is first
    monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(tmp_path / "two"))
    second = background._worker()
    assert second is not first and closed == [first] and len(started) == 2


def test_a_forked_child_starts_its_own_tuning_thread_and_workers():
    """Only the forking thread survives a fork: a child that inherited the handle of its parent's thread would
    queue tunes that nobody runs, and its parent's worker pipes would carry both processes' requests."""
    script = ("import os\n"
              "from inductor_attn.tuning import background, precompile\n"
              "background._STATE.update(thread=object(), worker=object())\n"
              "background._SCHEDULED.add('k')\n"
              "precompile._POOL.idle.append(object())\n"
              "pid = os.fork()\n"
              "if pid == 0:\n"
              "    print(background._STATE, background._SCHEDULED, precompile._POOL.idle, flush=True)\n"
              "    os._exit(0)\n"
              "os.waitpid(pid, 0)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout == "{'thread': None, 'worker': None} set() []\n", out.stderr
