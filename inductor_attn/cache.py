"""Looking inside the decision store: the Python side of ``python -m inductor_attn cache ...``.

Every function takes an optional ``store``: a DecisionStore (one file) or the process's layered store
(``get_store()``, the default: a writable store, then read-only ones).

>>> import inductor_attn
>>> rows = inductor_attn.cache.list_decisions()      # one dict per decision
>>> print(inductor_attn.cache.explain(rows[0]["key"][:8]))  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import socket
import time
import warnings
from pathlib import Path

from .problem import DECIDED_AT_COMPILE_TIME, Problem
from .store.db import DecisionStore, get_store
from .store.keys import ABSENT, library_versions, stale_reason, versions_like
from .store.layers import LayeredStore
from .store.priors import PriorTable, is_shipped
from .store.record import CandidateResult
from .store.schema import StoreError
from .tuning.step_cost import WALL_CLOCK, explain_choice, launch_costs

__all__ = ["DecisionStore", "StoreError", "get_store", "list_decisions", "show", "explain", "origin", "clear",
           "export", "export_priors", "import_decisions", "prune", "doctor", "plot", "short_problem"]


def short_problem(problem_key: str) -> str:
    """A compact label such as ``attention bf16 B4 H32/8 L4096x4096 D128 causal``."""
    p = Problem.from_key(problem_key)
    label = f"{p.op} {p.dtype} B{p.batch} H{p.heads_q}/{p.heads_kv} L{p.len_q}x{p.len_k} D{p.head_dim}"
    if p.head_dim_v != p.head_dim:
        label += f"/{p.head_dim_v}"
    if p.causal:
        label += " causal"
    if p.window_left >= 0 or p.window_right >= 0:
        label += f" window({p.window_left},{p.window_right})"
    if p.has_kv_seqlens:
        label += " kv_seqlens"
    if p.has_key_mask:
        label += " key_mask"
    if p.op == "paged":
        label += f" page{p.page_size} total_q{p.total_q}"
    if p.op == "block_sparse":
        density = "?" if p.density < 0 else f"{p.density:.2f}"
        label += f" blocks{p.block_q}x{p.block_kv} density{density}"
    return label


def _layered(store) -> LayeredStore:
    store = get_store() if store is None else store
    return store if isinstance(store, LayeredStore) else LayeredStore(store)


def _stale_check():
    """``(row, layer) -> reason or None``: does a row's versions still match this process's libraries and the
    source of each registered backend? A stale row's key is never looked up again. A shipped table's row is
    never stale: it answers for its bucket whatever its versions (store/priors.py); but one in another layer
    (an older ``cache export``, imported) answers for nothing."""
    from .backends import backends, source_hash

    sources = {b.name: source_hash(b) for b in backends()}

    def stale(row: dict, layer) -> str | None:
        if is_shipped(row):
            return None if isinstance(layer, PriorTable) else "a shipped table's decision outside its table"
        return stale_reason(row["versions"], versions_like(row["versions"]), sources)
    return stale


def list_decisions(store: DecisionStore | LayeredStore | None = None) -> list[dict]:
    """One summary per decision: key, op, problem label, device, winner, speedup vs default, ``store`` (the
    layer it comes from) and ``stale`` (why its versions no longer match, or None)."""
    stale = _stale_check()
    out, seen = [], set()
    for layer, rows in _layered(store).rows_by_layer():
        for row in rows:
            if row["key"] in seen:  # an earlier layer's row answers for this key
                continue
            seen.add(row["key"])
            winner = _winner_result(row)
            out.append({
                "key": row["key"], "op": row["op"], "problem": short_problem(row["problem"]),
                "device": row["device"], "winner": row["winner"], "default": row["record"]["default"],
                "speedup": None if winner is None else winner.get("speedup"), "store": layer.describe(),
                "stale": stale(row, layer),
            })
    return out


def _winner_result(row: dict) -> dict | None:
    return next((c for c in row["record"]["candidates"] if c["name"] == row["winner"]), None)


def _one(key_prefix: str, store) -> dict:
    store = _layered(store)
    rows = store.find(key_prefix)
    if not rows and store.broken:
        raise StoreError(f"the decision store is unreadable ({store.broken}); whether it holds a decision with "
                         f"a key starting with {key_prefix!r} is unknown")
    if len(rows) != 1:
        raise ValueError(f"key prefix {key_prefix!r} matches {len(rows)} decisions; give more characters"
                         if rows else f"no decision with a key starting with {key_prefix!r}")
    return rows[0]


def show(key_prefix: str, store: DecisionStore | LayeredStore | None = None) -> dict:
    """The whole stored row (versions, every candidate's samples) for one decision."""
    return _one(key_prefix, store)


def origin(row: dict, store: DecisionStore | LayeredStore | None = None) -> str:
    """Where a decision came from: tuned here (this host), a shipped table (store/priors.py), imported or
    shared (tuned on another host, in the writable store), or a read-only store."""
    rec = row["record"]
    if is_shipped(row):
        return rec["origin"]
    host = rec.get("host")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec["tuned_at"])) if rec.get("tuned_at") else "?"
    tuned = f"tuned on host {host} ({when})" if host else f"tuned ({when}; the host was not recorded)"
    store = _layered(store)
    layer = next((layer for layer, rows in store.rows_by_layer() if any(r["key"] == row["key"] for r in rows)),
                 store.writable)
    if layer is not store.writable:
        return f"read-only store {layer.describe()}: {tuned}"
    if host == socket.gethostname():
        return f"tuned here ({when})"
    return f"imported or shared: {tuned}"


