"""The SQLite decision store: round trips, concurrency, and damage that must never crash or lose rows."""

import doctest
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest

from inductor_attn.problem import Problem
from inductor_attn.store import keys, schema, wal
from inductor_attn.store.db import DecisionStore, get_store, path_access
from inductor_attn.store.keys import key_of
from inductor_attn.store.schema import StoreError


def decision_row(i: int, winner: str = "b:x=1") -> dict:
    """A row as the tuner writes it, for a problem of its own per ``i`` (batch i + 1)."""
    problem = Problem("attention", "float32", "cpu", i + 1, 2, 2, 32, 32, 16, 16).key()
    fields = {"op": "attention/forward", "problem": problem, "device": "cpu|sm_0|2sm",
              "versions": {"torch": "2.13", "sources": {"a": "1", "b": "2"}}}
    record = {"problem": problem, "direction": "forward", "winner": winner, "default": "a:default",
              "why": "b:x=1 is 2.00x faster", "timer": "fake", "tuned_at": 1.0,
              "candidates": [{"name": "a:default", "status": "passed", "median_ms": 1.0, "speedup": 1.0,
                              "samples": [1.0, 1.01]},
                             {"name": "b:x=1", "status": "passed", "median_ms": 0.5, "speedup": 2.0}]}
    return {"key": key_of(fields), **fields, "winner": winner, "record": record, "created": 1700000000.0 + i}


def _key(i: int) -> str:
    return decision_row(i)["key"]



def test_put_get_and_replace_round_trip(tmp_path):
    store = DecisionStore(tmp_path / "d.sqlite")
    store.put(decision_row(1))
    assert store.get(_key(1))["winner"] == "b:x=1"
    store.put(decision_row(1, winner="a:default"))
    assert store.get(_key(1))["winner"] == "a:default"
    assert store.get("missing") is None
    assert [r["key"] for r in store.find(_key(1)[:6])] == [_key(1)]


def test_every_write_and_clear_changes_the_generation(tmp_path):
    store = DecisionStore(tmp_path / "d.sqlite")
    first = store.generation()
    assert first and store.generation() == first
    store.put(decision_row(1))
    second = store.generation()
    assert second != first
    assert store.clear() == 1 and store.generation() not in (first, second)


def test_the_revision_changes_only_where_an_answer_changes(tmp_path):
    store = DecisionStore(tmp_path / "d.sqlite")
    first = store.revision()
    store.put(decision_row(1))
    store.put(decision_row(1))  # the same winner again
    assert store.revision() == first  # a new decision changes no answer the store gave
    store.put(decision_row(1, winner="a:default"))
    second = store.revision()
    assert second != first
    store.put(decision_row(2))
    assert store.delete(["no such key"]) == 0 and store.revision() == second
    assert store.delete([_key(2)]) == 1 and store.revision() != second
    third = store.revision()
    assert store.clear() == 1 and store.revision() != third


def test_a_row_that_overrides_a_read_only_store_changes_the_revision(tmp_path):
    from inductor_attn.store.layers import LayeredStore

    below = DecisionStore(tmp_path / "below.sqlite")
    below.put(decision_row(1))
    layered = LayeredStore(DecisionStore(tmp_path / "top.sqlite"), [DecisionStore(below.path, access="read")])
    first = layered.revision()
    layered.put(decision_row(2))
    layered.put(decision_row(1))  # what the read-only store answers already
    assert layered.revision() == first
    layered.put(decision_row(1, winner="a:default"))
    assert layered.revision() != first


def test_two_fresh_stores_have_different_generations(tmp_path):
    assert DecisionStore(tmp_path / "a.sqlite").generation() != DecisionStore(tmp_path / "b.sqlite").generation()


def test_json_export_import_round_trip(tmp_path):
    src = DecisionStore(tmp_path / "src.sqlite")
    for i in range(3):
        src.put(decision_row(i))
    assert src.export_json(tmp_path / "d.json") == 3
    dst = DecisionStore(tmp_path / "dst.sqlite")
    assert dst.import_json(tmp_path / "d.json") == 3
    strip = lambda rows: [{k: v for k, v in r.items() if k != "created"} for r in rows]  # noqa: E731
    assert strip(dst.rows()) == strip(src.rows())


