"""`bench --suite tuning-cost` (bench/tuning_cost.py): its comparisons on made-up records, and the whole
harness at smoke size on the CPU."""

import dataclasses
import json
import time
import types

import pytest
import torch
from fakes import FakeBackend, FakeTimer, timed_with_fakes

from inductor_attn.backends import AttnCall, enumerate_candidates, only_backends
from inductor_attn.bench import suites, tuning_cost
from inductor_attn.device import DeviceInfo
from inductor_attn.tuning.tuner import tune

DEV = DeviceInfo("cpu", (0, 0), 2)


def _record(medians: dict, noise=None) -> dict:
    return {"noise": noise, "candidates": [{"name": n, "median_ms": ms} for n, ms in medians.items()]}


def test_two_tunes_that_differ_inside_both_records_noise_count_as_inside():
    first = {"w": {"choice": "a:x", "tune_s": 2.0, "record": _record({"a:x": 1.0, "b:y": 1.03}, noise=0.04)}}
    second = {"w": {"choice": "b:y", "tune_s": 1.0, "record": _record({"a:x": 1.04, "b:y": 1.0}, noise=0.05)}}
    (item,) = tuning_cost.compare_tunes(first, second)
    assert not item["same"] and item["inside_noise"] and item["noise"] == [0.04, 0.05]


def test_a_difference_beyond_one_records_noise_is_outside():
    first = {"w": {"choice": "a:x", "tune_s": 2.0, "record": _record({"a:x": 1.0, "b:y": 1.10}, noise=0.04)}}
    second = {"w": {"choice": "b:y", "tune_s": 1.0, "record": _record({"a:x": 1.04, "b:y": 1.0}, noise=0.05)}}
    assert tuning_cost.compare_tunes(first, second)[0]["inside_noise"] is False


def test_a_workload_with_one_runnable_candidate_has_no_record_and_agrees():
    one = {"w": {"choice": "reference:default", "tune_s": 0.0, "record": None}}
    assert tuning_cost.compare_tunes(one, one) == [{"name": "w", "first": "reference:default",
                                                    "second": "reference:default", "same": True, "first_s": 0.0,
                                                    "second_s": 0.0, "noise": [None, None]}]


def test_the_summary_names_the_numbers_of_the_targets():
    result = {
        "workloads": ["d", "v"], "notes": ["regret: skipped"],
        "cold": [{"name": "d", "kind": "dense", "stock_s": 3.0, "cold_vs_stock_s": 2.0, "cold_added_s": 4.0,
                  "warm_added_s": 0.2,
                  "warm": {"imports_s": 2.5, "off_s": 1.5, "autotune_s": 1.7}},
                 {"name": "v", "kind": "varlen", "cold_added_s": 9.0}],
        "agreement": [{"name": "d", "same": True}, {"name": "v", "same": False, "inside_noise": True}],
        "regret": [{"name": "d", "regret": 0.0, "needed_margin": 1.1}, {"name": "v", "regret": 0.02,
                                                                         "needed_margin": 1.3}],
    }
    summary = tuning_cost.summarize(result)
    assert summary == {"cold_added_s_max[dense]": 4.0, "cold_vs_stock_s_max[dense]": 2.0,
                       "warm_added_s_max[dense]": 0.2, "cold_added_s_max[varlen]": 9.0, "agreement": 0.5,
                       "disagreements_inside_noise": 1, "disagreements": 1, "regret_median": 0.01,
                       "regret_worst": 0.02, "needed_margin": 1.3}
    result["summary"] = summary
    text = tuning_cost.table(result)
    assert "| d | 3.00 | 2.00 | 4.00 |  | 0.20 | 2.50 | 1.50 | agree | 0.00% |  |" in text
    assert "| v |  |  | 9.00 |  |  |  |  | differ (inside the noise) | 2.00% |  |" in text
    assert "- note: regret: skipped" in text


def test_the_table_leaves_out_workloads_the_time_budget_skipped_and_counts_them_in_one_line():
    result = {"workloads": ["d", "e", "f"], "summary": {}, "agreement": [], "regret": [],
              "cold": [{"name": "d", "kind": "dense", "cold_added_s": 4.0}],
              "notes": ["cold/warm: e skipped (time budget)", "cold/warm: f skipped (time budget)", "tune: stopped"]}
    text = tuning_cost.table(result)
    assert "| d |" in text and "| e |" not in text and "| f |" not in text
    assert "- cold and warm first calls: 2 of 3 workloads not started within the time budget" in text
    assert "e skipped" not in text and "- note: tune: stopped" in text


