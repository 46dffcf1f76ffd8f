"""Decision files: an import is checked whole before anything is written; an export replaces its target
only once it is complete. ``store`` is a DecisionStore or a LayeredStore."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from .schema import COLUMNS, FORMAT_VERSION, StoreError, check_export


def import_file(store, path: str | Path) -> int:
    """Add every decision of an export file in one transaction; returns how many were written.

    Raises FileNotFoundError/OSError if the file cannot be read, ValueError naming the file, the row and
    the field if any row is bad (nothing is written then), StoreError if the store cannot be written."""
    rows = read_export(path)
    written = store.put_many(rows)
    if store.broken:
        raise StoreError(f"the decision store is unusable ({store.broken}); nothing from {path} was imported")
    return written


def export_file(store, path: str | Path) -> int:
    """Write every decision ``store`` can read to ``path``; returns how many. An unreadable store raises
    StoreError and leaves ``path`` as it was."""
    rows = store.rows()
    if store.broken:
        raise StoreError(f"the decision store is unreadable ({store.broken}); {path} was left as it was")
    write_export(path, [{c: row[c] for c in COLUMNS} for row in rows])
    return len(rows)


def read_export(path: str | Path) -> list[dict]:
    """The checked rows of an export file (see schema.check_export)."""
    path = Path(path)
    data = path.read_bytes()
    try:
        parsed = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a JSON file ({err})") from None
    return check_export(parsed, str(path))


def write_export(path: str | Path, rows: list[dict]) -> None:
    """Write rows as an export file. A temporary file in the target's directory is renamed over the target
    once written and synced, so a failure at any point leaves an existing file whole."""
    target = Path(path).resolve()
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
