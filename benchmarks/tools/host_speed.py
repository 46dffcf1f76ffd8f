"""How fast the host runs launches over time, as the tuner's host probe sees them (a calibration tool).

    PYTHONPATH=. python benchmarks/tools/host_speed.py [--seconds 12] [--workers 8] [--out DIR]

Two launch-like calls, an aten op on a device tensor and the same with some Python around it, timed by
``tuning/timing.host_ms_each`` (the probe the tuner takes) every 0.2 s: first settled, then while Inductor's
compile pool starts (``AsyncCompile.warm_pool``, what each ``torch.compile`` does first) and while this
package's compile workers start (tuning/subproc.py). Each sample also says how many cores other processes kept
busy meanwhile (``/proc/stat``), the CPU steal time and the core the probe ran on. What it answers: whether a
probe taken during a tune reads high because of work the tune itself starts, or because the host's speed moves
on its own. Runs on a CPU-only machine too (the probes then launch CPU ops).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from inductor_attn.tuning.timing import host_ms_each


def _cpu_totals() -> tuple[int, int, int]:
    """(busy, total, steal) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        vals = list(map(int, f.readline().split()[1:]))
    return sum(vals) - vals[3] - vals[4], sum(vals), vals[7]


def _core() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])


def sample(launches: dict, device: torch.device) -> dict:
    busy0, total0, steal0 = _cpu_totals()
    own0, wall0, core0 = time.process_time(), time.perf_counter(), _core()
    got = host_ms_each(launches, device)
    busy1, total1, steal1 = _cpu_totals()
    own = (time.process_time() - own0) / (time.perf_counter() - wall0)
    others = max(0.0, (busy1 - busy0) / max(total1 - total0, 1) * os.cpu_count() - own)
    return {**{name: round(ms * 1e3, 2) for name, ms in got.items()}, "other_cores_busy": round(others, 1),
            "steal_jiffies": steal1 - steal0, "cores": [core0, _core()]}


def phase(name: str, seconds: float, launches: dict, device: torch.device, rows: list) -> None:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        row = {"phase": name, "t_s": round(time.monotonic() - start, 2), **sample(launches, device)}
        print(row, flush=True)
        rows.append(row)
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=12.0, help="length of each phase")
    parser.add_argument("--workers", type=int, default=8, help="compile workers to start (0: skip that phase)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from torch._inductor import async_compile
    from inductor_attn.tuning.subproc import Worker

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    x = torch.randn(1024, device=device)

    def with_python():
        pairs = {i: (i, i + 1) for i in range(40)}
        return x.view(32, 32).transpose(0, 1).add(len(pairs))

    launches = {"aten": lambda: x.add(1), "aten with Python": with_python}
    print(f"{os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable; Inductor compile threads "
          f"{async_compile.get_compile_threads()}; {device}")
    rows: list = []
    phase("settled", args.seconds / 4, launches, device, rows)
    async_compile.AsyncCompile.warm_pool()
    async_compile.AsyncCompile.wakeup()
    phase("Inductor's compile pool starting", args.seconds, launches, device, rows)
    if args.workers:
        workers = [Worker() for _ in range(args.workers)]
        phase("compile workers starting", args.seconds, launches, device, rows)
        for worker in workers:
            worker.kill()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_speed.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
