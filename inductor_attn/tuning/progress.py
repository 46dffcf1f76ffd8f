"""A progress bar that appears only when tuning takes longer than a second (rich, to stderr)."""

from __future__ import annotations

import contextlib
import sys
import time

SHOW_AFTER_S = 1.0


@contextlib.contextmanager
def progress_ticker(description: str, total: int):
    """Yields ``tick()``; the bar is created lazily on the first tick after SHOW_AFTER_S seconds."""
    start = time.perf_counter()
    state = {"done": 0, "bar": None, "task": None}

    def tick() -> None:
        state["done"] += 1
        if state["bar"] is None and time.perf_counter() - start > SHOW_AFTER_S and sys.stderr.isatty():
            from rich.progress import Progress

            state["bar"] = Progress(transient=True)
            state["bar"].start()
            state["task"] = state["bar"].add_task(description, total=total)
        if state["bar"] is not None:
            state["bar"].update(state["task"], completed=state["done"])

    try:
        yield tick
    finally:
        if state["bar"] is not None:
            state["bar"].stop()
