"""Input checks shared by the public API, the op implementations and the fake (meta) implementations.

Every message names the argument, what was given and what is accepted. Structural checks (types, shapes,
dtypes, devices, sizes) work on fake tensors too: they run eagerly, in the ops, and while torch.compile
traces (in the public API and in the ops' fake impls). Checks on index *values* (``check_*_values``)
read the tensors: eagerly they sync the device and raise ValueError; in compiled code and on fake tensors
(``make_fx``, ``FakeTensorMode``) they become device-side asserts, which stop the compiled call at run time
without a host sync. Their messages hold no sizes: a symbolic size formatted into a string would be
specialised (one compilation per length).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NoReturn

import torch

from .. import _compat
from ..messages import KV_SEQLENS_VALUES, PAGED_BLOCK_IDS, PAGED_KV_SEQLENS_VALUES, device_message

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256
LAYOUTS = {4: "(batch, heads, seq_len, head_dim)", 3: "(total_tokens, heads, head_dim)"}
PAGES = "(num_blocks, page_size, kv_heads, head_dim)"
MAX_PAGE_SIZE = 256
# Lengths and positions are int32 (kv_seqlens, cu_seqlens): no sequence is longer, and a window of more keys is
# unbounded (-1). Larger Python ints would also overflow the ops' int64 arguments.
MAX_INT32 = 2**31 - 1


def fail(error: type[Exception], message: str) -> NoReturn:
    """Raise ``error(message)``; while torch.compile traces, raise it so that it reaches the user as is.

    Dynamo reports an exception raised in code it traces as ``Unsupported: Observed exception``, with our
    text further down (torch 2.13: ``raised exception ValueError('...')``; torch 2.11:
    ``ValueError([ConstantVariable(str: '...')])``). An exception raised in code that Dynamo runs instead
    of tracing (an ``assume_constant_result`` function, or a fake impl) passes through unchanged if it is
    an ``Unsupported``: raised as a subclass of both that and ``error``, the first line the user reads is
    our message, and ``except ValueError`` still catches it. With ``fullgraph=False`` Dynamo breaks the
    graph there instead and runs the raise eagerly: the same exception.
    """
    # traced code sees is_compiling() True; a fake impl that Dynamo runs sees it True only on torch 2.13
    if torch.compiler.is_compiling() or _compat.dynamo_tracing():
        _raise_while_tracing(error, message)
    raise error(message)


@_compat.mark_constant_result  # Dynamo calls it with its constant arguments instead of tracing it
def _raise_while_tracing(error: type[Exception], message: str) -> NoReturn:
    raise _traced_error(error)(message)


@_compat.mark_constant_result  # Dynamo calls it while tracing; after a graph break, it runs eagerly
def refuse_to_trace(error: type[Exception], message: str) -> None:
    """For what compiled code cannot do but eager code can: raise ``error(message)`` while torch.compile traces,
    and return when it runs eagerly. Under fullgraph=True the user reads ``message`` first (see :func:`fail`);
    without, Dynamo breaks the graph at this call and runs it eagerly, where it returns."""
    if _compat.dynamo_tracing():
        raise _traced_error(error)(message)


@functools.cache
def _traced_error(error: type[Exception]) -> type[Exception]:
    """``Traced<error>``, a subclass of ``error`` and of Dynamo's Unsupported."""
    unsupported = _compat.dynamo_unsupported()

    class Traced(unsupported, error):
        def __init__(self, message: str):
            super().__init__(message, gb_type=f"inductor_attn: {error.__name__} in the arguments")

    Traced.__name__ = Traced.__qualname__ = f"Traced{error.__name__}"
    return Traced


