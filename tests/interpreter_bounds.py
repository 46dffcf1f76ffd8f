"""Out-of-bounds checks for Triton kernels run by the interpreter (``TRITON_INTERPRET=1``, the CPU tests).

On a GPU an out-of-bounds read is an illegal address (a lost CUDA context) or, worse, a silent read of a neighbour's
memory; the interpreter reads raw host memory and notices nothing. :func:`bounds_checked` makes every load and
store of the kernels launched inside it fail unless each address it touches (masked-off lanes excepted) lies in
the storage of one of that launch's tensor arguments (a TMA descriptor's tensor among them; loads through a
descriptor are not checked). Triton's interpreter (triton/runtime/interpreter.py:
``GridExecutor._init_args_hst`` hands the kernel its host tensors, ``InterpreterBuilder.create_masked_load`` and
``create_masked_store`` take every access) is patched for the duration.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest


@contextlib.contextmanager
def bounds_checked():
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    builder, executor = interpreter.interpreter_builder, interpreter.GridExecutor
    ranges: list[tuple[int, int]] = []
    init_args, load, store = executor._init_args_hst, builder.create_masked_load, builder.create_masked_store

    def init_args_recorded(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        ranges.clear()
        pending = [*args_hst, *kwargs_hst.values()]
        while pending:
            arg = pending.pop()
            if isinstance(arg, tuple):
                pending.extend(arg)
            elif hasattr(arg, "base"):  # a TensorDescriptor (TMA): its tensor
                pending.append(arg.base)
            elif hasattr(arg, "untyped_storage"):
                storage = arg.untyped_storage()
                ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        return args_hst, kwargs_hst

    def check(ptrs, mask, what: str) -> None:
        addresses = np.asarray(ptrs.data, dtype=np.uint64)[np.asarray(mask.data, dtype=bool)]
        if addresses.size == 0:
            return
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        inside = np.zeros(addresses.shape, dtype=bool)
        for start, end in ranges:
            inside |= (addresses >= start) & (addresses + size <= end)
        if not inside.all():
            raise AssertionError(f"a {what} outside every tensor argument: {int((~inside).sum())} of "
                                 f"{addresses.size} addresses")

    def checked_load(ptrs, mask, other, cache_policy, is_volatile):
        check(ptrs, mask, "load")
        return load(ptrs, mask, other, cache_policy, is_volatile)

    def checked_store(ptrs, value, mask, cache_policy):
        check(ptrs, mask, "store")
        return store(ptrs, value, mask, cache_policy)

    executor._init_args_hst = init_args_recorded
    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    try:
        yield
    finally:
        executor._init_args_hst = init_args
        del builder.create_masked_load, builder.create_masked_store
