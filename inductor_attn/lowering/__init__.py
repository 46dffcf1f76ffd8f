"""Inductor integration: a post-grad pass that decides op calls at compile time and puts their plans into
the graph (graph_pass.py, emit.py). It is installed the first time one of our ops is traced."""

from .graph_pass import active, install, uninstall

__all__ = ["install", "uninstall", "active"]
