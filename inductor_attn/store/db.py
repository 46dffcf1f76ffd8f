"""Decision store: SQLite files of tuning decisions, shared by processes, never a reason to crash.

Location: ``$INDUCTOR_ATTN_CACHE_DIR/decisions.sqlite`` if set, else ``inductor_attn/decisions.sqlite``
under Inductor's cache dir (``TORCHINDUCTOR_CACHE_DIR``, default ``/tmp/torchinductor_<user>``).

Read-only stores: a store on a read-only path (a shared image, a container layer, a read-only mount) is
opened read-only (``mode=ro``, or ``immutable=1`` where the directory is read-only too, since WAL mode
cannot even read there otherwise, unless both its ``-wal`` and ``-shm`` are there) and its decisions are
used. New decisions then go to an overlay: the store in Inductor's cache dir when that is writable and
another file, else memory (this process only). ``get_store()`` returns the layers (layers.py) and logs
one line saying where new decisions go.

Concurrency: WAL journal (readers never block the writer), a 30 s busy timeout, one short transaction
per write, ``INSERT OR REPLACE`` per row. A corrupt, locked or unreadable file gives one warning, after
which the store is skipped for the rest of the process (tuning still works, results are just not
persisted); the file is never deleted or rewritten, so other rows are never lost.

Damage: every row read is checked against the schema (schema.py); a bad row is skipped with one warning
per store, and the next tune of its problem replaces it. At the first open in a process, a write-ahead
log whose damage would drop committed transactions (wal.py), or fewer rows than the last write recorded
in ``meta``, gives one warning naming the file. ``health()`` is what ``cache doctor`` reports.

A new store starts with two random tokens. ``generation`` changes on every write; ``revision`` only on a write
that changes an answer the store gave: a row replaced with another winner, a delete, a clear, or an answer it
could not give (``unmeasured``). The Inductor FX-graph-cache guard (lowering/graph_pass.py) hashes one of them,
so compiled code that baked decisions is not replayed after the decisions changed, nor against another (e.g. a
fresh, empty) store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
import warnings
import weakref
from pathlib import Path

from .._compat import inductor_cache_dir
from . import transfer
from .layers import LayeredStore
from .priors import shipped_layers
from .schema import COLUMNS, Health, RowError, StoreError, check_row
from .wal import wal_damage

log = logging.getLogger(__name__)

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

# How a store file can be opened (path_access).
WRITE, READ, IMMUTABLE = "write", "read", "immutable"
READ_RETRIES = 3  # reads again of a read-only store before it counts as unusable (DecisionStore._guard)
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


def path_access(path: Path) -> str | None:
    """How a store at ``path`` can be opened by this process.

    WRITE: the file and its directory are writable (or the file can be created). READ (``mode=ro``): a file
    this process may not write whose WAL index (``-shm``) exists, as while its owner has it open. IMMUTABLE
    (``immutable=1``): no index to read the log by (the file is then read as of its last checkpoint), so no
    lock or index file is needed or made. None: no file, and none can be created. A READ store is opened immutable
    whenever the index has gone (``DecisionStore._open``), and a read-only open that meets the owner writing is
    tried again (``DecisionStore._guard``).
    """
    try:
        if not path.exists():
            return WRITE if _creatable(path.parent) else None
    except OSError:  # a directory on the way cannot be searched
        return None
    directory_writable = os.access(path.parent, os.W_OK)
    if directory_writable and os.access(path, os.W_OK):
        return WRITE
    # Only with the -shm index there: in a writable directory SQLite would create the -wal and -shm files for a
    # mode=ro reader, owned by it, and the store's owner could not write through them again
    if Path(f"{path}-shm").exists() and (directory_writable or _log_size(path) > 0):
        return READ
    return IMMUTABLE


def _creatable(directory: Path) -> bool:
    found = _nearest_existing(directory)
    return found.is_dir() and os.access(found, os.W_OK | os.X_OK)


def _nearest_existing(directory: Path) -> Path:
    while not directory.exists():
        directory = directory.parent
    return directory


def file_in_the_way(path: Path) -> Path | None:
    """The file that stands where a directory of ``path`` must be (INDUCTOR_ATTN_CACHE_DIR naming a file), or
    None."""
    try:
        found = _nearest_existing(path.parent)
    except OSError:  # a directory on the way cannot be searched: not a file in the way
        return None
    return None if found.is_dir() else found


def _why_not_creatable(path: Path) -> str:
    """Why no store can be created at ``path`` (path_access said None), for the log line."""
    in_the_way = file_in_the_way(path)
    return f"{in_the_way} is not a directory" if in_the_way else "its directory cannot be written or searched"


def _log_size(path: Path) -> int:
    try:
        return os.path.getsize(f"{path}-wal")
    except OSError:
        return 0


def _other_version(values) -> str | None:
    """The inductor_attn version named in a stored row's versions where it is not this package's (a row a newer
    version wrote, whose record this one may not read), else None."""
    from .._version import __version__

    try:
        version = json.loads(dict(zip(COLUMNS, values))["versions"]).get("inductor_attn")
    except (TypeError, ValueError, AttributeError, RecursionError):
        return None
    return version if isinstance(version, str) and version != __version__ else None


class _Undecodable(bytes):
    """A TEXT value that is not UTF-8 (a flipped bit on disk): its row fails ``_parse`` and is skipped alone. SQLite's
    own decoding would raise in the cursor, which reads as the whole store being unusable."""


def _text(raw: bytes) -> str | _Undecodable:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return _Undecodable(raw)


_OPENED: weakref.WeakSet = weakref.WeakSet()  # every store of this process, for the fork handlers below
_OPENED_LOCK = threading.Lock()


class DecisionStore:
    """One SQLite file of decisions. ``access`` (WRITE, READ, IMMUTABLE) is found from the filesystem when
    not given; passing READ or IMMUTABLE opens a writable file read-only all the same."""

    def __init__(self, path: Path | str | None = None, timeout_s: float = 30.0, access: str | None = None):
        self.path = Path(path) if path is not None else default_path()
        self.timeout_s = timeout_s
        if access not in (None, WRITE, READ, IMMUTABLE):
            raise ValueError(f"access must be one of {WRITE!r}, {READ!r}, {IMMUTABLE!r} or None, got {access!r}")
        self.access = access or path_access(self.path) or WRITE
        self.damage: list[str] = []
        self._broken: str | None = None
        self._opened = False
        self._warned_rows = False
        self._lock = threading.Lock()
        with _OPENED_LOCK:  # a fork walks the set
            _OPENED.add(self)

    def describe(self) -> str:
        return {WRITE: f"{self.path}", READ: f"{self.path} (read-only)",
                IMMUTABLE: f"{self.path} (read-only, immutable)"}[self.access]

    # -- connection ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _connect(self):
        first = not self._opened
        self._opened = True
        if first and self.access != IMMUTABLE:  # before SQLite replays the log and drops what follows damage
            self._report_damage(wal_damage(self.path))
        conn = self._open()
        try:
            if first:
                self._check_row_count(conn)
            yield conn
        finally:
            self._close(conn)

    def _open(self) -> sqlite3.Connection:
        if self.access == WRITE:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
        else:
            # decided at each open: once the owner closes the file its -wal and -shm go, and a mode=ro open would
            # make them again, as this process's own (the owner could not write through them)
            immutable = self.access == IMMUTABLE or not Path(f"{self.path}-shm").exists()
            flags = "mode=ro&immutable=1" if immutable else "mode=ro"
            conn = sqlite3.connect(f"{self.path.absolute().as_uri()}?{flags}", uri=True, timeout=self.timeout_s,
                                   isolation_level=None)
        conn.text_factory = _text
        try:
            conn.execute(f"PRAGMA busy_timeout={int(self.timeout_s * 1000)}")
            if self.access == WRITE:
                self._set_up(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _set_up(self, conn: sqlite3.Connection) -> None:
        """WAL mode and the tables. While another process writes a fresh file in its first journal mode,
        SQLite refuses the switch to WAL at once ("database is locked": it does not call the busy handler
        there), so the switch is retried here until the busy timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)
        conn.executescript(_SCHEMA)

    def _close(self, conn: sqlite3.Connection) -> None:
        conn.close()

    def _guard(self, action: str, fn, default=None):
        """Run ``fn(conn)``; on a store problem warn once, remember it and return ``default``. A read-only store
        is read again a few times first: its owner may be writing it just then (an immutable read of a file being
        checkpointed reads as malformed), and the WAL index it writes may appear or go between our opens."""
        if self._broken:
            return default
        for attempt in range(READ_RETRIES + 1):
            try:
                with self._lock, self._connect() as conn:
                    return fn(conn)
            except sqlite3.DatabaseError as err:
                # "locked": the busy timeout has already waited; a writable store is written, not read again
                if self.access == WRITE or attempt == READ_RETRIES or "locked" in str(err):
                    return self._give_up(action, err, default)
                time.sleep(0.05 * (attempt + 1))
            except (sqlite3.Error, OSError) as err:
                return self._give_up(action, err, default)

    def _give_up(self, action: str, err: Exception, default):
        self._broken = f"{type(err).__name__}: {err}"
        warnings.warn(
            f"inductor_attn: decision store {self.path} unusable while trying to {action} ({self._broken}); "
            "continuing without it for this process (decisions are tuned but not persisted)",
            RuntimeWarning, stacklevel=4,
        )
        return default

    @property
    def broken(self) -> str | None:
        return self._broken

    # -- damage ----------------------------------------------------------------------------------
    def _report_damage(self, what: str | None) -> None:
        if what is None:
            return
        self.damage.append(what)
        warnings.warn(f"inductor_attn: decision store {self.path} is damaged: {what} "
                      "(`python -m inductor_attn cache doctor` checks the rest)", RuntimeWarning, stacklevel=5)

    def _check_row_count(self, conn) -> None:
        # One statement, so both counts come from one snapshot even while another process prunes. CAST: a
        # garbled value reads as 0 (no claim) instead of raising; NULL when no write recorded a count.
        recorded, present = conn.execute(
            "SELECT (SELECT CAST(value AS INTEGER) FROM meta WHERE name = 'rows'), (SELECT count(*) FROM decisions)"
        ).fetchone()
        if recorded is not None and present < recorded:
            self._report_damage(f"its last write left {recorded} decisions, {present} are there now")

    # -- rows ------------------------------------------------------------------------------------
    def _parse(self, values) -> dict:
        """A stored row as a dict, checked against the schema (RowError if it does not match)."""
        row = dict(zip(COLUMNS, values))
        for column, value in row.items():
            if isinstance(value, _Undecodable):
                raise RowError(column, "is not UTF-8 text")
        for column in ("versions", "record"):
            try:
                row[column] = json.loads(row[column])
            except (TypeError, ValueError, RecursionError) as err:  # RecursionError: nested deeper than Python's stack
                raise RowError(column, f"is not JSON ({type(err).__name__}: {err})") from None
        return check_row(row)

    def _decode(self, values) -> dict | None:
        """``_parse``, but a bad row is skipped (None) with one warning per store; a row another version of the
        package wrote (:func:`_other_version`) is skipped without one: its key is never looked up here."""
        try:
            return self._parse(values)
        except RowError as err:
            if not self._warned_rows and not _other_version(values):
                self._warned_rows = True
                warnings.warn(f"inductor_attn: decision store {self.path}: skipping unreadable decision "
                              f"{_short_key(values[0])} ({err}), and any other; the next tune of its problem "
                              "replaces it", RuntimeWarning, stacklevel=4)
            return None

    def other_version_keys(self) -> list[str]:
        """The keys of rows another version of the package wrote that this one cannot read (:func:`_other_version`):
        stale here, as rows of another version are; ``cache prune`` deletes them."""
        def read(conn):
            keys = []
            for values in conn.execute(_SELECT):
                try:
                    self._parse(values)
                except RowError:
                    if _other_version(values):
                        keys.append(values[0])
            return keys

        return self._guard("list", read, default=[])

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

    def put_many(self, rows: list[dict], supersedes: bool = False) -> int:
        """Write ``rows`` in one transaction, so all or none are written; returns how many were. Each row
        is checked first: a bad one raises ValueError (RowError) and nothing is written. The revision
        changes when a row replaces one with another winner, or when ``supersedes`` says a row changes the
        answer another layer gave (layers.py)."""
        self._check_writable()
        values = [_encode(check_row(row)) for row in rows]
        if not values:  # a write would change the generation, and with it every FX-graph-cache key
            return 0
        key_at, winner_at = COLUMNS.index("key"), COLUMNS.index("winner")

        def write(conn):
            conn.execute("BEGIN IMMEDIATE")
            changed = supersedes or any(
                (old := conn.execute("SELECT winner FROM decisions WHERE key = ?", (v[key_at],)).fetchone())
                and old[0] != v[winner_at] for v in values)
            conn.executemany(f"INSERT OR REPLACE INTO decisions VALUES ({', '.join('?' * len(COLUMNS))})", values)
            _after_write(conn, changed)
            conn.execute("COMMIT")
            return len(values)

        return self._guard("write", write, default=0)

    def delete(self, keys: list[str]) -> int:
        """Delete the rows with these keys; returns how many there were."""
        self._check_writable()

        def remove(conn):
            conn.execute("BEGIN IMMEDIATE")
            n = sum(conn.execute("DELETE FROM decisions WHERE key = ?", (key,)).rowcount for key in keys)
            _after_write(conn, n > 0)
            conn.execute("COMMIT")
            return n

        return self._guard("delete", remove, default=0)

    def clear(self) -> int:
        self._check_writable()

        def wipe(conn):
            conn.execute("BEGIN IMMEDIATE")
            n = conn.execute("DELETE FROM decisions").rowcount
            _after_write(conn, n > 0)
            conn.execute("COMMIT")
            return n

        return self._guard("clear", wipe, default=0)

    def unmeasured(self) -> None:
        """A new revision with no row changed: this process's compiled code baked a choice that no stored row
        backs (a tune that ran out of memory), and a later process must tune instead of replaying that code
        from Inductor's cache, whose key holds the revision (lowering/graph_pass.py)."""
        self._check_writable()

        def bump(conn):
            conn.execute("BEGIN IMMEDIATE")
            _after_write(conn, True)
            conn.execute("COMMIT")

        self._guard("write", bump)

    def _check_writable(self) -> None:
        if self.access != WRITE:
            raise StoreError(f"decision store {self.describe()} is opened read-only; writes go to a writable layer")

    def generation(self) -> str:
        """Token that changes on every write; "" when the store is unusable (or a read-only one has none)."""
        return self._token("generation")

    def revision(self) -> str:
        """Token that changes only when a write changes an answer (module doc); a store written before
        revisions existed gets one at its first read, a read-only one answers with its generation."""
        return self._token("revision") or self.generation()

    def _token(self, name: str) -> str:
        def read_or_create(conn):
            row = conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
            if row or self.access != WRITE:
                return row[0] if row else ""
            conn.execute("INSERT OR IGNORE INTO meta VALUES (?, ?)", (name, uuid.uuid4().hex))
            return conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()[0]

        return self._guard("read", read_or_create, default="")

    def health(self) -> Health:
        """Integrity check, damage found at open, and every row sorted into good and bad (``cache doctor``)."""
        report = Health(self.describe())
        try:
            with self._lock, self._connect() as conn:
                report.integrity = [line for (line,) in conn.execute("PRAGMA integrity_check")]
                for values in conn.execute(f"{_SELECT} ORDER BY op, problem"):
                    try:
                        report.rows.append(self._parse(values))
                    except RowError as err:
                        if _other_version(values):
                            report.other_version.append(values[0])
                        else:
                            report.bad.append(f"{_short_key(values[0])}: {err}")
        except (sqlite3.Error, OSError) as err:
            report.error = f"{type(err).__name__}: {err}"
        report.damage = list(self.damage)
        return report

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
        return transfer.export_file(self, path)

    def import_json(self, path: str | Path) -> int:
        return transfer.import_file(self, path)


