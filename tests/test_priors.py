"""Shipped decision tables (store/priors.py): written by `cache export-priors`, read as the last store layer,
used by decide() per mode, and named by `cache explain`."""

import json
import os
import socket
import warnings

import pytest
import torch
from fakes import FakeBackend, small_call, timed_with_fakes
from test_store import decision_row

import inductor_attn
from inductor_attn import cache
from inductor_attn.backends import only_backends
from inductor_attn.cli import main
from inductor_attn.device import DeviceInfo
from inductor_attn.store import keys
from inductor_attn.store.db import get_store
from inductor_attn.store.priors import PACKAGE_DIR, PriorTable, device_slug, shortlist, table_paths
from inductor_attn.store.transfer import read_export, write_export
from inductor_attn.tuning.decisions import decide, forget_decisions

DEV = DeviceInfo("cpu", (0, 0), 2)
# x=1..4 within the shortlist margin (3%) of each other, x=3 and x=4 past the shortlist length, x=5 past the margin
TIMES = {"x=1": (0.5, 1e-4), "x=2": (0.503, 1e-4), "x=3": (0.506, 1e-4), "x=4": (0.509, 1e-4), "x=5": (0.6, 1e-4)}


@pytest.fixture
def fakes(monkeypatch):
    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", dict(TIMES))
    timed_with_fakes(monkeypatch, a, b)
    monkeypatch.setenv("INDUCTOR_ATTN_SEARCH", "exhaustive")
    with only_backends(a, b):
        yield a, b


@pytest.fixture
def shipped(fakes, tmp_path, monkeypatch):
    """A table measured in one store, then a fresh store that reads it: a new machine with the package."""
    with inductor_attn.tuning_mode("autotune"):
        decide(small_call(), DEV, "forward")
    path, n = cache.export_priors(tmp_path / "table" / "cpu.json", device=DEV, commit="abc1234", command="test")
    assert n == 1
    monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(tmp_path / "fresh"))
    monkeypatch.setenv("INDUCTOR_ATTN_PRIORS", str(path))
    forget_decisions()
    a, b = fakes
    a.calls = b.calls = 0
    return path


def test_an_exported_table_holds_device_versions_commit_command_and_reads_as_an_export(shipped):
    data = json.loads(shipped.read_text())
    assert data["device"] == "cpu" and data["commit"] == "abc1234" and data["command"] == "test"
    assert data["versions"]["torch"] == torch.__version__ and data["created"].endswith("UTC")
    assert [row["winner"] for row in read_export(shipped)] == ["b:x=1"]
    decision_lines = [line for line in shipped.read_text().splitlines() if line.startswith('  {"key":')]
    assert len(decision_lines) == 1 and json.loads(decision_lines[0])["winner"] == "b:x=1"  # one line per decision


def test_a_shipped_decision_shortens_the_autotune_to_the_candidates_close_to_its_winner(shipped):
    with inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), DEV, "forward") == "b:x=1"
    row = get_store().writable.rows()[0]  # measured here, stored in this machine's store
    status = {c["name"]: (c["status"], c["reason"]) for c in row["record"]["candidates"]}
    assert [n for n, (s, _) in status.items() if s == "passed"] == ["b:x=1", "b:x=2"]
    for name in ("a:default", "b:x=3", "b:x=4", "b:x=5"):
        assert status[name][1].startswith(
            "not timed again: not within 3% of the winner of the shipped decision and compiling within 1.5x its "
            "time, at least 3 s (at most 2, and each other backend's fastest within 3% plus the record's noise; "
            "shipped: cpu.json"), name
    assert row["record"]["search"].startswith("the candidates within 3% of the winner of the shipped decision")


def test_another_backends_fastest_within_the_margin_plus_the_records_noise_is_timed_too(shipped):
    # two libraries swing apart between sessions by more than one library's configs do (FA3 against FA4, H200)
    data = json.loads(shipped.read_text())
    record = data["decisions"][0]["record"]
    for c in record["candidates"]:
        if c["name"] == "a:default":
            c["median_ms"] = 0.52  # 4% behind the winner: past the 3% margin, within 3% + the noise
    record["noise"] = 0.02
    shipped.write_text(json.dumps(data))
    with inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), DEV, "forward") == "b:x=1"
    status = {c["name"]: c["status"] for c in get_store().writable.rows()[0]["record"]["candidates"]}
    assert [n for n, s in status.items() if s == "passed"] == ["a:default", "b:x=1", "b:x=2"]


