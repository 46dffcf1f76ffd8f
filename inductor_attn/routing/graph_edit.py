"""Small FX helpers shared by the rewrites: the skip signal, example values, and a node emitter."""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.fx
from torch.utils._pytree import tree_map


class Skip(Exception):
    """An attention call that stays as it is; the message is the reason."""


@contextlib.contextmanager
def failures_skip(emit: Emitter | None = None, why: str = ""):
    """Inside, any exception leaves the call as it is: a Skip whose reason is ``why`` then the exception (routing
    never fails a compile), after the nodes ``emit`` added are taken out again."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - reported as the reason the call stays as it is
        if emit is not None:
            emit.rollback()
        if isinstance(exc, Skip):
            raise
        raise Skip(f"{why}{type(exc).__name__}: {str(exc)[:200]}") from exc


def ev(x):
    """The example value Dynamo recorded for a node (a module for a ``get_attr``), or ``x`` itself."""
    if not isinstance(x, torch.fx.Node):
        return x
    if x.op == "get_attr":
        return getattr(x.graph.owning_module, x.target)
    return x.meta.get("example_value")


@contextlib.contextmanager
def _fake_tensor_log_quiet():
    """A node whose fake evaluation fails is a reason to leave a call alone, raised to the caller; torch's
    fake-tensor logger would also print the failure as an ERROR with a traceback."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class Emitter:
    """Inserts nodes before ``anchor`` with example values computed in the graph's fake mode; remembers
    them, so that a plan which fails halfway can take them out again (:meth:`rollback`)."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, fake_mode):
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode
        self.created: list[torch.fx.Node] = []

    def __call__(self, op: str, target, *args, **kwargs) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs)
        self.created.append(node)
        evs = tree_map(ev, (args, kwargs))
        with self.fake_mode if self.fake_mode is not None else contextlib.nullcontext(), _fake_tensor_log_quiet():
            if op == "call_method":
                value = getattr(evs[0][0], target)(*evs[0][1:], **evs[1])
            else:
                value = target(*evs[0], **evs[1])
        node.meta["example_value"] = value
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        return node

    def fn(self, target, *args, **kwargs) -> torch.fx.Node:
        return self("call_function", target, *args, **kwargs)

    def method(self, name: str, *args, **kwargs) -> torch.fx.Node:
        return self("call_method", name, *args, **kwargs)

    def rollback(self) -> None:
        for node in reversed(self.created):
            if not node.users:
                self.graph.erase_node(node)
        self.created.clear()