def test_import_rejects_a_file_that_is_not_an_export(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"schema": 1, "decisions": [{"key": "k"}]}))
    with pytest.raises(ValueError, match="lacks"):
        DecisionStore(tmp_path / "d.sqlite").import_json(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("[]")
    with pytest.raises(ValueError, match="not an inductor_attn decision export"):
        DecisionStore(tmp_path / "d.sqlite").import_json(tmp_path / "y.json")


def test_truncated_file_warns_once_and_keeps_the_file(tmp_path):
    path = tmp_path / "d.sqlite"
    store = DecisionStore(path)
    for i in range(60):
        store.put(decision_row(i))
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    damaged = DecisionStore(path)
    with pytest.warns(RuntimeWarning, match="unusable") as record:
        for i in range(5):
            damaged.get(_key(i))
            damaged.put(decision_row(1000 + i))
    assert len(record) == 1 and damaged.broken
    assert path.stat().st_size == len(data) // 3  # never rewritten or deleted


def test_locked_store_is_skipped_with_a_warning_not_a_hang(tmp_path):
    path = tmp_path / "d.sqlite"
    DecisionStore(path).put(decision_row(1))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        store = DecisionStore(path, timeout_s=0.2)
        with pytest.warns(RuntimeWarning, match="locked"):
            store.put(decision_row(2))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert DecisionStore(path).get(_key(1)) is not None


def test_a_fresh_store_that_another_process_is_setting_up_is_waited_for_not_disabled(tmp_path):
    """While another connection writes a fresh file in its first journal mode, SQLite refuses the switch to
    WAL at once ("database is locked", its busy handler is not called); a process that gave up there would
    run without a store (no decisions saved, no claims) for its whole run."""
    path = tmp_path / "d.sqlite"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(0.2, lambda: holder.execute("COMMIT"))
    release.start()
    try:
        store = DecisionStore(path, timeout_s=10)
        store.put(decision_row(1))
    finally:
        release.join()
        holder.close()
    assert store.broken is None and store.get(_key(1)) is not None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_many_processes_opening_one_fresh_store_at_once_all_get_a_working_store(tmp_path):
    """Ranks of a node open one fresh store together. ``INDUCTOR_ATTN_TEST_PROCESSES=480`` is the issue's count
    (480 of 480 worked in each of three runs on the 2-core CPU machine, 16-33 s each); 96 keep CI short."""
    n = int(os.environ.get("INDUCTOR_ATTN_TEST_PROCESSES", "96"))
    path, go = tmp_path / "fresh" / "d.sqlite", tmp_path / "go"
    pids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:  # the child: wait for the start, open, write, read back; its exit status says whether it worked
            ok = False
            try:
                while not go.exists():
                    time.sleep(0.001)
                store = DecisionStore(path)
                store.put(decision_row(i))
                ok = store.broken is None and store.get(_key(i)) is not None
            finally:
                os._exit(0 if ok else 1)
        pids.append(pid)
    go.touch()
    failed = sum(os.waitpid(pid, 0)[1] != 0 for pid in pids)
    assert failed == 0 and len(DecisionStore(path).rows()) == n


def _writer(path: str, worker: int, n: int) -> None:
    store = DecisionStore(path)
    for i in range(n):
        store.put(decision_row(worker * 1000 + i))
        assert store.get(_key(worker * 1000 + i)) is not None
    assert store.broken is None


def test_eight_concurrent_writer_processes_lose_no_rows(tmp_path, process_context):
    path = str(tmp_path / "d.sqlite")
    DecisionStore(path).generation()  # create the file once, as the first compile would
    procs = [process_context.Process(target=_writer, args=(path, w, 25)) for w in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 8
    assert len(DecisionStore(path).rows()) == 8 * 25


# -- rows that are bad inside the store (put there by another tool or an older bug) -------------------------
def _corrupt(path, key: str, column: str, value) -> None:
    """``value`` into one cell; bytes go in as TEXT that holds them (not UTF-8, as a flipped bit on disk leaves)."""
    cell = "CAST(? AS TEXT)" if isinstance(value, bytes) else "?"
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE decisions SET {column} = {cell} WHERE key = ?", (value, key))


@pytest.mark.parametrize("column, value", [("record", "garbage"), ("record", "123"), ("record", "{}"),
                                           ("versions", "{"), ("problem", "p1"), ("created", "yesterday"),
                                           ("winner", 5), ("winner", b"b:\xff"),
                                           ("versions", "[" * 100_000 + "]" * 100_000)])
def test_a_bad_row_in_the_store_is_skipped_with_one_warning(tmp_path, column, value):
    path = tmp_path / "d.sqlite"
    DecisionStore(path).put_many([decision_row(i) for i in range(3)])
    _corrupt(path, _key(1), column, value)
    store = DecisionStore(path)
    with pytest.warns(RuntimeWarning, match=f"skipping unreadable decision.*field '{column}'") as record:
        assert {r["key"] for r in store.rows()} == {_key(0), _key(2)}
        assert store.get(_key(1)) is None
        assert len(store.rows()) == 2
    assert len(record) == 1 and store.broken is None


def test_a_bad_row_is_replaced_by_the_next_write_of_its_key(tmp_path):
    path = tmp_path / "d.sqlite"
    DecisionStore(path).put(decision_row(1))
    _corrupt(path, _key(1), "record", "garbage")
    store = DecisionStore(path)
    with pytest.warns(RuntimeWarning, match="unreadable"):
        assert store.get(_key(1)) is None
    store.put(decision_row(1))
    assert store.get(_key(1))["record"]["winner"] == "b:x=1"


def test_put_refuses_a_row_that_breaks_the_schema(tmp_path):
    store = DecisionStore(tmp_path / "d.sqlite")
    with pytest.raises(ValueError, match="field 'winner': must be a non-empty string, got int 5"):
        store.put({**decision_row(1), "winner": 5})
    assert store.rows() == []


# -- read-only stores --------------------------------------------------------------------------------------
def _filled(path, n: int = 3):
    DecisionStore(path).put_many([decision_row(i) for i in range(n)])
    return path.read_bytes()


@pytest.mark.parametrize("access", ["read", "immutable"])
def test_a_store_opened_read_only_serves_its_rows_and_is_never_written(tmp_path, access):
    path = tmp_path / "d.sqlite"
    before = _filled(path)
    store = DecisionStore(path, access=access)
    assert store.get(_key(1))["winner"] == "b:x=1"
    assert len(store.rows()) == 3 and store.generation()
    with pytest.raises(StoreError, match="read-only"):
        store.put(decision_row(9))
    with pytest.raises(StoreError, match="read-only"):
        store.clear()
    assert path.read_bytes() == before and store.broken is None


def test_access_is_found_from_the_filesystem(tmp_path, monkeypatch):
    path = tmp_path / "d.sqlite"
    assert path_access(path) == "write"  # absent but creatable
    _filled(path)
    assert path_access(path) == "write"
    # Simulated, so that it holds as root too (root may write where chmod says no)
    read_only = {path, tmp_path}
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) not in read_only)
    assert path_access(path) == "immutable"  # read-only directory, no log: WAL mode can only read immutable
    assert path_access(tmp_path / "absent" / "d.sqlite") is None
    Path(f"{path}-wal").write_bytes(b"a log")
    assert path_access(path) == "immutable"  # the same, with a log but no -shm to read it by
    Path(f"{path}-shm").write_bytes(b"its index")
    assert path_access(path) == "read"  # the log and its index exist: SQLite reads both read-only
    read_only.discard(tmp_path)
    assert path_access(path) == "read"  # read-only file in a writable directory, its owner's index there
    Path(f"{path}-shm").unlink()
    # without it, a mode=ro reader would create the -wal and -shm files, as its own, where the owner writes
    assert path_access(path) == "immutable"