def test_a_backend_the_table_never_measured_has_its_first_candidate_timed_too(fakes, shipped, monkeypatch):
    # a backend installed or added after the table was made (FA3's wheel next to tables measured without it)
    a, b = fakes
    c = FakeBackend("c", {"default": (0.3, 1e-4), "y=2": (0.2, 1e-4)})
    timed_with_fakes(monkeypatch, a, b, c)
    with only_backends(a, b, c), inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), DEV, "forward") == "c:default"
        record = get_store().writable.rows()[0]["record"]
    status = {c["name"]: c["status"] for c in record["candidates"]}
    assert [n for n, s in status.items() if s == "passed"] == ["b:x=1", "b:x=2", "c:default"]
    assert record["search"].endswith("and the first candidate of each backend it never measured (c), timed here")


def test_a_backend_whose_library_the_table_lacked_counts_as_never_measured(fakes):
    """A table made where FA3's wheel was missing names FA3 only as pruned ("not importable"): where the wheel is
    installed, FA3 is one the table never measured. Read from the row's versions, not from the record's names."""
    from inductor_attn.backends.base import Library
    from inductor_attn.tuning.decisions import _unmeasured_backends

    a, b = fakes
    c = FakeBackend("c", {"default": (0.3, 1e-4)})
    c.library = Library(distributions=("pytest",))  # installed here
    record = {"candidates": [{"name": n} for n in ("a:default", "b:x=1", "c:-")]}
    sources = {"a": "1", "b": "2", "c": "3"}
    with only_backends(a, b, c):
        assert _unmeasured_backends({"versions": {"sources": sources, "pytest": "absent"}, "record": record}) == {"c"}
        assert _unmeasured_backends({"versions": {"sources": sources, "pytest": "8.0"}, "record": record}) == set()
        assert _unmeasured_backends({"versions": {"sources": {"a": "1"}}, "record": record}) == {"b", "c"}


def test_a_near_tie_whose_compile_took_much_longer_than_the_winners_is_left_out_of_the_shortlist(shipped):
    # a near-tie compiling 13 s next to a 3 s winner would set the cold tune's wait (worker compiles run side by side)
    data = json.loads(shipped.read_text())
    for c in data["decisions"][0]["record"]["candidates"]:
        c["compile_s"] = {"b:x=1": 3.0, "b:x=2": 13.0}.get(c["name"], 4.0)
    shipped.write_text(json.dumps(data))
    with inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), DEV, "forward") == "b:x=1"
    status = {c["name"]: c["status"] for c in get_store().writable.rows()[0]["record"]["candidates"]}
    assert [n for n, s in status.items() if s == "passed"] == ["b:x=1", "b:x=3"]


def test_a_shipped_winner_that_tied_a_faster_slow_compiling_candidate_is_timed_without_it(shipped):
    # FA3's prebuilt kernel won a tie by prior order against a JIT kernel 0.6% faster: a first compile need not
    # compile the JIT one again, since it must beat the winner by more than the tie margin to be chosen
    data = json.loads(shipped.read_text())
    row = data["decisions"][0]
    row["winner"] = row["record"]["winner"] = "b:x=2"
    for c in row["record"]["candidates"]:
        c["compile_s"] = {"b:x=1": 13.0, "b:x=2": 0.01}.get(c["name"], 1.0)
    shipped.write_text(json.dumps(data))
    with inductor_attn.tuning_mode("autotune"):
        decide(small_call(), DEV, "forward")
    status = {c["name"]: c["status"] for c in get_store().writable.rows()[0]["record"]["candidates"]}
    assert [n for n, s in status.items() if s == "passed"] == ["b:x=2", "b:x=3"]


def test_when_none_of_the_shortlist_runs_here_the_whole_search_runs(fakes, shipped):
    for cfg in ("x=1", "x=2", "x=3"):
        fakes[1].prune_reasons[cfg] = "not on this device"
    with inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), DEV, "forward") == "b:x=4"
    row = get_store().writable.rows()[0]
    assert not row["record"]["search"].startswith("the candidates within")