def test_the_warm_process_calls_in_off_mode_first_so_its_one_time_costs_stay_out_of_the_problems(monkeypatch):
    """Cold: autotune first (the default kernel's first compile counts as tuning, an upper bound); warm: every
    backend's import and an off call first (the process's one-time costs, paid once, not the store hit's)."""
    from inductor_attn.tuning.modes import current_mode

    order = []
    monkeypatch.setattr(tuning_cost, "first_call", lambda w, device, compiled: lambda: None)
    monkeypatch.setattr(tuning_cost, "_timed", lambda fn, device: order.append(current_mode("cpu")) or 0.0)
    w = suites.smoke_size(suites.SUITES["dense"][0])
    monkeypatch.setattr(tuning_cost, "import_backends", lambda w, device: None)
    for verb, expected in (("first-call", ["autotune", "off"]), ("warm-call", ["(imports)", "off", "autotune"])):
        order.clear()
        keys = {"autotune_s", "off_s"} | ({"imports_s"} if verb == "warm-call" else set())
        assert set(tuning_cost._WORKERS[verb](w, torch.device("cpu"), True)) == keys
        assert order[len(order) - 2:] == expected[-2:] and len(order) == len(expected)


def test_needed_margin_is_the_stage_one_ratio_that_finds_every_backend_within_one_percent_of_the_best():
    a = FakeBackend("a", {"default": (1.0, 0.001)})
    b = FakeBackend("b", {"k=1": (2.0, 0.001), "k=2": (0.9, 0.001)})  # default 2x the best default, best overall
    q = __import__("torch").randn(1, 2, 16, 16)
    call = AttnCall("attention", q, q, q, 0.25)
    with only_backends(a, b):
        record = tune(call, enumerate_candidates(call.problem, DEV), timer=FakeTimer([a, b]), rounds=10,
                      search="exhaustive")
        assert tuning_cost.needed_margin(record, DEV) == pytest.approx(2.0, rel=0.01)


