"""inductor_attn: torch.compile picks the fastest correct attention kernel for each shape.

Public API only; see README.md.
"""

from . import cache, ops  # noqa: E402  (ops registers the custom ops)
from ._version import __version__
from .api import attention, candidates, run_candidate, varlen_attention  # noqa: E402
from .backends import Candidate, Config, register_backend  # noqa: E402
from .enable import disable, enable, enabled, is_enabled  # noqa: E402
from .ops import BlockSparseMask  # noqa: E402
from .routing.rewrite import reset_routing_report, routing_report  # noqa: E402
from .runtime import reset_stats, stats  # noqa: E402
from .tuning.modes import MODES, set_mode, tuning_mode  # noqa: E402
from .tuning.ranks import sync_decisions  # noqa: E402

__all__ = [
    "attention", "varlen_attention", "BlockSparseMask", "candidates", "run_candidate", "Candidate", "Config",
    "register_backend", "set_mode", "tuning_mode", "MODES", "stats", "reset_stats", "cache", "__version__",
    "enable", "disable", "enabled", "is_enabled", "routing_report", "reset_routing_report", "sync_decisions",
]
