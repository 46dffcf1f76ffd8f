"""Custom ops (torch-only): importing this registers schemas, fake impls and autograd."""

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

__all__ = [
    "BACKWARD_OPS", "FORWARD_OPS", "BlockSparseMask", "attention_op", "attention_backward_op",
    "varlen_attention_op", "varlen_attention_backward_op", "block_sparse_attention_op",
    "block_sparse_attention_backward_op",
]
