"""The multigpu bench's rank program on the CPU, with two fake backends so that ranks really tune (on a
CPU only the reference kernel runs, and a problem with one candidate is never tuned).

The launches use the machine's Inductor cache, as the suite's in-process compiles do, instead of an empty
one each: they build the same C++ kernels every time, which was most of a launch's time on the CPU.
Inductor's FX graph and AOTAutograd caches are off, so that no launch replays another's compiled graphs
and the decisions baked into them: every launch still traces, rewrites and decides as on a fresh
machine."""

import os
import sys

import torch._functorch.config
import torch._inductor.config
from fakes import FakeBackend, FakeTimer
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from inductor_attn.backends import only_backends
from inductor_attn.bench import multigpu
from inductor_attn.tuning import tuner

if __name__ == "__main__":
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = default_cache_dir()
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    a = FakeBackend("a", {"default": (1.0, 0.01)}, traceable=True)
    b = FakeBackend("b", {"default": (0.5, 0.01)}, traceable=True)
    tuner.default_timer = lambda device_type: FakeTimer([a, b])
    with only_backends(a, b):
        sys.exit(multigpu.main(sys.argv[1:]))
