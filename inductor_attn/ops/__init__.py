"""Custom ops (torch-only): importing this registers schemas, fake impls and autograd."""

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
from .block_mask import BlockSparseMask

__all__ = [
    "BACKWARD_OPS", "FORWARD_OPS", "BlockSparseMask", "attention_op", "attention_backward_op",
    "varlen_attention_op", "varlen_attention_backward_op", "block_sparse_attention_op",
    "block_sparse_attention_backward_op",
]
