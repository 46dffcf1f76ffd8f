"""Benchmark suites: ``python -m inductor_attn bench``.

- Kernel suites (runner.py; workloads in suites.py): dense, decode, varlen and block_sparse forward
  kernels, and backward (forward + backward kernels of a training step), each against what users call
  today, with the tuner's gate and timer (tuning/measure.py). metrics.py counts FLOPs and bytes,
  quality.py runs the second tune and the compile-time measurement.
- flex_route (flex_route.py): compiled ``flex_attention`` against the same call routed by inductor_attn.
- Wall-clock suites (host_suites.py): overhead (host time per compiled call, end-to-end models),
  training (fwd+bwd steps, end-to-end training), tuning-cost (what tuning adds to a compile, cold and warm),
  paged (paged.py: paged-cache decode GB/s against a copy floor and our contiguous decode; chunked prefill TF/s;
  serving loops of compiled decode steps; transformers' continuous batching on our attention, models.py),
  fp8 (fp8.py: fp8_attention against our bf16 choice on dense prefill, TF/s and errors).

Results go to ``--out`` or to the decision store's directory, never into the source tree; report.py
writes JSON, markdown and plots, and ``--report`` merges results or updates benchmarks/RESULTS.md. On a
machine without a CUDA GPU, ``bench`` exits with status 2 and says so; ``--smoke`` runs the whole
pipeline on tiny float32 shapes (on a CPU only the reference backend runs), which tests the harness and
produces no number worth reading; its output says so. This module imports nothing heavy: the CLI builds
its parser here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# "all" is the four forward suites; backward and flex_route run on their own
KERNEL_SUITES = ("dense", "decode", "varlen", "block_sparse", "backward", "flex_route", "all")
# suites run by host_suites.py, each writing one results file of its own: those that time whole calls as a user's
# wall clock sees them (wallclock.py), and paged and fp8, which time user calls and kernels the tuner's way
WALLCLOCK_SUITES = ("overhead", "training", "tuning-cost", "paged", "fp8")
SUITE_CHOICES = KERNEL_SUITES + WALLCLOCK_SUITES


def _positive(kind: type, option: str):
    """An argparse type: ``kind(text)``, refused unless above zero (a finite float)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"{option} takes {'a whole' if kind is int else 'a'} number above zero, "
                                             f"got {text!r}")
        return value
    return parse


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
    parser.add_argument("--suite", choices=SUITE_CHOICES, default="all",
                        help="which workloads (default: all, the four forward kernel suites)")
    parser.add_argument("--quick", action="store_true",
                        help="the representative subset (3 dense, 3 decode, 2 varlen, 2 block-sparse, 2 backward; "
                             "flex_route without max-autotune; < 8 min)")
    parser.add_argument("--out", type=Path, default=None,
                        help="write results here (default: bench/<suite>-<device>-<time>/ beside the decision store)")
    parser.add_argument("--shard", type=_shard, default=(1, 1), metavar="K/N",
                        help="every N-th workload (training: shape) from the K-th: split a suite over several calls")
    parser.add_argument("--rounds", type=_positive(int, "--rounds"), default=None,
                        help="timing rounds per workload (default 30; quick 20)")
    parser.add_argument("--budget-s", type=_positive(float, "--budget-s"), default=None,
                        help="seconds the call may take; no workload starts after 60%% of it (70%% with --quick), the "
                             "rest is for the quality phase (default 480; quick 450); tuning-cost: the whole run, no "
                             "worker past it (default 540), the process's own start-up (10-15 s on the GPU "
                             "machines) on top; it writes what it finished as it goes")
    parser.add_argument("--no-quality", action="store_true",
                        help="skip the second tune and the compile-time measurement")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny float32 shapes: checks the harness (on a CPU too); the numbers mean nothing")
    parser.add_argument("--part", default="all",
                        choices=("all", "ops", "models", "shipped", "background", "search"),
                        help="overhead/training/paged suites: only the attention calls (ops; paged: its shapes and "
                             "serving loops) or only the HF Llama part (paged: transformers' continuous batching); "
                             "tuning-cost: only cold and warm first calls with the shipped decision tables "
                             "(shipped), the cold one in background mode (background); only agreement and regret "
                             "(search)")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse --short HEAD)")
    parser.add_argument("--report", type=Path, nargs="+", default=None, metavar="RESULTS_JSON",
                        help="measure nothing: replace the sections of their suites and device in "
                             "benchmarks/RESULTS.md by these results.json files, or with --out merge them into "
                             "results.json/.md, RESULTS.md and plots there")


