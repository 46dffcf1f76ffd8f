"""The SQLite decision store: round trips, concurrency, and damage that must never crash or lose rows."""

import json
import multiprocessing as mp
import sqlite3

import pytest

from inductor_attn.store.db import DecisionStore


def _row(i: int, winner: str = "b:x=1") -> dict:
    return {"key": f"k{i:04d}", "op": "attention/forward", "problem": f"p{i}", "device": "cpu|sm_0|2sm",
            "versions": {"torch": "2.13"}, "winner": winner, "record": {"default": "a:default", "candidates": []}}


def test_put_get_and_replace_round_trip(tmp_path):
    store = DecisionStore(tmp_path / "d.sqlite")
    store.put(_row(1))
    assert store.get("k0001")["winner"] == "b:x=1"
    store.put(_row(1, winner="a:default"))
    assert store.get("k0001")["winner"] == "a:default"
    assert store.get("missing") is None
    assert [r["key"] for r in store.find("k00")] == ["k0001"]


def test_every_write_and_clear_changes_the_generation(tmp_path):
    store = DecisionStore(tmp_path / "d.sqlite")
    first = store.generation()
    assert first and store.generation() == first
    store.put(_row(1))
    second = store.generation()
    assert second != first
    assert store.clear() == 1 and store.generation() not in (first, second)


def test_two_fresh_stores_have_different_generations(tmp_path):
    assert DecisionStore(tmp_path / "a.sqlite").generation() != DecisionStore(tmp_path / "b.sqlite").generation()


def test_json_export_import_round_trip(tmp_path):
    src = DecisionStore(tmp_path / "src.sqlite")
    for i in range(3):
        src.put(_row(i))
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
        store.put(_row(i))
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    damaged = DecisionStore(path)
    with pytest.warns(RuntimeWarning, match="unusable") as record:
        for i in range(5):
            damaged.get(f"k{i:04d}")
            damaged.put(_row(1000 + i))
    assert len(record) == 1 and damaged.broken
    assert path.stat().st_size == len(data) // 3  # never rewritten or deleted


def test_locked_store_is_skipped_with_a_warning_not_a_hang(tmp_path):
    path = tmp_path / "d.sqlite"
    DecisionStore(path).put(_row(1))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        store = DecisionStore(path, timeout_s=0.2)
        with pytest.warns(RuntimeWarning, match="locked"):
            store.put(_row(2))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert DecisionStore(path).get("k0001") is not None


def _writer(path: str, worker: int, n: int) -> None:
    store = DecisionStore(path)
    for i in range(n):
        store.put(_row(worker * 1000 + i))
        assert store.get(f"k{worker * 1000 + i:04d}") is not None
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
