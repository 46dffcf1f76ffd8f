"""Custom ops (no optional dependencies): importing this registers schemas, fake impls and autograd, and
the thin ``launch`` op that compiled code calls for plans it cannot hold as traced kernels. ``FORWARD_OPS``: every
forward op, the forward-only paged (ops/paged.py) and fp8 (ops/fp8.py) ones included."""

from ..block_mask import BlockSparseMask
from .attention import (
    BACKWARD_OPS,
    attention_backward_op,
    attention_op,
    block_sparse_attention_backward_op,
    block_sparse_attention_op,
    varlen_attention_backward_op,
    varlen_attention_op,
)
from .attention import FORWARD_OPS as _DENSE_FORWARD_OPS
from .fp8 import fp8_attention_op
from .launch import launch_op
from .paged import paged_attention_op

FORWARD_OPS = _DENSE_FORWARD_OPS + (paged_attention_op, fp8_attention_op)

__all__ = [
    "BACKWARD_OPS", "FORWARD_OPS", "BlockSparseMask", "attention_op", "attention_backward_op",
    "varlen_attention_op", "varlen_attention_backward_op", "block_sparse_attention_op",
    "block_sparse_attention_backward_op", "fp8_attention_op", "launch_op", "paged_attention_op",
]
