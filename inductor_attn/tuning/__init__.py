"""Deciding which candidate runs a problem."""

from .decisions import decide

__all__ = ["decide"]
