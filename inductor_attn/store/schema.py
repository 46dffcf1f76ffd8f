"""The decision row schema: one check for every row that enters the store (tuner, import) or leaves it (reads).

A row is a JSON object with exactly ``COLUMNS``; ``versions`` and ``record`` are JSON objects (TEXT in
SQLite). The check covers what readers rely on: ``attention()`` uses ``winner``; compiled code weighs the
device and host times of the record's candidates (``CandidateResult``); ``cache list``/``explain``
format every field of the record and parse both problem keys; the key must be the hash of the fields it
stands for, so a row can never answer for another problem. The record's fields and their types are those
of the tuner's ``TuneResult`` and ``CandidateResult`` (store/record.py), read from the dataclasses, so a
field added there is accepted here; the fields without a default are required, the others may be absent
(records from before they existed). Every string must be UTF-8 text (JSON can hold a lone surrogate,
which SQLite and a terminal refuse). A row that fails raises ``RowError`` naming the field; the store
skips such rows when reading, and an import refuses the whole file. ``Health`` is what ``cache doctor``
reports of one store: the rows that pass and those that fail.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

from ..problem import Problem
from . import record
from .keys import key_of

# Version of the row format, written as "schema" in exports. Bump it when a field changes meaning; an
# import of any other version is refused rather than guessed at.
FORMAT_VERSION = 1
COLUMNS = ("key", "op", "problem", "device", "versions", "winner", "record", "created")
# A record field that is no TuneResult field: a shipped table's rows get it when read (priors.py), and
# exports of a layered store carry it.
ORIGIN = "origin"
MAX_TIME_S = 1e12  # 31,000 years after the epoch: a larger time is no time (the time functions overflow)


@dataclasses.dataclass
class Health:
    """What ``cache doctor`` reports for one store."""

    where: str
    error: str | None = None  # the store could not be opened or read
    integrity: list[str] = dataclasses.field(default_factory=list)  # PRAGMA integrity_check; ["ok"] when sound
    damage: list[str] = dataclasses.field(default_factory=list)  # found at open: a damaged WAL, lost rows
    rows: list[dict] = dataclasses.field(default_factory=list)  # rows that match the schema
    bad: list[str] = dataclasses.field(default_factory=list)  # "key: why" for rows that do not
    # keys of rows another version of this package wrote that this one cannot read (a newer schema): stale, not bad
    other_version: list[str] = dataclasses.field(default_factory=list)


def is_shipped(row: dict) -> bool:
    """Whether a row was read from a shipped table (priors.py gives those rows their ``origin``)."""
    return str(row["record"].get(ORIGIN, "")).startswith("shipped")


class RowError(ValueError):
    """A row that does not match the schema; ``field`` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"field {field!r}: {message}")
        self.field = field


class StoreError(RuntimeError):
    """A store cannot do what was asked: it is unreadable or unusable, or a write went to a read-only store."""


def check_row(row) -> dict:
    """Return ``row`` if it matches the schema, else raise RowError.

    >>> check_row("garbage")
    Traceback (most recent call last):
    ...
    inductor_attn.store.schema.RowError: field 'row': must be a JSON object, got str 'garbage'
    """
    if not isinstance(row, dict):
        raise RowError("row", f"must be a JSON object, got {_kind(row)}")
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise RowError(missing[0], f"the row lacks {missing} (a row has {', '.join(COLUMNS)})")
    unknown = sorted(set(row) - set(COLUMNS))
    if unknown:
        raise RowError(unknown[0], f"unknown (a row has only {', '.join(COLUMNS)})")
    for column in ("key", "op", "problem", "device", "winner"):
        _text(row[column], column)
    problem = _problem(row["problem"], "problem")
    if row["op"].split("/")[0] != problem.op:
        raise RowError("op", f"must start with the problem's op {problem.op!r}, got {row['op']!r}")
    if ":" not in row["winner"]:
        raise RowError("winner", f"must be 'backend:config', got {row['winner']!r}")
    _check_versions(row["versions"])
    _check_record(row["record"])
    _check_choice(row["winner"], row["record"])
    _check_created(row["created"])
    expected = key_of({c: row[c] for c in ("op", "problem", "device", "versions")})
    if row["key"] != expected:
        raise RowError("key", f"is not the hash of the row's op, problem, device and versions ({expected[:12]}...), "
                              f"got {row['key'][:16]!r}")
    return row


