"""Tuning modes: how a decision is made when none is cached in memory.

- ``autotune``: stored decision, else measure now and store it (default for CUDA problems); a shipped
  decision (store/priors.py) shortens the measurement to its top candidates;
- ``background``: stored decision, else at once the shipped decision's winner (its fastest candidate of
  another backend when the winner is FA4's, whose import and JIT would hold the compile) or the hand rule
  (as in ``heuristic``), while a worker process measures the bucket and stores the decision for the next
  compile or process (background.py);
- ``cache-only``: stored decision, else the shipped decision, else the default candidate; never measures;
- ``heuristic``: no measurement and no store: today's hand rules decide (each backend's
  ``heuristic``, e.g. FA4's CLC rule, split-K decode iff L_kv >= 256), else the default
  (default for CPU problems, where only the reference runs);
- ``off``: always the default candidate (the first runnable one in prior order).

Set with the ``INDUCTOR_ATTN_MODE`` environment variable or ``inductor_attn.set_mode()`` /
``with inductor_attn.tuning_mode("cache-only"): ...``.
"""

from __future__ import annotations

import contextlib
import os

MODES = ("autotune", "background", "cache-only", "heuristic", "off")
ENV_VAR = "INDUCTOR_ATTN_MODE"
_override: str | None = None  # set_mode's
# tuning_mode blocks now open, (token, mode), innermost last: the last one opened rules while it lasts. Process-wide,
# not per thread: autograd runs a backward in a thread of its own, which must see the block its caller opened; so a
# block in one thread rules other threads' calls too while it lasts, and each block's exit removes its own entry
# (restoring "the previous mode" let two threads' blocks, closed out of order, leave one's mode set for good).
_SCOPED: list[tuple[object, str | None]] = []  # (token, mode; None: the default)


def _check(mode: str, name: str = "tuning mode") -> str:
    if mode not in MODES:
        raise ValueError(f"{name} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def current_mode(device_type: str) -> str:
    scoped = _SCOPED[-1:]  # one read: another thread may close its block meanwhile
    if scoped:
        if scoped[0][1] is not None:
            return scoped[0][1]
    elif _override is not None:
        return _override
    env = os.environ.get(ENV_VAR)
    if env:
        return _check(env, ENV_VAR)
    return "autotune" if device_type == "cuda" else "heuristic"


def set_mode(mode: str | None) -> None:
    """Set the mode for this process (None: back to the environment variable / device default); a
    :func:`tuning_mode` block open rules while it lasts."""
    global _override
    _override = None if mode is None else _check(mode)
    _forget()


@contextlib.contextmanager
def tuning_mode(mode: str | None):
    """``mode`` while the block runs, for the whole process (a backward runs in autograd's own thread); None: the
    environment variable's or the device's default, whatever set_mode set."""
    entry = (object(), None if mode is None else _check(mode))
    _SCOPED.append(entry)
    _forget()
    try:
        yield
    finally:
        _SCOPED.remove(entry)
        _forget()


# Called whenever the mode changes: decisions.py registers the dropping of the choices it remembers, made under the
# old mode (it imports this module, not the reverse).
_ON_CHANGE: list = []


def on_change(fn) -> None:
    """Call ``fn()`` whenever the mode changes (set_mode, a tuning_mode block's start and end)."""
    _ON_CHANGE.append(fn)


def _forget() -> None:
    for fn in _ON_CHANGE:
        fn()
