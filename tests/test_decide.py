"""Modes, the decision store round trip, and invalidation, through decide() with fake backends."""

import contextlib
import re

import pytest
import torch
from fakes import FakeBackend, small_call, timed_with_fakes

import inductor_attn
from inductor_attn import cache
from inductor_attn.backends import AttnCall, Library, only_backends
from inductor_attn.device import DeviceInfo
from inductor_attn.lowering.graph_pass import DecisionPass
from inductor_attn.store import keys
from inductor_attn.store.db import get_store
from inductor_attn.tuning.decisions import decide, decide_with_record, forget_decisions

DEV = DeviceInfo("cpu", (0, 0), 2)


@pytest.fixture
def fakes(monkeypatch):
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"x=1": (0.5, 0.01), "x=2": (0.8, 0.01)}, heuristic="x=2")
    timed_with_fakes(monkeypatch, a, b)
    with only_backends(a, b):
        yield a, b


def test_autotune_stores_the_decision_and_a_new_process_reuses_it_without_measuring(fakes):
    a, b = fakes
    with inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), DEV, "forward") == "b:x=1"
        runs = a.calls + b.calls
        assert runs > 0
        forget_decisions()  # what a new process starts with
        assert decide(small_call(), DEV, "forward") == "b:x=1"
        assert a.calls + b.calls == runs + 1  # zero benchmarks: the store answered, its winner gated once here
    assert len(get_store().rows()) == 1


def test_same_bucket_is_decided_once_other_bucket_again(fakes):
    a, b = fakes
    with inductor_attn.tuning_mode("autotune"):
        decide(small_call(lq=20), DEV, "forward")
        runs = a.calls + b.calls
        decide(small_call(lq=30), DEV, "forward")  # 20 and 30 share the bucket 32
        assert a.calls + b.calls == runs
        decide(small_call(lq=40), DEV, "forward")  # bucket 64
        assert a.calls + b.calls > runs
    assert len(get_store().rows()) == 2


def test_cache_only_uses_the_store_and_never_measures(fakes):
    a, b = fakes
    with inductor_attn.tuning_mode("cache-only"):
        assert decide(small_call(), DEV, "forward") == "a:default"
    assert a.calls + b.calls == 0
    with inductor_attn.tuning_mode("autotune"):
        decide(small_call(), DEV, "forward")
    with inductor_attn.tuning_mode("cache-only"):
        assert decide(small_call(), DEV, "forward") == "b:x=1"


def test_heuristic_mode_follows_the_hand_rule_without_measuring(fakes):
    a, b = fakes
    with inductor_attn.tuning_mode("heuristic"):
        assert decide(small_call(), DEV, "forward") == "b:x=2"
    assert a.calls + b.calls == 0 and get_store().rows() == []


def test_off_mode_always_runs_the_default(fakes):
    with inductor_attn.tuning_mode("off"):
        assert decide(small_call(), DEV, "forward") == "a:default"


def test_mode_from_environment_and_bad_mode_named_in_error(fakes, monkeypatch):
    monkeypatch.setenv("INDUCTOR_ATTN_MODE", "off")
    assert decide(small_call(), DEV, "forward") == "a:default"
    with pytest.raises(ValueError, match="tuning mode must be one of autotune"):
        inductor_attn.set_mode("fastest")
    monkeypatch.setenv("INDUCTOR_ATTN_MODE", "fastest")  # the variable named, as every other setting's error does
    with pytest.raises(ValueError, match="^INDUCTOR_ATTN_MODE must be one of autotune, .*, got 'fastest'$"):
        decide(small_call(), DEV, "forward")


def test_a_new_library_version_invalidates_stored_decisions(fakes, monkeypatch):
    a, b = fakes
    with inductor_attn.tuning_mode("autotune"):
        decide(small_call(), DEV, "forward")
        runs = a.calls + b.calls
        forget_decisions()
        monkeypatch.setattr(keys, "library_versions", lambda requires: {"torch": "9.9.9"})
        decide(small_call(), DEV, "forward")
        assert a.calls + b.calls > runs
    assert len(get_store().rows()) == 2