def check_export(data, source: str) -> list[dict]:
    """The rows of a parsed export file, each checked; ValueError names ``source``, the row and the field."""
    check_header(data, source)
    rows = check_decisions(data.get("decisions"), source)
    seen: dict[str, int] = {}
    return [check_decision(row, i, seen, source) for i, row in enumerate(rows)]


def check_header(members, source: str) -> None:
    """An export's top-level members (``decisions`` among them or not): ``schema`` must be this format
    version."""
    if not isinstance(members, dict) or "schema" not in members:
        raise ValueError(f"{source}: not an inductor_attn decision export (a JSON object with 'schema' and "
                         f"'decisions'), got {_kind(members)}")
    if type(members["schema"]) is not int or members["schema"] != FORMAT_VERSION:  # true and 1.0 equal 1
        raise ValueError(f"{source}: format version {members['schema']!r}; this inductor_attn reads version "
                         f"{FORMAT_VERSION}")


def check_decisions(rows, source: str):
    """``rows`` if the export's ``decisions`` member is a list."""
    if not isinstance(rows, list):
        raise ValueError(f"{source}: 'decisions' must be a list of rows, got {_kind(rows)}")
    return rows


def check_decision(row, index: int, seen: dict[str, int], source: str) -> dict:
    """Decision ``index`` of an export, checked; ``seen`` maps the keys of the decisions before it to their
    index (a key may appear once)."""
    try:
        check_row(row)
    except RowError as err:
        raise ValueError(f"{source}: decision {index}: {err}") from None
    if row["key"] in seen:
        raise ValueError(f"{source}: decision {index}: field 'key': repeats decision {seen[row['key']]}")
    seen[row["key"]] = index
    return row


def _kind(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r:.40}"


def _text(value, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise RowError(field, f"must be a non-empty string, got {_kind(value)}")
    return _utf8(value, field)


def _utf8(value: str, field: str) -> str:
    if value.isascii():
        return value
    try:
        value.encode()
    except UnicodeEncodeError as err:
        raise RowError(field, f"holds a lone surrogate {value[err.start]!r} at {err.start}, which is no UTF-8 "
                              f"text, in {value!r:.60}") from None
    return value


def _number(value, field: str, optional: bool = False) -> None:
    if type(value) is float or optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RowError(field, f"must be a number{' or null' if optional else ''}, got {_kind(value)}")
    try:
        float(value)  # readers format it as a float
    except OverflowError:
        raise RowError(field, f"is out of range, got {value!r:.40}") from None


def _problem(value: str, field: str) -> Problem:
    try:
        return Problem.from_key(value)
    except (ValueError, KeyError, TypeError) as err:
        raise RowError(field, f"is not a problem key ({type(err).__name__}: {err}), got {value!r:.60}") from None


def _check_versions(versions) -> None:
    if not isinstance(versions, dict):
        raise RowError("versions", f"must be a JSON object, got {_kind(versions)}")
    for name, value in versions.items():
        _utf8(name, "versions")
        if name == "sources":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise RowError("versions", f"'sources' must map backend names to hashes, got {_kind(value)}")
            for backend, digest in value.items():
                _utf8(backend, "versions")
                _utf8(digest, "versions")
        elif not isinstance(value, str):
            raise RowError("versions", f"{name!r} must be a version string, got {_kind(value)}")
        else:
            _utf8(value, "versions")


def _check_record(record) -> None:
    if not isinstance(record, dict):
        raise RowError("record", f"must be a JSON object (the tuner's record), got {_kind(record)}")
    _record_checker()(record, "record")
    if "tuned_at" in record:  # cache explain formats it as a local time
        _check_time(record["tuned_at"], "record.tuned_at")


def _check_choice(winner: str, record: dict) -> None:
    """The winner and the record's own winner and default must be candidates the record saw pass the gate: a
    reader weighs their times (compiled code) and shows them (``cache explain``)."""
    passed = {c["name"] for c in record["candidates"] if c["status"] == "passed"}
    for field, name in (("winner", winner), ("record.winner", record["winner"]), ("record.default", record["default"])):
        if name not in passed:
            raise RowError(field, f"{name!r} is not a candidate of the record that passed the gate (passed: "
                                  f"{', '.join(sorted(passed)) or 'none'})")


@functools.cache
def _record_checker():
    """TuneResult's fields (record.py), ``origin`` and the fields of older records."""
    return _fields_checker(record.TuneResult, "record", {ORIGIN: str, **record.LEGACY_FIELDS})


def _fields_checker(cls, what: str, extra: dict | None = None):
    """A check of a JSON object holding the fields of dataclass ``cls`` (and ``extra``: name -> type)."""
    hints = typing.get_type_hints(cls)
    checks = {f.name: _checker(hints[f.name]) for f in dataclasses.fields(cls)}
    checks.update({name: _checker(hint) for name, hint in (extra or {}).items()})
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]

    def check(value: dict, field: str) -> None:
        missing = [name for name in required if name not in value]
        if missing:
            raise RowError(field, f"lacks {missing} (a {what} has {', '.join(checks)})")
        for name, item in value.items():
            if name not in checks:
                raise RowError(f"{field}.{name}", f"unknown (a {what} has only {', '.join(checks)})")
            _precisely(checks[name], item, field, f"{field}.{name}")

    return check


