"""Run one op call: resolve the choice (baked in, or decided now), fetch its plan, launch it.

An empty ``choice`` means "decide at run time": eager calls and compiled code whose decision needs run-time
data (dynamic shapes, varlen, block masks) land here. Decisions are remembered per bucket in memory and
plans per exact problem, so the steady state is two dictionary lookups and the plan's launch.
"""

from __future__ import annotations

import collections
import contextlib
import threading

from ._compat import inductor_counters
from .backends import AttnCall, plan_for
from .device import DeviceInfo, device_info, on_device_of

# The ``choice`` of op calls decided at run time whose arguments were checked before the op: by the fake impl while
# tracing (compiled code), or by the public functions (api.py) eagerly. The op skips its checks (ops/attention.py).
CHECKED = "*"
__all__ = ["forward", "backward", "count_call", "plan_for", "stats", "reset_stats", "count_compiled"]

_STATS: collections.Counter = collections.Counter()  # op calls that ran through this module
# Plans put into compiled graphs are counted in Inductor's counters under this prefix: a compile's additions
# are replayed with its graph from Inductor's FX-graph cache (_compat.inductor_counters).
IN_GRAPHS = "inductor_attn: "
_UNCOUNTED = threading.local()  # .depth > 0 inside uncounted(), per thread


def _resolve(call: AttnCall, choice: str, direction: str, grad_lse: bool = False) -> tuple[str, DeviceInfo]:
    dev = device_info(call.q.device)
    if not choice or choice == CHECKED:
        from .tuning import decide  # lazy: tuning pulls in the store and timers

        choice = decide(call, dev, direction, grad_lse=grad_lse)
    return choice, dev


def count_call(key: tuple[str, str, str]) -> None:
    """Count one call of (op, direction, choice) that ran, unless inside :func:`uncounted`."""
    if not getattr(_UNCOUNTED, "depth", 0):
        _STATS[key] += 1


@contextlib.contextmanager
def uncounted():
    """Op calls this thread makes inside are left out of ``stats`` (the tuner's timing of the compiled-code
    path: a flag, so the timed launches carry no bookkeeping of their own)."""
    _UNCOUNTED.depth = getattr(_UNCOUNTED, "depth", 0) + 1
    try:
        yield
    finally:
        _UNCOUNTED.depth -= 1


def count_compiled(op: str, direction: str, choice: str) -> None:
    """Note a plan that compiled code launches itself: its calls run none of our Python to count them."""
    inductor_counters()[f"{IN_GRAPHS}{op}/{direction} -> {choice}"] += 1


def forward(call: AttnCall, choice: str):
    with on_device_of(call.q):  # deciding (and tuning) and launching on the call's device
        return _forward(call, choice)


def _forward(call: AttnCall, choice: str):
    resolved, dev = _resolve(call, choice, "forward")
    try:
        result = plan_for(call.problem, resolved, dev, "forward").launch(call)
    except Exception as err:
        if not _gives_way(call, dev, "forward", choice, resolved, err):
            raise
        return _forward(call, choice)
    count_call((call.op, "forward", resolved))
    return result


def backward(call: AttnCall, choice: str, out, lse, grad_out, grad_lse):
    with on_device_of(call.q):
        return _backward(call, choice, out, lse, grad_out, grad_lse)


def _backward(call: AttnCall, choice: str, out, lse, grad_out, grad_lse):
    resolved, dev = _resolve(call, choice, "backward", grad_lse is not None)
    try:
        result = plan_for(call.problem, resolved, dev, "backward").launch(call, out, lse, grad_out, grad_lse)
    except Exception as err:
        if not _gives_way(call, dev, "backward", choice, resolved, err, grad_lse is not None):
            raise
        return _backward(call, choice, out, lse, grad_out, grad_lse)
    count_call((call.op, "backward", resolved))
    return result


def _gives_way(call: AttnCall, dev: DeviceInfo, direction: str, choice: str, resolved: str, err: Exception,
               grad_lse: bool = False) -> bool:
    """Whether a choice decided here that cannot run here after all (a mode that does not measure ran an
    ungated default; flex's own tile ran out of shared memory on a GPU) gives way to the next candidate,
    instead of failing the user's call. A choice named by the caller (``run_candidate``) is never replaced;
    compiled code's baked one gives way through :func:`baked_gives_way`."""
    if choice and choice != CHECKED:
        return False
    from .tuning.decisions import give_way

    return give_way(call, dev, direction, resolved, err, grad_lse)


def baked_gives_way(call: AttnCall, direction: str, choice: str, err: Exception, grad_lse: bool = False) -> bool:
    """Whether ``choice``, which compiled code baked for ``call``, gives way after it raised ``err`` at its launch:
    as a choice decided at run time does (:func:`_gives_way`), where ``err`` means it cannot run here (a mode that
    does not measure baked an ungated default). The caller then runs the call as one decided at run time; the
    bucket's later compiles bake the next candidate (the failure is part of the FX graph cache key)."""
    from .tuning.decisions import give_way

    return give_way(call, device_info(call.q.device), direction, choice, err, grad_lse)


def stats() -> dict[str, int]:
    """How many op calls ran on which kernel since start (or the last ``reset_stats``), as
    ``{"attention/forward -> reference:default": 3, ...}``. Kernels that compiled code launches itself
    run none of our Python per call: they are counted once per compiled graph, whether compiled here or loaded
    from Inductor's cache, under keys ending in ``(launched by compiled code, per graph)``. Calls replayed
    inside a CUDA graph are not counted."""
    calls = {f"{op}/{direction} -> {choice}": n for (op, direction, choice), n in sorted(_STATS.items())}
    counters = dict(inductor_counters())  # a copy in one step: another thread's compile adds keys
    compiled = {f"{key[len(IN_GRAPHS):]} (launched by compiled code, per graph)": counters[key]
                for key in sorted(counters) if key.startswith(IN_GRAPHS)}
    return calls | compiled


def reset_stats() -> None:
    _STATS.clear()
    counters = inductor_counters()
    for key in [k for k in list(counters) if k.startswith(IN_GRAPHS)]:  # list(): one step, as a compile adds keys
        counters.pop(key, None)
