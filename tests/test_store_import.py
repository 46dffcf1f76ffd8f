"""Decision files: an import is checked whole and written all or nothing; an export never destroys."""

import dataclasses
import functools
import json
import re
import sqlite3
import tracemalloc

import pytest
from test_store import _key, decision_row

from inductor_attn.problem import Problem
from inductor_attn.store import transfer
from inductor_attn.store.db import DecisionStore
from inductor_attn.store.schema import StoreError


def _export_file(path, rows, schema=1):
    path.write_text(json.dumps({"schema": schema, "decisions": rows}))
    return path


def _set(row: dict, dotted: str, value) -> dict:
    """A copy of ``row`` with the field at ``dotted`` (e.g. ``record.problem``) replaced."""
    row = json.loads(json.dumps(row))
    *parents, last = dotted.split(".")
    target = row
    for name in parents:
        target = target[name] if not name.isdigit() else target[int(name)]
    target[last] = value
    return row


@pytest.fixture
def store(tmp_path):
    store = DecisionStore(tmp_path / "d.sqlite")
    store.put(decision_row(100))  # the store is not empty: a refused import must leave this row alone
    return store


def _unchanged(store, generation: str) -> None:
    assert [r["key"] for r in store.rows()] == [_key(100)] and store.generation() == generation


BAD_FIELDS = [
    ("record", "garbage", "record"), ("record", 123, "record"), ("record", {}, "record"),
    ("problem", "p1", "problem"), ("record.problem", "garbage", "record.problem"),
    ("winner", 5, "winner"), ("winner", "no-colon", "winner"), ("versions", "2.13", "versions"),
    ("versions.torch", 2.13, "versions"), ("created", "yesterday", "created"), ("created", None, "created"),
    ("created", float("nan"), "created"), ("created", 10**400, "created"), ("created", -1.0, "created"),
    ("op", "varlen/forward", "op"), ("key", "k0001", "key"),
    ("device", "", "device"), ("record.candidates", {}, "record.candidates"),
    ("record.candidates.0.median_ms", "fast", "record.candidates[0].median_ms"),
    ("record.candidates.0.samples", [1.0, "x"], "record.candidates[0].samples[1]"),
    ("record.candidates.0.speedup", 10**400, "record.candidates[0].speedup"),
    # fields that compiled code or `cache explain` reads: each crashed them once it was imported
    ("record.compiled_winner", {"b": 1}, "record.compiled_winner"),
    ("record.compiled_winner", ["b:x=1"], "record.compiled_winner"),
    ("record.candidates.0.extra", 1, "record.candidates[0].extra"),
    ("record.candidates.0.traced", "yes", "record.candidates[0].traced"),
    ("record.candidates.0.host_ms", [0.1], "record.candidates[0].host_ms"),
    ("record.tuned_at", "yesterday", "record.tuned_at"), ("record.tuned_at", 1e300, "record.tuned_at"),
    ("record.seconds", [1.0], "record.seconds"), ("record.seconds", {"total": "long"}, "record.seconds.total"),
    ("record.noise", "low", "record.noise"), ("record.host", 7, "record.host"), ("record.extra", 1, "record.extra"),
    # a lone surrogate: valid JSON, but no UTF-8 text for SQLite or a terminal
    ("device", "cpu\ud800", "device"), ("record.why", "\udc80", "record.why"),
    ("versions.torch", "2.13\ud800", "versions"),
    ("record.candidates.0.reason", "\ud800", "record.candidates[0].reason"),
    # a winner or default that no candidate of the record is, or one the gate did not pass: compiled code weighs
    # the candidates' times and would run another kernel than the winner
    ("winner", "c:x=9", "winner"), ("record.winner", "c:x=9", "record.winner"),
    ("record.default", "c:x=9", "record.default"), ("record.candidates.1.status", "wrong", "winner"),
]


@pytest.mark.parametrize("dotted, value, field", BAD_FIELDS, ids=[f"{d}={v!r}" for d, v, _ in BAD_FIELDS])
def test_one_bad_row_refuses_the_whole_file_and_names_file_row_and_field(tmp_path, store, dotted, value, field):
    rows = [decision_row(i) for i in range(20)]
    rows[10] = _set(rows[10], dotted, value)
    path = _export_file(tmp_path / "in.json", rows)
    generation = store.generation()
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: decision 10: field '{field}': ")):
        store.import_json(path)
    _unchanged(store, generation)


