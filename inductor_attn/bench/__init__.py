"""Benchmark suite: ``python -m inductor_attn bench``.

What it measures and how: runner.py (steps), suites.py (workloads), metrics.py (FLOPs and bytes),
quality.py (two fresh tunes, compile time), report.py (JSON, markdown, plots, RESULTS.md); wall-clock
suites: overhead.py (host cost of a call), tuning_cost.py (what tuning adds to a compile, cold and warm).

On a machine without a CUDA GPU, ``bench`` exits with status 2 and says so; ``--smoke`` runs the whole
pipeline on tiny float32 shapes (on a CPU only the reference backend runs), which tests the harness and
produces no number worth reading. This module imports nothing heavy: the CLI builds its parser here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

KERNEL_SUITES = ("dense", "decode", "varlen", "block_sparse", "all")
# suites that time whole calls as a user's wall clock sees them (wallclock.py), not kernels
WALLCLOCK_SUITES = ("overhead", "tuning-cost")
SUITE_CHOICES = KERNEL_SUITES + WALLCLOCK_SUITES


def _shard(text: str) -> tuple[int, int]:
    """``"2/3"`` -> ``(2, 3)``.

    >>> _shard("2/3")
    (2, 3)
    """
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard must look like K/N (e.g. 1/2), got {text!r}") from None
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 1 <= K <= N, got {text!r}")
    return k, n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", choices=SUITE_CHOICES, default="all", help="which workloads (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="the representative subset (3 dense, 3 decode, 2 varlen, 2 block-sparse; < 8 min)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write results here (default: benchmarks/results/<device>-<date>/, and regenerate "
                             "benchmarks/RESULTS.md)")
    parser.add_argument("--shard", type=_shard, default=(1, 1), metavar="K/N",
                        help="every N-th workload from the K-th: split a suite over several calls")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds per workload (default 30; quick 20)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds the call may take; no workload starts after 60%% of it (70%% with --quick), the "
                             "rest is for the quality phase (default 480; quick 450)")
    parser.add_argument("--no-quality", action="store_true",
                        help="skip the second tune and the compile-time measurement")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny float32 shapes: checks the harness (on a CPU too); the numbers mean nothing")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse --short HEAD)")
    parser.add_argument("--report", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                        help="measure nothing: merge results.json files (several suite calls) into "
                             "benchmarks/RESULTS.md, or with --out into results.json/.md, RESULTS.md and plots there")


def main(args: argparse.Namespace, command: str) -> int:
    """Run ``bench`` with parsed ``args``; ``command`` is the command line recorded in the results."""
    if args.report:
        from . import report
        from .runner import repo_root

        result = report.load(args.report)
        if args.out is None:
            path = repo_root() / "benchmarks" / "RESULTS.md"
            report.write_results_md(result, path)
        else:
            path = report.write_results(result, args.out)[2]
        print(f"wrote {path} from {len(args.report)} result file(s)")
        return 0
    if args.suite in WALLCLOCK_SUITES:
        from .host_suites import run_wallclock_suite

        return run_wallclock_suite(args.suite, smoke=args.smoke, quick=args.quick, out=args.out, command=command,
                                   commit=args.commit)
    from .runner import Options, run

    return run(Options(suite=args.suite, quick=args.quick, smoke=args.smoke, out=args.out, rounds=args.rounds,
                       budget_s=args.budget_s, quality=not args.no_quality, shard=args.shard, commit=args.commit,
                       command=command))
