"""Error texts that several layers must agree on, in a module that imports nothing of ours.

The API's compiled check of ``kv_seqlens`` values is a device-side assert with the text
``device_message(KV_SEQLENS_VALUES)``: ops/checks.py raises it, a kernel that makes the same check asserts
with it (backends/triton_decode.py), and lowering/ finds the graph's assert by it.
"""

KV_SEQLENS_VALUES = "kv_seqlens values must be in [0, k.shape[2]] (the k seq_len)"
# paged_attention's checks of its index values (ops/checks.py: eager ValueErrors say the same with the values)
PAGED_KV_SEQLENS_VALUES = "kv_seqlens values must be in [0, max_seqlen_k] (default block_table.shape[1] * page_size)"
PAGED_BLOCK_IDS = "block_table values must be in [0, num_blocks) in the pages that kv_seqlens reaches"
# Appended to device-side assert messages: the values cannot be printed from inside a kernel.
_DEVICE_CHECK = "(checked on the device in compiled code; call eagerly to see the values)"


def device_message(message: str) -> str:
    """The text of the device-side assert that checks ``message``'s condition.

    >>> device_message("x must be >= 0")
    'x must be >= 0 (checked on the device in compiled code; call eagerly to see the values)'
    """
    return f"{message} {_DEVICE_CHECK}"
