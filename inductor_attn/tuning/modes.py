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
_override: str | None = None


def _check(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"tuning mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def current_mode(device_type: str) -> str:
    if _override is not None:
        return _override
    env = os.environ.get(ENV_VAR)
    if env:
        return _check(env)
    return "autotune" if device_type == "cuda" else "heuristic"


def set_mode(mode: str | None) -> None:
    """Set the mode for this process (None: back to the environment variable / device default)."""
    global _override
    _override = None if mode is None else _check(mode)
    from .decisions import forget_choices

    forget_choices()


@contextlib.contextmanager
def tuning_mode(mode: str):
    previous = _override
    set_mode(mode)
    try:
        yield
    finally:
        set_mode(previous)