def test_an_edited_kernel_source_invalidates_its_decisions(fakes, monkeypatch, tmp_path):
    a, b = fakes
    kernel = tmp_path / "kernel.py"
    kernel.write_text("v1")
    monkeypatch.setattr(b, "sources", (kernel,))  # the files hashed into b's decision keys
    with inductor_attn.tuning_mode("autotune"):
        decide(small_call(), DEV, "forward")
        forget_decisions()
        kernel.write_text("v2")
        decide(small_call(), DEV, "forward")
    assert len(get_store().writable.rows()) == 2  # a second tune under a new key, not the first decision


def test_a_stored_winner_that_is_no_longer_runnable_is_retuned(fakes, monkeypatch):
    a, b = fakes
    with inductor_attn.tuning_mode("autotune"):
        decide(small_call(), DEV, "forward")
        forget_decisions()
        b.prune_reasons["x=1"] = "no longer supported"
        assert decide(small_call(), DEV, "forward") == "b:x=2"


def test_another_device_gets_its_own_decision(fakes):
    with inductor_attn.tuning_mode("autotune"):
        decide(small_call(), DEV, "forward")
        decide(small_call(), DeviceInfo("NVIDIA H100", (9, 0), 132), "forward")
    assert len(get_store().rows()) == 2


def test_broken_store_warns_once_and_tuning_still_works(fakes, tmp_path, monkeypatch):
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "decisions.sqlite").write_bytes(b"this is not a database" * 100)
    monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(bad))
    with inductor_attn.tuning_mode("autotune"), pytest.warns(RuntimeWarning, match="unusable") as record:
        assert decide(small_call(), DEV, "forward") == "b:x=1"
        forget_decisions()
        assert decide(small_call(), DEV, "forward") == "b:x=1"
    assert len([w for w in record if "unusable" in str(w.message)]) == 1
    assert (bad / "decisions.sqlite").read_bytes().startswith(b"this is not a database")


def test_only_one_runnable_candidate_is_not_measured_or_stored():
    with only_backends(inductor_attn.backends.REFERENCE), inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), DEV, "forward") == "reference:default"
    assert get_store().rows() == []


def test_candidates_lists_every_backend_with_its_pruned_reason():
    q = torch.randn(1, 2, 8, 16)
    cands = inductor_attn.candidates(q, q, q, causal=True)
    by_backend = {c.backend: c for c in cands}
    assert by_backend["sdpa"].pruned == "needs a CUDA device"
    assert by_backend["reference"].pruned is None and str(by_backend["reference"].config) == "default"


def test_run_candidate_runs_exactly_that_one_and_refuses_pruned_ones():
    q = torch.randn(1, 2, 8, 16)
    out = inductor_attn.run_candidate("reference:default", q, q, q, causal=True)
    torch.testing.assert_close(out, inductor_attn.attention(q, q, q, causal=True))
    with pytest.raises(ValueError, match="cannot run this call: needs a CUDA device"):
        inductor_attn.run_candidate("sdpa:-", q, q, q)
    with pytest.raises(ValueError, match="not a candidate for this call"):
        inductor_attn.run_candidate("nope:default", q, q, q)


def test_deterministic_backward_decisions_are_kept_apart(fakes):
    with inductor_attn.tuning_mode("autotune"):
        decide(small_call(), DEV, "backward")
        torch.use_deterministic_algorithms(True)
        try:
            decide(small_call(), DEV, "backward")
        finally:
            torch.use_deterministic_algorithms(False)
    assert sorted(r["op"] for r in get_store().rows()) == ["attention/backward", "attention/backward-deterministic"]


