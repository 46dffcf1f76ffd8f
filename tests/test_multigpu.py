"""Ranks under torchrun (inductor_attn/bench/multigpu.py): every rank finishes, decisions agree after
sync_decisions(), gradients and decode outputs are right, each bucket is tuned once per job, and a rank
killed while tuning leaves a sound store that the restarted job builds on.

The NCCL test needs two or more GPUs (``-m multigpu``); the gloo test runs the same jobs on the CPU with a
small Llama and two fake backends, so that the ranks really tune."""

from pathlib import Path

import pytest
import torch

from inductor_attn.bench import multigpu

WORKER_ON_CPU = (str(Path(__file__).with_name("multigpu_cpu_worker.py")),)


def _check(summaries: list[dict], grad_bound: float, decode_bound: float) -> dict:
    by_run = {s["run"]: s for s in summaries}
    for s in summaries:
        assert not s["hung"], f"{s['run']}: still running at the launch timeout"
        assert s["store_sound"], s
        if s["run"] == "fault":  # rank 1 died while tuning: torchrun ends the job
            assert s["returncode"] != 0 and s["finished"] == 0, s
            continue
        assert s["returncode"] == 0 and s["finished"] == s["ranks"], s
        assert s["grad_rel_err"] < grad_bound and s["decode_rel_err"] < decode_bound, s
    for name in ("cold", "warm", "single-cold", "single-warm", "restart"):
        if name in by_run:
            assert by_run[name]["decisions_identical"] and by_run[name]["buckets"] > 0, by_run[name]
    if "cold" in by_run:  # the ranks of a node share the store: each bucket is tuned once
        assert by_run["cold"]["tunes"] == by_run["cold"]["store_rows"], by_run["cold"]
    if "warm" in by_run:
        assert by_run["warm"]["tunes"] == 0, by_run["warm"]
    if "restart" in by_run:  # the restarted job tunes only what the killed one did not commit
        restart = by_run["restart"]
        assert restart["tunes"] == restart["store_rows"] - restart["rows_at_start"] > 0, restart
    return by_run


@pytest.mark.slow
def test_gloo_ranks_on_the_cpu_finish_agree_and_survive_a_killed_rank(tmp_path):
    summaries = multigpu.run(2, "cpu", tmp_path, runs=("cold", "warm", "fault", "restart"), timeout_s=600,
                             worker=WORKER_ON_CPU)
    _check(summaries, grad_bound=1e-4, decode_bound=1e-5)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_nccl_ranks_finish_agree_and_survive_a_killed_rank(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 or more GPUs, {torch.cuda.device_count()} visible")
    summaries = multigpu.run(min(torch.cuda.device_count(), 4), "cuda", tmp_path)
    _check(summaries, grad_bound=0.05, decode_bound=2e-2)
