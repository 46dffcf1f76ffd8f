"""Decision store: one SQLite file of tuning decisions, shared by processes, never a reason to crash.

Location: ``$INDUCTOR_ATTN_CACHE_DIR/decisions.sqlite`` if set, else ``inductor_attn/decisions.sqlite``
under Inductor's cache dir (``TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_<user>``).

Concurrency: WAL journal (readers never block the writer), a 30 s busy timeout, one short transaction
per write, ``INSERT OR REPLACE`` per row. A corrupt, locked or unreadable file gives one warning, after
which the store is skipped for the rest of the process (tuning still works, results are just not
persisted); the file is never deleted or rewritten, so other rows are never lost.

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

SCHEMA_VERSION = 1
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
_COLUMNS = ("key", "op", "problem", "device", "versions", "winner", "record", "created")
# Who is tuning what right now (tuning/ranks.py): a row lives only while its process tunes or measures,
# so that other processes sharing this file wait for its decision instead of tuning the same bucket.
_CLAIMS_SCHEMA = """
CREATE TABLE IF NOT EXISTS claims (
    name TEXT PRIMARY KEY,      -- a decision key, or "device:..." for the right to measure on a device
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    created REAL NOT NULL       -- time.time() when taken
);
"""


def default_path() -> Path:
    env = os.environ.get("INDUCTOR_ATTN_CACHE_DIR")
    root = Path(env) if env else Path(inductor_cache_dir()) / "inductor_attn"
    return root / "decisions.sqlite"


class DecisionStore:
    def __init__(self, path: Path | str | None = None, timeout_s: float = 30.0):
        self.path = Path(path) if path is not None else default_path()
        self.timeout_s = timeout_s
        self._broken: str | None = None
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
    def get(self, key: str) -> dict | None:
        def read(conn):
            row = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM decisions WHERE key = ?", (key,)).fetchone()
            return None if row is None else _row(row)

        return self._guard("read", read)

    def put(self, row: dict) -> None:
        row = {**row, "created": row.get("created") or time.time()}
        values = tuple(row[c] if c in ("created",) or isinstance(row[c], str) else json.dumps(row[c])
                       for c in _COLUMNS)

        def write(conn):
            conn.execute("BEGIN IMMEDIATE")
            conn.execute(f"INSERT OR REPLACE INTO decisions VALUES ({', '.join('?' * len(_COLUMNS))})", values)
            _bump_generation(conn)
            conn.execute("COMMIT")

        self._guard("write", write)

    def rows(self) -> list[dict]:
        return self._guard(
            "list", lambda conn: [_row(r) for r in conn.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM decisions ORDER BY op, problem")], default=[])

    def find(self, prefix: str) -> list[dict]:
        """Rows whose key starts with ``prefix`` (keys are long hashes; a few characters suffice)."""
        return [r for r in self.rows() if r["key"].startswith(prefix)]

    def clear(self) -> int:
        def wipe(conn):
            conn.execute("BEGIN IMMEDIATE")
            n = conn.execute("DELETE FROM decisions").rowcount
            _bump_generation(conn)
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

    # -- claims ----------------------------------------------------------------------------------
    def claim(self, name: str, host: str, pid: int, is_stale) -> dict | None:
        """Take the claim ``name`` for process ``pid`` on ``host``, atomically, unless another process
        holds it and ``is_stale(holder)`` is false: then return that holder (``host``, ``pid``,
        ``created``). None means the claim is ours, or the store is unusable (nobody can be waited for)."""
        def take(conn):
            conn.executescript(_CLAIMS_SCHEMA)
            conn.execute("BEGIN IMMEDIATE")
            found = conn.execute("SELECT host, pid, created FROM claims WHERE name = ?", (name,)).fetchone()
            holder = None if found is None else dict(zip(("host", "pid", "created"), found))
            if holder is not None and (holder["host"], holder["pid"]) != (host, pid) and not is_stale(holder):
                conn.execute("COMMIT")
                return holder
            conn.execute("INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?)", (name, host, pid, time.time()))
            conn.execute("COMMIT")
            return None

        return self._guard("claim", take)

    def release(self, name: str, host: str, pid: int) -> None:
        """Drop the claim ``name`` if process ``pid`` on ``host`` still holds it."""
        def drop(conn):
            conn.executescript(_CLAIMS_SCHEMA)
            conn.execute("DELETE FROM claims WHERE name = ? AND host = ? AND pid = ?", (name, host, pid))

        self._guard("release a claim", drop)

    # -- JSON ------------------------------------------------------------------------------------
    def export_json(self, path: str | Path) -> int:
        rows = self.rows()
        Path(path).write_text(json.dumps({"schema": SCHEMA_VERSION, "decisions": rows}, indent=1))
        return len(rows)

    def import_json(self, path: str | Path) -> int:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"{path}: not an inductor_attn decision export of schema {SCHEMA_VERSION}")
        rows = data["decisions"]
        for i, row in enumerate(rows):
            missing = [c for c in _COLUMNS if c not in row]
            if missing:
                raise ValueError(f"{path}: decision {i} lacks {missing}")
        for row in rows:
            self.put(row)
        return len(rows)


def _row(values) -> dict:
    row = dict(zip(_COLUMNS, values))
    row["versions"] = json.loads(row["versions"])
    row["record"] = json.loads(row["record"])
    return row


def _bump_generation(conn) -> None:
    conn.execute("INSERT OR REPLACE INTO meta VALUES ('generation', ?)", (uuid.uuid4().hex,))


_DEFAULT: dict[Path, DecisionStore] = {}


def get_store() -> DecisionStore:
    """The process-wide store for the current location (re-read from the environment on each call)."""
    path = default_path()
    if path not in _DEFAULT:
        _DEFAULT[path] = DecisionStore(path)
    return _DEFAULT[path]
