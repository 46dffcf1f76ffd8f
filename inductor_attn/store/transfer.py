"""Decision files: an import is checked whole before anything is written; an export replaces its target
only once it is complete. ``store`` is a DecisionStore or a LayeredStore.

An import streams its file (an export of 10^6 decisions is about 900 MB): it reads the file once to check
every row, keeping only their keys, and again to write the rows in transactions of ``IMPORT_BATCH``, so
that no write holds the store's lock for long (other processes' writes wait at most the busy timeout).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import uuid
from pathlib import Path

from .schema import (COLUMNS, FORMAT_VERSION, StoreError, check_decision, check_decisions, check_export,
                     check_header, is_shipped)

IMPORT_BATCH = 1000  # rows per transaction: tens of milliseconds of holding the write lock
CHUNK = 1 << 20  # characters read at a time
MAX_VALUE = 64 << 20  # characters one row may span: a larger or unterminated one is no decision


def file_to_read(path: str | Path) -> Path:
    """``path`` as a Path; ValueError where it names a directory, a pipe or a device (reading a FIFO would wait
    for a writer for ever). A missing file is left to ``open``: FileNotFoundError."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ValueError(f"{str(path)!r} is not a regular file (a directory, a pipe or a device)")
    return path


def file_to_write(path: str | Path) -> Path:
    """``path`` resolved, for a file that is written next to it and renamed over it; ValueError where it names a
    directory (the empty name is the current one) or something else that is not a regular file."""
    target = Path(path).resolve()
    if target.exists() and not target.is_file():
        raise ValueError(f"{str(path)!r} is {'a directory' if target.is_dir() else 'not a regular file'}: give the "
                         "name of a file to write")
    return target


def import_file(store, path: str | Path) -> int:
    """Add every decision of an export file; returns how many were written.

    Raises FileNotFoundError/OSError if the file cannot be read, ValueError naming the file, the row and
    the field if any row is bad or the path is no regular file (nothing is written then), StoreError if the store
    cannot be written (the transactions before the one that failed stay written)."""
    path = file_to_read(path)
    with open(path, encoding="utf-8-sig", newline="") as f:  # both passes read the same file
        total, written = _check_file(f, path), 0
        f.seek(0)
        rows = (row for kind, _, row in _members(f, path) if kind == ROW)
        while batch := list(itertools.islice(rows, IMPORT_BATCH)):
            if store.put_many(batch) != len(batch):
                done = f"{written} of its {total} decisions were" if written else "nothing from it was"
                raise StoreError(f"the decision store is unusable ({store.broken}); {done} imported from {path}")
            written += len(batch)
    return written


def read_export(path: str | Path) -> list[dict]:
    """The checked rows of a small export file, read whole (see schema.check_export)."""
    path = file_to_read(path)
    try:
        parsed = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{path}: not a JSON file ({type(err).__name__}: {err})") from None
    return check_export(parsed, str(path))


def _check_file(f, path: Path) -> int:
    """Check an export file as it streams by; returns how many decisions it holds. A bad row is reported at
    once where ``schema`` came before it, else once the version is known (a version error comes first)."""
    members, seen, bad = {}, {}, None
    for kind, name, value in _members(f, path):
        if kind == DOCUMENT:
            check_header(value, str(path))
        elif kind == MEMBER:
            members[name] = value
            if name == "schema":
                check_header(members, str(path))
        elif bad is None:
            try:
                check_decision(value, name, seen, str(path))
            except ValueError as err:
                if "schema" in members:
                    raise
                bad = err
    check_header(members, str(path))
    check_decisions(members.get("decisions"), str(path))
    if bad is not None:
        raise bad
    return len(seen)


