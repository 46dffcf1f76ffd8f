"""Command line: ``python -m inductor_attn {demo,cache,bench}``.

Building the parser imports only argparse, and each command imports what it needs when it runs: the
bench package parses its own options (``bench_parser``), so ``--help`` and ``cache list`` never load it,
Inductor or matplotlib.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings

DESCRIPTION = ("torch.compile picks the fastest correct attention kernel per shape, by measurement: demo shows it, "
               "cache inspects the decisions it keeps, bench measures it")
BENCH_HELP = ("benchmark suite: autotuned vs SDPA default, backend defaults, hand rules, oracle (needs a GPU; "
              "--smoke runs tiny shapes anywhere)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inductor_attn", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile a small transformer block and show which kernels ran")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")

    cache = sub.add_parser("cache", help="inspect the decision store")
    verbs = cache.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="one line per decision; stale ones are marked")
    for verb, text in (("show", "the whole stored row as JSON"), ("explain", "why the winner won")):
        verbs.add_parser(verb, help=text).add_argument("key", help="a decision key (a unique prefix suffices)")
    verbs.add_parser("clear", help="delete every decision of the writable store")
    verbs.add_parser("prune", help="delete the writable store's stale decisions (never looked up again)")
    verbs.add_parser("doctor", help="integrity check, damage, unreadable rows, rows per library versions")
    for verb, text in (("export", "write decisions to a JSON file"), ("import", "add decisions from a JSON file"),
                       ("plot", "draw winners and speedups to a PNG")):
        verbs.add_parser(verb, help=text).add_argument("file")
    priors = verbs.add_parser("export-priors", help="write this GPU's decisions as a shipped table "
                                                    "(inductor_attn/priors/<device>.json)")
    priors.add_argument("--out", default=None, help="where to write it (default: the package's priors directory)")
    priors.add_argument("--tune", nargs="+", default=None, metavar="SUITE",
                        choices=("dense", "decode", "varlen", "block_sparse", "all"),
                        help="first tune every workload of these bench suites into the store (exhaustive search)")
    priors.add_argument("--quick", action="store_true", help="with --tune: the quick subset of each suite")
    priors.add_argument("--shard", default="1/1", metavar="K/N",
                        help="with --tune: every N-th workload from the K-th (split a long tune over several calls)")
    priors.add_argument("--smoke", action="store_true", help="with --tune: tiny float32 shapes (tests the command)")

    sub.add_parser("bench", help=BENCH_HELP, add_help=False)  # listed here; main() hands its options to bench_parser
    return parser


def bench_parser() -> argparse.ArgumentParser:
    from .bench import add_arguments

    parser = argparse.ArgumentParser(prog="python -m inductor_attn bench", description=BENCH_HELP)
    add_arguments(parser)
    return parser


def run_cache(args) -> int:
    from . import cache
    from .store.db import default_path, file_in_the_way

    # the library falls back to another store there; a command would act on that one, not the one named
    path = default_path()
    if (in_the_way := file_in_the_way(path)) is not None:
        raise cache.StoreError(f"the decision store {path} cannot be made: {in_the_way} is a file, not a directory "
                               "(INDUCTOR_ATTN_CACHE_DIR names the store's directory)")
    store = cache.get_store()
    status = _CACHE_VERBS[args.verb](cache, store, args)
    if store.broken:
        print(f"warning: the store was unusable: {store.broken}", file=sys.stderr)
        return 1
    return status


def _list(cache, store, args) -> int:
    rows = cache.list_decisions(store)
    if store.broken and not rows:
        raise cache.StoreError(f"the decision store is unreadable ({store.broken})")
    print(f"{len(rows)} decisions in {store.describe()}")
    for r in rows:
        speedup = "" if r["speedup"] is None else f"{r['speedup']:.2f}x vs {r['default']}"
        marks = (f"  [stale: {r['stale']}]" if r["stale"] else "") + \
            ("  [read-only]" if r["store"] != store.writable.describe() else "")
        print(f"  {r['key'][:12]}  {r['op']:24s} {r['problem']:56s} -> {r['winner']}  {speedup}{marks}")
    stale = [r for r in rows if r["stale"]]
    kept = sum(r["store"] != store.writable.describe() for r in stale)
    if stale:
        prune = "`python -m inductor_attn cache prune` deletes " + ("those of the writable store" if kept else "them")
        print(f"{len(stale)} stale: never looked up again, each for the reason it gives ("
              + ("read-only stores keep them" if kept == len(stale) else prune) + ")")
    return 0


def _show(cache, store, args) -> int:
    print(json.dumps(cache.show(args.key, store), indent=1))
    return 0


def _explain(cache, store, args) -> int:
    print(cache.explain(args.key, store))
    return 0


def _clear(cache, store, args) -> int:
    print(f"deleted {cache.clear(store)} decisions from {store.writable.describe()}")
    for layer in store.read_only:
        print(f"left {layer.describe()} as it is")
    return 0


def _prune(cache, store, args) -> int:
    deleted, kept = cache.prune(store)
    print(f"deleted {deleted} stale decisions from {store.writable.describe()}")
    if kept:
        print(f"kept {kept} stale decisions of read-only stores")
    return 0


def _doctor(cache, store, args) -> int:
    report, healthy = cache.doctor(store)
    print(report)
    return 0 if healthy else 1


def _export(cache, store, args) -> int:
    print(f"exported {cache.export(args.file, store)} decisions to {args.file}")
    return 0


def _import(cache, store, args) -> int:
    from .store.db import MemoryStore

    if isinstance(store.writable, MemoryStore):  # this command's process ends here: nothing would be kept
        raise cache.StoreError("no decision store can be written here (see the warning above; set "
                               "INDUCTOR_ATTN_CACHE_DIR to a writable directory): nothing was imported")
    print(f"imported {cache.import_decisions(args.file, store)} decisions into {store.writable.describe()}")
    return 0


def _export_priors(cache, store, args) -> int:
    command = " ".join(["python -m inductor_attn cache export-priors", *(["--tune", *args.tune] if args.tune else []),
                        *(["--quick"] if args.quick else []), *(["--smoke"] if args.smoke else []),
                        *([f"--shard {args.shard}"] if args.shard != "1/1" else [])])
    if not args.tune and (args.quick or args.smoke or args.shard != "1/1"):
        given = [f for f, on in (("--quick", args.quick), ("--smoke", args.smoke), ("--shard", args.shard != "1/1"))
                 if on]
        raise ValueError(f"{' and '.join(given)} choose what --tune tunes; without --tune nothing is tuned")
    if args.tune:
        from .bench import _shard
        from .bench.tuning_cost import tune_suites

        try:
            shard = _shard(args.shard)
        except argparse.ArgumentTypeError as err:
            raise ValueError(str(err)) from None
        print(f"tuning the workloads of {', '.join(args.tune)} into {store.writable.describe()}")
        tune_suites(args.tune, args.quick, args.smoke, shard)
    path, n = cache.export_priors(args.out, store, command=command)
    print(f"wrote {n} decisions to {path}")
    return 0


def _plot(cache, store, args) -> int:
    print(f"plotted {cache.plot(args.file, store)} decisions to {args.file}")
    return 0


_CACHE_VERBS = {"list": _list, "show": _show, "explain": _explain, "clear": _clear, "prune": _prune,
                "doctor": _doctor, "export": _export, "import": _import, "plot": _plot, "export-priors": _export_priors}


def _cache(args) -> int:
    """``cache`` with one-line errors: exit 2 for bad input (a file, a key), 1 for an unusable store, a
    missing optional dependency or a tune (export-priors --tune) that ran out of device memory."""
    from .store.schema import StoreError
    from .tuning.decisions import OutOfMemoryWhileTuning

    try:
        return run_cache(args)
    except (StoreError, ImportError, OutOfMemoryWhileTuning) as err:  # the last: export-priors --tune
        print(f"error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `cache list | head`: the reader has gone; say nothing, as a shell command would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit, flushing stdout
        return 1
    except OSError as err:  # the file argument cannot be read or written, or the output (stdout) written
        where = getattr(args, "file", None) or err.filename or "the output"
        print(f"error: {where}: {err.strerror or err}", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def _one_line_warnings():
    """Store warnings print as ``warning: ...`` instead of a source location and a code line."""
    saved = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = saved


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from .bench import main as run_bench

        return run_bench(bench_parser().parse_args(argv[1:]), " ".join(["python -m inductor_attn", *argv]))
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        try:
            return run_demo(args.device)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    with _one_line_warnings():
        return _cache(args)


if __name__ == "__main__":
    sys.exit(main())
