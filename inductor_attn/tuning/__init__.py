"""Deciding which candidate runs a problem."""

from .decisions import decide, decide_with_record

__all__ = ["decide", "decide_with_record"]