def test_a_read_only_store_never_makes_the_log_files_its_owner_writes_through(tmp_path):
    # opened while the owner had the file open (its -shm there), read again after the owner closed it (SQLite then
    # removes -wal and -shm): a mode=ro open would make both, as the reader's own
    path = tmp_path / "d.sqlite"
    _filled(path)
    owner = sqlite3.connect(path)
    owner.execute("SELECT count(*) FROM decisions").fetchone()
    assert Path(f"{path}-shm").exists()
    reader = DecisionStore(path, access="read")
    assert len(reader.rows()) == 3
    owner.close()
    assert not Path(f"{path}-shm").exists() and not Path(f"{path}-wal").exists()
    assert len(reader.rows()) == 3
    assert not Path(f"{path}-shm").exists() and not Path(f"{path}-wal").exists()


def test_a_read_only_store_read_while_its_owner_writes_is_read_again_not_given_up(tmp_path, monkeypatch, recwarn):
    path = tmp_path / "d.sqlite"
    _filled(path)
    store = DecisionStore(path, access="immutable")
    real_open, failures = DecisionStore._open, [sqlite3.DatabaseError("database disk image is malformed")] * 2

    def open_while_checkpointed(self):
        if failures:
            raise failures.pop()
        return real_open(self)

    monkeypatch.setattr(DecisionStore, "_open", open_while_checkpointed)
    assert len(store.rows()) == 3 and store.broken is None and not recwarn.list
    failures[:] = [sqlite3.DatabaseError("database disk image is malformed")] * 9
    assert store.rows() == [] and "malformed" in store.broken  # for good: it gives up, once