@pytest.mark.parametrize("mode", ["off", "heuristic", "cache-only"])
def test_an_ungated_choice_that_cannot_run_gives_way_to_the_next_candidate(mode, caplog):
    """A mode that does not measure runs the default ungated; when it fails at its launch (flex's own tile
    ran out of shared memory on an H100 this way), the call runs the next candidate and the bucket keeps it."""
    a = FakeBackend("a", {"default": (1.0, 0.01)}, fail={"default"})
    b = FakeBackend("b", {"x=1": (0.5, 0.01)})
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    inductor_attn.reset_stats()
    with only_backends(a, b), inductor_attn.tuning_mode(mode):
        before = DecisionPass().uuid()
        out = inductor_attn.attention(q, k, v, causal=True)
        # a graph compiled before it failed bakes it: Inductor's cache must not replay that graph now
        assert DecisionPass().uuid() != before
        again = inductor_attn.attention(q, k, v, causal=True)
        with pytest.raises(RuntimeError, match="simulated"):  # a choice the caller names is never replaced
            inductor_attn.run_candidate("a:default", q, k, v, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(again, want)
    assert a.calls == 2 and b.calls == 2  # the failed default ran once per bucket, then the explicit call
    assert sum("a:default failed at its launch" in r.getMessage() for r in caplog.records) == 1
    assert inductor_attn.stats() == {"attention/forward -> b:x=1": 2}  # only calls that ran are counted


def test_a_launch_error_that_leaves_the_cuda_context_unusable_is_raised_not_handed_to_the_next_candidate(
        monkeypatch):
    from inductor_attn.tuning import decisions

    monkeypatch.setattr(decisions, "device_error", lambda device: "AcceleratorError: illegal memory access")
    a = FakeBackend("a", {"default": (1.0, 0.01)}, fail={"default"})
    b = FakeBackend("b", {"x=1": (0.5, 0.01)})
    q = torch.randn(1, 2, 16, 8)
    with only_backends(a, b), inductor_attn.tuning_mode("off"):
        with pytest.raises(RuntimeError, match="simulated"):
            inductor_attn.attention(q, q, q, causal=True)
    assert b.calls == 0


def test_uncounted_leaves_out_the_calls_of_its_own_thread_only():
    import threading

    from inductor_attn import runtime

    a = FakeBackend("a", {"default": (1.0, 0.01)})
    q = torch.randn(1, 2, 16, 8)
    inductor_attn.reset_stats()
    with only_backends(a), inductor_attn.tuning_mode("off"):
        with runtime.uncounted():
            inductor_attn.attention(q, q, q)
            other = threading.Thread(target=lambda: inductor_attn.attention(q, q, q))
            other.start()
            other.join()
        inductor_attn.attention(q, q, q)
    assert a.calls == 3 and inductor_attn.stats() == {"attention/forward -> a:default": 2}


def test_a_choice_that_failed_at_an_eager_launch_is_not_what_the_next_compile_bakes():
    a = FakeBackend("a", {"default": (1.0, 0.01)}, fail={"default"})
    b = FakeBackend("b", {"x=1": (0.5, 0.01)})
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    with only_backends(a, b), inductor_attn.tuning_mode("off"):
        assert decide(AttnCall("attention", q, k, v, 0.25, True), DEV, "forward") == "a:default"
        inductor_attn.attention(q, k, v, causal=True)  # a:default fails at its launch here
        assert decide(AttnCall("attention", q, k, v, 0.25, True), DEV, "forward") == "b:x=1"


class _OutOfMemory(FakeBackend):
    def _forward(self, cfg, call):
        self.calls += 1
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def test_running_out_of_device_memory_is_raised_and_keeps_the_choice():
    """Out of memory says nothing about the kernel: giving way would demote a good choice (and re-tune)."""
    a = _OutOfMemory("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"x=1": (0.5, 0.01)})
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    with only_backends(a, b), inductor_attn.tuning_mode("off"):
        for _ in range(2):
            with pytest.raises(torch.OutOfMemoryError):
                inductor_attn.attention(q, k, v, causal=True)
    assert a.calls == 2 and b.calls == 0


class _CostlyImport(FakeBackend):
    """A backend whose enumeration would import a large library (as FA4's imports flash_attn.cute)."""

    library = Library(costly_import=True)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.enumerated = 0

    def supports(self, p, dev, direction="forward"):
        self.enumerated += 1
        return super().supports(p, dev, direction)


@pytest.mark.parametrize("mode", ["autotune", "cache-only", "background"])
def test_a_store_hit_for_another_backend_never_enumerates_a_backend_with_a_costly_import(monkeypatch, mode):
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"x=1": (0.5, 0.01)})
    costly = _CostlyImport("costly", {"default": (0.9, 0.01)})
    timed_with_fakes(monkeypatch, a, costly, b)
    with only_backends(a, costly, b):
        with inductor_attn.tuning_mode("autotune"):
            assert decide(small_call(), DEV, "forward") == "b:x=1"
        forget_decisions()  # a new process
        costly.enumerated = 0
        with inductor_attn.tuning_mode(mode):
            assert decide(small_call(), DEV, "forward") == "b:x=1"
        assert costly.enumerated == 0


