"""Compiling ahead in threads of the tuning process and in worker processes (tuning/precompile.py,
tuning/subproc.py and tuning/worker.py), on the CPU.

The worker-process tests start real workers (a fresh interpreter each) that compile real candidates: under
TRITON_INTERPRET=1 a Triton warmup compiles nothing, so they test the protocol, the call's round trip and
the handling of failures, timeouts and crashes, not a compiler.
"""

import collections
import queue
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from fakes import FakeBackend

from inductor_attn.backends import AttnCall, Library
from inductor_attn.block_mask import BlockSparseMask
from inductor_attn.tuning import measure, precompile
from inductor_attn.tuning.subproc import Worker, WorkerError, load_call, save_call

TRITON_FORWARD = "triton:block_m=64,block_n=32,num_stages=2,num_warps=4,schedule=tile"


def _call():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16), torch.randn(1, 2, 32, 16)
    return AttnCall("attention", q, k, v, 0.25, causal=True)


def test_a_saved_call_comes_back_with_its_layouts_and_its_index_tensors_by_value(tmp_path):
    packed = torch.randn(40, 3, 2, 16)  # q, k, v as views of one packed buffer: strides with gaps
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    call = AttnCall("varlen", packed[:, 0], packed[:, 1], packed[:, 2], 0.25, True, -1, -1, None, cu, cu, 25, 25)
    save_call(call, tmp_path / "call.pt")
    back = load_call(tmp_path / "call.pt")
    for name in ("q", "k", "v"):
        got, want = getattr(back, name), getattr(call, name)
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
    assert torch.equal(back.cu_seqlens_q, cu) and back.problem == call.problem and back.max_seqlen_k == 25


def test_a_saved_block_sparse_call_keeps_its_mask(tmp_path):
    counts = torch.ones(1, 1, 2, dtype=torch.int32)
    sparse = BlockSparseMask((64, 64), 32, 32, counts, torch.zeros(1, 1, 2, 1, dtype=torch.int32), None, None,
                             torch.full((1, 1, 2, 1, 32, 1), -1, dtype=torch.int32), 0.5, 1.0)
    q = torch.randn(1, 2, 64, 16)
    call = AttnCall("block_sparse", q, q, q, 0.25, sparse=sparse)
    save_call(call, tmp_path / "call.pt")
    back = load_call(tmp_path / "call.pt").sparse
    assert torch.equal(back.partial_bits, sparse.partial_bits) and back.seq_lengths == (64, 64)


def test_compile_jobs_run_in_threads_at_once_up_to_the_worker_count_and_report_each_outcome(monkeypatch):
    """Triton's compiler releases the GIL: a stage's compile jobs run in threads, at most the worker count at
    once, each outcome (its seconds, its error) under its name; one at a time where Python's parser is not
    thread-safe (the Triton compiler parses each kernel's source)."""
    monkeypatch.setenv("INDUCTOR_ATTN_COMPILE_WORKERS", "3")
    monkeypatch.setattr(precompile, "parallel_parse_safe", lambda: True)
    running, most, lock = set(), [0], threading.Lock()

    def job(name, fail=False):
        def run():
            assert threading.current_thread() is not threading.main_thread()
            with lock:
                running.add(name)
                most[0] = max(most[0], len(running))
            time.sleep(0.2)
            with lock:
                running.discard(name)
            if fail:
                raise RuntimeError(f"{name} does not compile")
        return run

    start = time.perf_counter()
    got = precompile.compile_all({n: job(n, fail=n == "c") for n in "abcd"}, {}, _call())
    assert most[0] == 3 and time.perf_counter() - start < 0.75  # two rounds of three threads, not four in turn (0.8)
    assert list(got) == list("abcd") and got["a"].seconds >= 0.2 and not got["a"].failed
    assert got["c"].failed and str(got["c"].error) == "c does not compile"
    monkeypatch.setattr(precompile, "parallel_parse_safe", lambda: False)
    most[0] = 0
    precompile.compile_all({n: job(n) for n in "ab"}, {}, _call())
    assert most[0] == 1


