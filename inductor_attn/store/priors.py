"""Shipped decision tables ("priors"): decisions measured on the GPUs this project measures on (H100,
H200), kept as JSON inside the package and read as the last read-only layers of the store.

A table is ``inductor_attn/priors/<device>.json``: an export file (``schema``, ``decisions``; so
``cache import`` reads it too) with what it was measured with: ``device``, ``versions``, ``commit``,
``created`` and the ``command`` that produced it (``python -m inductor_attn cache export-priors``,
README). ``INDUCTOR_ATTN_PRIORS`` names another directory or file, or ``off``.

How decisions use them (tuning/decisions.py), for the same op, bucket and device:
- autotune: the shipped decision shortens the search: only the candidates of its record within
  ``SHORTLIST_MARGIN`` of its winner (by median time, at most ``SHORTLIST``) are measured here, and the
  result is stored as a decision of this machine. A candidate further behind would have to gain more than
  that on a machine of the same model to matter, and each one costs a JIT compile (seconds for each FA4
  config on an H100 or H200, 2026-11); when none of them runs here, the whole search runs. Candidates compile
  before timing (tuning/precompile.py: FA4's at once in workers, or one after another in this process when
  few; Triton's in threads of this process), so a long compile adds to a cold tune's wait: a
  near-tie whose recorded compile took more than ``SHORTLIST_COMPILE_FACTOR`` times the fastest
  candidate's (which must compile anyway; at least ``SHORTLIST_COMPILE_FLOOR_S``) is left out, as its gain
  is within the margin. Configs of one library rise and fall together from one session to the next, two
  libraries do not: at B2 H32 L16k D128 causal on an H200, FA3's kernel was 3.5% behind FA4's in one tune
  and 7.7% ahead of it in a bench run the same day (2026-11-29). So each other library's fastest
  candidate within the margin widened by the record's own measured noise is timed too, under the same
  compile bound (``rivals``);
- cache-only: the shipped winner is used as it is;
- background: the shipped winner runs until the background tune's decision lands (when it is FA4's,
  the fastest shipped candidate of another backend, so that the first compile waits for no FA4 JIT).

A shipped row answers for its bucket whatever the library versions it was measured with (``match``):
kernels rarely swap places between releases, and the shortlist is timed again here anyway. Its record
carries ``origin`` ("shipped: <file> (...)"), which ``cache explain`` shows. A table that cannot be read
gives one warning and is skipped: everything else goes on without it, and ``cache doctor`` names it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import uuid
import warnings
from pathlib import Path

from .schema import FORMAT_VERSION, Health, check_export, is_shipped  # noqa: F401 - is_shipped: read from here too
from .transfer import file_to_write

ENV_VAR = "INDUCTOR_ATTN_PRIORS"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / "priors"
# The winner and its runner-up: a third near-tie costs one more JIT compile (3.6-5.9 s each for FA4 on an H100,
# where near-ties compile one after another) to catch a swing the tuner's 2% tie margin mostly absorbs anyway.
SHORTLIST = 2
SHORTLIST_MARGIN = 0.03  # the cold-tuning issue's worst-case regret bound
SHORTLIST_COMPILE_FACTOR = 1.5
SHORTLIST_COMPILE_FLOOR_S = 2.0  # compiles shorter than this (SDPA's, most Triton configs) all count as cheap


def device_slug(name: str) -> str:
    """File name stem for a device's table.

    >>> device_slug("NVIDIA H100 80GB HBM3"), device_slug("NVIDIA H200")
    ('nvidia-h100-80gb-hbm3', 'nvidia-h200')
    """
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def table_paths() -> list[Path]:
    """The tables this process reads: every ``*.json`` in the package's priors directory, or in what
    ``INDUCTOR_ATTN_PRIORS`` names (a directory or one file); none when it is ``off``. A path it names that
    does not exist, and anything but a regular file (a FIFO would block the read), give a warning."""
    where = os.environ.get(ENV_VAR)
    if where == "off":
        return []
    path = Path(where) if where else PACKAGE_DIR
    if not path.exists():
        if where:
            warnings.warn(f"inductor_attn: {ENV_VAR} names {path}, which does not exist: no shipped decision "
                          "tables are read", RuntimeWarning, stacklevel=3)
        return []
    found = sorted(path.glob("*.json")) if path.is_dir() else [path]
    for other in (p for p in found if not p.is_file()):
        warnings.warn(f"inductor_attn: shipped decision table {other} is not a regular file; skipped",
                      RuntimeWarning, stacklevel=3)
    return [p for p in found if p.is_file()]


class PriorTable:
    """One shipped table as a read-only store layer (store/layers.py): ``get`` by exact key, ``rows``, and
    ``match`` by op, bucket and device whatever the versions."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._rows: list[dict] | None = None
        self._meta: dict = {}
        self._error: str | None = None
        self._generation: str | None = None

    def _load(self) -> list[dict]:
        # published whole: a thread reading while another loads must see the rows or load them itself, never
        # an empty table
        rows = self._rows
        if rows is None:
            try:
                data = json.loads(self.path.read_bytes())
                found = check_export(data, str(self.path))
            except (OSError, ValueError, RecursionError) as err:  # RecursionError: JSON nested past Python's stack
                self._error = f"{type(err).__name__}: {err}"
                warnings.warn(f"inductor_attn: shipped decision table {self.path} is unusable ({self._error}); "
                              "continuing without it", RuntimeWarning, stacklevel=4)
                rows = self._rows = []
                return rows
            self._meta = {k: v for k, v in data.items() if k != "decisions"}
            origin = f"shipped: {self.path.name} ({self.summary()})"
            rows = self._rows = [{**row, "record": {**row["record"], "origin": origin}} for row in found]
        return rows

    def summary(self) -> str:
        """Where and with what the table was measured, e.g. ``NVIDIA H200, torch 2.11.0, commit abc1234``."""
        meta = self._meta
        torch_version = meta.get("versions", {}).get("torch", "?")
        return f"{meta.get('device', '?')}, torch {torch_version}, commit {meta.get('commit', '?')}"

    def describe(self) -> str:
        self._load()
        return f"{self.path} (shipped, read-only: {self.summary()})"

    # A store layer that is broken makes imports, exports and listings refuse (their result would be
    # wrong); an unreadable table is only skipped with its warning, as if absent. ``error`` says why.
    broken = None

    @property
    def error(self) -> str | None:
        """Why the table cannot be read, or None."""
        self._load()
        return self._error

    def get(self, key: str) -> dict | None:
        return next((row for row in self._load() if row["key"] == key), None)

    def rows(self) -> list[dict]:
        return list(self._load())

    def match(self, op: str, problem: str, device: str) -> dict | None:
        """The table's decision for this op (with direction), bucket key and device key, measured with any
        versions; among several, the newest."""
        found = [r for r in self._load() if (r["op"], r["problem"], r["device"]) == (op, problem, device)]
        return max(found, key=lambda r: r["created"], default=None)

    def generation(self) -> str:
        """The table's content hash, read once: the FX-graph-cache guard asks at every compile."""
        if self._generation is None:
            try:
                self._generation = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
            except OSError:
                self._generation = ""
        return self._generation

    def revision(self) -> str:
        return self.generation()

    def health(self) -> Health:
        report = Health(self.describe())
        if self.error:
            report.error = self.error
        else:
            report.integrity, report.rows = ["ok"], self.rows()
        return report