def shape_text(sizes) -> str:
    """``str(tuple(sizes))``, built one size at a time: while torch.compile traces, a message passed to
    :func:`fail` must be a constant, and Dynamo formats a symbolic size in an f-string but not a tuple of them
    (``dynamic=True``).

    >>> shape_text(torch.Size([2, 3])), shape_text((5,)), shape_text(())
    ('(2, 3)', '(5,)', '()')
    """
    items = [f"{size}" for size in sizes]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def assert_on_device(cond: torch.Tensor, message: str) -> None:
    """Compiled code only: stop at run time unless the 0-dim bool ``cond`` holds, with no host sync. On the
    CPU, Inductor's kernel raises RuntimeError(message); on CUDA it is a Triton device assert (the kernel
    traps, the message is printed by the device, and the host sees a device-side assert error). Inductor
    pastes the message into C++ and Python string literals: it must hold no quotes or backslashes."""
    _compat.assert_async(cond, device_message(message))


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, x, ndim: int, layout: str) -> None:
    if not isinstance(x, torch.Tensor):
        fail(TypeError, f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.is_nested or x.layout is not torch.strided:  # kernels index memory through strides
        fail(TypeError, f"{name} must be a dense (strided) tensor, got a {'nested' if x.is_nested else x.layout} one")
    if x.dim() != ndim:
        fail(ValueError, f"{name} must have {ndim} dims {layout}, got shape {shape_text(x.shape)}")


def check_same_dtype_device(tensors: dict[str, torch.Tensor], dtypes=SUPPORTED_DTYPES) -> None:
    (first, ref), *rest = tensors.items()
    if ref.dtype not in dtypes:
        hint = "; float8_e4m3fn q, k, v with their descales go to inductor_attn.fp8_attention"
        fail(TypeError, f"{first} has dtype {ref.dtype}; supported dtypes are {_dtype_names(dtypes)}"
                        + (hint if ref.dtype == torch.float8_e4m3fn else ""))
    for name, t in rest:
        if t.dtype != ref.dtype:
            fail(TypeError, f"{name} has dtype {t.dtype} but {first} has {ref.dtype}; q, k and v must share one dtype")
        if t.device != ref.device:
            fail(ValueError, f"{name} is on {t.device} but {first} is on {ref.device}; all inputs must be on one "
                             f"device")


def check_head_dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
    if dk != d:
        fail(ValueError, f"k head_dim must equal q head_dim ({d}), got {dk}")
    for name, size in (("q head_dim", d), ("v head_dim", dv)):
        if not MIN_HEAD_DIM <= size <= MAX_HEAD_DIM:
            fail(ValueError, f"{name} must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {size}")


def check_qkv(q, k, v, ndim: int, dtypes=SUPPORTED_DTYPES) -> None:
    """q, k, v are tensors of the op's rank, one of ``dtypes`` and one device, with head dims in range."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, ndim, LAYOUTS[ndim])
    check_same_dtype_device({"q": q, "k": k, "v": v}, dtypes)
    check_head_dims(q, k, v)


def check_heads(heads_q, heads_kv, v_heads) -> None:
    if v_heads != heads_kv:
        fail(ValueError, f"v must have as many heads as k ({heads_kv}), got {v_heads}")
    # 0 q heads go with any k/v heads (an empty output); 0 k/v heads only with 0 q heads
    if heads_q % max(heads_kv, 1) != 0 or (heads_kv == 0 and heads_q > 0):
        fail(ValueError, f"q heads ({heads_q}) must be a multiple of k/v heads ({heads_kv}) for GQA/MQA")


# who refuses a zero size, and why: the ops run kernels; attention() and varlen_attention() answer such calls
OPS_NEED_SIZES = ("the inductor_attn ops", "inductor_attn.attention and varlen_attention return empty outputs for zero "
                                           "sizes")


def check_not_empty(sizes: dict[str, int], refused_by: tuple[str, str] = OPS_NEED_SIZES) -> None:
    """Every size >= 1, else a ValueError naming the size and ``refused_by`` (who, why)."""
    who, why = refused_by
    for name, size in sizes.items():
        if size < 1:
            fail(ValueError, f"{name} must be >= 1 for {who}, got {size} ({why})")


def check_bool(name: str, value) -> None:
    """A flag: True or False only, never a truthy string or a tensor (whose truth is read on the host)."""
    if value is not True and value is not False:
        kind = type(value).__name__
        if kind in ("bool", "bool_"):  # NumPy's: its 2.x type is called bool too
            kind = f"{type(value).__module__}.{kind}"
        fail(TypeError, f"{name} must be a bool (True or False), got {kind}")


def refuse_grad(op: str, tensors: dict) -> None:
    """For the forward-only ops (no backward): with grad mode on, no tensor of ``tensors`` ({argument: value},
    non-tensors skipped) may require grad. Under torch.no_grad() or torch.inference_mode() any is taken: the
    output then needs no backward."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            fail(ValueError, f"{op} is forward only (it has no backward): {name} requires grad while grad mode is on; "
                             f"pass {name}.detach() or call {op} under torch.no_grad() or torch.inference_mode()")