class MemoryStore(DecisionStore):
    """A store that lives as long as this process: the writable layer when no file can be written."""

    def __init__(self):
        super().__init__(":memory:", access=WRITE)
        self._opened = True  # it starts empty: no log or row count to check
        self._conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self._conn.executescript(_SCHEMA)

    def describe(self) -> str:
        return "memory (this process only)"

    def _open(self) -> sqlite3.Connection:
        return self._conn

    def _close(self, conn: sqlite3.Connection) -> None:
        pass  # closing would drop every row


def _short_key(key) -> str:
    return repr(key[:16] if isinstance(key, str) else key)


def _encode(row: dict) -> tuple:
    return tuple(json.dumps(row[c]) if c in ("versions", "record") else row[c] for c in COLUMNS)


def _after_write(conn, changed: bool) -> None:
    """In the write's transaction: a new generation (and revision, where ``changed``), and the row count
    that the next open checks."""
    conn.execute("INSERT OR REPLACE INTO meta VALUES ('generation', ?)", (uuid.uuid4().hex,))
    if changed:
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('revision', ?)", (uuid.uuid4().hex,))
    conn.execute("INSERT OR REPLACE INTO meta VALUES ('rows', (SELECT count(*) FROM decisions))")


def open_layers(primary: Path) -> LayeredStore:
    """The layers for a store at ``primary``: it when writable, else it read-only (if it exists) under a
    writable overlay, with one log line saying where new decisions go; then the shipped decision tables
    (priors.py), last, so any decision measured or imported here wins over them."""
    shipped = shipped_layers()
    access = path_access(primary)
    if access == WRITE:
        return LayeredStore(DecisionStore(primary, access=WRITE), shipped)
    read_only = [] if access is None else [DecisionStore(primary, access=access)]
    overlay = _overlay(primary)
    what = "is read-only: its decisions are used" if read_only else f"cannot be created ({_why_not_creatable(primary)})"
    log.warning("inductor_attn: decision store %s %s; new decisions go to %s", primary, what, overlay.describe())
    return LayeredStore(overlay, read_only + shipped)


