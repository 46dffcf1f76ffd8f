"""The decision row schema: one check for every row that enters the store (tuner, import) or leaves it (reads).

A row is a JSON object with exactly ``COLUMNS``; ``versions`` and ``record`` are JSON objects (TEXT in
SQLite). The check covers what readers rely on: ``attention()`` uses ``winner``; ``cache list``/``explain``
format the record's candidates and parse both problem keys; the key must be the hash of the fields it
stands for, so a row can never answer for another problem. A row that fails raises ``RowError`` naming
the field; the store skips such rows when reading, and an import refuses the whole file.
"""

from __future__ import annotations

from ..problem import Problem
from .keys import key_of

# Version of the row format, written as "schema" in exports. Bump it when a field changes meaning; an
# import of any other version is refused rather than guessed at.
FORMAT_VERSION = 1
COLUMNS = ("key", "op", "problem", "device", "versions", "winner", "record", "created")
RECORD_STRINGS = ("problem", "winner", "default", "why", "timer")
CANDIDATE_NUMBERS = ("error", "compile_s", "median_ms", "speedup", "ci_low", "ci_high", "host_ms")


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
    _check_created(row["created"])
    expected = key_of({c: row[c] for c in ("op", "problem", "device", "versions")})
    if row["key"] != expected:
        raise RowError("key", f"is not the hash of the row's op, problem, device and versions ({expected[:12]}...), "
                              f"got {row['key'][:16]!r}")
    return row


def check_export(data, source: str) -> list[dict]:
    """The rows of a parsed export file, each checked; ValueError names ``source``, the row and the field."""
    if not isinstance(data, dict) or "schema" not in data:
        raise ValueError(f"{source}: not an inductor_attn decision export (a JSON object with 'schema' and "
                         f"'decisions'), got {_kind(data)}")
    if data["schema"] != FORMAT_VERSION:
        raise ValueError(f"{source}: format version {data['schema']!r}; this inductor_attn reads version "
                         f"{FORMAT_VERSION}")
    rows = data.get("decisions")
    if not isinstance(rows, list):
        raise ValueError(f"{source}: 'decisions' must be a list of rows, got {_kind(rows)}")
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        try:
            check_row(row)
        except RowError as err:
            raise ValueError(f"{source}: decision {i}: {err}") from None
        if row["key"] in seen:
            raise ValueError(f"{source}: decision {i}: field 'key': repeats decision {seen[row['key']]}")
        seen[row["key"]] = i
    return rows


def _kind(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r:.40}"


def _text(value, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise RowError(field, f"must be a non-empty string, got {_kind(value)}")
    return value


def _number(value, field: str, optional: bool = False) -> None:
    if optional and value is None:
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
        if name == "sources":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise RowError("versions", f"'sources' must map backend names to hashes, got {_kind(value)}")
        elif not isinstance(value, str):
            raise RowError("versions", f"{name!r} must be a version string, got {_kind(value)}")


def _check_record(record) -> None:
    if not isinstance(record, dict):
        raise RowError("record", f"must be a JSON object (the tuner's record), got {_kind(record)}")
    for name in RECORD_STRINGS:
        if not isinstance(record.get(name), str):
            raise RowError("record", f"{name!r} must be a string, got {_kind(record.get(name))}")
    _problem(record["problem"], "record")
    candidates = record.get("candidates")
    if not isinstance(candidates, list):
        raise RowError("record", f"'candidates' must be a list, got {_kind(candidates)}")
    for i, cand in enumerate(candidates):
        _check_candidate(cand, f"record.candidates[{i}]")


def _check_candidate(cand, where: str) -> None:
    if not isinstance(cand, dict):
        raise RowError(where, f"must be a JSON object, got {_kind(cand)}")
    for name in ("name", "status"):
        _text(cand.get(name), f"{where}.{name}")
    for name in CANDIDATE_NUMBERS:
        _number(cand.get(name), f"{where}.{name}", optional=True)
    for name in ("reason", "note"):
        if not isinstance(cand.get(name), (str, type(None))):
            raise RowError(f"{where}.{name}", f"must be a string or null, got {_kind(cand.get(name))}")
    samples = cand.get("samples", [])
    if not isinstance(samples, list):
        raise RowError(f"{where}.samples", f"must be a list of numbers, got {_kind(samples)}")
    for sample in samples:
        _number(sample, f"{where}.samples")


def _check_created(created) -> None:
    _number(created, "created")
    if not 0 <= created < 1e12:  # also false for NaN; 1e12 s is 31,000 years away
        raise RowError("created", f"must be a time in seconds since the epoch, got {created!r:.40}")