def test_a_stored_winner_of_a_backend_with_a_costly_import_is_found_the_full_way(monkeypatch):
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    costly = _CostlyImport("costly", {"default": (0.5, 0.01)})
    timed_with_fakes(monkeypatch, a, costly)
    with only_backends(a, costly), inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), DEV, "forward") == "costly:default"
        runs = a.calls + costly.calls
        forget_decisions()
        costly.enumerated = 0
        assert decide(small_call(), DEV, "forward") == "costly:default"
        assert costly.enumerated > 0 and a.calls + costly.calls == runs + 1  # enumerated and gated, not measured


@contextlib.contextmanager
def _new_machine_with_the_table_of(monkeypatch, tmp_path, *backends):
    """An autotune's decision among ``backends`` exported as a shipped table; then a fresh store that reads it,
    with the enumerations of the costly ones counted from zero."""
    timed_with_fakes(monkeypatch, *backends)
    with only_backends(*backends):
        with inductor_attn.tuning_mode("autotune"):
            decide(small_call(), DEV, "forward")
        path, _ = cache.export_priors(tmp_path / "table" / "cpu.json", device=DEV, commit="abc1234", command="test")
        monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(tmp_path / "fresh"))
        monkeypatch.setenv("INDUCTOR_ATTN_PRIORS", str(path))
        forget_decisions()
        for backend in backends:
            if isinstance(backend, _CostlyImport):
                backend.enumerated = 0
        yield


@contextlib.contextmanager
def _new_machine_with_a_shipped_table(monkeypatch, tmp_path, b_times: dict, costly_times: dict):
    """Backends a, costly (whose enumeration would import a large library) and b, on a new machine with the
    table of their autotune (above). Yields (b, costly)."""
    b, costly = FakeBackend("b", b_times), _CostlyImport("costly", costly_times)
    with _new_machine_with_the_table_of(monkeypatch, tmp_path, FakeBackend("a", {"default": (1.0, 0.01)}), costly, b):
        yield b, costly


def test_a_shipped_shortlist_of_other_backends_never_enumerates_a_backend_with_a_costly_import(monkeypatch, tmp_path):
    with (_new_machine_with_a_shipped_table(monkeypatch, tmp_path, {"x=1": (0.5, 1e-4), "x=2": (0.505, 1e-4)},
                                            {"default": (0.9, 0.01)}) as (b, costly),
          inductor_attn.tuning_mode("autotune")):
        assert decide(small_call(), DEV, "forward") == "b:x=1"
        assert costly.enumerated == 0
        status = {c["name"]: c for c in get_store().writable.rows()[0]["record"]["candidates"]}
        assert [n for n, c in status.items() if c["status"] == "passed"] == ["b:x=1", "b:x=2"]
        assert status["costly:-"]["reason"].startswith("not enumerated: the shipped decision names none of its")


def test_a_shipped_shortlist_with_a_costly_backends_config_enumerates_it(monkeypatch, tmp_path):
    with (_new_machine_with_a_shipped_table(monkeypatch, tmp_path, {"x=1": (0.505, 1e-4)},
                                            {"default": (0.5, 1e-4), "t=2": (0.51, 1e-4)}) as (b, costly),
          inductor_attn.tuning_mode("autotune")):
        assert decide(small_call(), DEV, "forward") == "costly:default"
        assert costly.enumerated > 0


@pytest.mark.parametrize("mode", ["autotune", "cache-only"])
def test_a_shipped_decision_naming_one_costly_backend_enumerates_that_one_only(monkeypatch, tmp_path, mode):
    # FA3's prebuilt kernel won; FA4 (a JIT library as costly to import) is not in the shortlist: not imported
    prebuilt, jit = _CostlyImport("prebuilt", {"default": (0.5, 1e-4)}), _CostlyImport("jit", {"default": (0.8, 1e-4)})
    with _new_machine_with_the_table_of(monkeypatch, tmp_path, FakeBackend("a", {"default": (1.0, 0.01)}), prebuilt,
                                        jit):
        with inductor_attn.tuning_mode(mode):
            assert decide(small_call(), DEV, "forward") == "prebuilt:default"
        assert prebuilt.enumerated > 0 and jit.enumerated == 0


def test_when_a_shipped_shortlist_of_other_backends_cannot_run_the_whole_search_enumerates_every_backend(
        monkeypatch, tmp_path):
    with (_new_machine_with_a_shipped_table(monkeypatch, tmp_path, {"x=1": (0.5, 0.01)},
                                            {"default": (0.9, 0.01)}) as (b, costly),
          inductor_attn.tuning_mode("autotune")):
        b.prune_reasons["x=1"] = "not on this device"
        assert decide(small_call(), DEV, "forward") == "costly:default"