def test_a_compile_that_runs_out_of_memory_beside_others_is_left_to_the_gate_but_alone_it_fails(monkeypatch):
    monkeypatch.setattr(precompile, "parallel_parse_safe", lambda: True)

    def big():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setenv("INDUCTOR_ATTN_COMPILE_WORKERS", "2")
    got = precompile.compile_all({"a": lambda: None, "b": big}, {}, _call())
    assert not got["b"].failed and got["b"].skipped == "out of device memory compiling beside others"
    monkeypatch.setenv("INDUCTOR_ATTN_COMPILE_WORKERS", "1")
    got = precompile.compile_all({"a": lambda: None, "b": big}, {}, _call())
    assert got["b"].failed and isinstance(got["b"].error, torch.OutOfMemoryError)


@pytest.mark.parametrize("version, safe", [((3, 10, 14), True), ((3, 11, 7), False), ((3, 11, 8), False),
                                           ((3, 11, 9), True), ((3, 12, 1), False), ((3, 12, 2), True),
                                           ((3, 13, 0), True)])
def test_compile_threads_parse_at_once_only_on_pythons_whose_parser_allows_it(monkeypatch, version, safe):
    monkeypatch.setattr(precompile.sys, "version_info", (*version, "final", 0))
    assert precompile.parallel_parse_safe() is safe


def test_a_compile_thread_that_loses_the_cuda_context_stops_the_stage_naming_its_candidate(monkeypatch):
    monkeypatch.setenv("INDUCTOR_ATTN_COMPILE_WORKERS", "2")
    lost = measure.CudaContextLost("candidate b left this process's CUDA context unusable")

    def job(name):
        def run():
            if name == "b":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return run

    monkeypatch.setattr(precompile, "raise_if_context_lost",
                        lambda name, err, device: (_ for _ in ()).throw(lost) if name == "b" else None)
    with pytest.raises(measure.CudaContextLost, match="candidate b"):
        precompile.compile_all({n: job(n) for n in "abc"}, {}, _call())


@pytest.mark.parametrize("text", ["-1", "many"])
def test_a_bad_worker_count_is_named_with_what_is_accepted(monkeypatch, text):
    monkeypatch.setenv("INDUCTOR_ATTN_COMPILE_WORKERS", text)
    with pytest.raises(ValueError, match=f"INDUCTOR_ATTN_COMPILE_WORKERS must be a non-negative number, got '{text}'"):
        precompile.max_workers()


def test_worker_count_defaults_to_this_ranks_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("INDUCTOR_ATTN_COMPILE_WORKERS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(32)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert precompile.max_workers() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert precompile.max_workers() == precompile.MAX_WORKERS


@pytest.mark.slow
def test_worker_processes_compile_candidates_and_report_errors_and_timeouts(monkeypatch):
    monkeypatch.setenv("INDUCTOR_ATTN_COMPILE_WORKERS", "2")
    jobs = {TRITON_FORWARD: (TRITON_FORWARD, "forward"), "nope:default": ("nope:default", "forward")}
    got = precompile._ProcessJobs(jobs, _call(), limit=120, workers=2).finish({})
    assert got[TRITON_FORWARD].seconds is not None and not got[TRITON_FORWARD].failed
    assert got["nope:default"].bug and "unknown backend 'nope'" in got["nope:default"].reason
    # workers go back to the pool and serve the next tune without starting again
    assert len(precompile._POOL.idle) == 2
    worker = precompile._POOL.take()
    assert worker.ready
    with pytest.raises(TimeoutError, match="compile request took longer than 0.2 s"):
        worker._reply(0.2, "compile request", 1)  # an answer that does not come in time
    assert not worker.alive  # killed: it may have been stuck in a compile
    precompile._POOL.close_idle(older_than_s=0)


@pytest.mark.slow
def test_a_worker_that_dies_says_why():
    worker = Worker()
    worker.proc.stdin.write("not json\n")
    worker.proc.stdin.flush()
    with pytest.raises(WorkerError, match="last stderr line: json.decoder.JSONDecodeError"):
        worker.request("compile", 60, call="/nonexistent", choice=TRITON_FORWARD, direction="forward")


@pytest.mark.parametrize("line", ["Loaded 3 kernels", '{"level": "info", "msg": "loaded"}', '{"id": 7, "ok": 1}',
                                  "[1, 2]"])
def test_a_worker_line_that_is_not_a_reply_ends_that_worker_with_a_worker_error(line):
    """Something printed on the protocol pipe (a library's import message, JSON or not): the driver thread gets a
    WorkerError, which it handles (the job falls to another worker), not a JSON error or a reply taken for the
    next one (every later reply one off: a KeyError ended background mode's thread)."""
    worker = Worker.__new__(Worker)
    worker.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE)
    worker.replies, worker.stderr = queue.Queue(), collections.deque()
    worker._drains = [threading.Thread(target=lambda: None) for _ in range(2)]
    for thread in worker._drains:
        thread.start()
    worker.replies.put(line)
    with pytest.raises(WorkerError, match=re.escape(f"it sent a line that is not the reply to compile request: "
                                                    f"{line!r}")):
        worker._reply(5, "compile request", 1)
    assert not worker.alive