def test_cache_only_uses_the_shipped_decision_as_it_is(fakes, shipped):
    with inductor_attn.tuning_mode("cache-only"):
        assert decide(small_call(), DEV, "forward") == "b:x=1"
    # nothing measured or stored; its winner gated once here (a decision not tuned in this process)
    assert sum(f.calls for f in fakes) == 1 and get_store().writable.rows() == []


def test_a_shipped_decision_measured_with_other_versions_still_answers_for_its_bucket(shipped, monkeypatch):
    monkeypatch.setattr(keys, "library_versions", lambda requires: {"torch": "9.9.9"})
    with inductor_attn.tuning_mode("cache-only"):
        assert decide(small_call(), DEV, "forward") == "b:x=1"


def test_a_shipped_winner_that_cannot_run_here_is_not_used(fakes, shipped):
    fakes[1].prune_reasons["x=1"] = "not on this device"
    with inductor_attn.tuning_mode("cache-only"):
        assert decide(small_call(), DEV, "forward") == "a:default"


def test_a_decision_measured_here_wins_over_the_shipped_one(fakes, shipped):
    fakes[1].times["x=2"] = (0.1, 0.01)
    with inductor_attn.tuning_mode("autotune"):
        assert decide(small_call(), DEV, "forward") == "b:x=2"
    forget_decisions()
    with inductor_attn.tuning_mode("cache-only"):
        assert decide(small_call(), DEV, "forward") == "b:x=2"