def test_off_mode_enumerates_a_backend_with_a_costly_import_only_when_it_comes_before_the_default(monkeypatch):
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    costly = _CostlyImport("costly", {"default": (0.5, 0.01)})
    with inductor_attn.tuning_mode("off"):
        with only_backends(a, costly):
            assert decide(small_call(), DEV, "forward") == "a:default"
            assert costly.enumerated == 0
        forget_decisions()
        with only_backends(costly, a):
            assert decide(small_call(), DEV, "forward") == "costly:default"
            assert costly.enumerated > 0


def test_background_mode_first_runs_the_best_shipped_candidate_of_a_backend_without_a_costly_import(
        monkeypatch, tmp_path):
    monkeypatch.setenv("INDUCTOR_ATTN_SEARCH", "exhaustive")  # the table times b:x=2, which is not b's default
    queued = []
    monkeypatch.setattr("inductor_attn.tuning.background.schedule", lambda *args: queued.append(args[2]) or True)
    with _new_machine_with_a_shipped_table(monkeypatch, tmp_path, {"x=1": (0.7, 1e-4), "x=2": (0.6, 1e-4)},
                                           {"default": (0.5, 1e-4)}) as (b, costly):
        with inductor_attn.tuning_mode("background"):
            assert decide(small_call(), DEV, "forward") == "b:x=2"  # not the shipped winner, costly:default
        assert costly.enumerated == 0 and len(queued) == 1  # the worker tunes the bucket, FA4 included


class _Prebuilt(_CostlyImport):
    """A costly import whose kernels come compiled (FA3's wheel): a first call waits for the import only."""

    library = Library(costly_import=True, prebuilt=True)


def test_background_mode_runs_a_shipped_winner_of_a_prebuilt_backend_at_once(monkeypatch, tmp_path):
    queued = []
    monkeypatch.setattr("inductor_attn.tuning.background.schedule", lambda *args: queued.append(args[2]) or True)
    prebuilt, jit = _Prebuilt("prebuilt", {"default": (0.5, 1e-4)}), _CostlyImport("jit", {"default": (0.8, 1e-4)})
    with _new_machine_with_the_table_of(monkeypatch, tmp_path, FakeBackend("a", {"default": (1.0, 0.01)}), prebuilt,
                                        jit):
        with inductor_attn.tuning_mode("background"):
            assert decide(small_call(), DEV, "forward") == "prebuilt:default"
        assert jit.enumerated == 0 and len(queued) == 1


def test_cache_explain_says_what_compiled_code_runs_under_cuda_graphs_and_by_how_host_bound_the_graph_is(
        monkeypatch):
    """A decision made before every candidate's host time was measured (a record with the one compiled-code
    choice of the old rule) is read by today's rule; explain gives the winner under CUDA graphs and, with plain
    launches, the winner in device-bound graphs and the cheaper launch in host-bound ones."""
    a = FakeBackend("a", {"default": (60.0, 0.01)}, traceable=True, host_s=0.001)
    b = FakeBackend("b", {"default": (50.0, 0.01)}, host_s=0.025)  # 50 ms kernel, 25 ms launch
    timed_with_fakes(monkeypatch, a, b)
    with only_backends(a, b), inductor_attn.tuning_mode("autotune"):
        assert decide_with_record(small_call(), DEV, "forward")[0] == "b:default"
        (row,) = get_store().rows()
        row["record"].update(compiled_winner="a:default", compiled_why="the rule before session 33")
        get_store().put(row)
        forget_decisions()
        choice, record = decide_with_record(small_call(), DEV, "forward")
    assert choice == "b:default" and record["compiled_winner"] == "a:default"
    lines = [x.strip() for x in cache.explain(row["key"][:16]).splitlines()]
    start = next(i for i, x in enumerate(lines) if x.startswith("compiled code:"))
    assert lines[start] == "compiled code:    under CUDA graphs: b:default (device time only)"
    assert re.fullmatch(r"plain launches, H - D < -?[\d.]+ ms: b:default", lines[start + 1])
    assert re.fullmatch(r"plain launches, H - D >= -?[\d.]+ ms: a:default", lines[start + 2])


