"""Under torch.distributed every rank runs rank 0's decision, even when their own timings disagree."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world: int, init_file: str, cache_dir: str, results):
    os.environ["INDUCTOR_ATTN_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")  # separate stores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from fakes import FakeBackend, FakeTimer

        import inductor_attn
        from inductor_attn.backends import AttnCall, only_backends
        from inductor_attn.device import DeviceInfo
        from inductor_attn.tuning import tuner
        from inductor_attn.tuning.decisions import decide

        # each rank measures a different winner: rank 0 sees "b" faster, the others "a"
        a = FakeBackend("a", {"default": (1.0, 0.01) if rank == 0 else (0.3, 0.01)})
        b = FakeBackend("b", {"default": (0.5, 0.01)})
        tuner.default_timer = lambda device_type: FakeTimer([a, b])
        q = torch.randn(1, 2, 16, 16)
        call = AttnCall("attention", q, q.clone(), q.clone(), 0.25)
        with only_backends(a, b), inductor_attn.tuning_mode("autotune"):
            results[rank] = decide(call, DeviceInfo("cpu", (0, 0), 2), "forward")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_all_ranks_use_rank_zero_decision(world, tmp_path):
    # spawn, not fork: earlier tests in the same pytest process leave torch.compile worker threads
    # whose locks a forked child would inherit held (the full suite hung here with fork)
    results = mp.get_context("spawn").Manager().dict()
    mp.start_processes(_worker, args=(world, str(tmp_path / "init"), str(tmp_path), results), nprocs=world,
                       start_method="spawn")
    assert dict(results) == {r: "b:default" for r in range(world)}