def _simulate_read_only(monkeypatch, *paths) -> None:
    """What os.access says on a read-only mount (and what chmod says to anyone but root)."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) in paths and mode & os.W_OK else real(p, mode))


def test_get_store_on_a_read_only_path_reads_it_and_writes_to_the_overlay(tmp_path, monkeypatch, caplog):
    shipped = tmp_path / "image" / "decisions.sqlite"
    shipped.parent.mkdir()
    before = _filled(shipped, n=2)
    monkeypatch.setenv("INDUCTOR_ATTN_CACHE_DIR", str(shipped.parent))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _simulate_read_only(monkeypatch, shipped, shipped.parent)
    with caplog.at_level("WARNING", logger="inductor_attn.store.db"):
        store = get_store()
        assert store.get(_key(1))["winner"] == "b:x=1"
        store.put(decision_row(5))
        assert store.get(_key(5)) is not None and len(store.rows()) == 3
    overlay = tmp_path / "inductor" / "inductor_attn" / "decisions.sqlite"
    assert [r["key"] for r in DecisionStore(overlay).rows()] == [_key(5)]
    assert shipped.read_bytes() == before and store.broken is None
    (line,) = caplog.messages
    assert f"{shipped} is read-only: its decisions are used; new decisions go to {overlay}" in line


def test_new_decisions_stay_in_memory_when_no_store_can_be_written(tmp_path, monkeypatch, caplog):
    shipped = tmp_path / "inductor" / "inductor_attn" / "decisions.sqlite"
    shipped.parent.mkdir(parents=True)
    before = _filled(shipped, n=1)
    monkeypatch.delenv("INDUCTOR_ATTN_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _simulate_read_only(monkeypatch, shipped, shipped.parent)
    with caplog.at_level("WARNING", logger="inductor_attn.store.db"):
        store = get_store()
        store.put(decision_row(7))
        assert {r["key"] for r in store.rows()} == {_key(0), _key(7)}
    assert "new decisions go to memory (this process only)" in caplog.messages[0] and len(caplog.messages) == 1
    assert shipped.read_bytes() == before


def test_cache_import_where_no_store_can_be_written_imports_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    from inductor_attn.cli import main

    exported = tmp_path / "decisions.json"
    DecisionStore(tmp_path / "elsewhere.sqlite").put(decision_row(3))
    DecisionStore(tmp_path / "elsewhere.sqlite").export_json(exported)
    shipped = tmp_path / "inductor" / "inductor_attn" / "decisions.sqlite"
    shipped.parent.mkdir(parents=True)
    _filled(shipped, n=1)
    monkeypatch.delenv("INDUCTOR_ATTN_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    _simulate_read_only(monkeypatch, shipped, shipped.parent)
    assert main(["cache", "import", str(exported)]) == 1  # "imported into memory" would be lost as the command ends
    assert capsys.readouterr().err.endswith("INDUCTOR_ATTN_CACHE_DIR to a writable directory): nothing was imported\n")


_UNPRIVILEGED_READ = """
import os, sys
from inductor_attn.store.db import get_store
store = get_store()
print(store.get(sys.argv[1])["winner"], len(store.rows()), store.describe(), store.broken)
"""


@pytest.mark.parametrize("log", [False, True], ids=["checkpointed", "a log without its -shm"])
def test_a_wal_store_in_a_read_only_directory_is_readable_by_an_unprivileged_process(tmp_path, log):
    """The real thing, not a simulation: the directory and file are read-only to the process reading them
    (as root, the reader runs as nobody, since root writes wherever it likes). A write-ahead log without its
    index (-shm) cannot be read there, nor created: the file is read immutable, as of its last checkpoint."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot make a directory read-only to the reader")
        prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        hidden = [str(p) for p in Path(sys.prefix).resolve().parents if not p.stat().st_mode & 0o001]
        if hidden:
            pytest.skip(f"this Python environment ({sys.prefix}) is not reachable by other users: {hidden[0]} "
                        "lacks o+x, so the unprivileged reader would start without it")
    root = Path(tempfile.mkdtemp(prefix="ia-ro-"))  # outside pytest's 0700 tmp dir, so nobody can reach it
    try:
        store_dir = root / "image"
        store_dir.mkdir()
        if log:
            _crash_copy(root / "live.sqlite", 3, store_dir / "decisions.sqlite")  # decision 0 was checkpointed
            (store_dir / "decisions.sqlite-wal").chmod(0o444)
        else:
            _filled(store_dir / "decisions.sqlite", n=2)
        (store_dir / "decisions.sqlite").chmod(0o444)
        store_dir.chmod(0o555)
        scratch = root / "scratch"
        scratch.mkdir(mode=0o777)
        scratch.chmod(0o777)
        root.chmod(0o755)
        env = {**os.environ, "INDUCTOR_ATTN_CACHE_DIR": str(store_dir), "TORCHINDUCTOR_CACHE_DIR": str(scratch),
               "HOME": str(scratch)}
        done = subprocess.run([*prefix, sys.executable, "-c", _UNPRIVILEGED_READ, _key(0)], capture_output=True,
                              text=True, env=env, cwd=str(scratch), timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[:2] == ["b:x=1", "1" if log else "2"]
        assert "(read-only, immutable)" in done.stdout and done.stdout.strip().endswith("None")
        assert "is read-only: its decisions are used" in done.stderr
    finally:
        store_dir.chmod(0o755)
        shutil.rmtree(root)


# -- damage found at open ----------------------------------------------------------------------------------
def _crash_copy(path, n: int, dest):
    """Write n rows while another connection keeps the log open, then copy the files as a crash would
    leave them: the rows are committed, most of them only in the write-ahead log."""
    store = DecisionStore(path)
    store.put(decision_row(0))
    holder = sqlite3.connect(path)  # the last connection to close would checkpoint and remove the log
    holder.execute("SELECT count(*) FROM decisions").fetchone()
    for i in range(1, n):
        store.put(decision_row(i))
    for suffix in ("", "-wal"):
        shutil.copy(f"{path}{suffix}", f"{dest}{suffix}")
    holder.close()


def test_an_overwritten_wal_warns_once_naming_the_file_at_the_next_open(tmp_path):
    _crash_copy(tmp_path / "live.sqlite", 100, tmp_path / "intact.sqlite")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an intact log warns about nothing
        assert len(DecisionStore(tmp_path / "intact.sqlite").rows()) == 100
    _crash_copy(tmp_path / "live2.sqlite", 100, tmp_path / "d.sqlite")
    wal = tmp_path / "d.sqlite-wal"
    with open(wal, "r+b") as f:
        f.seek(wal.stat().st_size // 2)
        f.write(os.urandom(4096))
    store = DecisionStore(tmp_path / "d.sqlite")
    with pytest.warns(RuntimeWarning, match=f"{tmp_path / 'd.sqlite'} is damaged: frame .* of its write-ahead log "
                                            "d.sqlite-wal fails its checksum") as record:
        survivors = len(store.rows())
        store.put(decision_row(500))
    assert len(record) == 1 and survivors < 100  # the loss is real, and now it is said
    assert store.broken is None


def test_a_store_with_fewer_rows_than_its_last_write_left_warns_at_open(tmp_path):
    path = tmp_path / "d.sqlite"
    DecisionStore(path).put_many([decision_row(i) for i in range(10)])
    with sqlite3.connect(path) as conn:  # rows lost behind the store's back
        conn.execute("DELETE FROM decisions WHERE rowid <= 3")
    with pytest.warns(RuntimeWarning, match="its last write left 10 decisions, 7 are there now") as record:
        store = DecisionStore(path)
        assert len(store.rows()) == 7
        store.get(_key(9))
    assert len(record) == 1


@pytest.mark.parametrize("module", [schema, wal, keys])
def test_doctest_examples_hold(module):
    assert doctest.testmod(module).failed == 0