# What _members yields: (MEMBER, name, value) for each top-level member, except that a ``decisions`` list
# comes as (MEMBER, "decisions", []) and then each of its elements as (ROW, index, row); (DOCUMENT, None,
# value) for a file that is no JSON object.
MEMBER, ROW, DOCUMENT = "member", "row", "document"
_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def _members(f, path: Path):
    reader = _Reader(f, path)
    if reader.peek() != "{":
        yield DOCUMENT, None, reader.value()
    else:
        names = set()
        for _ in _items(reader, "{}"):
            name = reader.value()
            if not isinstance(name, str) or name in names:
                raise reader.error(f"a member name {'repeats' if name in names else 'must be a string'}")
            names.add(name)
            reader.take(":")
            if name == "decisions" and reader.peek() == "[":
                yield MEMBER, name, []
                for index in _items(reader, "[]"):
                    yield ROW, index, reader.value()
            else:
                yield MEMBER, name, reader.value()
    if reader.peek():
        raise reader.error("extra data after the JSON document")


def _items(reader, brackets: str):
    """The indices of the items of the object or list that starts next, each yielded when the reader is at
    the item; the caller reads it."""
    opening, closing = brackets
    reader.take(opening)
    if reader.peek() == closing:
        reader.take(closing)
        return
    for index in itertools.count():
        yield index
        if reader.take("," + closing) == closing:
            return


class _Reader:
    """A JSON document read ``CHUNK`` characters at a time (more for a value that spans more: the look-ahead
    doubles): ``value()`` decodes the next value whole, ``take()`` and ``peek()`` step through the
    punctuation between values."""

    def __init__(self, f, path: Path):
        self.f, self.path = f, path
        self.text, self.pos, self.before, self.done = "", 0, 0, False

    def _more(self) -> bool:
        """Read another chunk (dropping what was consumed); False at the end of the file."""
        chunk = "" if self.done else self._read()
        self.done = not chunk
        self.before += self.pos
        self.text, self.pos = self.text[self.pos:] + chunk, 0
        return bool(chunk)

    def _read(self) -> str:
        try:
            return self.f.read(max(CHUNK, len(self.text) - self.pos))
        except UnicodeDecodeError as err:
            raise ValueError(f"{self.path}: not a JSON file ({err})") from None

    def peek(self) -> str:
        """The next character after white space; "" at the end of the file."""
        while True:
            self.pos = _SPACE.match(self.text, self.pos).end()
            if self.pos < len(self.text) or not self._more():
                return self.text[self.pos:self.pos + 1]

    def take(self, allowed: str) -> str:
        found = self.peek()
        if not found or found not in allowed:
            raise self.error(f"expecting one of {' '.join(allowed)}, got {found or 'the end of the file'}")
        self.pos += 1
        return found

    def value(self):
        self.peek()
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, self.pos)
                if end < len(self.text) or self.done:  # a number at the end of the chunk may go on
                    self.pos = end
                    return value
            except json.JSONDecodeError as err:
                if self.done or len(self.text) - self.pos > MAX_VALUE:
                    raise self.error(err.msg, err.pos) from None
            except RecursionError:  # nested deeper than Python's stack: no export is
                raise self.error("nested too deep") from None
            self._more()

    def error(self, what: str, pos: int | None = None) -> ValueError:
        at = self.before + (self.pos if pos is None else pos)
        return ValueError(f"{self.path}: not a JSON file ({what}: character {at})")


def export_file(store, path: str | Path) -> int:
    """Write every decision ``store`` can read to ``path``, but those of shipped tables (every install has them,
    and imported they would answer for nothing: only a table's own rows are looked up as shipped decisions);
    returns how many. An unreadable store raises StoreError and leaves ``path`` as it was."""
    rows = [row for row in store.rows() if not is_shipped(row)]
    if store.broken:
        raise StoreError(f"the decision store is unreadable ({store.broken}); {path} was left as it was")
    write_export(path, [{c: row[c] for c in COLUMNS} for row in rows])
    return len(rows)


def write_export(path: str | Path, rows: list[dict]) -> None:
    """Write rows as an export file. A temporary file in the target's directory is renamed over the target
    once written and synced, so a failure at any point leaves an existing file whole."""
    target = file_to_write(path)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "x") as f:
            json.dump({"schema": FORMAT_VERSION, "decisions": rows}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if target.exists():
            shutil.copymode(target, tmp)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