@pytest.mark.slow
def test_smoke_run_measures_every_phase_for_each_workload(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_INTERPRET")  # workers run the reference only: the harness, quickly
    tiny = [suites.smoke_size(suites.SUITES[kind][0]) for kind in ("dense", "varlen")]
    monkeypatch.setattr(suites, "select", lambda suite, **kwargs: tiny)
    result = tuning_cost.run(smoke=True, quick=True, device=None)
    assert [r["name"] for r in result["cold"]] == [w.name for w in tiny]
    assert all({"cold_added_s", "warm_added_s"} <= set(r) for r in result["cold"])
    assert [("cold_vs_stock_s" in r) for r in result["cold"]] == [True, False]  # stock: dense and decode
    assert [t["same"] for t in result["agreement"]] == [True, True]
    assert [r["regret"] for r in result["regret"]] == [0.0, 0.0] and result["notes"] == []
    json.dumps(result)


def _run_part(monkeypatch, part: str, first_call: dict, first_verb: str) -> tuple[list, dict]:
    """``run(part=...)`` over one smoke dense workload with fake worker processes: the one of ``first_verb``
    answers ``first_call``, the others an autotune call; each answers an off call of 0.5 s. Returns the
    (verb, shipped) of every worker started, and the result."""
    tiny = [suites.smoke_size(suites.SUITES["dense"][0])]
    monkeypatch.setattr(suites, "select", lambda suite, **kwargs: tiny)
    calls = []

    def worker(verb, workloads, env, deadline, smoke, notes, shipped=False):
        calls.append((verb, shipped))
        if verb == "stock-first-call":
            return {w.name: {"stock_s": 0.25} for w in workloads}
        return {w.name: {**(first_call if verb == first_verb else {"autotune_s": 0.75}), "off_s": 0.5}
                for w in workloads}

    monkeypatch.setattr(tuning_cost, "_worker", worker)
    return calls, tuning_cost.run(smoke=True, quick=True, device=None, part=part)


def test_part_shipped_measures_cold_and_warm_first_calls_with_the_shipped_tables(monkeypatch):
    """``--part shipped``: what a user of the package gets (its decision tables on), cold and warm only."""
    tune = {"tune_seconds": {"compile": 0.5, "gate": 0.1, "timing": 0.2, "total": 0.9}, "timed": 2}
    calls, result = _run_part(monkeypatch, "shipped", {"autotune_s": 2.0, **tune}, "first-call")
    assert calls == [("stock-first-call", False), ("first-call", True), ("warm-call", True)]
    assert result["agreement"] == [] and result["regret"] == [] and result["cold"][0]["cold_added_s"] == 1.5
    assert result["cold"][0]["cold_vs_stock_s"] == 1.75
    text = tuning_cost.table(result)
    assert "shipped decision tables: on" in text and "| 0.9 (0.5 / 0.1 / 0.2; 2) |" in text


def test_part_background_measures_the_cold_first_call_in_background_mode_and_when_its_tune_landed(monkeypatch):
    first = {"background_s": 1.25, "landed": True, "landed_s": 12.0, "landed_winner": "fa4:default"}
    calls, result = _run_part(monkeypatch, "background", first, "background-first-call")
    assert calls == [("stock-first-call", False), ("background-first-call", True), ("warm-call", True)]
    assert result["cold"][0]["cold_added_s"] == 0.75 and result["cold"][0]["warm_added_s"] == 0.25
    assert "its tune stored fa4:default 12.0 s after it" in tuning_cost.table(result)


def test_the_background_first_call_worker_runs_its_calls_and_waits_for_the_tune(monkeypatch):
    # smaller than the smoke size: the background tune times Triton candidates in the interpreter
    w = dataclasses.replace(suites.smoke_size(suites.SUITES["dense"][0]), batch=1, len_q=32, len_k=32, head_dim=32,
                            label="")
    got = tuning_cost._WORKERS["background-first-call"](w, torch.device("cpu"), True)
    assert {"background_s", "off_s", "landed", "landed_s"} <= set(got) and got["landed"]
    assert got["landed_winner"] is not None  # a tune stored it: without one, "landed" holds at once


def test_part_search_runs_only_agreement_and_regret_which_share_the_whole_budget(monkeypatch):
    tiny = [suites.smoke_size(suites.SUITES["dense"][0])]
    monkeypatch.setattr(suites, "select", lambda suite, **kwargs: tiny)
    calls = []

    def worker(verb, workloads, env, deadline, smoke, notes, shipped=False):
        calls.append((verb, round(deadline - time.monotonic())))
        if verb == "tune":
            return {w.name: {"choice": "a:x", "tune_s": 1.0, "record": None} for w in workloads}
        return {w.name: {"name": w.name, "regret": 0.0} for w in workloads}

    monkeypatch.setattr(tuning_cost, "_worker", worker)
    saved = []
    result = tuning_cost.run(smoke=True, quick=True, device=None, part="search", budget_s=110,
                             save=lambda partial: saved.append(json.loads(json.dumps(partial))))
    assert [verb for verb, _ in calls] == ["tune", "tune", "regret"] and result["cold"] == []
    assert [(len(s["agreement"]), len(s["regret"])) for s in saved] == [(1, 0), (1, 1)]  # what a kill would leave
    # agreement gets 0.3 / 0.55 of the budget (60 s), its first tune 3/4 of that; the fakes take no time
    assert [seconds for _, seconds in calls] == [45, 60, 110]
    assert result["summary"] == {"agreement": 1.0, "disagreements_inside_noise": 0, "disagreements": 0,
                                 "regret_median": 0.0, "regret_worst": 0.0, "needed_margin": None}


def test_a_shard_runs_every_nth_workload_and_no_worker_outlives_the_budget(monkeypatch):
    deadlines = []

    def worker(verb, workloads, env, deadline, smoke, notes, shipped=False):
        deadlines.append(deadline - time.monotonic())
        return {w.name: {"stock_s": 1.0, "autotune_s": 2.0, "off_s": 0.5} for w in workloads}

    monkeypatch.setattr(tuning_cost, "_worker", worker)
    every = suites.select("all", quick=True, smoke=True)
    result = tuning_cost.run(smoke=True, quick=True, device=None, part="shipped", budget_s=30, shard=(2, 3))
    assert result["workloads"] == [w.name for w in every[1::3]] and len(result["cold"]) == len(every[1::3])
    assert max(deadlines) <= 30  # a started workload used to get WORKER_MIN_S (120 s) past the budget


def test_a_first_call_that_tuned_reports_its_tune_and_a_store_hit_does_not(monkeypatch):
    import inductor_attn
    from inductor_attn.backends import REFERENCE

    a = FakeBackend("a", {"default": (1.0, 0.01)})
    b = FakeBackend("b", {"x=1": (0.5, 0.01)})
    timed_with_fakes(monkeypatch, a, b)
    w = suites.smoke_size(suites.SUITES["dense"][0])
    with only_backends(a, b, REFERENCE), inductor_attn.tuning_mode("autotune"):
        cold = tuning_cost._first_call_worker(w, torch.device("cpu"), smoke=True)
        warm = tuning_cost._first_call_worker(w, torch.device("cpu"), smoke=True, modes=("off", "autotune"))
    assert cold["timed"] >= 2 and {"compile", "gate", "timing", "total"} <= set(cold["tune_seconds"])
    assert "tune_seconds" not in warm


def test_workers_turn_the_shipped_tables_off_unless_asked(monkeypatch, tmp_path):
    seen = []

    def fake_run(cmd, env, **kw):
        seen.append(env.get("INDUCTOR_ATTN_PRIORS"))
        return types.SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(tuning_cost.subprocess, "run", fake_run)
    w = suites.smoke_size(suites.SUITES["dense"][0])
    monkeypatch.delenv("INDUCTOR_ATTN_PRIORS")
    for shipped in (False, True):
        tuning_cost._worker("first-call", [w], {}, time.monotonic() + 60, True, [], shipped)
    assert seen == ["off", None]


@pytest.mark.parametrize("suite,part", [("overhead", "shipped"), ("training", "background"), ("tuning-cost", "ops")])
def test_a_part_of_another_suite_is_refused_with_what_the_suite_takes(suite, part, capsys):
    from inductor_attn.bench.host_suites import run_wallclock_suite

    assert run_wallclock_suite(suite, smoke=True, quick=True, part=part, out=None, command="test", commit="x") == 2
    assert f"--part {part} applies to" in capsys.readouterr().err
