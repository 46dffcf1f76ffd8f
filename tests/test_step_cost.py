"""What compiled code runs: the candidate that makes the graph's step fastest (tuning/step_cost.py)."""

import pytest

from inductor_attn.tuning.step_cost import (OP_IN_GRAPH_MS, Bucket, GraphWork, LaunchCost, choose_for_graph,
                                            explain_choice, launch_costs)

# B1 H32 L512 D128 causal on an H200 (issue 52): FA4's kernel is faster, its launch through our op dearer
FA4 = LaunchCost("fa4:default", device_ms=0.0138, host_ms=0.082)
FLASH = LaunchCost("sdpa:kernel=flash", device_ms=0.0229, host_ms=0.034)


def _choice(rest, calls=1, winner=FA4.name, costs=(FA4, FLASH)):
    return choose_for_graph({"k": Bucket(winner, list(costs), calls)}, rest)["k"][0]


def test_under_cuda_graphs_the_winner_runs_whatever_its_launch_costs():
    assert _choice(None) == FA4.name


def test_a_device_bound_graph_runs_the_fastest_kernel():
    assert _choice(GraphWork(host_ms=1.0, device_ms=5.0), calls=8) == FA4.name


def test_a_host_bound_graph_runs_the_cheapest_launch():
    assert _choice(GraphWork(host_ms=4.0, device_ms=0.6), calls=8) == FLASH.name


def test_a_graph_of_the_call_alone_runs_what_makes_the_call_fastest():
    # a compiled attention call alone: ~38 us of frame and guards, no other kernel
    assert _choice(GraphWork(host_ms=0.038, device_ms=0.0)) == FLASH.name
    # a larger call: at half the probes' host speed FA4's launch hides behind its kernel, and cuDNN's slower
    # kernel makes the step slower: the faster kernel stays
    big = [LaunchCost("fa4:default", 0.0686, 0.082), LaunchCost("sdpa:kernel=cudnn", 0.0822, 0.041)]
    assert _choice(GraphWork(host_ms=0.038, device_ms=0.0), costs=big) == "fa4:default"


def test_a_cheaper_launch_must_win_at_every_host_speed_the_probes_may_stand_for():
    """A tune's probes read the host's speed of their moment, 0.5-2x what compiled code meets (HOST_SCALES).
    Made-up figures: a lone call whose winner launches in 100 us for a 90 us kernel, and a challenger that
    launches in 30 us for a 120 us kernel. At the probes' speed the winner's step is host-bound and the challenger
    faster; at half that speed the winner's kernel outlasts its launch and the challenger is slower: the faster
    kernel stays. Where the challenger's launch is so cheap that its step wins at every speed, it runs."""
    winner = LaunchCost("fast", device_ms=0.090, host_ms=0.100)
    cheap = LaunchCost("cheap", device_ms=0.120, host_ms=0.030)
    alone = GraphWork(host_ms=0.038, device_ms=0.0)
    assert _choice(alone, winner="fast", costs=(winner, cheap)) == "fast"
    cheaper_kernel = LaunchCost("cheap", device_ms=0.070, host_ms=0.030)
    assert _choice(alone, winner="fast", costs=(winner, cheaper_kernel)) == "cheap"


def test_the_tie_margin_is_asked_at_the_probes_own_host_speed_alone():
    """HF Llama's B1 L512 training forward (H200, 2026-12-01): 8 calls in a graph of 4.2 ms of other host time.
    cuDNN's launch is 37 us cheaper per call, its kernel 1.6 us slower: at half the probes' speed its gain is
    below 2% of the step, yet it is never slower; it runs."""
    fa4 = LaunchCost("fa4:tile_mn=128x176", device_ms=0.0084, host_ms=0.0947)
    cudnn = LaunchCost("sdpa:kernel=cudnn", device_ms=0.0100, host_ms=0.0579)
    rest = GraphWork(host_ms=4.210, device_ms=0.711)
    assert _choice(rest, calls=8, winner=fa4.name, costs=(fa4, cudnn)) == cudnn.name


def test_the_winner_stays_within_the_tie_margin_of_the_best_step():
    near = LaunchCost("b", device_ms=0.98, host_ms=0.0)
    winner = LaunchCost("a", device_ms=0.96, host_ms=0.012)  # costs 1.0 + 1% more in a host-bound graph
    assert _choice(GraphWork(1.0, 0.0), winner="a", costs=(winner, near)) == "a"