class FakeWorker:
    alive, ready = True, False
    started = 0

    def __init__(self):
        FakeWorker.started += 1
        self.idle_since = time.monotonic()

    def close(self):
        self.alive = False


def test_a_lone_worker_compile_waits_for_its_first_call_unless_a_worker_is_idle(monkeypatch):
    monkeypatch.setattr(precompile, "Worker", FakeWorker)
    monkeypatch.setattr(precompile, "_POOL", precompile._Pool())
    FakeWorker.started = 0
    assert precompile.compile_all({}, {"fa4:x": ("fa4:x", "forward")}, _call()) == {}
    assert FakeWorker.started == 0


def test_workers_for_a_later_stage_start_early_up_to_the_worker_count(monkeypatch):
    monkeypatch.setattr(precompile, "Worker", FakeWorker)
    monkeypatch.setattr(precompile, "_POOL", precompile._Pool())
    monkeypatch.setenv("INDUCTOR_ATTN_COMPILE_WORKERS", "3")
    FakeWorker.started = 0
    precompile.prestart(1)  # one compile to come: not worth a worker
    assert FakeWorker.started == 0
    precompile.prestart(7)
    precompile.prestart(7)  # already started: idle workers count
    assert FakeWorker.started == 3 and len(precompile._POOL.idle) == 3
    precompile._POOL.close_idle(older_than_s=0)
    assert precompile._POOL.idle == []


class SlowStartWorker(FakeWorker):
    """A worker whose start-up takes until ``up`` is set, then answers every compile request."""

    up = threading.Event()
    compiled: list = []

    def wait_ready(self):
        SlowStartWorker.up.wait(10)
        self.ready = True

    def request(self, op, timeout_s, **fields):
        SlowStartWorker.compiled.append(fields["choice"])
        return {"seconds": 0.5}


@pytest.fixture
def slow_workers(monkeypatch):
    monkeypatch.setattr(precompile, "Worker", SlowStartWorker)
    monkeypatch.setattr(precompile, "_POOL", precompile._Pool())
    monkeypatch.setenv("INDUCTOR_ATTN_COMPILE_WORKERS", "2")
    SlowStartWorker.up.clear()
    SlowStartWorker.compiled = []
    yield
    SlowStartWorker.up.set()


def test_this_process_compiles_the_process_jobs_that_no_started_worker_has_taken(slow_workers):
    done = []
    jobs = {n: (n, "forward") for n in ("fa4:a", "fa4:b", "fa4:c", "fa4:d")}
    here = {n: (lambda n=n: done.append(n)) for n in jobs}
    here["fa4:b"] = lambda: 1 / 0
    timer = threading.Timer(2.0, SlowStartWorker.up.set)  # the workers come up after this process is done
    timer.start()
    got = precompile.compile_all({}, jobs, _call(), here)
    assert done == ["fa4:a", "fa4:c", "fa4:d"] and SlowStartWorker.compiled == []
    assert not got["fa4:a"].failed and isinstance(got["fa4:b"].error, ZeroDivisionError)


def test_ready_workers_take_process_jobs_and_this_process_only_those_left(slow_workers):
    SlowStartWorker.up.set()
    jobs = {n: (n, "forward") for n in ("fa4:a", "fa4:b", "fa4:c", "fa4:d")}
    got = precompile.compile_all({}, jobs, _call(), here={"fa4:d": lambda: time.sleep(0.5)})
    assert set(got) == set(jobs) and not any(c.failed for c in got.values())
    assert set(SlowStartWorker.compiled) | {"fa4:d"} == set(jobs)


def test_a_few_process_jobs_compile_here_without_starting_a_worker(slow_workers):
    SlowStartWorker.started = 0
    done = []
    jobs = {n: (n, "forward") for n in ("fa4:a", "fa4:b", "fa4:c")}
    got = precompile.compile_all({}, jobs, _call(), {n: (lambda n=n: done.append(n)) for n in jobs})
    assert done == list(jobs) and set(got) == set(jobs) and SlowStartWorker.started == 0