# --- decisions not tuned here are gated before they run -------------------------------------------------
@contextlib.contextmanager
def _a_wrong_winner_not_tuned_here(monkeypatch, tmp_path, layer: str):
    """A decision whose winner b:default ran right where it was tuned and computes wrong output here, reached
    through ``layer``: the writable store (another process tuned it), an import, or a shipped table. Yields
    (a, b); the process has forgotten everything (a new process)."""
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"default": (0.5, 0.01)})
    timed_with_fakes(monkeypatch, a, b)
    with only_backends(a, b):
        with inductor_attn.tuning_mode("autotune"):
            assert decide(small_call(), DEV, "forward") == "b:default"
        if layer == "imported":
            cache.export(tmp_path / "decisions.json")
            monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(tmp_path / "other machine"))
            cache.import_decisions(tmp_path / "decisions.json")
        elif layer == "shipped":
            path, _ = cache.export_priors(tmp_path / "table" / "cpu.json", device=DEV, commit="abc1234", command="t")
            monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(tmp_path / "other machine"))
            monkeypatch.setenv("INDUCTOR_ATTN_PRIORS", str(path))
        forget_decisions()
        b.wrong = {"default"}
        yield a, b


@pytest.mark.parametrize("layer, mode", [("stored", "autotune"), ("stored", "cache-only"), ("stored", "background"),
                                         ("imported", "autotune"), ("imported", "cache-only"),
                                         ("shipped", "cache-only"), ("shipped", "background")])
def test_a_winner_not_tuned_here_that_computes_wrong_output_never_runs(monkeypatch, tmp_path, layer, mode):
    monkeypatch.setattr("inductor_attn.tuning.background.schedule", lambda *args: True)  # no worker process
    with _a_wrong_winner_not_tuned_here(monkeypatch, tmp_path, layer) as (a, b):
        with inductor_attn.tuning_mode(mode):
            call = small_call()
            out = inductor_attn.attention(call.q, call.k, call.v)
            assert decide(small_call(), DEV, "forward") == "a:default"
    torch.testing.assert_close(out, inductor_attn.run_candidate("reference:default", call.q, call.k, call.v))


def test_a_background_decision_that_lands_from_elsewhere_is_gated_before_it_runs(monkeypatch, tmp_path):
    """Background mode answers at once, then takes the stored row once a tune lands; a row this process did not
    tune (another process's, or a worker's) is gated first, as any decision not tuned here."""
    import inductor_attn.tuning.decisions as decisions

    monkeypatch.setattr("inductor_attn.tuning.background.schedule", lambda *args: True)  # the row lands below
    monkeypatch.setattr(decisions, "RECHECK_S", 0.0)
    with _a_wrong_winner_not_tuned_here(monkeypatch, tmp_path, "stored") as (a, b):
        store = get_store()
        (row,) = store.rows()
        store.delete([row["key"]])
        with inductor_attn.tuning_mode("background"):
            call = small_call()
            decide(call, DEV, "forward")  # provisional: nothing stored yet
            store.put(row)
            assert decide(call, DEV, "forward") == "a:default"
            out = inductor_attn.attention(call.q, call.k, call.v)
    torch.testing.assert_close(out, inductor_attn.run_candidate("reference:default", call.q, call.k, call.v))


def test_a_row_another_process_stored_over_one_tuned_here_is_gated(monkeypatch):
    """This process tuned a bucket (winner b); another process then stored its own row under the same key (winner
    c, wrong here). When b gives way at a launch, the bucket is decided again from that row: c is gated, not
    taken for the row this process tuned."""
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"default": (0.5, 0.01)})
    c = FakeBackend("c", {"default": (0.8, 0.01)})
    timed_with_fakes(monkeypatch, a, b, c)
    call = small_call()
    with only_backends(a, b, c), inductor_attn.tuning_mode("autotune"):
        assert decide(call, DEV, "forward") == "b:default"
        store = get_store()
        (row,) = store.rows()
        store.put({**row, "winner": "c:default", "record": {**row["record"], "winner": "c:default"},
                   "created": row["created"] + 1})
        c.wrong, b.fail = {"default"}, {"default"}
        out = inductor_attn.attention(call.q, call.k, call.v)
        assert decide(call, DEV, "forward") == "a:default"
    torch.testing.assert_close(out, inductor_attn.run_candidate("reference:default", call.q, call.k, call.v))