def refuse_forward_ad(function: str, tensors: dict) -> None:
    """Forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``): our ops have no forward
    derivative, and PyTorch's custom ops drop the tangents of inputs that do not require grad, which would give a
    derivative of zero without an error; so no tensor of ``tensors`` may carry a tangent. Not while torch.compile
    traces: reading the dual level there would be a guard on every compiled call."""
    if torch.compiler.is_compiling():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and _compat.has_tangent(t):
            fail(NotImplementedError, f"{function} has no forward-mode derivative (torch.func.jvp, jacfwd, "
                                      f"torch.autograd.forward_ad): {name} carries a tangent; use reverse mode "
                                      f"(backward, torch.autograd.grad)")


def check_int(name: str, value, accepted: str = "") -> None:
    """A Python int or, in traced code, a SymInt (torch.compile made a value that changed between calls
    symbolic: decided at run time then); never a bool. ``accepted``: what the message adds after "an int"."""
    if not isinstance(value, (int, torch.SymInt)) or isinstance(value, bool):
        fail(TypeError, f"{name} must be an int{accepted}, got {type(value).__name__}")


def check_window(window_left: int, window_right: int) -> None:
    for name, w in (("window_left", window_left), ("window_right", window_right)):
        check_int(name, w, " (-1 = unbounded)")
        if w < -1:
            fail(ValueError, f"{name} must be -1 (unbounded) or >= 0, got {w}")
        if w > MAX_INT32:
            fail(ValueError, f"{name} must be at most {MAX_INT32} (-1 is unbounded), got {w}")


def check_scale(scale) -> None:
    """None (the default, 1 / sqrt(head_dim)) or a real number that converts to float without loss: Python
    and NumPy floats and ints, as F.scaled_dot_product_attention takes them; never bool or a tensor."""
    if scale is None or isinstance(scale, torch.SymFloat):
        return  # under dynamic shapes the default scale is symbolic: its value is checked when it runs
    _check_real("scale", scale)


def check_softcap(softcap) -> None:
    """A real number >= 0 (0: no softcap), taken as :func:`check_scale` takes the scale."""
    if isinstance(softcap, torch.SymFloat):
        return
    if _check_real("softcap", softcap) and softcap < 0:
        fail(ValueError, f"softcap must be >= 0 (0 = no softcap), got {softcap}")


def _check_real(name: str, x) -> bool:
    """``x`` a real number that converts to float without loss; whether its value was checked (not in traced code,
    where the op's fake impl checks it)."""
    if isinstance(x, torch.Tensor):
        fail(TypeError, f"{name} must be a float, got a Tensor of shape {shape_text(x.shape)}; pass float({name}) "
                        f"(a host sync for a device tensor)")
    if not isinstance(x, numbers.Real) or isinstance(x, bool):
        # torch.compile traces a NumPy scalar as an array (F.scaled_dot_product_attention refuses it there too)
        traced_numpy = torch.compiler.is_compiling() and type(x).__module__ == "numpy"
        accepted = f"; in compiled code pass float({name})" if traced_numpy else " (an int or NumPy scalar works too)"
        fail(TypeError, f"{name} must be a float, got {type(x).__name__}{accepted}")
    if torch.compiler.is_dynamo_compiling() and type(x) is not int:
        # traced code (the public functions'), where Dynamo may trace a float argument as a symbol whose value is
        # not known: the op's fake impl checks it at trace time, where the op's float argument has made it a
        # value (a guard on that value: another one traces again). An int is a constant there, and only here
        # can one past float's range or precision be told: the op sees the float it became.
        return False
    # an int past float's range is compared as an int: float() overflows (inside Dynamo, an internal error)
    if not (math.isfinite(x) if type(x) is not int else abs(x) < 2 ** 1024):
        fail(ValueError, f"{name} must be finite, got {x}")
    if abs(x) > torch.finfo(torch.float32).max:  # the kernels compute in float32, where it would be inf
        fail(ValueError, f"{name} must be within float32's range (+-3.4e38), got {x}")
    if float(x) != x:
        fail(ValueError, f"{name} must convert to float without loss, got {x!r}")
    return True