def test_a_kernel_tied_with_the_winners_and_cheaper_to_launch_runs_in_plain_mode():
    """HF Llama's B4 L2048 training forward (H200): FA3 won on device by 1%, FA4 ties it with a launch a third of
    FA3's. In a graph estimated device-bound both cost the same, so the cheaper launch runs (the estimate can be
    wrong: that step waited on the host); under CUDA graphs the winner runs."""
    fa3 = LaunchCost("fa3:num_splits=1", device_ms=0.0885, host_ms=0.150)
    fa4 = LaunchCost("fa4:default", device_ms=0.0895, host_ms=0.075)
    device_bound = GraphWork(host_ms=4.2, device_ms=5.7)
    chosen = choose_for_graph({"k": Bucket(fa3.name, [fa3, fa4], 8)}, device_bound)["k"]
    assert chosen[0] == fa4.name and "ties the winner fa3:num_splits=1's kernel" in chosen[1]
    assert _choice(None, winner=fa3.name, costs=(fa3, fa4)) == fa3.name
    # a launch within the probes' error of the winner's leaves the winner
    close = LaunchCost("fa4:default", device_ms=0.0895, host_ms=0.130)
    assert _choice(device_bound, calls=8, winner=fa3.name, costs=(fa3, close)) == fa3.name
    # a kernel faster than the winner's beyond the margin is no tie: the cheapest tied launch is the incumbent,
    # and the faster kernel replaces it only where the step gains
    faster = LaunchCost("fa4:tile_mn=128x176", device_ms=0.060, host_ms=0.048)
    tied = LaunchCost("fa4:default", device_ms=0.0870, host_ms=0.023)
    chosen = choose_for_graph({"k": Bucket(fa3.name, [fa3, faster, tied], 8)}, device_bound)["k"]
    assert chosen[0] == faster.name and "ties the winner" in chosen[1] and "with fa4:default" in chosen[1]
    cheapest = LaunchCost("fa4:tile_mn=128x176", device_ms=0.060, host_ms=0.020)  # faster and cheaper: no tie
    chosen = choose_for_graph({"k": Bucket(fa3.name, [fa3, cheapest], 8)}, device_bound)["k"]
    assert chosen[0] == cheapest.name and "ties" not in chosen[1] and "with the winner fa3" in chosen[1]


def test_buckets_of_one_graph_are_decided_together():
    """Two dear launches make the graph host-bound (5.5 ms of host against 4.0 of device); one cheap launch
    makes it device-bound again (3.6 against 4.05), and the other bucket then keeps its fast kernel (both
    cheap: 4.1)."""
    costs = [LaunchCost("fast", 1.0, 2.0), LaunchCost("cheap", 1.05, 0.1)]
    buckets = {"fwd": Bucket("fast", costs, 1), "bwd": Bucket("fast", costs, 1)}
    chosen = choose_for_graph(buckets, GraphWork(host_ms=1.5, device_ms=2.0))
    assert sorted(choice for choice, _ in chosen.values()) == ["cheap", "fast"]
    assert "host" in chosen["fwd"][1] or "host" in chosen["bwd"][1]


def test_a_bucket_without_measured_host_times_runs_its_winner():
    chosen = choose_for_graph({"k": Bucket("a", [], 3)}, GraphWork(5.0, 0.1))
    assert chosen["k"][0] == "a" and "no host time" in chosen["k"][1]


def test_records_give_the_candidates_that_passed_with_both_figures():
    record = {"timer": "cuda-graph", "candidates": [
        {"name": "a", "status": "passed", "median_ms": 1.0, "host_ms": 0.1},
        {"name": "b", "status": "passed", "median_ms": 2.0, "host_ms": None},  # tuned before step 7 timed all
        {"name": "c", "status": "wrong", "median_ms": None, "host_ms": None},
        {"name": "d", "status": "passed", "median_ms": 0.5, "host_ms": 0.3}]}
    assert launch_costs(record) == [LaunchCost("a", 1.0, 0.1), LaunchCost("d", 0.5, 0.3)]
    assert launch_costs({**record, "timer": "wall-clock"}) == []  # a CPU time holds its launch already


def test_configs_of_one_backend_and_launch_path_share_its_host_time():
    """A knob changes the kernel, not the Python that launches it: a config's lower probe is noise, and a
    host-bound graph keeps the tuner's winner rather than a slower config of the same backend. A call through
    the launch op (not traced) costs compiled code more than its probe."""
    costs = launch_costs(_timed(("fa4:default", 0.0138, 0.060, False), ("fa4:tile=1", 0.0174, 0.036, False),
                                ("fa4:tile=2", 0.0167, 0.057, False), ("sdpa:kernel=flash", 0.023, 0.046, True)))
    op = 0.057 + OP_IN_GRAPH_MS
    assert [c.host_ms for c in costs] == pytest.approx([op, op, op, 0.046])
    chosen = choose_for_graph({"k": Bucket("fa4:default", costs[:3])}, GraphWork(host_ms=0.038, device_ms=0.0))
    assert chosen["k"][0] == "fa4:default"
    chosen = choose_for_graph({"k": Bucket("fa4:default", costs)}, GraphWork(host_ms=0.038, device_ms=0.0))
    assert chosen["k"][0] == "sdpa:kernel=flash"


