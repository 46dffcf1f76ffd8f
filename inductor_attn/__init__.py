"""inductor_attn: torch.compile picks the fastest correct attention kernel for each shape.

Public API only; see README.md.
"""

from . import ops  # registers the custom ops
from .api import attention, varlen_attention
from .dispatch import reset_stats, stats
from .ops import BlockSparseMask

__version__ = "0.1.0"

__all__ = ["attention", "varlen_attention", "BlockSparseMask", "stats", "reset_stats", "__version__"]