def explain(key_prefix: str, store: DecisionStore | LayeredStore | None = None) -> str:
    """Why the winner won: where the decision came from, how it was searched, and every candidate with its
    median time, CI, correctness and reasons."""
    row = _one(key_prefix, store)
    rec = row["record"]
    lines = [
        f"decision {row['key'][:16]}  {row['op']}",
        f"  came from:        {origin(row, store)}",
        f"  problem (bucket): {short_problem(row['problem'])}",
        f"  measured on:      {short_problem(rec['problem'])}  ({rec['timer']} timer)",
        f"  device:           {row['device']}",
        "  versions:         " + ", ".join(f"{k} {v}" for k, v in row["versions"].items() if k != "sources"),
        f"  winner:           {row['winner']}  (default {rec['default']})",
        f"  why:              {rec['why']}",
        *_compiled_lines(rec, row["winner"], Problem.from_key(row["problem"]).op),
        *_pairing_lines(row),
        *_search_lines(rec),
        "",
        f"  {'candidate':44s} {'status':8s} {'median ms':>10s} {'speedup':>8s} {'95% CI':>15s} "
        f"{'rel.err':>8s} {'1st call s':>10s} {'host ms':>8s}  reason",
    ]
    weighed = {c.name: c.host_ms for c in launch_costs(rec)}  # the host times the rule of compiled code reads
    for c in rec["candidates"]:
        mark = "*" if c["name"] == row["winner"] else " "
        ci = f"{c['ci_low']:.3f}-{c['ci_high']:.3f}" if c.get("ci_low") is not None else ""
        host = weighed.get(c["name"], c.get("host_ms"))
        through_op = " + the launch op's cost in a graph" if c.get("traced") is False else ""
        pooled = (f"host: its launch path's median{through_op}; its own probe {c['host_ms']:.4f} ms"
                  if host is not None and c.get("host_ms") is not None and host != c["host_ms"] else "")
        lines.append(
            f"{mark} {c['name'][:44]:44s} {c['status']:8s} {_fmt(c.get('median_ms'), '.4f'):>10s} "
            f"{_fmt(c.get('speedup'), '.3f'):>8s} {ci:>15s} {_fmt(c.get('error'), '.1e'):>8s} "
            f"{_fmt(c.get('compile_s'), '.2f'):>10s} {_fmt(host, '.4f'):>8s}  "
            f"{c.get('reason') or c.get('note') or pooled}"
        )
    return "\n".join(lines)


def library_of(choice: str, versions: dict) -> str:
    """The library whose kernel a choice runs, with the version a decision row recorded: the first distribution
    of its backend's library, torch for those that list none (SDPA, flex, the reference).

    >>> library_of("sdpa:kernel=cudnn", {"torch": "2.13.0"})
    'torch 2.13.0'
    """
    dist = _distribution(choice)
    return f"{dist} {versions.get(dist, ABSENT)}"