@pytest.mark.parametrize("slack_ms", [-0.5, -0.03, -0.02, 0.0, 0.2])
def test_explain_predicts_the_choice_of_a_graph_for_its_host_minus_device_time(slack_ms):
    lines = explain_choice(FA4.name, [FA4, FLASH])
    assert lines[0] == f"under CUDA graphs: {FA4.name} (device time only)"
    switch = float(lines[1].split("<")[1].split("ms")[0])
    expected = FA4.name if slack_ms < switch else FLASH.name
    rest = GraphWork(max(slack_ms, 0.0) + 1.0, max(-slack_ms, 0.0) + 1.0)  # the same slack on a larger graph
    assert _choice(GraphWork(max(slack_ms, 0.0), max(-slack_ms, 0.0))) == expected
    assert lines[1].endswith(FA4.name) and lines[2].endswith(FLASH.name) and len(lines) == 3
    assert _choice(rest) in (FA4.name, FLASH.name)


def test_explain_says_when_one_candidate_runs_whatever_the_graph():
    best = LaunchCost("a", device_ms=0.01, host_ms=0.01)
    lines = explain_choice("a", [best, LaunchCost("b", 0.02, 0.02)])
    assert lines[1] == "plain launches: a whatever the rest of the graph"


def test_a_host_advantage_within_the_probes_error_leaves_the_winner():
    """Two probes of one tune are within about 10% of each other's truth: 45 against 55 us of launch is not
    enough to give up a faster kernel in a graph of the call alone; 34 against 82 is."""
    winner = LaunchCost("fa4:default", device_ms=0.0138, host_ms=0.055)
    cheaper = LaunchCost("sdpa:kernel=cudnn", device_ms=0.0151, host_ms=0.045)
    assert _choice(GraphWork(host_ms=0.038, device_ms=0.0), costs=(winner, cheaper)) == "fa4:default"
    assert _choice(GraphWork(host_ms=0.038, device_ms=0.0), costs=(FA4, FLASH)) == FLASH.name


def test_sdpas_kernels_are_launch_paths_of_their_own():
    """SDPA's kernel knob calls another aten op, whose launch costs another host time: pooled with the others,
    cuDNN's faster kernel took flash's cheaper launch and ran where flash made the step faster (H200, L512c)."""
    costs = launch_costs(_timed(("fa4:default", 0.0137, 0.067, False), ("sdpa:kernel=cudnn", 0.0150, 0.054, True),
                                ("sdpa:kernel=flash", 0.0228, 0.047, True),
                                ("sdpa:kernel=efficient", 0.037, 0.098, True)))
    assert [c.host_ms for c in costs] == pytest.approx([0.067 + OP_IN_GRAPH_MS, 0.054, 0.047, 0.098])
    chosen = choose_for_graph({"k": Bucket("fa4:default", costs)}, GraphWork(host_ms=0.038, device_ms=0.0))
    assert chosen["k"][0] == "sdpa:kernel=flash"


def _timed(*candidates) -> dict:
    """A tune record whose ``candidates`` (name, median ms, host ms, traced) all passed."""
    return {"timer": "cuda-graph", "candidates": [
        {"name": name, "status": "passed", "median_ms": ms, "host_ms": host, "traced": traced}
        for name, ms, host, traced in candidates]}


@pytest.mark.parametrize("order", ["AB", "BA"])
def test_buckets_of_one_graph_take_the_best_joint_choice_whichever_is_decided_first(order):
    """16 global and 24 sliding-window layers: decided one at a time, the first bucket met a graph host-bound only
    because the other still ran its dear launch, took a cheap launch of a 4x slower kernel and left the step at
    3.12 ms where SDPA's flash kernel in both gives 1.92 (FA4 in both: 5.04)."""
    a = Bucket("fa4", [LaunchCost("fa4", 0.026, 0.112), LaunchCost("sdpa:flash", 0.034, 0.034),
                       LaunchCost("triton", 0.065, 0.020)], calls=16)
    b = Bucket("fa4", [LaunchCost("fa4", 0.021, 0.112), LaunchCost("sdpa:flash", 0.035, 0.034),
                       LaunchCost("triton", 0.091, 0.020)], calls=24)
    chosen = choose_for_graph({key: {"A": a, "B": b}[key] for key in order}, GraphWork(host_ms=0.56, device_ms=0.52))
    assert {key: choice for key, (choice, _) in chosen.items()} == {"A": "sdpa:flash", "B": "sdpa:flash"}
    if order == "BA":  # where one at a time went wrong, the record says how the joint choice won
        assert "chosen with the graph's other buckets: the step costs 1.920 ms against 3.120 ms" in chosen["B"][1]