def test_a_winner_not_tuned_here_is_gated_once_per_process_and_bucket(monkeypatch, tmp_path):
    gated = []
    import inductor_attn.tuning.decisions as decisions

    real = decisions.gate_once
    monkeypatch.setattr(decisions, "gate_once", lambda *args, **kw: gated.append(args[1]) or real(*args, **kw))
    with _a_wrong_winner_not_tuned_here(monkeypatch, tmp_path, "stored") as (a, b):
        b.wrong = set()  # right here too: it runs, after one check
        for mode in ("autotune", "autotune", "cache-only", "autotune"):  # a mode switch learns nothing new
            with inductor_attn.tuning_mode(mode):
                assert decide(small_call(), DEV, "forward") == "b:default"
    assert gated == ["b:default"]


def test_compiled_code_never_runs_a_wrong_candidate_of_a_record_not_tuned_here(monkeypatch, tmp_path):
    """A record can steer compiled code to a candidate other than its winner (the cheaper launch of a host-bound
    graph): a record from elsewhere that marks a wrong one "passed" is gated before compiled code takes it."""
    from inductor_attn.lowering import emit
    from inductor_attn.tuning.step_cost import GraphWork

    a = FakeBackend("a", {"default": (0.6, 0.01)}, traceable=True, host_s=0.001)
    b = FakeBackend("b", {"default": (0.5, 0.01)}, host_s=0.02)  # the winner, behind a dear launch
    timed_with_fakes(monkeypatch, a, b)
    monkeypatch.setattr(emit, "graph_work", lambda graph, calls, dev, training: GraphWork(host_ms=10.0, device_ms=0.0))
    call = small_call()

    def fn(q, k, v):
        return inductor_attn.attention(q, k, v)

    with only_backends(a, b), inductor_attn.tuning_mode("autotune"):
        torch._dynamo.reset()
        torch.compile(fn, fullgraph=True)(call.q, call.k, call.v)
        assert "attention/forward -> a:default (launched by compiled code, per graph)" in inductor_attn.stats()
        forget_decisions()  # a new process, where a computes wrong output
        a.traceable, a.wrong = False, {"default"}
        torch._dynamo.reset()
        inductor_attn.reset_stats()
        with torch._inductor.config.patch(fx_graph_cache=False):
            out = torch.compile(fn, fullgraph=True)(call.q, call.k, call.v)
        assert inductor_attn.stats() == {"attention/forward -> b:default": 1}
    torch._dynamo.reset()
    torch.testing.assert_close(out, inductor_attn.run_candidate("reference:default", call.q, call.k, call.v))


def test_a_choice_remembered_before_the_registry_changed_is_made_again():
    """A bucket decided inside only_backends(...), or while a backend was registered, is decided again from the
    registry as it is now, not run from the memo with a backend that is gone."""
    from inductor_attn.backends import REFERENCE, register_backend, unregister_backend

    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    fast = FakeBackend("fast", {"a=1": (0.1, 0.0)})
    with only_backends(fast, REFERENCE):
        inductor_attn.attention(q, k, v)
    inductor_attn.attention(q, k, v)  # raised "unknown backend 'fast'" before
    mine = FakeBackend("mine", {"a=1": (0.1, 0.0)})
    register_backend(mine, first=True)
    try:
        inductor_attn.attention(q, k, v)
    finally:
        unregister_backend("mine")
    inductor_attn.reset_stats()
    inductor_attn.attention(q, k, v)
    assert not any("mine" in key or "fast" in key for key in inductor_attn.stats())


def _out_of_memory_in(backend: FakeBackend, cfg: str, monkeypatch) -> None:
    """``backend``'s config ``cfg`` cannot get device memory (a server's cache holds it); the others run."""
    real = backend._forward

    def forward(config, call):
        if config == cfg:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.93 GiB (simulated)")
        return real(config, call)

    monkeypatch.setattr(backend, "_forward", forward)