def test_a_worker_imports_the_costly_libraries_of_the_backends_before_it_says_ready(monkeypatch):
    """The parent gives jobs only to ready workers: a worker whose first job also imported FA4's CuTe DSL
    (about 3 s) would be slower than this process at that job."""
    from inductor_attn.tuning import worker

    loaded = []
    cheap, costly = FakeBackend("cheap", {"default": (1.0, 0.0)}), FakeBackend("costly", {"default": (1.0, 0.0)})
    for backend in (cheap, costly):
        monkeypatch.setattr(backend, "library", Library(costly_import=backend is costly,
                                                        load=lambda name=backend.name: loaded.append(name)))
    monkeypatch.setattr(worker, "backends", lambda: [cheap, costly])
    worker.load_costly_libraries()
    assert loaded == ["costly"]


def test_a_worker_whose_cuda_context_is_lost_says_so_and_the_parent_takes_no_further_job_to_it(monkeypatch):
    from inductor_attn.tuning import worker

    err = RuntimeError("CUDA error: an illegal memory access was encountered")
    request = {"op": "compile", "choice": TRITON_FORWARD}
    assert "lost" not in worker._error(err, request)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(worker, "device_error", lambda device: "AcceleratorError: illegal memory access")
    assert worker._error(err, request) == {"error": "RuntimeError: CUDA error: an illegal memory access was "
                                            "encountered", "bug": False, "lost": True}


def test_a_worker_gives_a_requests_memory_back_to_the_driver_before_it_answers(monkeypatch, tmp_path):
    from inductor_attn.tuning import worker

    save_call(_call(), tmp_path / "call.pt")
    request = {"op": "compile", "call": str(tmp_path / "call.pt"), "choice": TRITON_FORWARD, "direction": "forward"}
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    monkeypatch.setattr(worker, "device_error", lambda device: None)
    assert set(worker.answer(request)) == {"seconds"} and emptied == [1]
    reply = worker.answer({"op": "nope"})
    assert reply["bug"] and reply["error"] == "KeyError: 'nope'" and emptied == [1, 1]
    monkeypatch.setattr(worker, "device_error", lambda device: "AcceleratorError: illegal memory access")
    assert worker.answer({"op": "nope"})["lost"] and emptied == [1, 1]  # a lost context is not called again


def test_a_worker_whose_memory_cannot_be_freed_answers_and_says_it_is_lost(monkeypatch, tmp_path):
    """A sticky CUDA error that the request's own error check did not see (another device's context) surfaces
    in empty_cache: the reply still goes out, marked lost, so the worker exits after it."""
    from inductor_attn.tuning import worker

    save_call(_call(), tmp_path / "call.pt")
    request = {"op": "compile", "call": str(tmp_path / "call.pt"), "choice": TRITON_FORWARD, "direction": "forward"}

    def sticky():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", sticky)
    reply = worker.answer(request)
    assert reply["lost"] and reply["seconds"] is not None


def test_a_worker_that_lost_its_cuda_context_gets_no_further_job(monkeypatch):
    class LosingWorker(FakeWorker):
        jobs: list = []

        def __init__(self):
            super().__init__()
            self.number = FakeWorker.started

        def wait_ready(self):
            self.ready = True

        def request(self, op, timeout_s, **fields):
            LosingWorker.jobs.append((self.number, fields["choice"]))
            if len(LosingWorker.jobs) == 1:  # the first job's candidate breaks its worker's context
                self.alive = False
                return {"error": "AcceleratorError: illegal memory access", "bug": False, "lost": True}
            return {"seconds": 0.1}

    monkeypatch.setattr(precompile, "Worker", LosingWorker)
    monkeypatch.setattr(precompile, "_POOL", precompile._Pool())
    monkeypatch.setenv("INDUCTOR_ATTN_COMPILE_WORKERS", "1")
    jobs = {n: (n, "forward") for n in ("fa4:a", "fa4:b", "fa4:c", "fa4:d")}
    got = precompile.compile_all({}, jobs, _call())
    (first, a), *rest = LosingWorker.jobs
    assert a == "fa4:a" and got["fa4:a"].reason.startswith("AcceleratorError") and not got["fa4:a"].bug
    assert [name for _, name in rest] == ["fa4:b", "fa4:c", "fa4:d"] and all(w != first for w, _ in rest)
    assert not any(got[n].failed for n in ("fa4:b", "fa4:c", "fa4:d"))