def _distribution(choice: str) -> str:
    """The first distribution of a choice's backend's library; torch for those that list none."""
    from .backends import backends

    requires = next((b.library.distributions for b in backends() if b.name == choice.partition(":")[0]), ())
    return requires[0] if requires else "torch"


def _pairing_lines(row: dict) -> list[str]:
    """For a backward decision: whose forward out and lse the gate fed its candidates, and whether that forward
    and the winner are of different libraries (a backward takes any forward's out and lse: layout.py)."""
    rec = row["record"]
    if rec.get("direction") != "backward":
        return []
    forward = rec.get("paired_with")
    if not forward:
        return ["  paired with:      the reference's out and lse (no forward was decided in the tuning process)"]
    fwd, bwd = library_of(forward, row["versions"]), library_of(row["winner"], row["versions"])
    cross = "out and lse cross libraries" if _distribution(forward) != _distribution(row["winner"]) else "one library"
    return [f"  paired with:      forward {forward} ({fwd}), backward {row['winner']} ({bwd}): {cross}; gated as a "
            f"pair (the forward's out and lse in, gradients against the reference's)"]


def _search_lines(rec: dict) -> list[str]:
    """How the tuner searched (tuner.py): staged, exhaustive or a shipped shortlist; the noise between
    timing sessions; seconds per phase. Records from before these were kept have none of them."""
    lines = []
    if rec.get("search"):
        lines.append(f"  search:           {rec['search']}")
    if rec.get("noise") is not None or rec.get("noise_note"):
        noise = "not measured" if rec.get("noise") is None else f"{rec['noise']:.1%}"
        lines.append(f"  noise:            {noise}: {rec.get('noise_note', '')}")
    if rec.get("seconds"):
        lines.append("  seconds:          " + ", ".join(f"{k} {v:.2f}" for k, v in rec["seconds"].items()))
    return lines


def _compiled_lines(rec: dict, winner: str, op: str) -> list[str]:
    """What compiled code runs, by the rule of tuning/step_cost.py on the record's device and host times: the
    winner under CUDA graphs; with plain launches it depends on how host-bound the rest of the graph is (its
    host time H minus its device time D, per call of this bucket, as lowering/graph_cost.py estimates them;
    the INFO log of ``inductor_attn.lowering.emit`` says what each compiled graph chose and why). Ops decided at
    run time (varlen, block-sparse) run the winner in compiled code too: the rule is applied at compile time."""
    if rec.get("timer") == WALL_CLOCK:
        return [f"  compiled code:    {winner}  (timed by the wall clock, its launch included)"]
    if op not in DECIDED_AT_COMPILE_TIME:
        return [f"  compiled code:    {winner}  ({op} calls are decided at run time: the winner runs)"]
    lines = explain_choice(winner, launch_costs(rec))
    return [f"  compiled code:    {lines[0]}", *(f"                    {line}" for line in lines[1:])]


def _fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def clear(store: DecisionStore | LayeredStore | None = None) -> int:
    """Delete every decision of the writable store (returns how many; read-only stores are never changed);
    this process's remembered choices are dropped too."""
    from .tuning.decisions import forget_choices

    forget_choices()
    store = _layered(store)
    deleted = store.clear()
    if store.broken:
        raise StoreError(f"the decision store is unusable ({store.broken}); nothing was deleted")
    return deleted


def prune(store: DecisionStore | LayeredStore | None = None) -> tuple[int, int]:
    """Delete the stale decisions (see ``list_decisions``) of the writable store. Returns (how many were
    deleted, how many stale ones read-only stores keep)."""
    store = _layered(store)
    stale = _stale_check()
    by_layer = {id(layer): [row["key"] for row in rows if stale(row, layer)]
                for layer, rows in store.rows_by_layer()}
    writable = by_layer.pop(id(store.writable)) + store.writable.other_version_keys()
    deleted = store.delete(writable) if writable else 0
    if store.broken:
        raise StoreError(f"the decision store is unusable ({store.broken}); nothing was deleted")
    return deleted, sum(map(len, by_layer.values()))


def export(path: str | Path, store: DecisionStore | LayeredStore | None = None) -> int:
    """Write every decision to a JSON file (to ship tuned decisions with a model). The file is replaced
    only once the new one is complete; an unreadable store raises StoreError and leaves it as it was."""
    return _layered(store).export_json(path)