def _overlay(primary: Path) -> DecisionStore:
    """The store in Inductor's cache dir if it is writable and not ``primary``, else memory."""
    try:
        path = Path(inductor_cache_dir()) / "inductor_attn" / "decisions.sqlite"
    except OSError:  # cache_dir() creates the directory
        return MemoryStore()
    if path != primary and path_access(path) == WRITE:
        return DecisionStore(path, access=WRITE)
    return MemoryStore()


_STORES: dict[Path, LayeredStore] = {}
_STORES_LOCK = threading.Lock()


def get_store() -> LayeredStore:
    """The process-wide store for the current location (re-read from the environment on each call)."""
    path = default_path()
    store = _STORES.get(path)
    if store is None:
        with _STORES_LOCK:  # one store per location: threads that raced here would each keep their own layers
            store = _STORES.get(path)
            if store is None:
                store = _STORES[path] = open_layers(path)
    return store


def _hold_for_fork() -> None:
    """Before a fork: wait until no thread of this process is inside a store, each of which holds its store's lock
    while it uses SQLite. A child forked while another thread was inside SQLite would find SQLite's own mutexes
    held for ever (its first store access hung); and one forked while a store's lock was held, that lock."""
    _STORES_LOCK.acquire()  # get_store's order: it opens stores (which join _OPENED) under _STORES_LOCK
    _OPENED_LOCK.acquire()
    for store in sorted(_OPENED, key=id):
        store._lock.acquire()
        _HELD.append(store)  # one by one: after the fork, exactly these are released


def _release_after_fork() -> None:
    for store in reversed(_HELD):
        store._lock.release()
    _HELD.clear()
    _OPENED_LOCK.release()
    _STORES_LOCK.release()


def _new_locks_in_child() -> None:
    global _STORES_LOCK, _OPENED_LOCK
    _STORES_LOCK, _OPENED_LOCK = threading.Lock(), threading.Lock()
    for store in _HELD:
        store._lock = threading.Lock()
    _HELD.clear()


_HELD: list = []
os.register_at_fork(before=_hold_for_fork, after_in_parent=_release_after_fork, after_in_child=_new_locks_in_child)
