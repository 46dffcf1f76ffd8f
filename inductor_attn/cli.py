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
    verbs.add_parser("list", help="one line per decision")
    for verb, text in (("show", "the whole stored row as JSON"), ("explain", "why the winner won")):
        verbs.add_parser(verb, help=text).add_argument("key", help="a decision key (a unique prefix suffices)")
    verbs.add_parser("clear", help="delete every decision")
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
    if args.verb == "list":
        rows = cache.list_decisions()
        print(f"{len(rows)} decisions in {store.path}")
        for r in rows:
            speedup = "" if r["speedup"] is None else f"{r['speedup']:.2f}x vs {r['default']}"
            print(f"  {r['key'][:12]}  {r['op']:24s} {r['problem']:56s} -> {r['winner']}  {speedup}")
    elif args.verb == "show":
        print(json.dumps(cache.show(args.key), indent=1))
    elif args.verb == "explain":
        print(cache.explain(args.key))
    elif args.verb == "clear":
        print(f"deleted {cache.clear()} decisions from {store.path}")
    elif args.verb == "export":
        print(f"exported {cache.export(args.file)} decisions to {args.file}")
    elif args.verb == "import":
        print(f"imported {cache.import_decisions(args.file)} decisions into {store.path}")
    elif args.verb == "plot":
        print(f"plotted {cache.plot(args.file)} decisions to {args.file}")
    if store.broken:
        print(f"warning: the store was unusable: {store.broken}", file=sys.stderr)
        return 1
    return 0


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