def export_priors(path: str | Path | None = None, store: DecisionStore | LayeredStore | None = None, *,
                  device=None, commit: str | None = None, command: str = "") -> tuple[Path, int]:
    """Write the decisions measured for ``device`` (default: this machine's GPU) with this process's library
    versions and backend sources as a shipped table (store/priors.py), with the device, the versions, the
    commit and ``command`` inside, without timing samples and host names: to ``path``, default
    ``inductor_attn/priors/<device>.json``. Decisions read from shipped tables are not exported again.
    Returns (path, how many decisions)."""
    import torch

    from .bench.runner import git_commit
    from .device import device_info
    from .store.priors import PACKAGE_DIR, device_slug, write_table
    from .backends.registry import required_distributions
    from .store.schema import COLUMNS

    dev = device or device_info("cuda" if torch.cuda.is_available() else "cpu")
    if path is None and dev.arch == 0:  # every later process loads the package's tables: they hold GPUs' decisions
        raise ValueError("export-priors writes into the package's shipped tables only on a GPU; on a CPU pass --out "
                         "FILE")
    stale = _stale_check()
    store = _layered(store)
    rows = [_shippable({c: row[c] for c in COLUMNS}) for row in store.rows()
            if row["device"] == dev.key() and not is_shipped(row) and not stale(row, store.writable)]
    if store.broken:
        raise StoreError(f"the decision store is unreadable ({store.broken}); no table was written")
    if not rows:
        raise ValueError(f"no current decisions for {dev.key()} in {store.describe()}: tune first (`cache "
                         "export-priors --tune all` tunes the bench suites' workloads)")
    target = Path(path) if path is not None else PACKAGE_DIR / f"{device_slug(dev.name)}.json"
    meta = {"device": dev.name, "device_key": dev.key(), "versions": library_versions(required_distributions()),
            "commit": commit or git_commit(), "command": command}
    write_table(target, rows, meta)
    return target, len(rows)


def _shippable(row: dict) -> dict:
    """A row for a table that ships in the package: its candidates keep their statistics (what the
    shortlist and ``cache explain`` read) but not every timing sample, and the measuring machine's host
    name is left out (the table names the device). Measured figures (timings, the noise, phase seconds; not
    times of day) keep four significant digits, finer than any timing's noise (0.3% at the least between
    sessions), and a candidate's fields that hold their defaults are left out (readers take
    ``CandidateResult``'s defaults): a third off a table's size."""
    defaults = {f.name: f.default for f in dataclasses.fields(CandidateResult)
                if f.default is not dataclasses.MISSING}
    candidates = [{k: _four_digits(v) for k, v in c.items()
                   if k != "samples" and (k not in defaults or v != defaults[k])}
                  for c in row["record"]["candidates"]]
    record = row["record"]
    seconds = {k: _four_digits(v) for k, v in (record.get("seconds") or {}).items()}
    return {**row, "record": {**record, "noise": _four_digits(record.get("noise")), "seconds": seconds,
                              "candidates": candidates, "host": ""}}


def _four_digits(value):
    """A float to four significant digits; any other value as it is.

    >>> _four_digits(0.030248820520297), _four_digits(1.1723), _four_digits(3), _four_digits(None)
    (0.03025, 1.172, 3, None)
    """
    return float(f"{value:.4g}") if isinstance(value, float) else value


def import_decisions(path: str | Path, store: DecisionStore | LayeredStore | None = None) -> int:
    """Add the decisions of a JSON export to the writable store (rows with the same key are replaced);
    returns how many were written. The whole file is checked first: a bad one raises ValueError naming the
    row and the field, and nothing is written (store/transfer.py)."""
    from .tuning.decisions import forget_choices

    forget_choices()
    return _layered(store).import_json(path)


def doctor(store: DecisionStore | LayeredStore | None = None) -> tuple[str, bool]:
    """Check every layer: SQLite's integrity_check, damage found at open, rows that fail the schema, and
    the rows per library versions (stale or current). Returns (report, whether all is well)."""
    stale = _stale_check()
    store = _layered(store)
    lines, healthy = [], True
    with warnings.catch_warnings():  # damage found at open is in the report
        warnings.simplefilter("ignore", RuntimeWarning)
        reports = [(layer.health(), layer) for layer in store.layers]
    for report, layer in reports:
        lines += _health_lines(report, lambda row: stale(row, layer), layer is store.writable)
        healthy &= report.error is None and report.integrity == ["ok"] and not report.bad and not report.damage
    return "\n".join(lines), healthy


