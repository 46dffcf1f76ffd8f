"""The multigpu bench's rank program on the CPU, with two fake backends so that ranks really tune (on a
CPU only the reference kernel runs, and a problem with one candidate is never tuned)."""

import sys

from fakes import FakeBackend, FakeTimer

from inductor_attn.backends import only_backends
from inductor_attn.bench import multigpu
from inductor_attn.tuning import tuner

if __name__ == "__main__":
    a = FakeBackend("a", {"default": (1.0, 0.01)}, traceable=True)
    b = FakeBackend("b", {"default": (0.5, 0.01)}, traceable=True)
    tuner.default_timer = lambda device_type: FakeTimer([a, b])
    with only_backends(a, b):
        sys.exit(multigpu.main(sys.argv[1:]))
