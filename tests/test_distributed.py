"""Under torch.distributed (gloo on the CPU, 3 and 4 ranks, a process each) ranks that meet different problems, in
different orders, in eager, compiled and dynamic-shape code, and that recompile at different times, never
deadlock or pair up wrong: decisions issue no collective. Ranks sharing a store tune each bucket once and
agree through it; ranks with their own stores (separate nodes) agree after sync_decisions().

Every test fails instead of hanging: collectives time out after GLOO_TIMEOUT_S, and a rank still running
after RANKS_TIMEOUT_S is killed and reported as a deadlock."""

import contextlib
import datetime
import os
import pickle
import random
import time
import traceback

import pytest
import torch
import torch._inductor.config
import torch.distributed as dist

GLOO_TIMEOUT_S = 20
RANKS_TIMEOUT_S = 55
SHARED = [(2, 20), (2, 40), (2, 100)]  # (heads, length): buckets of length 32, 64 and 128, met by every rank


def _private(rank: int) -> tuple[int, int]:
    return 3 + rank, 24  # a head count of its own: a bucket that no other rank meets


def _run_ranks(ctx, scenario, world: int, tmp_path, **kwargs) -> list[dict]:
    """``scenario(rank, world, root, **kwargs)`` on ``world`` gloo ranks, processes of multiprocessing
    context ``ctx``; each rank's result."""
    procs = [ctx.Process(target=_rank_main, args=(scenario, rank, world, str(tmp_path), kwargs))
             for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {RANKS_TIMEOUT_S} s: a deadlock"
    results = []
    for rank, p in enumerate(procs):
        path = tmp_path / f"rank{rank}.pkl"
        assert path.exists(), f"rank {rank} died (exit code {p.exitcode}) without a result"
        results.append(pickle.loads(path.read_bytes()))
    errors = {rank: r["error"] for rank, r in enumerate(results) if "error" in r}
    assert not errors, "\n".join(f"rank {rank}:\n{e}" for rank, e in errors.items())
    return results


def _rank_main(scenario, rank: int, world: int, root: str, kwargs: dict) -> None:
    torch.set_num_threads(1)  # 2-4 ranks share the CI machine's 2 cores
    torch._inductor.config.compile_threads = 1  # no compile worker pool left behind by a killed rank
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    try:
        result = scenario(rank, world, root, **kwargs)
    except BaseException:  # noqa: BLE001 - reported by the parent with the rank's traceback
        result = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    with open(os.path.join(root, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


# ------------------------------------------------------------------------------------- what a rank does
def _inputs(heads: int, length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, heads, length, 16, generator=gen) for _ in range(3))


def _attn_static(q, k, v):
    import inductor_attn

    return inductor_attn.attention(q, k, v, causal=True)


def _attn_dynamic(q, k, v):
    import inductor_attn

    return inductor_attn.attention(q, k, v, causal=True)


class _Rank:
    """One rank's fake backends (with its node's timings), its compiled functions, and the tunes it ran."""

    def __init__(self, a_ms: float, b_ms: float, tune_s: float):
        from fakes import FakeBackend, FakeTimer

        import inductor_attn
        from inductor_attn.backends import only_backends
        from inductor_attn.tuning import decisions, tuner

        self.a = FakeBackend("a", {"default": (a_ms, 0.01)})
        self.b = FakeBackend("b", {"default": (b_ms, 0.01)})
        tuner.default_timer = lambda device_type: FakeTimer([self.a, self.b])
        self.tunes: list[tuple[str, float, float]] = []  # (bucket, start, end) of each tune this rank ran
        real_tune = decisions.tune

        def recorded_tune(call, *args, **kw):
            start = time.time()
            time.sleep(tune_s)  # tuning takes time: other ranks must find the claim, not race past it
            result = real_tune(call, *args, **kw)
            self.tunes.append((_label(call.problem), start, time.time()))
            return result

        decisions.tune = recorded_tune
        self.scope = contextlib.ExitStack()
        self.scope.enter_context(only_backends(self.a, self.b))
        self.scope.enter_context(inductor_attn.tuning_mode("autotune"))
        self.static = torch.compile(_attn_static, dynamic=False, fullgraph=True)
        self.dynamic = torch.compile(_attn_dynamic, dynamic=True, fullgraph=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.scope.close()

    def run(self, heads: int, length: int, mode: str, seed: int = 0) -> str:
        """Run one problem in ``mode``, check it against the float64 reference; the choice that ran."""
        import inductor_attn
        from naive import dense

        from inductor_attn.tuning.correctness import TOLERANCES, rel_err

        q, k, v = _inputs(heads, length, seed)
        fn = {"eager": _attn_static, "compiled": self.static, "dynamic": self.dynamic}[mode]
        inductor_attn.reset_stats()
        out = fn(q, k, v)
        want, _ = dense(q, k, v, 0.25, causal=True)
        err = rel_err(out, want)
        assert err <= TOLERANCES[torch.float32], f"{mode} H{heads} L{length}: rel. error {err:.2e}"
        (ran,) = inductor_attn.stats()
        return ran.split(" -> ")[1]


def _label(problem) -> str:
    return f"H{problem.heads_q} L{problem.bucket().len_q}"


def _decided(problems) -> dict[str, str]:
    """This rank's decision for each problem, without running it."""
    from inductor_attn.backends import AttnCall
    from inductor_attn.device import device_info
    from inductor_attn.tuning.decisions import decide

    out = {}
    for heads, length in problems:
        q, k, v = _inputs(heads, length, 0)
        call = AttnCall("attention", q, k, v, 0.25, True)
        out[_label(call.problem)] = decide(call, device_info(q.device), "forward")
    return out


def _memo() -> dict[str, str]:
    from inductor_attn.tuning.decisions import decision_entries

    return {_label(key[1]): choice for key, choice, _ in decision_entries()}


# ------------------------------------------------------------------- nodes of ranks, a store per node
def _ranks_on_nodes(rank: int, world: int, root: str, per_node: int, compiled: bool) -> dict:
    node = rank // per_node
    os.environ["INDUCTOR_ATTN_CACHE_DIR"] = os.path.join(root, f"store{node}")  # what one node's ranks share
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, f"inductor{node}")
    # independent tunes disagree: node 0 measures b faster than a, the other nodes a faster than b
    with _Rank(a_ms=1.0 if node == 0 else 0.3, b_ms=0.5, tune_s=0.1) as me:
        return _meet_problems(me, rank, world, compiled)


def _meet_problems(me: _Rank, rank: int, world: int, compiled: bool) -> dict:
    import inductor_attn
    from inductor_attn.store.db import get_store
    from inductor_attn.tuning.decisions import forget_decisions

    mine = SHARED + [_private(rank)]
    random.Random(rank).shuffle(mine)
    modes = ("eager", "compiled", "dynamic") if compiled else ("eager",)
    for i, (heads, length) in enumerate(mine):
        if i == rank % len(mine):  # each rank recompiles, with its decisions forgotten, at its own time
            torch._dynamo.reset()
            forget_decisions()
        me.run(heads, length, modes[(i + rank) % len(modes)], seed=i)
    for i, (heads, length) in enumerate(mine):  # other lengths of the same buckets
        for mode in modes[::2]:  # eager and dynamic: no recompile per length
            me.run(heads, length + 1, mode, seed=10 + i)
    result = {"before": _memo(), "tunes": list(me.tunes)}
    baked, run_time = SHARED[1], SHARED[0]
    if compiled:
        result["compiled_before"] = me.run(*baked, "compiled")
    result["changed"] = inductor_attn.sync_decisions()
    if compiled:
        result["compiled_after_sync"] = me.run(*baked, "compiled")  # no recompile: the baked choice runs
        result["dynamic_after_sync"] = me.run(*run_time, "dynamic")  # decided at run time: the agreed one
        torch._dynamo.reset()
        result["compiled_after_recompile"] = me.run(*baked, "compiled")
    result["after"] = _decided(SHARED + [_private(r) for r in range(world)])
    result["tunes_after_sync"] = len(me.tunes) - len(result["tunes"])
    result["store"] = {_label_of_key(row["problem"]): row["winner"] for row in get_store().rows()}
    return result


def _label_of_key(problem_key: str) -> str:
    from inductor_attn.problem import Problem

    return _label(Problem.from_key(problem_key))


def _bucket_label(heads: int, length: int) -> str:
    return f"H{heads} L{1 << (length - 1).bit_length()}"


# Compiling costs each rank ~4 s of CPU (Inductor's imports and a first graph), so the four-rank case runs
# eager only; the three-rank case compiles, with and without dynamic shapes, on a shared and a lone store.
@pytest.mark.parametrize("world,per_node,compiled", [(3, 2, True), (4, 2, False)])
def test_ranks_meeting_different_problems_tune_once_per_node_and_use_rank_zero_decision_after_sync(
        world, per_node, compiled, tmp_path, process_context):
    results = _run_ranks(process_context, _ranks_on_nodes, world, tmp_path, per_node=per_node, compiled=compiled)
    shared = [_bucket_label(*p) for p in SHARED]
    private = {rank: _bucket_label(*_private(rank)) for rank in range(world)}
    for node in range(-(-world // per_node)):
        ranks = range(node * per_node, min(world, (node + 1) * per_node))
        tunes = sorted((t for rank in ranks for t in results[rank]["tunes"]), key=lambda t: t[1])
        # tuning cost is not multiplied by the ranks of a node: each bucket is tuned by one of them
        assert sorted(b for b, _, _ in tunes) == sorted(shared + [private[rank] for rank in ranks])
        assert all(end <= next_start for (_, _, end), (_, next_start, _) in zip(tunes, tunes[1:])), \
            f"two ranks of node {node} measured on its CPU at once: {tunes}"
        for rank in ranks:  # the node's store held the decision: its ranks agree before any sync
            assert {b: results[rank]["before"][b] for b in shared} == \
                {b: "b:default" if node == 0 else "a:default" for b in shared}
    agreed = {**{b: "b:default" for b in shared}, **{private[r]: results[r]["before"][private[r]] for r in private}}
    for rank, r in enumerate(results):
        assert r["after"] == agreed and r["tunes_after_sync"] == 0
        assert r["changed"] == (0 if rank < per_node else len(SHARED))
        assert r["store"] == agreed  # the next process on each node starts from the agreed decisions
        if compiled:  # compiled code keeps its baked choice until recompiled; run-time decisions follow at once
            assert r["compiled_after_sync"] == r["compiled_before"] == r["before"][_bucket_label(*SHARED[1])]
            assert r["compiled_after_recompile"] == r["dynamic_after_sync"] == "b:default"
