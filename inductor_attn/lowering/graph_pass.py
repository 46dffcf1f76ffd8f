"""The post-grad pass that decides at compile time and puts each plan into the graph.

It sits in Inductor's ``post_grad_custom_post_pass`` (after AOTAutograd, before Inductor reinplaces
mutations and lowers), once per compiled graph, forward and backward. Two jobs:

1. Each ``inductor_attn`` op call whose choice can be made from shapes (emit.py) is replaced by its
   plan: traced kernels and torch ops that Inductor's generated code launches itself, or one call of the
   thin ``inductor_attn::launch`` op for kernels that cannot be traced.
2. Keep Inductor's FX graph cache honest. On a cache hit no pass runs: the code built from earlier
   decisions replays (notes/pytorch-internals.md). The cache key hashes every custom pass's ``uuid()``,
   so ours hashes what the decisions depend on: a token of the decision store (store/db.py), the
   backends' sources, the source of the rule that picks what compiled code runs (step_cost.py, graph_cost.py,
   emit.py), the package version, the tuning mode and the simulated device.

   Under ``autotune`` the token is the store's revision, which a new decision leaves alone: a compile
   that meets a problem with no decision measures it and bakes what it stores, so code cached before the
   store grew stays right, and the process after a cold tune finds the code that tune compiled (its key
   was taken before the tune wrote). In the other modes a compile bakes a guess where no decision is, so
   the token is the generation, which every write changes; ``off`` and ``heuristic`` read no store and
   take none. Where the token moved since this process remembered its choices (another process tuned,
   cleared or imported), they are forgotten first: the compile must bake what the store answers under the
   key it is cached with. Choices that failed at a launch here are hashed too: a graph that bakes one
   must not replay after.

A pass the user had already put in that slot is kept, run first, and its uuid is part of ours.
"""

from __future__ import annotations

import functools
import hashlib
import os
import uuid
from pathlib import Path

from .._compat import inductor_config, inference_aware_pass_base, launch_user_triton_kernels_statically

_Base = inference_aware_pass_base()


class DecisionPass(_Base):
    def __init__(self, chained=None):
        self.chained = chained

    def __call__(self, graph, is_inference: bool | None = None) -> None:
        """``is_inference``: whether AOTAutograd compiles an inference graph (torch passes it to this kind of pass;
        None where it does not: then a graph with a backward call or a read lse counts as a training step's)."""
        if self.chained is not None:
            if is_inference is not None and isinstance(self.chained, inference_aware_pass_base()):
                self.chained(graph, is_inference=is_inference)
            else:
                self.chained(graph)
        from .emit import emit_plans

        emit_plans(graph, is_inference)

    def uuid(self):
        from .. import backends
        from .._version import __version__
        from ..device import ENV_VAR as DEVICE_ENV
        from ..store.db import get_store
        from ..store.keys import library_versions
        from ..tuning.decisions import failed_here, follow_store
        from ..tuning.modes import ENV_VAR as MODE_ENV
        from ..tuning.modes import current_mode

        store = get_store()
        mode = current_mode("cuda")
        # off and heuristic never read the store: its writes need not recompile their graphs
        token = follow_store({"autotune": store.revision, "off": str, "heuristic": str}.get(mode, store.generation))
        if store.broken:  # decisions are not persisted: never let a cached graph stand in for a tune
            return uuid.uuid4().hex
        parts = [__version__, token, mode, os.environ.get(MODE_ENV, ""), os.environ.get(DEVICE_ENV, ""),
                 _rule_hash(), failed_here()]
        parts += [f"{b.name}={backends.source_hash(b)}" for b in backends.backends()]
        # decisions are keyed on these too: a new FA4 brings new decisions, which a new row does not signal
        parts += sorted(library_versions(backends.registry.required_distributions()).items())
        if self.chained is not None:
            chained_uuid = getattr(self.chained, "uuid", lambda: None)()
            if chained_uuid is None:
                return None  # the user's pass cannot be cached: neither can the graph
            parts.append(repr(chained_uuid))
        return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()


@functools.cache
def _rule_hash() -> str:
    """The source of what decides which candidate compiled code runs, given the store's decisions, and of the launch
    op that runs it (cached code calls it with a plan string in the format of that module's ``plan_key``)."""
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for path in (here / "emit.py", here / "graph_cost.py", here.parent / "tuning" / "step_cost.py",
                 here.parent / "ops" / "launch.py"):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def install() -> None:
    """Put the pass in ``post_grad_custom_post_pass`` (chaining what is there), once, and have Inductor
    launch the Triton kernels that plans trace in with its static launcher."""
    launch_user_triton_kernels_statically()
    config = inductor_config()
    current = config.post_grad_custom_post_pass
    if not isinstance(current, DecisionPass):
        config.post_grad_custom_post_pass = DecisionPass(current)


def uninstall() -> None:
    """Put back the pass that :func:`install` found."""
    config = inductor_config()
    current = config.post_grad_custom_post_pass
    if isinstance(current, DecisionPass):
        config.post_grad_custom_post_pass = current.chained


def active() -> bool:
    return isinstance(inductor_config().post_grad_custom_post_pass, DecisionPass)
