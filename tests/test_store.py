"""The SQLite decision store: round trips, concurrency, and damage that must never crash or lose rows."""

import json
import multiprocessing as mp
import sqlite3

import pytest

from inductor_attn.problem import Problem
from inductor_attn.store.db import DecisionStore
from inductor_attn.store.keys import key_of


def decision_row(i: int, winner: str = "b:x=1") -> dict:
    """A row as the tuner writes it, for a problem of its own per ``i`` (batch i + 1)."""
    problem = Problem("attention", "float32", "cpu", i + 1, 2, 2, 32, 32, 16, 16).key()
    fields = {"op": "attention/forward", "problem": problem, "device": "cpu|sm_0|2sm",
              "versions": {"torch": "2.13", "sources": {"a": "1", "b": "2"}}}
    record = {"problem": problem, "direction": "forward", "winner": winner, "default": "a:default",
              "why": "b:x=1 is 2.00x faster", "timer": "fake", "tuned_at": 1.0,
              "candidates": [{"name": "a:default", "status": "passed", "median_ms": 1.0, "speedup": 1.0,
                              "samples": [1.0, 1.01]}]}
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


def _writer(path: str, worker: int, n: int) -> None:
    store = DecisionStore(path)
    for i in range(n):
        store.put(decision_row(worker * 1000 + i))
        assert store.get(_key(worker * 1000 + i)) is not None
    assert store.broken is None


def test_eight_concurrent_writer_processes_lose_no_rows(tmp_path):
    path = str(tmp_path / "d.sqlite")
    DecisionStore(path).generation()  # create the file once, as the first compile would
    ctx = mp.get_context("spawn")  # fork could inherit locks held by torch.compile threads of earlier tests
    procs = [ctx.Process(target=_writer, args=(path, w, 25)) for w in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 8
    assert len(DecisionStore(path).rows()) == 8 * 25


# -- rows that are bad inside the store (put there by another tool or an older bug) -------------------------
def _corrupt(path, key: str, column: str, value) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE decisions SET {column} = ? WHERE key = ?", (value, key))


@pytest.mark.parametrize("column, value", [("record", "garbage"), ("record", "123"), ("record", "{}"),
                                           ("versions", "{"), ("problem", "p1"), ("created", "yesterday"),
                                           ("winner", 5)])
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