def shipped_layers() -> list[PriorTable]:
    return [PriorTable(path) for path in table_paths()]


def shipped_match(store, fields: dict) -> dict | None:
    """The shipped decision for the op, bucket and device of ``fields`` (decision_fields), from the
    store's shipped layers: one with the same key first, else any versions."""
    tables = [layer for layer in getattr(store, "read_only", []) if isinstance(layer, PriorTable)]
    for table in tables:
        row = table.get(fields["key"])
        if row is not None:
            return row
    matches = [row for t in tables if (row := t.match(fields["op"], fields["problem"], fields["device"]))]
    return max(matches, key=lambda r: r["created"], default=None)


def shortlist(row: dict, k: int, margin: float | None = None, compile_factor: float | None = None,
              rivals: bool = False) -> list[str]:
    """A decision's winner, then the other candidates that passed in its record, fastest first, ``k`` in all;
    with ``margin``, only those within that fraction of the winner's time; with ``compile_factor``, only those
    whose recorded compile took at most that many times the winner's (or ``SHORTLIST_COMPILE_FLOOR_S``, if more).
    With ``rivals`` (and ``margin``), then the fastest of each backend not yet named whose time is within
    ``margin`` plus the record's ``noise`` of the winner's and whose compile is within the same bound.

    Anchored on the winner, not on the fastest: a winner that tied a faster candidate inside the noise won by
    prior order (FA3's prebuilt kernel before FA4's JIT), and a JIT kernel that was no better need not be
    compiled again on a first compile.

    >>> rec = {"candidates": [{"name": "a:x", "status": "passed", "median_ms": 2.0},
    ...                       {"name": "b:y", "status": "passed", "median_ms": 1.0, "compile_s": 3.0},
    ...                       {"name": "d:w", "status": "passed", "median_ms": 1.02, "compile_s": 13.0},
    ...                       {"name": "e:v", "status": "passed", "median_ms": 1.03, "compile_s": 4.0},
    ...                       {"name": "c:z", "status": "failed", "median_ms": None}]}
    >>> shortlist({"winner": "b:y", "record": rec}, 3), shortlist({"winner": "b:y", "record": rec}, 3, margin=0.03)
    (['b:y', 'd:w', 'e:v'], ['b:y', 'd:w', 'e:v'])
    >>> shortlist({"winner": "b:y", "record": rec}, 3, margin=0.03, compile_factor=1.5)
    ['b:y', 'e:v']
    >>> shortlist({"winner": "e:v", "record": rec}, 3, margin=0.03, compile_factor=1.5)  # d:w compiles 13 s
    ['e:v', 'b:y']
    >>> rec["candidates"].append({"name": "f:u", "status": "passed", "median_ms": 1.05, "compile_s": 0.01})
    >>> rec["noise"] = 0.03  # f:u is 5% behind b:y: within 3% + 3%
    >>> shortlist({"winner": "b:y", "record": rec}, 2, margin=0.03, compile_factor=1.5, rivals=True)
    ['b:y', 'e:v', 'f:u']
    """
    timed = [c for c in row["record"]["candidates"] if c["status"] == "passed" and c.get("median_ms") is not None]
    timed.sort(key=lambda c: (c["name"] != row["winner"], c["median_ms"]))
    if not timed:
        return []
    first, rest = timed[0], timed[1:]
    if compile_factor is not None:
        bound = compile_factor * max(first.get("compile_s") or 0.0, SHORTLIST_COMPILE_FLOOR_S)
        rest = [c for c in rest if (c.get("compile_s") or 0.0) <= bound]
    near = rest if margin is None else [c for c in rest if c["median_ms"] <= first["median_ms"] * (1 + margin)]
    chosen = [first, *near][:k]
    if rivals and margin is not None:
        wide = first["median_ms"] * (1 + margin + (row["record"].get("noise") or 0.0))
        named = {c["name"].split(":")[0] for c in chosen}
        for c in rest:
            backend = c["name"].split(":")[0]
            if c["median_ms"] <= wide and backend not in named:
                named.add(backend)
                chosen.append(c)
    return [c["name"] for c in chosen]


def table_text(body: dict) -> str:
    """A table's JSON as the package ships it: the header indented, one line per decision. A decision with its
    candidates' statistics is a few KB; a line each keeps a regenerated table's diff per decision at three quarters
    of the indented size."""
    head = json.dumps({k: v for k, v in body.items() if k != "decisions"}, indent=1)
    rows = ",\n".join("  " + json.dumps(row, separators=(",", ":")) for row in body["decisions"])
    return head[:-2] + ',\n "decisions": [\n' + rows + "\n ]\n}\n"


def write_table(path: Path, rows: list[dict], meta: dict) -> None:
    """Write a table: ``meta`` (device, versions, commit, created, command) and the rows. Written next to
    the target and renamed over it when complete, so a failure leaves an existing table whole."""
    target = file_to_write(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = {"schema": FORMAT_VERSION, "created": created, **meta, "decisions": rows}
    try:
        tmp.write_text(table_text(body))
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