def check_index_tensor(name: str, x, shape: tuple, device: torch.device, layout: str,
                       dtype: torch.dtype = torch.int32) -> None:
    """A tensor argument of a fixed dtype, shape and device: int32 indices and lengths, bool masks."""
    kind = str(dtype).removeprefix("torch.")
    article = "an" if kind[0] in "aeiou" else "a"
    if not isinstance(x, torch.Tensor):
        fail(TypeError, f"{name} must be {article} {kind} torch.Tensor {layout}, got {type(x).__name__}")
    if x.dtype != dtype:
        fail(TypeError, f"{name} must have dtype {kind}, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        fail(ValueError, f"{name} must have shape {shape_text(shape)} {layout}, got {shape_text(x.shape)}")
    if x.device != device:
        fail(ValueError, f"{name} is on {x.device} but q is on {device}")


def check_attention(q, k, v, scale, window_left, window_right, kv_seqlens, key_mask=None, *,
                    allow_empty: bool = False, dtypes=SUPPORTED_DTYPES, refused_by=OPS_NEED_SIZES) -> None:
    """Everything the ops need that does not read tensor values. ``allow_empty``: batch, heads and lengths
    may be 0 (the public API answers those calls without a kernel). ``dtypes``: those q, k, v may have."""
    check_qkv(q, k, v, 4, dtypes)
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        fail(ValueError, f"q, k, v must share the batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[2] != v.shape[2]:
        fail(ValueError, f"k and v must share seq_len, got {k.shape[2]} and {v.shape[2]}")
    check_heads(q.shape[1], k.shape[1], v.shape[1])
    if not allow_empty:
        check_not_empty({"batch": q.shape[0], "q heads": q.shape[1], "q seq_len": q.shape[2],
                         "k seq_len": k.shape[2]}, refused_by)
    check_scale(scale)
    check_window(window_left, window_right)
    if kv_seqlens is not None:
        check_kv_seqlens(q, kv_seqlens)
    if key_mask is not None:
        check_index_tensor("key_mask", key_mask, (q.shape[0], k.shape[2]), q.device,
                           "(batch, k seq_len), True = the key may be attended", dtype=torch.bool)


def values_deferred(*tensors) -> bool:
    """Whether a check of index or scale *values* becomes a device-side assert instead of a host read: in compiled
    code, and on fake tensors (``FakeTensorMode``, ``make_fx``), whose values cannot be read."""
    # a plain torch.Tensor is no FakeTensor (a subclass): the eager call's usual case costs no is_fake call
    return torch.compiler.is_compiling() or any(isinstance(t, torch.Tensor) and type(t) is not torch.Tensor
                                                and _compat.is_fake(t) for t in tensors)


def check_kv_seqlens(q, kv_seqlens) -> None:
    check_index_tensor("kv_seqlens", kv_seqlens, (q.shape[0],), q.device, "(batch,)")


def check_attention_values(k, kv_seqlens) -> None:
    """kv_seqlens[b] in [0, Lk]. Eagerly a device sync and a ValueError; compiled, a device-side assert."""
    if kv_seqlens is None:
        return
    lk = k.shape[2]
    if values_deferred(kv_seqlens):
        assert_on_device(((kv_seqlens >= 0) & (kv_seqlens <= lk)).all(), KV_SEQLENS_VALUES)
        return
    if kv_seqlens.numel() == 0:
        return
    lo, hi = int(kv_seqlens.min()), int(kv_seqlens.max())
    if lo < 0 or hi > lk:
        raise ValueError(f"kv_seqlens values must be in [0, {lk}] (the k seq_len), got min {lo}, max {hi}")


def check_cu_seqlens(name: str, cu, device: torch.device) -> None:
    if not isinstance(cu, torch.Tensor):
        fail(TypeError, f"{name} must be an int32 torch.Tensor of shape (num_seqs + 1,), got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        fail(TypeError, f"{name} must have dtype int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        fail(ValueError, f"{name} must have shape (num_seqs + 1,) with num_seqs >= 1, got {shape_text(cu.shape)}")
    if cu.device != device:
        fail(ValueError, f"{name} is on {cu.device} but q is on {device}")


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, window_left,
                 window_right, *, allow_empty: bool = False) -> None:
    """Everything the varlen op needs that does not read tensor values. The public API also passes None for
    max_seqlen_q/k (computed from cu_seqlens after this check) and for scale (the default), and allows 0
    heads, and max_seqlen_q/k of 0 with 0 tokens (``allow_empty``: it runs no kernel then); 0 tokens are allowed
    either way."""
    check_qkv(q, k, v, 3)
    if k.shape[0] != v.shape[0]:
        fail(ValueError, f"k and v must share total_tokens, got {k.shape[0]} and {v.shape[0]}")
    check_heads(q.shape[1], k.shape[1], v.shape[1])
    if not allow_empty:
        check_not_empty({"q heads": q.shape[1]})
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        fail(ValueError, f"cu_seqlens_q and cu_seqlens_k must have the same length (num_seqs + 1), "
                         f"got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}")
    for name, m, tokens in (("max_seqlen_q", max_seqlen_q, q.shape[0]), ("max_seqlen_k", max_seqlen_k, k.shape[0])):
        if m is None:
            continue
        check_int(name, m)
        # guard_or_false: a max_seqlen read from a tensor in compiled code (.item()) has no value while tracing; the
        # device asserts of check_varlen_values compare it with the lengths at run time
        if _compat.guard_or_false(m < 1) and not (allow_empty and m == 0 and tokens == 0):
            fail(ValueError, f"{name} must be >= 1" + (", or 0 with no tokens" if allow_empty else "") + f", got {m}")
        if _compat.guard_or_false(m > MAX_INT32):
            fail(ValueError, f"{name} must be at most {MAX_INT32} (cu_seqlens are int32), got {m}")
    check_scale(scale)
    check_window(window_left, window_right)


def check_varlen_values(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """cu_seqlens start at 0, never decrease, end at the total and respect max_seqlen. Eagerly a device sync
    and a ValueError; compiled, device-side asserts."""
    check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    check_cu_seqlens_values("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)


def check_cu_seqlens_values(name: str, cu: torch.Tensor, total, max_len) -> None:
    """One side of :func:`check_varlen_values` (``name`` ends in q or k: the side its messages name)."""
    if values_deferred(cu):
        assert_cu_seqlens(name, cu, total, max_len)
        return
    values = cu.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{name} must be non-decreasing (monotone), got {values}")
    if values[-1] != total:
        raise ValueError(f"{name}[-1] must equal the total tokens of {name[-1]} ({total}), got {values[-1]}")
    if max(lengths) > max_len:
        raise ValueError(f"max_seqlen_{name[-1]} ({max_len}) is smaller than the longest sequence ({max(lengths)})")


def assert_cu_seqlens(name: str, cu: torch.Tensor, total, max_len) -> None:
    """The values' checks of ``cu`` as device asserts (compiled code). It names no global that reaches ``torch``, so
    that the API's traced fast paths may call it without Dynamo adding a guard in Python (api.py)."""
    side = name[-1]
    lengths = cu[1:] - cu[:-1]
    assert_on_device(cu[0] == 0, f"{name} must start at 0")
    assert_on_device((lengths >= 0).all(), f"{name} must be non-decreasing (monotone)")
    assert_on_device(cu[-1] == total, f"{name}[-1] must equal the total tokens of {side} ({side}.shape[0])")
    # int32 lengths never pass MAX_INT32, and a larger bound (the op's checks refuse it) would overflow the comparison
    assert_on_device(lengths.max() <= min(max_len, MAX_INT32),
                     f"max_seqlen_{side} must be >= the longest sequence in {name}")


def check_block_sparse(q, k, v, sparse, scale) -> None:
    """Shapes of the block-mask tensors against q/k: a mask built for other lengths is refused."""
    check_attention(q, k, v, scale, -1, -1, None)
    bq, bk = sparse.block_q, sparse.block_kv
    for name, size in (("block_q", bq), ("block_kv", bk)):
        # a SymInt where Dynamo's automatic dynamic shapes made a block size that changed between compiles
        # dynamic: block-sparse calls are decided at run time, where the op gets the int
        if not isinstance(size, (int, torch.SymInt)) or isinstance(size, bool) or size < 1:
            fail(ValueError, f"{name} must be a positive int, got {size!r}")
    if bk % 32 != 0:
        fail(ValueError, f"block_kv must be a multiple of 32 (bitmaps pack 32 keys per word), got {bk}")
    batch, heads = q.shape[0], q.shape[1]
    n_q = -(-q.shape[2] // bq)
    cnt = sparse.kv_num_blocks
    if not isinstance(cnt, torch.Tensor) or cnt.dim() != 3:
        fail(ValueError, f"kv_num_blocks must be an int32 tensor [batch or 1, heads or 1, q_blocks], got "
                         f"{shape_text(cnt.shape) if isinstance(cnt, torch.Tensor) else type(cnt).__name__}")
    b, h, m = cnt.shape
    if b not in (1, batch) or h not in (1, heads) or m != n_q:
        fail(
            ValueError,
            f"block mask was built for other lengths or sizes: kv_num_blocks has shape {shape_text((b, h, m))}, "
            f"expected ({batch} or 1, {heads} or 1, {n_q}) for Lq={q.shape[2]}, block_q={bq}"
        )
    # a mask shared over a dim its mask_mod reads (BlockSparseMask.shared_but_read) holds index 0's mask only
    for size, given, name, flag, plural in ((b, batch, "batch", "B", "batch rows"), (h, heads, "head", "H", "heads")):
        if name in sparse.shared_but_read and size == 1 and given != 1:
            fail(ValueError,
                 f"block_mask: its mask_mod reads the {name} index, but the mask is shared over the {name} dim "
                 f"({flag}=None or 1 when it was made) while q has {given} {plural}; make the BlockMask with "
                 f"{flag}={given}, or convert it with BlockSparseMask.from_block_mask(block_mask, batch={batch}, "
                 f"heads={heads})")
    for name in ("kv_indices", "partial_bits") + (("full_kv_indices",) if sparse.full_kv_indices is not None else ()):
        if not isinstance(getattr(sparse, name), torch.Tensor):
            fail(TypeError, f"{name} must be an int32 tensor, got {type(getattr(sparse, name)).__name__}")
    for name in ("density", "partial_fraction"):  # they pick the tuning bucket; -1: unknown
        x = getattr(sparse, name)
        if not isinstance(x, numbers.Real) or isinstance(x, bool) or not (x == -1 or 0 <= x <= 1):
            fail(ValueError if isinstance(x, numbers.Real) else TypeError,
                 f"{name} must be a fraction in [0, 1] (or -1, unknown), got {x!r}")
    n_partial = sparse.kv_indices.shape[-1]
    check_index_tensor("kv_num_blocks", cnt, (b, h, m), q.device, "[B, H, q_blocks]")
    check_index_tensor("kv_indices", sparse.kv_indices, (b, h, m, n_partial), q.device, "[B, H, q_blocks, n]")
    check_index_tensor("partial_bits", sparse.partial_bits, (b, h, m, n_partial, bq, bk // 32), q.device,
                       "[B, H, q_blocks, n, block_q, block_kv // 32]")
    if (sparse.full_kv_num_blocks is None) != (sparse.full_kv_indices is None):
        fail(ValueError, "full_kv_num_blocks and full_kv_indices must be given together or both be None")
    if sparse.full_kv_num_blocks is not None:
        n_full = sparse.full_kv_indices.shape[-1]
        check_index_tensor("full_kv_num_blocks", sparse.full_kv_num_blocks, (b, h, m), q.device, "[B, H, q_blocks]")
        check_index_tensor("full_kv_indices", sparse.full_kv_indices, (b, h, m, n_full), q.device,
                           "[B, H, q_blocks, n]")


def check_block_sparse_values(k, sparse) -> None:
    """A (hand-made) mask's block lists: each count within its list's slots, each listed kv block within the
    keys; a kernel would read past k otherwise. Unlisted slots may hold anything (flex's do). Eagerly a device
    sync and a ValueError; compiled, device-side asserts."""
    n_kv = -(-k.shape[2] // sparse.block_kv)
    lists = [("kv_num_blocks", "kv_indices", sparse.kv_num_blocks, sparse.kv_indices)]
    if sparse.full_kv_num_blocks is not None:
        lists.append(("full_kv_num_blocks", "full_kv_indices", sparse.full_kv_num_blocks, sparse.full_kv_indices))
    for count_name, index_name, count, index in lists:
        slots = index.shape[-1]
        listed_index = torch.where(torch.arange(slots, device=index.device) < count[..., None], index, 0)
        if values_deferred(count, index):
            assert_on_device(((count >= 0) & (count <= slots)).all(),
                             f"{count_name} values must be in [0, {index_name}.shape[-1]]")
            assert_on_device(((listed_index >= 0) & (listed_index < n_kv)).all(),
                             f"{index_name} values must be in [0, the kv blocks of k) where {count_name} lists them")
            continue
        lo, hi = torch.stack([count.min(), count.max()]).tolist()
        if lo < 0 or hi > slots:
            raise ValueError(f"{count_name} values must be in [0, {slots}] (the slots of {index_name}), got min {lo}, "
                             f"max {hi}")
        lo, hi = torch.stack([listed_index.min(), listed_index.max()]).tolist()
        if lo < 0 or hi >= n_kv:
            bad = index[(listed_index < 0) | (listed_index >= n_kv)]
            raise ValueError(f"{index_name} values must be in [0, {n_kv}) (the kv blocks of k seq_len {k.shape[2]} at "
                             f"block_kv {sparse.block_kv}) where {count_name} lists them, got {bad.unique().tolist()}")


def check_paged(q, k_cache, v_cache, block_table, kv_seqlens, cu_seqlens_q, max_seqlen_q, max_seqlen_k, scale,
                window_left, window_right, softcap=0.0) -> None:
    """Everything the paged op needs that does not read tensor values: k_cache and v_cache in the (vLLM,
    FlashAttention) page layout, int32 tables and lengths of one sequence count. The public API passes None
    for max_seqlen_q/k (defaults filled in after this check) and for scale (the default)."""
    check_tensor("q", q, 3, LAYOUTS[3])
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, x, 4, PAGES)
    check_same_dtype_device({"q": q, "k_cache": k_cache, "v_cache": v_cache})
    check_head_dims(q, k_cache, v_cache)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        fail(ValueError, f"k_cache and v_cache must share (num_blocks, page_size, kv_heads), got "
                         f"{tuple(k_cache.shape[:3])} and {tuple(v_cache.shape[:3])}")
    check_heads(q.shape[1], k_cache.shape[2], v_cache.shape[2])
    page_size = k_cache.shape[1]
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        fail(ValueError, f"page_size (k_cache.shape[1] in the NHD layout) must be in [1, {MAX_PAGE_SIZE}], got "
                         f"{page_size}")
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        got = tuple(block_table.shape) if isinstance(block_table, torch.Tensor) else type(block_table).__name__
        fail(ValueError if isinstance(block_table, torch.Tensor) else TypeError,
             f"block_table must be an int32 torch.Tensor of shape (num_seqs, pages per sequence), got {got}")
    num_seqs, pages = block_table.shape
    check_index_tensor("block_table", block_table, (num_seqs, pages), q.device, "(num_seqs, pages per sequence)")
    check_index_tensor("kv_seqlens", kv_seqlens, (num_seqs,), q.device, "(num_seqs,), one per block_table row")
    check_not_empty({"num_seqs (block_table.shape[0])": num_seqs, "block_table.shape[1]": pages,
                     "num_blocks": k_cache.shape[0], "q tokens": q.shape[0], "q heads": q.shape[1]},
                    ("paged_attention", "it runs a kernel for every call"))
    if cu_seqlens_q is None:
        if q.shape[0] != num_seqs:
            fail(ValueError, f"without cu_seqlens_q, q holds one token per sequence: q.shape[0] must equal "
                             f"block_table.shape[0] ({num_seqs}), got {q.shape[0]}")
    else:
        check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
        if cu_seqlens_q.shape[0] != num_seqs + 1:
            fail(ValueError, f"cu_seqlens_q must have shape (num_seqs + 1,) = ({num_seqs + 1},), got "
                             f"{shape_text(cu_seqlens_q.shape)}")
    # max_seqlen_q is a bound on any sequence's queries, as in FlashAttention: a serving loop passes one bound for
    # steps of any size (paged_call clamps it to the step's queries); max_seqlen_k is one within the table's reach
    for name, m, most, what in (("max_seqlen_q", max_seqlen_q, MAX_INT32, "MAX_INT32 (cu_seqlens are int32)"),
                                ("max_seqlen_k", max_seqlen_k, pages * page_size, "block_table.shape[1] * page_size")):
        if m is None:
            continue
        check_int(name, m)
        if m < 1 or m > most:
            fail(ValueError, f"{name} must be in [1, {what}] = [1, {most}], got {m}")
    if cu_seqlens_q is None and max_seqlen_q is not None and max_seqlen_q != 1:  # a kernel would run rows no query has
        fail(ValueError, f"without cu_seqlens_q, each sequence has one query: max_seqlen_q must be 1 (or None), got "
                         f"{max_seqlen_q}")
    # a shape no cu_seqlens_q values can satisfy (each sequence at most max_seqlen_q queries, q.shape[0] in all):
    # refused while tracing, where compiled code's representative call (lowering/emit.py) spreads them evenly
    if cu_seqlens_q is not None and max_seqlen_q is not None and q.shape[0] > num_seqs * max_seqlen_q:
        fail(ValueError, f"q.shape[0] ({q.shape[0]}) must be at most num_seqs * max_seqlen_q ({num_seqs} * "
                         f"{max_seqlen_q}): cu_seqlens_q gives no sequence more than max_seqlen_q queries")
    check_scale(scale)
    check_window(window_left, window_right)
    check_softcap(softcap)


def check_paged_values(k_cache, block_table, kv_seqlens, cu_seqlens_q, q, max_seqlen_q, max_seqlen_k) -> None:
    """kv_seqlens in [0, max_seqlen_k]; the block ids of the pages they reach in [0, num_blocks); cu_seqlens_q as
    varlen's. Table entries past a sequence's last page may hold anything. Eagerly a device sync and a ValueError;
    compiled, device-side asserts."""
    num_blocks, page_size = k_cache.shape[0], k_cache.shape[1]
    reached = torch.arange(block_table.shape[1], device=block_table.device) * page_size < kv_seqlens[:, None]
    ids = torch.where(reached, block_table, 0)
    if cu_seqlens_q is not None:
        check_cu_seqlens_values("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
    if values_deferred(kv_seqlens, block_table):
        assert_on_device(((kv_seqlens >= 0) & (kv_seqlens <= max_seqlen_k)).all(), PAGED_KV_SEQLENS_VALUES)
        assert_on_device(((ids >= 0) & (ids < num_blocks)).all(), PAGED_BLOCK_IDS)
        return
    lo, hi, id_lo, id_hi = torch.stack([kv_seqlens.min(), kv_seqlens.max(), ids.min(), ids.max()]).tolist()
    if lo < 0 or hi > max_seqlen_k:
        raise ValueError(f"kv_seqlens values must be in [0, {max_seqlen_k}] (max_seqlen_k; default "
                         f"block_table.shape[1] * page_size), got min {lo}, max {hi}")
    if id_lo < 0 or id_hi >= num_blocks:
        bad = block_table[reached & ((block_table < 0) | (block_table >= num_blocks))]
        raise ValueError(f"block_table values must be in [0, {num_blocks}) (the blocks of k_cache) in the pages that "
                         f"kv_seqlens reaches, got {bad.unique().tolist()}")
