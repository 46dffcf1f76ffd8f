"""Deciding which candidate runs a problem."""

from .decide import decide

__all__ = ["decide"]