def test_a_tune_that_runs_out_of_device_memory_stores_nothing_and_runs_its_winner_unmeasured(fakes, monkeypatch,
                                                                                             caplog):
    """A server's cache may hold most of the device's memory (transformers' continuous batching sizes its cache
    to it): a candidate that cannot get memory says nothing about its kernel, and a decision stored from that
    tune would hold in later processes that have the room."""
    a, b = fakes
    _out_of_memory_in(b, "x=1", monkeypatch)
    with inductor_attn.tuning_mode("autotune"), caplog.at_level("WARNING"):
        assert decide(small_call(), DEV, "forward") == "b:x=2"  # the tune's winner of those that ran
        runs = a.calls + b.calls
        assert decide(small_call(), DEV, "forward") == "b:x=2"  # remembered in this process: no second tune
    assert a.calls + b.calls == runs
    assert get_store().rows() == []
    assert "ran out of device memory in b:x=1" in caplog.text and "nothing stored" in caplog.text


def test_code_compiled_with_an_unmeasured_choice_is_not_replayed_by_a_later_process(fakes, monkeypatch):
    """Inductor's cache key holds the store's revision under autotune, which a new decision leaves alone: a tune
    that ran out of memory and stored nothing must change it, or a later process with room would replay the
    unmeasured choice from that cache and never tune the bucket."""
    from inductor_attn.lowering.graph_pass import DecisionPass

    a, b = fakes
    _out_of_memory_in(b, "x=1", monkeypatch)
    with inductor_attn.tuning_mode("autotune"):
        before = DecisionPass().uuid()
        assert decide(small_call(), DEV, "forward") == "b:x=2"
        assert DecisionPass().uuid() != before and get_store().rows() == []


def test_following_the_store_keeps_choices_it_still_backs_and_forgets_the_others(monkeypatch):
    """A compile keys its graph on the store's token (lowering/graph_pass.py): a choice whose row the store still
    holds as it was stays (a training compile's backward pairs with the forward the same compile just tuned); one
    whose row another process replaced is read again."""
    from inductor_attn.tuning import decisions

    a, b = FakeBackend("a", {"default": (1.0, 0.01)}), FakeBackend("b", {"default": (0.5, 0.01)})
    timed_with_fakes(monkeypatch, a, b)
    with only_backends(a, b), inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), DEV, "forward") == "b:default"
        decisions.follow_store(lambda: "moved")
        assert [choice for _, choice, _ in decisions.decision_entries()] == ["b:default"]  # kept, not re-read
        (row,) = get_store().rows()
        get_store().put({**row, "winner": "a:default", "record": {**row["record"], "winner": "a:default"},
                         "created": row["created"] + 1})  # another process's tune lands
        decisions.follow_store(lambda: "moved again")
        assert decide(small_call(), DEV, "forward") == "a:default"


def test_a_first_call_inside_a_cuda_graph_capture_is_not_remembered(fakes, monkeypatch):
    """Nothing can be measured inside a capture, so its call runs the default; the bucket is still tuned at its
    first call outside one (it used to keep the default for the process's life)."""
    from inductor_attn.tuning import decisions

    capturing = [True]
    monkeypatch.setattr(decisions, "_capturing", lambda call: capturing[0])
    with inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), DEV, "forward") == "a:default"
        capturing[0] = False
        assert decide(small_call(), DEV, "forward") == "b:x=1"


def test_background_mode_queues_no_tune_from_inside_a_cuda_graph_capture(monkeypatch):
    """Queueing a tune saves the call's tensors for the worker: a copy to the host, which would spoil the user's
    capture. Inside one the shipped record's fastest candidate enumerated here runs, and nothing is queued."""
    from inductor_attn.backends import Candidate, Config
    from inductor_attn.backends.registry import LOOKUP_ONLY
    from inductor_attn.tuning import decisions

    queued = []
    monkeypatch.setattr(decisions, "_schedule_tune", lambda *args: queued.append(args))
    monkeypatch.setattr(decisions, "get_backend", lambda name: type("B", (), {"library": Library()})())
    light = [Candidate("jit", None, pruned=LOOKUP_ONLY), Candidate("a", Config())]
    record = {"candidates": [{"name": "jit:-", "status": "passed", "median_ms": 1.0},
                             {"name": "a:default", "status": "passed", "median_ms": 1.5}]}
    prior = {"winner": "jit:-", "record": record}
    for capturing, want in ((True, ("a:default", None, None)), (False, ("a:default", None, "k"))):
        monkeypatch.setattr(decisions, "_capturing", lambda call, c=capturing: c)
        assert decisions._background_without_costly_imports(small_call(), light, {"key": "k"}, prior,
                                                            "forward") == want
    assert len(queued) == 1
