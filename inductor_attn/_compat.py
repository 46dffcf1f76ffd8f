"""Every private PyTorch API this package touches, imported in one place with version guards.

tests/test_compat.py imports each name on the installed torch and fails loudly when one moves.
"""

from __future__ import annotations

import torch

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])


def inductor_lowering():
    """``register_lowering`` and ``fallback_handler`` (torch/_inductor/lowering.py, 2.11 and 2.13)."""
    from torch._inductor.lowering import fallback_handler, register_lowering

    return register_lowering, fallback_handler