def _precisely(check, value, field: str, precise: str) -> None:
    """``check(value, field)``; a failure is checked again under its own field's name: building every
    name up front cost more than the checks themselves."""
    try:
        check(value, field)
    except RowError:
        check(value, precise)
        raise


@functools.cache
def _checker(hint, nullable: bool = False):
    """A function ``(value, field)`` that raises RowError unless ``value`` as JSON holds a field of type
    ``hint``: str, float, bool, Problem (its key), a dataclass (a JSON object of its fields), ``list[X]``,
    ``dict[str, X]`` or ``X | None``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _checker(next(a for a in args if a is not type(None)), nullable=True)
        return lambda value, field: value is None or inner(value, field)
    or_null = " or null" if nullable else ""

    def expect(kind: type, what: str):
        def check(value, field):
            if not isinstance(value, kind):
                raise RowError(field, f"must be {what}{or_null}, got {_kind(value)}")
        return check

    if hint is str:
        is_str = expect(str, "a string")
        return lambda value, field: is_str(value, field) or _utf8(value, field)
    if hint is float:
        return lambda value, field: _number(value, field, optional=nullable)
    if hint is bool:
        return expect(bool, "true or false")
    if hint is Problem:
        return lambda value, field: _problem(_text(value, field), field)
    if dataclasses.is_dataclass(hint):
        is_object, fields = expect(dict, "a JSON object"), _fields_checker(hint, hint.__name__)
        return lambda value, field: is_object(value, field) or fields(value, field)
    if origin is list:
        is_list, item = expect(list, "a list"), _checker(args[0])

        def items(value, field):
            is_list(value, field)
            for i, x in enumerate(value):
                _precisely(item, x, field, f"{field}[{i}]")
        return items
    if origin is dict and args[0] is str:
        is_object, item = expect(dict, "a JSON object"), _checker(args[1])

        def entries(value, field):
            is_object(value, field)
            for name, x in value.items():
                _precisely(item, x, field, f"{field}.{_utf8(name, field)}")
        return entries
    raise TypeError(f"the schema cannot check a field of type {hint!r} (schema._checker)")


def _check_created(created) -> None:
    _check_time(created, "created")


def _check_time(value, field: str) -> None:
    _number(value, field)
    if not 0 <= value < MAX_TIME_S:  # also false for NaN
        raise RowError(field, f"must be a time in seconds since the epoch, got {value!r:.40}")
