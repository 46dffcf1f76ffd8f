"""Custom ops (no optional dependencies): importing this registers schemas, fake impls and autograd, and
the thin ``launch`` op that compiled code calls for plans it cannot hold as traced kernels."""

from ..block_mask import BlockSparseMask
from .attention import (
    BACKWARD_OPS,
    FORWARD_OPS,
    attention_backward_op,
    attention_op,
    block_sparse_attention_backward_op,
    block_sparse_attention_op,
    varlen_attention_backward_op,
    varlen_attention_op,
)
from .fp8 import fp8_attention_op
from .launch import launch_op

__all__ = [
    "BACKWARD_OPS", "FORWARD_OPS", "BlockSparseMask", "attention_op", "attention_backward_op",
    "varlen_attention_op", "varlen_attention_backward_op", "block_sparse_attention_op",
    "block_sparse_attention_backward_op", "fp8_attention_op", "launch_op",
]
