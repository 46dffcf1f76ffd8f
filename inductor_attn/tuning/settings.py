"""Tuning settings read from the environment. A bad value is a ValueError that names the variable, what
was given and what is accepted; an unset or empty variable means the default."""

from __future__ import annotations

import os
from collections.abc import Callable


def env_number(name: str, default, parse: Callable[[str], float], valid: Callable[[float], bool], accepted: str):
    """``parse(os.environ[name])`` when it is set and ``valid``; ``default`` when unset or empty.

    >>> env_number("INDUCTOR_ATTN_UNSET_EXAMPLE", 1.25, float, lambda x: x >= 1, "a factor >= 1")
    1.25
    """
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = parse(text)
    except ValueError:
        value = None
    if value is None or not valid(value):
        raise ValueError(f"{name} must be {accepted}, got {text!r}")
    return value


def env_flag(name: str) -> bool:
    """``1`` on, ``0`` (or unset, or empty) off; anything else a ValueError, not a silent off.

    >>> env_flag("INDUCTOR_ATTN_UNSET_EXAMPLE")
    False
    """
    text = os.environ.get(name, "")
    if text not in ("", "0", "1"):
        raise ValueError(f"{name} must be 1 (on) or 0 (off), got {text!r}")
    return text == "1"
