"""Running the suites of bench/__init__.py's ``WALLCLOCK_SUITES`` and writing what they measured.

Results go to ``--out`` (default: ``<decision store dir>/bench/<suite>-<device>-<time>.json``, never the
source tree), with the device, date, commit, versions and command inside; the markdown table is printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..store.db import default_path


def run_wallclock_suite(suite: str, *, smoke: bool, quick: bool, part: str, out: Path | None, command: str,
                        commit: str | None, budget_s: float | None = None, shard: tuple[int, int] = (1, 1)) -> int:
    if not smoke and not torch.cuda.is_available():
        print(f"error: bench --suite {suite} measures GPU calls and needs a CUDA GPU; add --smoke for a CPU run "
              "of the harness (its numbers mean nothing)", file=sys.stderr)
        return 2
    from . import fp8, overhead, paged, training, tuning_cost
    from .runner import run_stamp

    module = {"overhead": overhead, "training": training, "tuning-cost": tuning_cost, "paged": paged,
              "fp8": fp8}[suite]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meta = {"suite": suite, "smoke": smoke, "quick": quick, "part": part, "shard": f"{shard[0]}/{shard[1]}",
            "command": command, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            **run_stamp(commit)}
    if suite != "tuning-cost" and part in ("shipped", "background", "search"):
        print(f"error: --part {part} applies to bench --suite tuning-cost; {suite} takes all, ops or models",
              file=sys.stderr)
        return 2
    if suite == "tuning-cost" and part in ("ops", "models"):
        print(f"error: --part {part} applies to the overhead, training and paged suites; tuning-cost takes all, "
              "shipped, background or search", file=sys.stderr)
        return 2
    if suite != "tuning-cost" and budget_s is not None:
        print(f"error: --budget-s applies to bench --suite tuning-cost, not {suite}", file=sys.stderr)
        return 2
    if suite == "fp8" and part != "all":
        print(f"error: --part {part} applies to the overhead, training, paged and tuning-cost suites, not fp8",
              file=sys.stderr)
        return 2
    if suite == "overhead" and shard != (1, 1):
        print("error: --shard applies to bench --suite training, tuning-cost, paged and fp8 (and the kernel "
              "suites), not overhead", file=sys.stderr)
        return 2
    name = f"{suite}-{meta['device'].replace(' ', '_')}-{meta['date'][:16]}.json"
    path = out or default_path().parent / "bench" / name
    if path.suffix != ".json":
        path = path / f"{suite}.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        path.write_text(json.dumps({"meta": meta, **result}, indent=1, default=str))

    if suite in ("paged", "fp8"):
        measured = _run_shapes(module, smoke, quick, device, save, shard) if part in ("all", "ops") else {"rows": []}
        if suite == "paged" and shard[0] == 1:  # the serving loops and the model run once, not in every shard
            measured.update(paged.run_loops_and_model(smoke, part, device, lambda more: save({**measured, **more})))
    else:
        extra = ({"budget_s": budget_s, "shard": shard, "save": save} if suite == "tuning-cost" else
                 {"save": save, "shard": shard} if suite == "training" else {})
        measured = module.run(smoke, quick, device, part, **extra)
    result = {"meta": meta, **measured}
    save(result)
    label = "SMOKE (tiny shapes on this machine: not a measurement)" if smoke else meta["device"]
    print(f"bench --suite {suite}: {label}, {meta['date']}, commit {meta['commit']}")
    print(module.table(result))
    print(f"wrote {path}")
    return 0


def _run_shapes(module, smoke: bool, quick: bool, device: torch.device, save, shard: tuple[int, int]) -> dict:
    """A suite of shapes (paged.py, fp8.py: ``shapes(quick, smoke)`` and ``run_shape(shape, device, rounds)``):
    every shape (``shard`` (k, n): every n-th from the k-th, 1-based), saved after each one so that a run
    stopped from outside keeps what it measured, with the names of the shapes still to run (``not_run``, which
    the report prints: such a file looks complete otherwise)."""
    rounds, (k, n) = 3 if smoke else 15, shard
    todo = module.shapes(quick, smoke)[k - 1::n]
    rows = []
    for i, s in enumerate(todo):
        rows.append(module.run_shape(s, device, rounds))
        save({"rows": rows, "not_run": [t.name for t in todo[i + 1:]]})
    return {"rows": rows}