@pytest.mark.parametrize("content, message", [
    ({"schema": 1}, "'decisions' must be a list of rows, got null"),
    ({"schema": 1, "decisions": None}, "'decisions' must be a list of rows, got null"),
    ({"schema": 1, "decisions": [None]}, "decision 0: field 'row': must be a JSON object, got null"),
    ({"schema": 2, "decisions": []}, "format version 2; this inductor_attn reads version 1"),
    ({"schema": True, "decisions": []}, "format version True; this inductor_attn reads version 1"),
    ({"schema": 1.0, "decisions": []}, "format version 1.0; this inductor_attn reads version 1"),
    ({"decisions": []}, "not an inductor_attn decision export"),
    ([], "not an inductor_attn decision export"),
    ({"schema": 1, "decisions": [{**decision_row(1), "extra": 1}]}, "decision 0: field 'extra': unknown"),
    ({"schema": 1, "decisions": [decision_row(1), decision_row(1)]}, "decision 1: field 'key': repeats decision 0"),
])
def test_a_file_that_is_not_a_valid_export_is_refused_naming_it(tmp_path, store, content, message):
    path = tmp_path / "in.json"
    path.write_text(json.dumps(content))
    generation = store.generation()
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: ") + ".*" + re.escape(message)):
        store.import_json(path)
    _unchanged(store, generation)