def _health_lines(report, stale, writable: bool) -> list[str]:
    lines = [report.where]
    if report.error:
        return lines + [f"  unreadable: {report.error}"]
    lines.append(f"  integrity_check: {'; '.join(report.integrity[:5])}")
    lines += [f"  damage: {what}" for what in report.damage]
    lines.append(f"  {len(report.rows)} decisions, {len(report.bad)} unreadable")
    lines += [f"    unreadable {what}" for what in report.bad[:10]]
    if report.other_version:
        fate = "`cache prune` deletes them" if writable else "a read-only store, which `cache prune` leaves"
        lines.append(f"  {len(report.other_version)} written by another inductor_attn version in a form this one "
                     f"cannot read (stale: never looked up here; {fate})")
    per_version = collections.Counter(_library_label(row["versions"]) for row in report.rows)
    current = {label for row in report.rows
               if (label := _library_label(row["versions"])) == _library_label(versions_like(row["versions"]))}
    for label, n in per_version.most_common():
        lines.append(f"    {n:5d}  {label}{'  (current)' if label in current else ''}")
    n_stale = sum(1 for row in report.rows if stale(row))
    if n_stale:
        lines.append(f"  {n_stale} stale (never looked up again; `cache list` says why): "
                     + ("`cache prune` deletes them" if writable else "a read-only store, which `cache prune` leaves"))
    return lines


def _library_label(versions: dict) -> str:
    """torch and this package first, then the rest by name: one label whatever order a file keeps them in."""
    names = sorted(set(versions) - {"sources"}, key=lambda name: (name != "torch", name != "inductor_attn", name))
    return ", ".join(f"{name} {versions[name]}" for name in names)


def plot(path: str | Path, store: DecisionStore | LayeredStore | None = None) -> int:
    """Draw each decision's winner and its speedup over the default (with the 95% CI) to ``path``, one bar per
    decision, labelled with its problem, op, device and key (``cache explain KEY`` tells more): a PNG unless the
    file name ends in another format matplotlib writes (.svg, .pdf). Needs matplotlib (the ``plot`` extra):
    ImportError without it."""
    from .store.transfer import file_to_write

    path = file_to_write(path)
    try:
        import matplotlib
    except ImportError:
        raise ImportError("cache plot needs matplotlib: pip install 'inductor-attn[plot]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    store = _layered(store)
    rows = store.rows()
    if store.broken:
        raise StoreError(f"the decision store is unreadable ({store.broken}); {path} was not drawn")
    if not rows:
        raise ValueError("the decision store is empty: nothing to plot")
    labels, speedups, lows, highs, winners = [], [], [], [], []
    for row in rows:
        w = _winner_result(row) or {}
        labels.append(f"{short_problem(row['problem'])}\n{row['op']} on {row['device'].split('|')[0]}, "
                      f"key {row['key'][:8]}")
        s = w.get("speedup") or 1.0
        speedups.append(s)
        lows.append(s - (w.get("ci_low") or s))
        highs.append((w.get("ci_high") or s) - s)
        winners.append(row["winner"].split(":")[0])
    colors = {name: f"C{i}" for i, name in enumerate(sorted(set(winners)))}
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(rows) + 1.5), layout="constrained")
    ys = range(len(rows))
    ax.barh(ys, speedups, xerr=[lows, highs], color=[colors[w] for w in winners], capsize=3)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(list(ys), labels, fontsize=7)
    ax.set_xlabel("speedup of the winner over the default candidate (95% CI)")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()], labels=list(colors),
               title="winner", fontsize=7, loc="outside right upper")
    # as wide as the longest label needs, plus room for the bars: the layout fits the rest
    widest = max(label.get_window_extent(fig.canvas.get_renderer()).width for label in ax.get_yticklabels())
    fig.set_figwidth(widest / fig.dpi + 8)
    suffix = path.suffix[1:].lower()  # the file is written where it was asked for, not with a .png added
    fig.savefig(path, dpi=120, format=suffix if suffix in fig.canvas.get_supported_filetypes() else "png")
    plt.close(fig)
    return len(rows)
