"""Where our launches and captures go on a machine with several GPUs, and what a failed capture leaves behind:
checked on a CPU with the CUDA calls they make stood in for (a GPU test cannot pick a second device here)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from fakes import small_call

from inductor_attn import device, runtime
from inductor_attn.tuning import timing


class _OnCuda:
    """Stands for a CUDA tensor on device ``index``: what ``on_device_of`` reads of it."""

    is_cuda = True

    def __init__(self, index: int):
        self.device = torch.device("cuda", index)
        self._index = index

    def get_device(self) -> int:
        return self._index


@pytest.fixture
def current_device(monkeypatch):
    """torch.cuda.current_device and torch.cuda.device, on a pretend machine whose current device is 0."""
    state = {"device": 0, "entered": []}

    @contextlib.contextmanager
    def guard(d):
        previous, state["device"] = state["device"], torch.device(d).index
        state["entered"].append(state["device"])
        try:
            yield
        finally:
            state["device"] = previous

    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["device"])
    monkeypatch.setattr(torch.cuda, "device", guard)
    return state


def test_a_tensor_on_another_gpu_makes_its_device_current_and_others_change_nothing(current_device):
    with device.on_device_of(_OnCuda(1)):
        assert current_device["device"] == 1
    assert current_device["device"] == 0
    for t in (_OnCuda(0), torch.zeros(1)):
        with device.on_device_of(t):
            assert current_device["device"] == 0
    assert current_device["entered"] == [1]


def test_eager_calls_decide_and_launch_under_their_tensors_device(monkeypatch):
    """Triton launches, the tuner's CUDA graphs and its events all take the current device: runtime runs a call
    (its decision, any tune, its launch) under ``on_device_of(q)``."""
    seen = []

    @contextlib.contextmanager
    def recording(t):
        seen.append(t)
        yield

    monkeypatch.setattr(runtime, "on_device_of", recording)
    call = small_call()
    runtime.forward(call, "")
    assert seen == [call.q]


class _Graph:
    def __init__(self, end_fails: bool):
        self.end_fails, self.mode = end_fails, None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.mode = capture_error_mode

    def capture_end(self):
        if self.end_fails:
            raise RuntimeError("operation not permitted when stream is capturing")


@pytest.mark.parametrize("end_fails", [False, True])
def test_the_timer_captures_thread_local_and_restores_the_callers_stream_however_it_ends(monkeypatch, end_fails):
    """A tune runs inside the user's program: a capture in torch's default "global" mode fails other threads'
    unsafe CUDA calls (a DataLoader's pin-memory thread), and torch.cuda.graph's exit leaves the thread on the
    capture stream when ending the capture raises."""
    streams = []

    @contextlib.contextmanager
    def stream(s):
        streams.append(("enter", s))
        try:
            yield
        finally:
            streams.append(("exit", s))

    monkeypatch.setattr(torch.cuda, "stream", stream)
    graph, ran = _Graph(end_fails), []
    with pytest.raises(RuntimeError) if end_fails else contextlib.nullcontext():
        timing._capture(graph, None, "side", lambda: ran.append(1))
    assert graph.mode == "thread_local" and ran == [1]
    assert streams == [("enter", "side"), ("exit", "side")]
