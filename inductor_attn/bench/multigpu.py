"""Ranks under torchrun: no hang, which kernels each rank runs, and what tuning costs a job.

``python -m inductor_attn.bench.multigpu --nproc N [--runs ...] [--out DIR]`` launches torchrun once per
run, one process per GPU (NCCL), every rank of a run on one shared decision store:

- ``stock``: the same job with plain ``torch.compile`` (no ``enable()``): the compile seconds to add to;
- ``cold``: N ranks, an empty store; ``warm``: N ranks again on the store ``cold`` left (a restarted job);
- ``single-cold``, ``single-warm``: the same with one rank, so tuning cost with N ranks compares with one;
- ``fault``: N ranks on an empty store; rank 1 exits at the start of its first tune, holding a claim, and
  torchrun ends the job. The store must stay sound. ``restart``: the job again on that store, as a user
  restarts it; its ranks must tune only what the killed job did not commit. (A restart by torchrun's own
  ``--max-restarts`` failed with gloo: the new attempt's ranks could not connect, "connectFullMesh
  failed", so the restart is a new launch.)

Each rank (worker below) trains HF Llama (random init, ``models.SIZE`` on a GPU) under DDP and
``torch.compile``, each rank on its own sequence length, and checks the first step's gradients against
eager gradients averaged over every rank's batch (what DDP computes, in one process). It then runs a
compiled decode attention with a KV cache whose lengths differ per rank (``kv_seqlens``), checked against
the float64 reference. Where every rank arrives it calls ``sync_decisions()`` and records its decisions:
README promises identical run-time decisions on all ranks after it.

Every wait is bounded: collectives time out after ``COLLECTIVE_TIMEOUT_S``, and a launch still running
after ``--launch-timeout`` seconds is killed and reported as a hang. Each launch gets empty Inductor and
Triton caches, so a warm run is warm in our store only.

``--device cpu`` runs the same jobs with gloo on the CPU with a small Llama. Only the reference kernel runs
there, so nothing is tuned and the fault run kills nobody; tests/test_multigpu.py adds two fake backends
(tests/multigpu_cpu_worker.py) to check the harness and the decision path on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..tuning.measure import sync

RUNS = ("stock", "cold", "warm", "single-cold", "single-warm", "fault", "restart")
COLLECTIVE_TIMEOUT_S = 600
LAUNCH_TIMEOUT_S = 1500
KILLED_EXIT = 43  # the fault run's exit code for the rank it kills
TINY = {"layers": 1, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128}
# Per rank (rank % len): lengths that fall into different buckets, so ranks meet different problems.
LENGTHS = {"cuda": (1024, 1536, 768, 2048), "cpu": (24, 40, 56, 72)}
BATCH = {"cuda": 2, "cpu": 1}
DECODE = {"cuda": (4, 16, 4, 128, 4096), "cpu": (2, 4, 2, 16, 64)}  # B, Hq, Hkv, D, cache length


# ----------------------------------------------------------------------------------------------- driver
def _spec(run: str, nproc: int) -> tuple[int, str, bool]:
    """(ranks, store name, with the plugin) of ``run``."""
    ranks = 1 if run.startswith("single") else nproc
    store = {"stock": "store-stock", "cold": "store", "warm": "store", "single-cold": "store-single",
             "single-warm": "store-single", "fault": "store-fault", "restart": "store-fault"}[run]
    return ranks, store, run != "stock"


WORKER = ("-m", "inductor_attn.bench.multigpu")


def launch(run: str, nproc: int, device: str, out: Path, timeout_s: float, worker=WORKER) -> dict:
    """One torchrun job; its ranks' results and what the store holds after it. ``worker``: the program
    torchrun starts per rank (this module; tests wrap it to register fake backends on the CPU)."""
    ranks, store_name, plugin = _spec(run, nproc)
    if run == "fault" and ranks < 2:
        raise ValueError(f"the fault run kills rank 1: --nproc must be at least 2, got {nproc}")
    store = out / store_name
    if run in ("cold", "single-cold", "fault", "stock"):
        shutil.rmtree(store, ignore_errors=True)
    here = out / run
    shutil.rmtree(here, ignore_errors=True)
    here.mkdir(parents=True)
    env = {**os.environ, "INDUCTOR_ATTN_CACHE_DIR": str(store), "INDUCTOR_ATTN_MODE": "autotune",
           "TORCHINDUCTOR_CACHE_DIR": str(here / "inductor-cache"), "TRITON_CACHE_DIR": str(here / "triton-cache")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           *worker, "--worker",
           "--device", device, "--out", str(here)]
    cmd += ["--plugin"] if plugin else []
    cmd += ["--kill-rank", "1"] if run == "fault" else []
    start = time.perf_counter()
    with open(here / "log.txt", "w") as log:
        try:
            rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    results = [json.loads(p.read_text()) for p in sorted(here.glob("rank*.json"))]
    return {"run": run, "ranks": ranks, "returncode": rc, "hung": rc is None, "wall_s": time.perf_counter() - start,
            "results": results, "store": _store_health(store), "log": str(here / "log.txt")}


def _store_health(path: Path) -> dict:
    from ..store.db import DecisionStore

    if not (path / "decisions.sqlite").exists():
        return {"rows": 0, "integrity": ["no store"], "bad": [], "damage": []}
    health = DecisionStore(path / "decisions.sqlite").health()
    return {"rows": len(health.rows), "integrity": health.integrity, "bad": health.bad, "damage": health.damage,
            "error": health.error}


def summarize(job: dict) -> dict:
    """The numbers a run is judged by: every rank finished, decisions agree, errors, seconds, tunes."""
    results = job["results"]
    decisions = [tuple(map(tuple, r.get("decisions", []))) for r in results]
    return {
        "run": job["run"], "ranks": job["ranks"], "finished": len(results), "returncode": job["returncode"],
        "hung": job["hung"],
        "decisions_identical": len(set(decisions)) <= 1, "buckets": len(decisions[0]) if decisions else 0,
        "first_step_s": max((r["training"]["first_step_s"] for r in results), default=None),
        "first_decode_s": max((r["decode"]["first_call_s"] for r in results), default=None),
        "step_ms": max((r["training"]["step_ms"] for r in results), default=None),
        "grad_rel_err": max((r["training"]["grad_rel_err"] for r in results), default=None),
        "decode_rel_err": max((r["decode"]["rel_err"] for r in results), default=None),
        "tunes": sum(len(r["tunes"]) for r in results),
        "tune_s": sum(s for r in results for _, s in r["tunes"]),
        "rows_at_start": max((r["store_rows_at_start"] for r in results), default=None),
        "store_rows": job["store"]["rows"], "store_sound": job["store"]["integrity"] == ["ok"]
        and not job["store"]["bad"],
        "kernels": sorted({k for r in results for k in r["stats"]}),
    }


def run(nproc: int, device: str, out: Path, runs=RUNS, timeout_s: float = LAUNCH_TIMEOUT_S,
        worker=WORKER) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    summaries = []
    for name in runs:
        job = launch(name, nproc, device, out, timeout_s, worker)
        summaries.append(summarize(job))
        (out / "multigpu.json").write_text(json.dumps({"nproc": nproc, "device": device, "runs": summaries},
                                                      indent=1))
    return summaries


# ----------------------------------------------------------------------------------------------- worker
def _worker(device_type: str, out: Path, plugin: bool, kill_rank: int | None) -> None:
    import torch.distributed as dist

    import inductor_attn

    from ..store.db import get_store
    from ..tuning import decisions

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any object collective (sync_decisions)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    tunes: list[tuple[str, float]] = []
    measured = decisions.tune

    def recorded_tune(call, *args, **kwargs):
        if rank == kill_rank:
            os._exit(KILLED_EXIT)  # the fault: die holding this bucket's claim, before anything is committed
        start = time.perf_counter()
        result = measured(call, *args, **kwargs)
        tunes.append((str(call.problem), time.perf_counter() - start))
        return result

    decisions.tune = recorded_tune
    if plugin:
        inductor_attn.enable()
    result = {"rank": rank, "world": world, "plugin": plugin,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "store_rows_at_start": len(get_store().rows())}
    result["training"] = _train(device, rank, world)
    result["decode"] = _decode(device, rank, plugin)
    if plugin:
        result["changed_by_sync"] = inductor_attn.sync_decisions()
        result["decisions"] = sorted([repr(key), choice] for key, choice, _ in decisions.decision_entries())
    result["stats"] = inductor_attn.stats()
    result["tunes"] = tunes
    (out / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _train(device: torch.device, rank: int, world: int, steps: int = 5) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from .models import SIZE, build_llama, worst_rel_err

    lengths, batch = LENGTHS[device.type], BATCH[device.type]
    size, dtype = (SIZE, torch.bfloat16) if device.type == "cuda" else (TINY, torch.float32)
    model = build_llama(**size, max_len=max(lengths), device=device, dtype=dtype).train()
    eager = copy.deepcopy(model)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    compiled = torch.compile(ddp)

    def ids(r: int) -> torch.Tensor:
        gen = torch.Generator(device).manual_seed(r)
        return torch.randint(0, 32000, (batch, lengths[r % len(lengths)]), device=device, generator=gen)

    mine = ids(rank)
    start = time.perf_counter()
    compiled(input_ids=mine, labels=mine).loss.backward()
    sync(device)
    first_step_s = time.perf_counter() - start
    got = [p.grad.detach().clone() for p in model.parameters()]
    for r in range(world):  # DDP averages the ranks' gradients: the same in one process, eagerly
        (eager(input_ids=ids(r), labels=ids(r)).loss / world).backward()
    want = [p.grad for p in eager.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        compiled(input_ids=mine, labels=mine).loss.backward()
        opt.step()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return {"length": mine.shape[1], "first_step_s": first_step_s, "step_ms": statistics.median(times),
            "grad_rel_err": worst_rel_err(got, want)}


def _decode_ours(q, k, v, lengths):
    import inductor_attn

    return inductor_attn.attention(q, k, v, kv_seqlens=lengths)


def _decode_stock(q, k, v, lengths):
    valid = torch.arange(k.shape[2], device=k.device) < lengths[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :],
                                                            enable_gqa=True)


def _decode(device: torch.device, rank: int, plugin: bool, calls: int = 20) -> dict:
    b, hq, hkv, d, cache = DECODE[device.type]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device).manual_seed(1000 + rank)
    q = torch.randn(b, hq, 1, d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, hkv, cache, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    lengths = torch.randint(1, cache + 1, (b,), device=device, dtype=torch.int32, generator=gen)
    fn = torch.compile(_decode_ours if plugin else _decode_stock)
    start = time.perf_counter()
    out = fn(q, k, v, lengths)
    sync(device)
    first_call_s = time.perf_counter() - start
    ref = _decode_stock(*(t.double() for t in (q, k, v)), lengths)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(q, k, v, lengths)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return {"kv_lengths": lengths.tolist(), "first_call_s": first_call_s, "call_ms": statistics.median(times),
            "rel_err": ((out.double() - ref).norm() / ref.norm()).item()}


# ------------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inductor_attn.bench.multigpu", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: every visible GPU)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--out", type=Path, default=Path("multigpu-results"))
    parser.add_argument("--launch-timeout", type=float, default=LAUNCH_TIMEOUT_S)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plugin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kill-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.device, args.out, args.plugin, args.kill_rank)
        return 0
    runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {', '.join(unknown)}; accepted: {', '.join(RUNS)}")
    nproc = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if nproc < 1:
        parser.error(f"--nproc must be at least 1, got {nproc} (no GPU visible? try --device cpu)")
    for summary in run(nproc, args.device, args.out, runs, args.launch_timeout):
        print(json.dumps({k: v for k, v in summary.items() if k != "kernels"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
