"""Command line: ``python -m inductor_attn {demo,cache,bench}``."""

from __future__ import annotations

import argparse
import json
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inductor_attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="compile a small transformer block and show which kernels ran")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")

    cache = sub.add_parser("cache", help="inspect the decision store")
    verbs = cache.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="one line per decision; stale ones are marked")
    for verb, text in (("show", "the whole stored row as JSON"), ("explain", "why the winner won")):
        verbs.add_parser(verb, help=text).add_argument("key", help="a decision key (a unique prefix suffices)")
    verbs.add_parser("clear", help="delete every decision of the writable store")
    verbs.add_parser("prune", help="delete stale decisions (versions or backend sources changed)")
    verbs.add_parser("doctor", help="integrity check, damage, unreadable rows, rows per library versions")
    for verb, text in (("export", "write decisions to a JSON file"), ("import", "add decisions from a JSON file"),
                       ("plot", "draw winners and speedups to a PNG")):
        verbs.add_parser(verb, help=text).add_argument("file")

    from .bench import add_arguments as add_bench_arguments

    bench = sub.add_parser("bench", help="benchmark suite: autotuned vs SDPA default, backend defaults, hand rules, "
                                         "oracle (needs a GPU; --smoke runs tiny shapes anywhere)")
    add_bench_arguments(bench)
    return parser


def run_cache(args) -> int:
    from . import cache

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
    stale = sum(1 for r in rows if r["stale"])
    if stale:
        print(f"{stale} stale: never looked up again, since versions or backend sources changed "
              "(`python -m inductor_attn cache prune` deletes them)")
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
    print(f"imported {cache.import_decisions(args.file, store)} decisions into {store.writable.describe()}")
    return 0


def _plot(cache, store, args) -> int:
    print(f"plotted {cache.plot(args.file, store)} decisions to {args.file}")
    return 0


_CACHE_VERBS = {"list": _list, "show": _show, "explain": _explain, "clear": _clear, "prune": _prune,
                "doctor": _doctor, "export": _export, "import": _import, "plot": _plot}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args.device)
    if args.command == "cache":
        try:
            return run_cache(args)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if args.command == "bench":
        from .bench import main as run_bench

        command = " ".join(["python -m inductor_attn", *(sys.argv[1:] if argv is None else argv)])
        return run_bench(args, command)
    return 2


if __name__ == "__main__":
    sys.exit(main())