def main(args: argparse.Namespace, command: str) -> int:
    """Run ``bench`` with parsed ``args``; ``command`` is the command line recorded in the results."""
    if args.out is not None:  # made first: a suite that cannot write its results should not run for minutes
        try:  # the host suites also take a file (a name ending in .json)
            (args.out.parent if args.out.suffix == ".json" else args.out).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            print(f"error: --out {args.out}: {err.strerror or err}", file=sys.stderr)
            return 2
    if args.report:
        try:
            return _report(args)
        except ValueError as err:  # a results file that cannot be read or is not one
            print(f"error: {err}", file=sys.stderr)
            return 2
        except (KeyError, TypeError, AttributeError) as err:  # a field _read_results does not check
            names = ", ".join(str(p) for p in args.report)
            print(f"error: {names}: a row lacks a field or holds one of another type ({type(err).__name__}: "
                  f"{err}); was it written by another version of inductor_attn, or edited?", file=sys.stderr)
            return 2
    if args.suite in WALLCLOCK_SUITES:
        from .host_suites import run_wallclock_suite

        return run_wallclock_suite(args.suite, smoke=args.smoke, quick=args.quick, part=args.part, out=args.out,
                                   command=command, commit=args.commit, budget_s=args.budget_s, shard=args.shard)
    from .runner import Options, run

    return run(Options(suite=args.suite, quick=args.quick, smoke=args.smoke, out=args.out, rounds=args.rounds,
                       budget_s=args.budget_s, quality=not args.no_quality, shard=args.shard, commit=args.commit,
                       command=command))


def _report(args: argparse.Namespace) -> int:
    """``bench --report``: the results files into RESULTS.md's sections, or merged into ``--out``."""
    from . import report
    from .runner import repo_root

    loaded = [_read_results(Path(p)) for p in args.report]
    if any(report.summary_suite(d) for d in loaded):  # paged's and fp8's own files: RESULTS.md only
        if not all(report.summary_suite(d) for d in loaded) or args.out is not None:
            print(f"error: the results files of bench --suite {' or '.join(report.SUMMARY_SUITES)} are reported "
                  "alone, into benchmarks/RESULTS.md", file=sys.stderr)
            return 2
        if any(d["meta"].get("smoke") for d in loaded):
            print("error: smoke results are not measurements: they never go into RESULTS.md", file=sys.stderr)
            return 2
        path = repo_root() / "benchmarks" / "RESULTS.md"
        print(f"updated {path}: " + "; ".join(report.update_summary_sections(loaded, path)))
        return 0
    result = report.merge(loaded, args.report)
    if args.out is None:
        path = repo_root() / "benchmarks" / "RESULTS.md"
        written = report.update_results_md(result, path)
        print(f"updated {path}: " + "; ".join(written))
    else:
        path = report.write_results(result, args.out)[2]
        print(f"wrote {path} from {len(args.report)} result file(s)")
    return 0


def _read_results(path: Path) -> dict:
    """A results file's contents; ValueError naming the file where it cannot be read, is not JSON or is not a
    results object (a dict with its ``meta``)."""
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"{path}: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("meta"), dict):
        raise ValueError(f"{path}: not an inductor_attn bench results file (no meta)")
    meta = data["meta"]
    missing = [k for k in ("device", "date", "commit", "command") if not isinstance(meta.get(k), str)]
    if missing or not isinstance(meta.get("versions"), dict):
        raise ValueError(f"{path}: its meta lacks {', '.join(missing or ['versions'])}: every table says which run "
                         "made it (a file edited by hand, or not written by bench?)")
    rows = data.get("rows", [])
    named = "schema" not in data or all(isinstance(r, dict) and isinstance(r.get("name"), str) for r in rows)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows) or not named:
        raise ValueError(f"{path}: its rows are not a list of workloads (a file edited by hand?)")
    return data
