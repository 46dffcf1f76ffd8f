"""Decision store: one SQLite file of tuning decisions, shared by processes, never a reason to crash.

Location: ``$INDUCTOR_ATTN_CACHE_DIR/decisions.sqlite`` if set, else ``inductor_attn/decisions.sqlite``
under Inductor's cache dir (``TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_<user>``).

Concurrency: WAL journal (readers never block the writer), a 30 s busy timeout, one short transaction
per write, ``INSERT OR REPLACE`` per row. A corrupt, locked or unreadable file gives one warning, after
which the store is skipped for the rest of the process (tuning still works, results are just not
persisted); the file is never deleted or rewritten, so other rows are never lost.

Rows: every row written or read is checked against the schema (schema.py). A bad row read is skipped
with one warning per store, and the next tune of its problem replaces it.

A new store starts with a random ``generation`` token and every write replaces it; the Inductor
FX-graph-cache guard hashes it, so compiled code that baked decisions is not replayed after the
decisions changed, nor against another (e.g. a fresh, empty) store.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import uuid
import warnings
from pathlib import Path

from .._compat import inductor_cache_dir
from . import transfer
from .schema import COLUMNS, RowError, check_row

_SCHEMA = """
CREATE TABLE IF NOT EXISTS decisions (
    key TEXT PRIMARY KEY,       -- sha256 of everything that can change the answer (see keys.py)
    op TEXT NOT NULL,           -- "attention/forward", ...
    problem TEXT NOT NULL,      -- bucketed Problem.key()
    device TEXT NOT NULL,       -- DeviceInfo.key()
    versions TEXT NOT NULL,     -- JSON: torch, triton, cutlass-dsl, flash-attn-4, inductor_attn, sources
    winner TEXT NOT NULL,       -- "backend:config"
    record TEXT NOT NULL,       -- JSON TuneResult: every candidate, timings, CI, reasons
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM decisions"


def default_path() -> Path:
    env = os.environ.get("INDUCTOR_ATTN_CACHE_DIR")
    root = Path(env) if env else Path(inductor_cache_dir()) / "inductor_attn"
    return root / "decisions.sqlite"


class DecisionStore:
    def __init__(self, path: Path | str | None = None, timeout_s: float = 30.0):
        self.path = Path(path) if path is not None else default_path()
        self.timeout_s = timeout_s
        self._broken: str | None = None
        self._warned_rows = False
        self._lock = threading.Lock()

    # -- connection ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _connect(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
        try:
            conn.execute(f"PRAGMA busy_timeout={int(self.timeout_s * 1000)}")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)
            yield conn
        finally:
            conn.close()

    def _guard(self, action: str, fn, default=None):
        """Run ``fn(conn)``; on a store problem warn once, remember it and return ``default``."""
        if self._broken:
            return default
        try:
            with self._lock, self._connect() as conn:
                return fn(conn)
        except (sqlite3.Error, OSError) as err:
            self._broken = f"{type(err).__name__}: {err}"
            warnings.warn(
                f"inductor_attn: decision store {self.path} unusable while trying to {action} ({self._broken}); "
                "continuing without it for this process (decisions are tuned but not persisted)",
                RuntimeWarning, stacklevel=3,
            )
            return default

    @property
    def broken(self) -> str | None:
        return self._broken

    # -- rows ------------------------------------------------------------------------------------
    def _parse(self, values) -> dict:
        """A stored row as a dict, checked against the schema (RowError if it does not match)."""
        row = dict(zip(COLUMNS, values))
        for column in ("versions", "record"):
            try:
                row[column] = json.loads(row[column])
            except (TypeError, ValueError) as err:
                raise RowError(column, f"is not JSON ({err})") from None
        return check_row(row)

    def _decode(self, values) -> dict | None:
        """``_parse``, but a bad row is skipped (None) with one warning per store."""
        try:
            return self._parse(values)
        except RowError as err:
            if not self._warned_rows:
                self._warned_rows = True
                warnings.warn(f"inductor_attn: decision store {self.path}: skipping unreadable decision "
                              f"{_short_key(values[0])} ({err}), and any other; the next tune of its problem "
                              "replaces it", RuntimeWarning, stacklevel=4)
            return None

    def get(self, key: str) -> dict | None:
        def read(conn):
            row = conn.execute(f"{_SELECT} WHERE key = ?", (key,)).fetchone()
            return None if row is None else self._decode(row)

        return self._guard("read", read)

    def rows(self) -> list[dict]:
        def read(conn):
            return [row for row in map(self._decode, conn.execute(f"{_SELECT} ORDER BY op, problem")) if row]

        return self._guard("list", read, default=[])

    def find(self, prefix: str) -> list[dict]:
        """Rows whose key starts with ``prefix`` (keys are long hashes; a few characters suffice)."""
        return [r for r in self.rows() if r["key"].startswith(prefix)]

    def put(self, row: dict) -> None:
        self.put_many([{**row, "created": row.get("created") or time.time()}])

    def put_many(self, rows: list[dict]) -> int:
        """Write ``rows`` in one transaction, so all or none are written; returns how many were. Each row
        is checked first: a bad one raises ValueError (RowError) and nothing is written."""
        values = [_encode(check_row(row)) for row in rows]

        def write(conn):
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(f"INSERT OR REPLACE INTO decisions VALUES ({', '.join('?' * len(COLUMNS))})", values)
            _after_write(conn)
            conn.execute("COMMIT")
            return len(values)

        return self._guard("write", write, default=0)

    def clear(self) -> int:
        def wipe(conn):
            conn.execute("BEGIN IMMEDIATE")
            n = conn.execute("DELETE FROM decisions").rowcount
            _after_write(conn)
            conn.execute("COMMIT")
            return n

        return self._guard("clear", wipe, default=0)

    def generation(self) -> str:
        """Token that changes on every write; "" when the store is unusable."""
        def read_or_create(conn):
            row = conn.execute("SELECT value FROM meta WHERE name = 'generation'").fetchone()
            if row:
                return row[0]
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('generation', ?)", (uuid.uuid4().hex,))
            return conn.execute("SELECT value FROM meta WHERE name = 'generation'").fetchone()[0]

        return self._guard("read", read_or_create, default="")

    # -- JSON ------------------------------------------------------------------------------------
    def export_json(self, path: str | Path) -> int:
        return transfer.export_file(self, path)

    def import_json(self, path: str | Path) -> int:
        return transfer.import_file(self, path)


def _short_key(key) -> str:
    return repr(key[:16] if isinstance(key, str) else key)


def _encode(row: dict) -> tuple:
    return tuple(json.dumps(row[c]) if c in ("versions", "record") else row[c] for c in COLUMNS)


def _after_write(conn) -> None:
    """In the write's transaction: a new generation (the FX-graph-cache guard hashes it)."""
    conn.execute("INSERT OR REPLACE INTO meta VALUES ('generation', ?)", (uuid.uuid4().hex,))


_DEFAULT: dict[Path, DecisionStore] = {}


def get_store() -> DecisionStore:
    """The process-wide store for the current location (re-read from the environment on each call)."""
    path = default_path()
    if path not in _DEFAULT:
        _DEFAULT[path] = DecisionStore(path)
    return _DEFAULT[path]
