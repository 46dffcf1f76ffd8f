"""What a process reads and writes: one writable store first, then read-only stores.

``get`` asks each layer in order and returns the first hit, so decisions measured on this machine win
over those read from elsewhere. ``rows`` is the union (an earlier layer's row wins for a key). Writes,
``clear`` and ``delete`` touch only the writable layer: a read-only layer is never changed.

A read-only layer needs ``path``, ``describe()``, ``broken``, ``get``, ``rows``, ``generation``,
``revision`` and, for ``cache doctor``, ``health()``. Today the layers are SQLite files on read-only
paths (db.py opens them with ``mode=ro``); a decision table shipped inside the package becomes one more
read-only layer after them, in ``db.open_layers``.
"""

from __future__ import annotations

import time
from pathlib import Path

from . import transfer
from .schema import is_shipped


class LayeredStore:
    def __init__(self, writable, read_only=()):
        self.writable = writable
        self.read_only = list(read_only)

    @property
    def layers(self) -> list:
        return [self.writable, *self.read_only]

    @property
    def path(self) -> Path:
        """Where new decisions go."""
        return self.writable.path

    def describe(self) -> str:
        return " + ".join(layer.describe() for layer in self.layers)

    @property
    def broken(self) -> str | None:
        """The first unusable layer and why, or None."""
        return next((f"{layer.describe()}: {layer.broken}" for layer in self.layers if layer.broken), None)

    def get(self, key: str) -> dict | None:
        return next((row for layer in self.layers if (row := layer.get(key)) is not None), None)

    def rows_by_layer(self) -> list[tuple[object, list[dict]]]:
        return [(layer, layer.rows()) for layer in self.layers]

    def rows(self) -> list[dict]:
        seen: dict[str, dict] = {}
        for _, rows in self.rows_by_layer():
            for row in rows:
                seen.setdefault(row["key"], row)
        return sorted(seen.values(), key=lambda r: (r["op"], r["problem"]))

    def find(self, prefix: str) -> list[dict]:
        """Rows whose key starts with ``prefix`` (keys are long hashes; a few characters suffice)."""
        return [r for r in self.rows() if r["key"].startswith(prefix)]

    def generation(self) -> str:
        """Changes whenever any layer's decisions change (the FX-graph-cache guard hashes it)."""
        return "+".join(layer.generation() for layer in self.layers)

    def revision(self) -> str:
        """Changes whenever any layer's answers change (db.py's module doc says which writes do)."""
        return "+".join(layer.revision() for layer in self.layers)

    def put(self, row: dict) -> None:
        self.put_many([{**row, "created": row.get("created") or time.time()}])

    def put_many(self, rows: list[dict]) -> int:
        # a row that changes what a read-only store answered changes an answer too (a shipped decision is
        # never used as is where the revision is what counts: autotune re-measures it)
        supersedes = any((old := layer.get(row["key"])) is not None and not is_shipped(old)
                         and old["winner"] != row["winner"] for row in rows for layer in self.read_only)
        return self.writable.put_many(rows, supersedes=supersedes)

    def delete(self, keys: list[str]) -> int:
        return self.writable.delete(keys)

    def clear(self) -> int:
        return self.writable.clear()

    def unmeasured(self) -> None:
        self.writable.unmeasured()

    def claim(self, name: str, host: str, pid: int, is_stale) -> dict | None:
        """Claims (tuning/ranks.py) live in the writable layer, shared with the processes that write it."""
        return self.writable.claim(name, host, pid, is_stale)

    def release(self, name: str, host: str, pid: int) -> None:
        self.writable.release(name, host, pid)

    def export_json(self, path: str | Path) -> int:
        return transfer.export_file(self, path)

    def import_json(self, path: str | Path) -> int:
        return transfer.import_file(self, path)