def test_an_unreadable_table_warns_once_and_is_skipped(fakes, tmp_path, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": 1, "decisions": [{"key": "x"}]}')
    monkeypatch.setenv("INDUCTOR_ATTN_PRIORS", str(bad))
    with inductor_attn.tuning_mode("cache-only"), pytest.warns(RuntimeWarning, match="bad.json is unusable") as rec:
        assert decide(small_call(), DEV, "forward") == "a:default"
        forget_decisions()
        decide(small_call(), DEV, "forward")
    assert len(rec) == 1


def test_with_an_unreadable_table_every_cache_command_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": 1, "decisions": [{"key": "x"}]}')
    monkeypatch.setenv("INDUCTOR_ATTN_PRIORS", str(bad))
    write_export(tmp_path / "in.json", [decision_row(i) for i in range(3)])
    with pytest.warns(RuntimeWarning, match="bad.json is unusable"):
        assert main(["cache", "import", str(tmp_path / "in.json")]) == 0
        assert main(["cache", "export", str(tmp_path / "out.json")]) == 0
        assert main(["cache", "list"]) == 0
    out = capsys.readouterr()
    assert f"imported 3 decisions into {get_store().path}" in out.out and "exported 3 decisions" in out.out
    assert "3 decisions in" in out.out and out.err == ""
    assert len(read_export(tmp_path / "out.json")) == 3
    assert main(["cache", "doctor"]) == 1  # what doctor is for: it names the table
    assert f"{bad} (shipped, read-only" in capsys.readouterr().out


def test_the_package_reads_every_table_in_its_priors_directory_unless_turned_off(monkeypatch):
    monkeypatch.delenv("INDUCTOR_ATTN_PRIORS", raising=False)
    assert table_paths() == sorted(PACKAGE_DIR.glob("*.json"))
    monkeypatch.setenv("INDUCTOR_ATTN_PRIORS", "off")
    assert table_paths() == []


def test_a_fifo_among_the_tables_is_skipped_with_a_warning_instead_of_blocking(shipped, monkeypatch):
    fifo = shipped.parent / "waiting.json"
    os.mkfifo(fifo)  # reading it would block until something writes to it
    monkeypatch.setenv("INDUCTOR_ATTN_PRIORS", str(shipped.parent))
    with pytest.warns(RuntimeWarning, match=f"{fifo} is not a regular file; skipped"):
        assert table_paths() == [shipped]


def test_a_priors_path_that_does_not_exist_warns_once_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("INDUCTOR_ATTN_PRIORS", str(tmp_path / "nowhere"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        assert table_paths() == [] and table_paths() == []
    assert [str(w.message) for w in record] == [
        f"inductor_attn: INDUCTOR_ATTN_PRIORS names {tmp_path / 'nowhere'}, which does not exist: no shipped "
        "decision tables are read"]


def test_every_table_the_package_ships_reads_whole_and_says_what_measured_it():
    """A shipped table is measured, never made up: it names its GPU, versions, commit and command, and every
    decision in it is for that GPU and has a timed winner."""
    for path in sorted(PACKAGE_DIR.glob("*.json")):
        table = PriorTable(path)
        assert table.error is None, path
        meta = json.loads(path.read_text())
        assert meta["command"].startswith("python -m inductor_attn cache export-priors") and meta["commit"]
        assert path.stem == device_slug(meta["device"]) and meta["versions"]["torch"]
        for row in table.rows():
            assert row["device"] == meta["device_key"] and row["winner"] in shortlist(row, 100), row["key"]


def test_shipped_decisions_are_never_called_stale_and_prune_never_talks_of_them(monkeypatch, capsys):
    """The package's tables were measured with other versions than this machine's (a CUDA torch, other
    kernel sources): they still answer for their buckets, so no command calls them stale."""
    monkeypatch.delenv("INDUCTOR_ATTN_PRIORS")
    assert len(get_store().rows()) == 20
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "20 decisions in" in out and "stale" not in out
    main(["cache", "doctor"])
    out = capsys.readouterr().out
    assert out.count("(shipped, read-only") == 2 and "stale" not in out and "prune" not in out
    assert main(["cache", "prune"]) == 0
    assert capsys.readouterr().out == f"deleted 0 stale decisions from {get_store().path}\n"


def test_cache_explain_says_where_each_decision_came_from(fakes, shipped):
    table_row = get_store().rows()[0]
    assert cache.origin(table_row) == f"shipped: cpu.json (cpu, torch {torch.__version__}, commit abc1234)"
    with inductor_attn.tuning_mode("autotune"):
        decide(small_call(), DEV, "forward")
    here = get_store().writable.rows()[0]
    assert cache.origin(here).startswith("tuned here (")
    assert "came from:        tuned here" in cache.explain(here["key"][:12])
    assert "search:           the candidates within 3% of the winner of the shipped decision" in cache.explain(
        here["key"][:12])
    elsewhere = {**here, "record": {**here["record"], "host": "node-7"}}
    get_store().put(elsewhere)
    assert cache.origin(elsewhere).startswith("imported or shared: tuned on host node-7 (")
    assert socket.gethostname() != "node-7"


def test_export_priors_on_a_cpu_writes_nothing_into_the_package(capsys):
    from inductor_attn.store.priors import PACKAGE_DIR

    before = sorted(PACKAGE_DIR.iterdir())
    assert main(["cache", "export-priors"]) == 2
    assert capsys.readouterr().err == ("error: export-priors writes into the package's shipped tables only on a GPU; "
                                       "on a CPU pass --out FILE\n")
    assert sorted(PACKAGE_DIR.iterdir()) == before


def test_export_priors_without_decisions_for_this_device_says_how_to_tune_them(tmp_path, capsys):
    assert main(["cache", "export-priors", "--out", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err
    assert "no current decisions for cpu|sm_0" in err and "`cache export-priors --tune all`" in err


def test_export_priors_tune_measures_the_bench_workloads_and_writes_the_table(fakes, tmp_path, monkeypatch, capsys):
    from inductor_attn.bench import suites

    tiny = suites.smoke_size(suites.SUITES["dense"][0])
    monkeypatch.setattr(suites, "select", lambda name, **kwargs: [tiny])
    monkeypatch.setattr("inductor_attn.device._cpu_info", lambda: DEV)
    out = tmp_path / "t.json"
    assert main(["cache", "export-priors", "--tune", "dense", "--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["command"] == "python -m inductor_attn cache export-priors --tune dense --smoke"
    assert [row["winner"] for row in data["decisions"]] == ["b:x=1"]
    assert data["decisions"][0]["record"]["search"] == "exhaustive"


def test_an_exported_table_keeps_each_candidates_statistics_but_not_its_samples_or_host(shipped):
    (row,) = read_export(shipped)
    winner = next(c for c in row["record"]["candidates"] if c["name"] == "b:x=1")
    assert "samples" not in winner and winner["median_ms"] == pytest.approx(0.5, abs=0.05)
    assert "note" not in winner  # at CandidateResult's default: readers take it from there
    assert row["record"]["host"] == ""


def test_a_shipped_row_keeps_four_digits_of_what_was_measured_and_every_digit_of_when():
    record = {"tuned_at": 1795960886.123, "noise": 0.0302488, "seconds": {"timing": 1.23456},
              "candidates": [{"name": "a:x", "status": "passed", "median_ms": 0.0302488, "note": "", "samples": [1.0]}]}
    shipped = cache._shippable({"key": "k", "record": record})["record"]
    assert shipped["tuned_at"] == 1795960886.123 and shipped["noise"] == 0.03025
    assert shipped["seconds"] == {"timing": 1.235} and shipped["host"] == ""
    assert shipped["candidates"] == [{"name": "a:x", "status": "passed", "median_ms": 0.03025}]


def test_export_priors_names_a_bad_shard_and_what_it_accepts(tmp_path, capsys):
    assert main(["cache", "export-priors", "--tune", "dense", "--shard", "3/2", "--out", str(tmp_path / "t.json")]) == 2
    assert "error: --shard K/N needs 1 <= K <= N, got '3/2'" in capsys.readouterr().err


def test_an_export_leaves_shipped_decisions_out_and_one_imported_from_an_older_export_is_stale(shipped, tmp_path,
                                                                                              capsys):
    """A shipped table's row answers only from its table: in the writable store (an export of an older
    inductor_attn, imported) nothing looks it up, so list calls it stale and prune deletes it."""
    (table_row,) = get_store().rows()
    assert cache.export(tmp_path / "out.json") == 0 and read_export(tmp_path / "out.json") == []
    write_export(tmp_path / "old.json", [table_row])  # what an older export held: the row with its origin
    assert cache.import_decisions(tmp_path / "old.json") == 1
    (listed,) = cache.list_decisions()
    assert listed["stale"] == "a shipped table's decision outside its table"
    main(["cache", "doctor"])
    assert "1 stale (never looked up again; `cache list` says why): `cache prune` deletes them" in \
        capsys.readouterr().out
    assert cache.prune() == (1, 0) and [r["key"] for r in get_store().rows()] == [table_row["key"]]


def test_doctor_counts_rows_of_one_set_of_versions_as_one_whatever_order_a_file_keeps_them_in(capsys):
    rows = []
    for i, versions in enumerate(({"torch": "2.13", "triton": "3.6"}, {"triton": "3.6", "torch": "2.13"})):
        row = {**decision_row(i), "versions": {**versions, "sources": {}}}
        rows.append({**row, "key": keys.key_of({c: row[c] for c in ("op", "problem", "device", "versions")})})
    get_store().put_many(rows)
    main(["cache", "doctor"])
    assert "    2  torch 2.13, triton 3.6\n" in capsys.readouterr().out


def test_a_shipped_decision_is_no_measurement_when_ranks_agree(fakes, shipped, monkeypatch):
    """sync_decisions prefers a rank whose decision a tune backs, and writes its row to the other ranks' stores:
    a shipped table's guess is neither (its row belongs in its table)."""
    from inductor_attn.tuning.decisions import decision_entries

    monkeypatch.setattr("inductor_attn.tuning.background.schedule", lambda *args: True)  # no worker process
    with inductor_attn.tuning_mode("background"):
        decide(small_call(), DEV, "forward")
        ((_, choice, row),) = decision_entries()
    assert choice == "b:x=1" and row is None


def test_explain_of_a_decision_made_at_run_time_says_the_winner_runs_in_compiled_code(monkeypatch, capsys):
    """Varlen and block-sparse calls are decided per call, and the host/device rule is applied only at compile
    time: their explain printed plain-launch alternatives that compiled code never runs."""
    monkeypatch.delenv("INDUCTOR_ATTN_PRIORS")
    row = next(r for r in get_store().rows() if r["op"].startswith("varlen"))
    assert main(["cache", "explain", row["key"][:12]]) == 0
    assert (f"  compiled code:    {row['winner']}  (varlen calls are decided at run time: the winner runs)"
            in capsys.readouterr().out)