@pytest.mark.parametrize("content", [b"", b"{not json", b"\xff\xfe\x00garbage",
                                     b'{"schema": 1, "decisions": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}"])
def test_a_file_that_is_not_json_is_refused_naming_it(tmp_path, store, content):
    path = tmp_path / "in.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="^" + re.escape(f"{path}: not a JSON file")):
        store.import_json(path)


def test_a_missing_file_raises_file_not_found_naming_it(tmp_path, store):
    with pytest.raises(FileNotFoundError, match="missing.json"):
        store.import_json(tmp_path / "missing.json")


def test_an_empty_export_writes_nothing(tmp_path, store):
    generation = store.generation()
    assert store.import_json(_export_file(tmp_path / "in.json", [])) == 0
    _unchanged(store, generation)


def test_the_count_returned_is_the_count_written(tmp_path, store):
    path = _export_file(tmp_path / "in.json", [decision_row(i) for i in range(20)])
    assert store.import_json(path) == 20
    assert len(store.rows()) == 21


def test_an_import_into_an_unusable_store_writes_nothing_and_says_so(tmp_path):
    path = _export_file(tmp_path / "in.json", [decision_row(i) for i in range(3)])
    (tmp_path / "bad.sqlite").write_bytes(b"this is not a database" * 100)
    store = DecisionStore(tmp_path / "bad.sqlite")
    with pytest.warns(RuntimeWarning, match="unusable"), \
            pytest.raises(StoreError, match="nothing from .* was imported"):
        store.import_json(path)


def test_an_import_is_one_transaction(tmp_path, store):
    """A write that fails on row 10 of 20 (here the database refuses it) leaves none of the 20 behind."""
    with sqlite3.connect(store.path) as conn:
        conn.execute(f"CREATE TRIGGER refuse BEFORE INSERT ON decisions WHEN NEW.key = '{_key(10)}' "
                     "BEGIN SELECT RAISE(ABORT, 'refused'); END")
    path = _export_file(tmp_path / "in.json", [decision_row(i) for i in range(20)])
    generation = store.generation()
    with pytest.warns(RuntimeWarning, match="refused"), pytest.raises(StoreError):
        store.import_json(path)
    with sqlite3.connect(store.path) as conn:
        assert conn.execute("SELECT count(*) FROM decisions").fetchone()[0] == 1
        assert conn.execute("SELECT value FROM meta WHERE name = 'generation'").fetchone()[0] == generation


def test_a_large_import_is_streamed_and_written_in_bounded_transactions(tmp_path, store, monkeypatch):
    """An import of 10^6 decisions held the write lock past other processes' busy timeout, and its whole file
    in memory several times over: here 1,000 rows, in transactions of at most 50, read 16 KiB at a time."""
    monkeypatch.setattr(transfer, "IMPORT_BATCH", 50)
    monkeypatch.setattr(transfer, "CHUNK", 1 << 14)
    store.import_json(_export_file(tmp_path / "warm.json", [decision_row(1)]))  # one-time allocations
    transfer.write_export(tmp_path / "in.json", [decision_row(i) for i in range(1000, 2000)])
    size = (tmp_path / "in.json").stat().st_size
    batches = []
    put_many = DecisionStore.put_many
    monkeypatch.setattr(DecisionStore, "put_many", lambda self, rows: batches.append(len(rows)) or put_many(self, rows))
    tracemalloc.start()
    try:
        assert store.import_json(tmp_path / "in.json") == 1000
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert batches == [50] * 20 and len(store.rows()) == 1002
    assert peak < size / 2, f"{peak} bytes at the peak for a file of {size}"  # read whole: 3x the file


@pytest.mark.parametrize("order", ["schema first", "decisions first"])
def test_a_bad_row_is_found_before_anything_is_written_whatever_the_key_order(tmp_path, store, monkeypatch, order):
    monkeypatch.setattr(transfer, "IMPORT_BATCH", 10)
    rows = [decision_row(i) for i in range(50)]
    rows[45] = _set(rows[45], "winner", 5)
    content = {"schema": 1, "decisions": rows}
    path = tmp_path / "in.json"
    path.write_text(json.dumps(content, sort_keys=order == "decisions first"))
    generation = store.generation()
    with pytest.raises(ValueError, match=re.escape(f"{path}: decision 45: field 'winner'")):
        store.import_json(path)
    _unchanged(store, generation)
    path.write_text(json.dumps({**content, "schema": 2}, sort_keys=order == "decisions first"))
    with pytest.raises(ValueError, match="format version 2"):
        store.import_json(path)
    _unchanged(store, generation)


# -- exports ---------------------------------------------------------------------------------------------
def test_export_of_a_corrupt_store_raises_and_leaves_the_target_alone(tmp_path):
    target = tmp_path / "out.json"
    target.write_text('{"schema": 1, "decisions": ["what was there before"]}')
    (tmp_path / "bad.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.warns(RuntimeWarning, match="unusable"), pytest.raises(StoreError, match="left as it was"):
        DecisionStore(tmp_path / "bad.sqlite").export_json(target)
    assert target.read_text() == '{"schema": 1, "decisions": ["what was there before"]}'


def test_an_export_that_fails_while_writing_leaves_the_target_whole(tmp_path, store, monkeypatch):
    target = tmp_path / "out.json"
    target.write_text("before")

    def half_written(obj, f, **kwargs):
        f.write('{"schema": 1, "decis')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transfer.json, "dump", half_written)
    with pytest.raises(OSError, match="No space left"):
        store.export_json(target)
    assert target.read_text() == "before"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_export_replaces_the_target_keeping_its_permissions(tmp_path, store):
    target = tmp_path / "out.json"
    target.write_text("before")
    target.chmod(0o640)
    assert store.export_json(target) == 1
    assert json.loads(target.read_text())["decisions"][0]["key"] == _key(100)
    assert target.stat().st_mode & 0o777 == 0o640


def test_a_field_the_tuner_adds_to_its_record_is_accepted_and_checked(tmp_path, store, monkeypatch):
    """The record's fields are the tuner's dataclasses' (schema.py), not a copy of them."""
    from inductor_attn.store import record, schema

    @dataclasses.dataclass
    class Later(record.TuneResult):
        launches: float | None = None

    monkeypatch.setattr(record, "TuneResult", Later)
    monkeypatch.setattr(schema, "_record_checker", functools.cache(schema._record_checker.__wrapped__))
    result = Later(Problem.from_key(decision_row(1)["record"]["problem"]), "forward", "b:x=1", "a:default", "why",
                   "fake", [record.CandidateResult(n, "passed", median_ms=1.0) for n in ("a:default", "b:x=1")],
                   launches=3.0)
    row = {**decision_row(1), "record": result.to_json()}
    assert store.import_json(_export_file(tmp_path / "in.json", [row])) == 1
    with pytest.raises(ValueError, match="field 'record.launches': must be a number or null, got str 'x'"):
        store.import_json(_export_file(tmp_path / "bad.json", [_set(row, "record.launches", "x")]))
