"""Deciding which candidate runs a problem. ``decide`` and ``decide_with_record`` load the decision machinery
(the store, the tuner) at first use: the ops import ``measure`` alone when the package is imported."""

__all__ = ["decide", "decide_with_record"]


def __getattr__(name: str):
    if name in __all__:
        from . import decisions

        return getattr(decisions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
