"""Record the compiled kernels a library's Python interface launches for one call, and replay them.

A library such as flash-attn-4 spends far more host time per call deciding what to launch (argument checks,
compile-key building, heuristics: about 1,300 lines of Python in FA4 b36) than launching (about 2 us for a
compiled CuTe kernel, tritonbench #1002). A backend whose library keeps its compiled kernels in
``compile_cache`` mappings can record one call through the interface and replay the same kernels after it:

1. :class:`Recording` swaps the ``compile_cache`` of the library's kernel owners for one call and notes which
   compiled objects run, in which order, with which arguments.
2. :meth:`Recording.replay` rebuilds those calls as a :class:`Replay` over the call's *values* (the tensors and
   scalars that change from call to call, in an order the backend chooses): each argument becomes a role (an
   index into the values), a scratch buffer the library allocated (allocated again per replay), or a constant.
3. :func:`checked_replay` runs the replay on fresh outputs, with the scratch buffers it does not zero
   poisoned, and keeps it only if it reproduces the library's outputs.
4. :class:`Replays` holds a plan's replays by :func:`layout_key` of the values (libraries compile per layout),
   and :class:`Known` lets a call site that repeats one layout skip that key (:func:`quick_key`).

Which objects own the compile caches, and which values a call has, is the backend's part (backends/fa4/).
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
import weakref

import torch

from .._compat import current_raw_stream

log = logging.getLogger(__name__)

# What an argument of a replayed kernel call is: a recorded constant, a role (an index into the values) or a
# scratch buffer (an index into Replay.scratch)
CONST, ROLE, SCRATCH = range(3)


class Recording:
    """Swaps the ``compile_cache`` of a library's kernel owners for one call (under a lock) to see which compiled
    objects run, in which order, with which arguments, and which of those tensors were all zeros when first
    handed over. ``owners`` come from the backend (FA4: ``fwd_compile_cache_owners``), whose tests fail when the
    attributes move."""

    _LOCK = threading.Lock()

    def __init__(self, owners: list):
        self.owners = owners
        self.calls: list = []
        self.zeroed: dict[int, bool] = {}  # data_ptr -> all zeros when first passed

    def __enter__(self):
        self._LOCK.acquire()
        self.thread, self.real = threading.get_ident(), []
        try:
            self.real = [owner.compile_cache for owner in self.owners]
            for owner, real in zip(self.owners, self.real):
                owner.compile_cache = _RecordingCache(real, self)
        except BaseException:  # an owner without the attribute: put back what was swapped, never keep the lock
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for owner, real in zip(self.owners, self.real):
            owner.compile_cache = real
        self._LOCK.release()

    def note(self, fn, args: tuple) -> None:
        for a in args:
            if isinstance(a, torch.Tensor) and a.data_ptr() not in self.zeroed:
                self.zeroed[a.data_ptr()] = not bool(a.any()) if a.numel() else True
        self.calls.append((fn, args))

    def replay(self, values: tuple, scratch: bool) -> Replay | None:
        """The recorded calls as a :class:`Replay` over ``values``, or None when they cannot be rebuilt from
        them. Without ``scratch``: one call whose every tensor is one of ``values``. With it, any number of
        calls, and tensors the library made become scratch buffers, unless one has the first value's dtype (a
        copy of an input rather than a buffer of the library's own), overlaps a value without being it, is an
        integer tensor handed over non-zero (an index or counter filled from the inputs, which no poison can
        check), or is passed with two layouts. Always None for a tensor hidden in a container. A tensor that is
        several values gets the first one's role (:func:`layout_key` keys on which values are one tensor);
        other arguments (the scale among them: :func:`layout_key` keys on it) are constants."""
        if not self.calls or (not scratch and len(self.calls) != 1):
            return None
        roles: dict[tuple, int] = {}
        spans = []
        for i, t in enumerate(values):
            if isinstance(t, torch.Tensor):
                roles.setdefault(_identity(t), i)
                spans.append(_span(t))
        buffers: list = []
        buffer_at: dict[int, int] = {}
        steps = []
        for fn, args in self.calls:
            specs = []
            for arg in args:
                if not isinstance(arg, torch.Tensor):
                    if _holds_tensor(arg):
                        return None
                    specs.append((CONST, arg))
                    continue
                role = roles.get(_identity(arg))
                if role is not None:
                    specs.append((ROLE, role))
                    continue
                lo, hi = _span(arg)
                if (not scratch or arg.dtype == values[0].dtype or any(lo < end and start < hi for start, end in spans)
                        or not (arg.dtype.is_floating_point or self.zeroed[arg.data_ptr()])):
                    return None
                layout = (tuple(arg.shape), tuple(arg.stride()), arg.dtype)
                j = buffer_at.setdefault(arg.data_ptr(), len(buffers))
                if j == len(buffers):
                    buffers.append((*layout, self.zeroed[arg.data_ptr()]))
                elif buffers[j][:3] != layout:
                    return None
                specs.append((SCRATCH, j))
            steps.append((fn, specs))
        return Replay(steps, buffers)


class _RecordingCache:
    """A stand-in for one compile cache: lookups and inserts go to the real one; the compiled objects it hands
    out to the recording thread note each call with the recording before running."""

    def __init__(self, real, recording: Recording):
        self.real, self.recording = real, recording

    def __contains__(self, key):
        return key in self.real

    def __setitem__(self, key, fn):
        self.real[key] = fn

    def __getitem__(self, key):
        fn = self.real[key]
        if threading.get_ident() != self.recording.thread:  # another thread's library call: not the one recorded
            return fn
        return lambda *args: self.recording.note(fn, args) or fn(*args)


def _identity(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range a tensor's elements can reach (0-size tensors reach nothing)."""
    if t.numel() == 0:
        return (0, 0)
    reach = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (reach + 1) * t.element_size()


def _holds_tensor(x) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (tuple, list)):
        return any(_holds_tensor(y) for y in x)
    fields = getattr(x, "_fields", None) or getattr(x, "__dataclass_fields__", None)
    return bool(fields) and any(_holds_tensor(getattr(x, f)) for f in fields)


class Replay:
    """The recorded compiled kernels called in the recorded order, each argument a role (an index into the
    values a launch builds), a scratch buffer (allocated per call as recorded: shape, strides, dtype, and zeroed
    or not) or a recorded constant.

    A launch is host time on the critical path of a host-bound step (FA4's backward replay of a B4 H16/4 L2k D64
    call took 167 us, 50 of them making its five scratch buffers, 50 its five kernel calls; H200, 2026-11-30), so
    the scratch buffers are views of one allocation, those to be zeroed side by side and cleared by one fill, each
    at an offset of a multiple of ``_ALIGN`` bytes as the allocator's own blocks are. That allocation is kept
    between calls, one per device, for calls on its default stream (:meth:`_Arena.kept`): such a call then makes
    no tensor but the fill. Each kernel's arguments are picked out of one tuple of values, buffers and constants
    by precomputed indices."""

    def __init__(self, steps: list, scratch: list):
        self.steps, self.scratch = steps, scratch
        self._arena = _Arena(scratch)
        self._picks = None  # (steps they were built from, [(fn, picker)], constants)

    def __call__(self, values: tuple, poison: float | None = None):
        device = values[0].device
        arena = self._arena
        if poison is not None or not arena.places or arena.nbytes > KEEP_AT_MOST or not _may_keep(device):
            self._launch(values, arena.carve(device, poison))
            return
        with _lock(device):  # another thread's replay on this default stream must not interleave its kernels with ours
            self._launch(values, arena.kept(device))

    def _launch(self, values: tuple, buffers: list) -> None:
        if self._picks is None or self._picks[0] is not self.steps:  # built on first use (tools swap steps)
            self._picks = (self.steps, *_pickers(self.steps, len(values), len(buffers)))
        _, calls, constants = self._picks
        pool = (*values, *buffers, *constants)
        for fn, pick in calls:
            fn(*pick(pool))

    def without_zeroing(self, j: int) -> Replay:
        """This replay with scratch buffer ``j`` allocated as it comes, not zeroed."""
        scratch = list(self.scratch)
        scratch[j] = (*scratch[j][:3], False)
        return Replay(self.steps, scratch)


_ALIGN = 512  # bytes: where the CUDA caching allocator starts its blocks


class _Arena:
    """Where each scratch buffer lies in one allocation: zeroed buffers first (one fill clears them), each at a
    multiple of ``_ALIGN`` bytes with its span rounded up to one."""

    def __init__(self, scratch: list):
        order = sorted(range(len(scratch)), key=lambda j: not scratch[j][3])
        self.places = [None] * len(scratch)  # (shape, stride, dtype, offset in elements of dtype)
        self.zeroed_bytes, end = 0, 0
        for j in order:
            shape, stride, dtype, zeroed = scratch[j]
            span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, stride))
            self.places[j] = (shape, stride, dtype, end // dtype.itemsize)
            end += -(-span * dtype.itemsize // _ALIGN) * _ALIGN
            if zeroed:
                self.zeroed_bytes = end
        self.nbytes = end
        self.dtypes = sorted({s[2] for s in scratch}, key=str)
        self.zeroed = [s[3] for s in scratch]

    def carve(self, device: torch.device, poison: float | None) -> list[torch.Tensor]:
        """The buffers in a new allocation, in scratch order; those not zeroed filled with ``poison`` if given."""
        if not self.places:
            return []
        buffers, zeroed_span = self._views(torch.empty(self.nbytes, dtype=torch.uint8, device=device))
        if zeroed_span is not None:
            zeroed_span.zero_()
        if poison is not None:
            for buf, zeroed in zip(buffers, self.zeroed):
                if not zeroed:
                    buf.fill_(poison)
        return buffers

    def kept(self, device: torch.device) -> list[torch.Tensor]:
        """The buffers as views of the allocation kept for ``device`` (:data:`_KEPT`; :func:`_may_keep` says when),
        grown to this arena's size where it is smaller; the zeroed ones cleared. The caller holds
        the device's lock (:func:`_lock`) until its kernels are launched: kernels of one stream run in launch order, so
        one call's kernels are done with the buffers before the next call's first kernel touches them, as the
        caching allocator reuses a freed block on its own stream."""
        flat, views = _KEPT.get(device, (None, None))
        if flat is None or flat.numel() < self.nbytes:
            with torch.inference_mode(False):  # an inference tensor could not be cleared outside inference mode
                flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            views = weakref.WeakKeyDictionary()  # an arena's views go with it
            _KEPT[device] = (flat, views)
        made = views.get(self)
        if made is None:
            with torch.inference_mode(False):  # nor could a view made inside it
                made = views[self] = self._views(flat)
        buffers, zeroed_span = made
        if zeroed_span is not None:
            zeroed_span.zero_()
        return buffers

    def _views(self, flat: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The buffers laid out in ``flat`` (bytes, at least ``nbytes``), and the span of the zeroed ones."""
        typed = {dtype: flat.view(dtype) for dtype in self.dtypes}
        buffers = [typed[dtype].as_strided(shape, stride, offset) for shape, stride, dtype, offset in self.places]
        return buffers, (flat[:self.zeroed_bytes] if self.zeroed_bytes else None)


# The scratch allocation kept per device for replays on its default stream (:func:`_may_keep`): as large as
# the largest arena replayed there, and each arena's views of it. It holds that much memory for the process's
# life, as a library's workspace does (cuDNN's, cuBLAS's): about 51 MB for FA4's backward at B4 H16/4 L2k D64
# (float32 accumulators of dq, and of dk and dv for GQA); an arena larger than KEEP_AT_MOST is allocated per
# call (its kernels run long enough to hide the allocation, and a process keeps no gigabytes for good). First made
# inside a ``torch.cuda.use_mem_pool`` context, it lives in that pool.
_KEPT: dict[torch.device, tuple[torch.Tensor, weakref.WeakKeyDictionary]] = {}
KEEP_AT_MOST = 256 << 20
_LOCKS: dict[torch.device, threading.Lock] = {}


def kept_bytes(device: torch.device) -> int:
    """Bytes of the scratch allocation kept for replays on ``device`` (0 if none)."""
    flat, _ = _KEPT.get(device, (None, None))
    return 0 if flat is None else flat.numel()


def served_bytes(device: torch.device, reset: bool = False) -> int:
    """The largest arena that replays on ``device`` have taken from its kept allocation since the last reset
    (0 if none): what a call needed of memory that an earlier call allocated, which a peak measured above what
    was allocated before the call leaves out. The arenas served are those holding views of the allocation; a
    reset forgets the views, which the next replay of each arena makes again (no memory, a few views)."""
    flat, views = _KEPT.get(device, (None, None))
    if flat is None:
        return 0
    served = max((arena.nbytes for arena in views.keys()), default=0)
    if reset:
        _KEPT[device] = (flat, weakref.WeakKeyDictionary())
    return served


def _lock(device: torch.device) -> threading.Lock:
    return _LOCKS.get(device) or _LOCKS.setdefault(device, threading.Lock())  # setdefault: one lock if threads race


def _may_keep(device: torch.device) -> bool:
    """Whether a replay on ``device`` may use the kept allocation: on CUDA only on the current device's default
    stream. No CUDA graph is captured there, and cudagraph trees run their warm-up, whose allocations go to the
    graph's pool, on a stream of their own (``_use_cuda_memory_pool_manager``, torch/_inductor/cudagraph_trees.py,
    2.11 and 2.13): a buffer kept from there would live in the graph's pool without being an output, which
    cudagraph trees refuse (backends/triton_decode.py's docstring tells of the time a cache did that). Calls on
    other streams allocate their buffers per call."""
    if device.type != "cuda":
        return True
    return device.index == torch.cuda.current_device() and current_raw_stream(device.index) == 0


def _pickers(steps: list, num_values: int, num_buffers: int) -> tuple[list, tuple]:
    """Per step, its compiled object and a function that takes its arguments out of the pool (values, then
    buffers, then the constants returned here) in one C call."""
    constants, calls = [], []
    for fn, specs in steps:
        at = []
        for kind, x in specs:
            if kind == ROLE:
                at.append(x)
            elif kind == SCRATCH:
                at.append(num_values + x)
            else:
                at.append(num_values + num_buffers + len(constants))
                constants.append(x)
        pick = operator.itemgetter(*at) if len(at) > 1 else (lambda pool, at=tuple(at): tuple(pool[i] for i in at))
        calls.append((_direct(fn, len(at)), pick))
    return calls, tuple(constants)


def _direct(fn, num_args: int):
    """The tvm-ffi function behind a CuTe DSL compiled object, for a call of ``num_args`` positional arguments,
    where calling it is what the object's own ``__call__`` does with them (cutlass/cutlass_dsl/tvm_ffi_provider.py,
    CuTe DSL 4.8): its Python frames are host time on every replayed kernel call (FA4's backward makes five).
    ``fn`` itself for anything else: arguments it converts per call (pointer-address specs), and a signature
    whose generated kwargs wrapper (tvm_ffi.utils.kwargs_wrapper) would fill defaults, take keywords or unpack a
    dataclass. :func:`checked_replay` runs the replay through what this returns before it is kept."""
    execution_args = getattr(fn, "execution_args", None)
    if execution_args is None or getattr(execution_args, "has_pointer_address_arg_specs", True):
        return fn
    wrapper = getattr(fn, "_kwargs_wrapper", None)
    if wrapper is not None:  # TVMFFIJitCompiledFunctionWithKwargs: the wrapper calls the function it holds
        code = getattr(wrapper, "__code__", None)
        raw = fn.__tvm_ffi_object__() if hasattr(fn, "__tvm_ffi_object__") else None
        if (code is None or raw is None or getattr(wrapper, "__globals__", {}).get("__i_target_func") is not raw
                or code.co_argcount != num_args or code.co_kwonlyargcount
                or any(name.startswith("__i_unpack") for name in code.co_names)):
            return fn
        return raw
    for cls in type(fn).__mro__:  # TVMFFIJitCompiledFunction is a tvm_ffi.Function: call that class's __call__
        if cls.__name__ == "Function" and cls.__module__ == "tvm_ffi.core":
            # a function not made (compiled for another architecture) raises in the object's own call
            return functools.partial(cls.__call__, fn) if fn.__chandle__() != 0 else fn
    return fn


# What a check fills the scratch buffers a replay does not zero with: NaN spreads through sums, a large finite
# value shows through a max or a min, which NaN may pass unseen.
_POISONS = (float("nan"), 1e4)


def checked_replay(replay: Replay | None, fresh_values: tuple, expected, got, label: str,
                   after=None) -> Replay | None:
    """``replay`` if it reproduced the library's ``expected`` outputs, run on ``fresh_values`` (the recorded
    call's inputs, new outputs ``got``; then ``after()``) with every scratch buffer it does not zero poisoned
    (all of them floating point, :data:`_POISONS`); else None, logged with ``label``. A buffer that the library
    filled on the host, not in a recorded kernel, shows here. Then each floating-point buffer handed over
    zeroed (a recording sees only that it was all zeros: fresh memory from the allocator often is) is tried
    poisoned too, outputs NaN first; where the outputs still come out right, a kernel clears it (FA4 b36's
    preprocess clears dq's accumulator) and the replay stops zeroing it: one fill kernel less per call."""
    if replay is None:
        return None
    poisoned = any(not zeroed for *_, zeroed in replay.scratch)
    for poison in _POISONS if poisoned else _POISONS[:1]:
        err = _replayed_error(replay, fresh_values, expected, got, poison, after)
        if not err <= 1e-2:  # NaN fails too
            log.warning("%s: the recorded kernel calls did not reproduce the call (relative error %.3g); this "
                        "plan keeps calling the library's interface", label, err)
            return None
    for j, (_, _, dtype, zeroed) in enumerate(replay.scratch):
        if zeroed and dtype.is_floating_point:
            trial = replay.without_zeroing(j)
            if all(_replayed_error(trial, fresh_values, expected, got, poison, after) <= 1e-2 for poison in _POISONS):
                replay = trial
    return replay


def _replayed_error(replay: Replay, fresh_values: tuple, expected, got, poison: float, after) -> float:
    """The largest relative error of ``got`` against ``expected`` after ``replay`` ran with ``poison``, from
    outputs filled with NaN (what a run leaves must be its own, not the run before's); NaN where their non-finite
    entries differ, or where the replay raises. Within 1% counts as reproduced: a kernel that adds up with atomics
    (FA4's backward, into dq) does so in no fixed order."""
    for out in got:
        out.fill_(float("nan"))
    try:
        replay(fresh_values, poison=poison)
    except Exception as err:  # noqa: BLE001 - e.g. a kernel's function refusing what the library's call converts first
        log.warning("replaying the recorded kernel calls raised %s: %s", type(err).__name__, err)
        return float("nan")
    if after is not None:
        after()
    errors = []
    for want, have in zip(expected, got):
        finite = want.isfinite()
        if not torch.equal(finite, have.isfinite()):
            return float("nan")
        want, have = want[finite].float(), have[finite].float()
        errors.append(((have - want).norm() / want.norm().clamp_min(1e-30)).item())
    return float("nan") if any(e != e for e in errors) else max(errors, default=0.0)


class Replays:
    """A plan's recorded replays, one per layout of the values (each tensor's shape, strides, dtype and
    16-byte alignment, and the scalars): a library compiles a kernel per broadcast pattern and alignment (FA4:
    zero strides, cute_dsl_utils ``get_broadcast_dims``), so a replay serves only values laid out as the call it
    recorded; and with the scalars in the key, every float it passes is replayed as recorded. A layout is
    recorded at its first call, never while a CUDA graph is being captured (the check reads results back), and
    at most ``LIMIT`` of them; a layout whose recording was refused (None) keeps going through the library's
    interface. A backend that records only values its library takes as they are, and whose layout checks read
    nothing :func:`layout_key` leaves out, can look its views up unchecked."""

    LIMIT = 8

    def __init__(self):
        self.by_layout: dict[tuple, Replay | None] = {}
        self.known: dict[tuple, Known] = {}  # quick_key of a call's own tensors -> its replay, once replayed

    def get(self, values: tuple) -> Replay | None:
        return self.by_layout.get(layout_key(values))

    def wants(self, values: tuple) -> bool:
        capturing = values[0].is_cuda and _capturing(values[0].device)
        return not capturing and len(self.by_layout) < self.LIMIT and layout_key(values) not in self.by_layout

    def add(self, values: tuple, replay: Replay | None) -> None:
        self.by_layout[layout_key(values)] = replay

    def know(self, quick: tuple, replay: Replay, outputs) -> None:
        """Remember that calls keyed ``quick`` (:func:`quick_key`) replay ``replay`` into outputs laid out as
        ``outputs``: their next calls skip building the values' full layout key and computing output layouts."""
        if len(self.known) < self.LIMIT:
            self.known[quick] = Known(replay, tuple((t.shape, t.stride(), t.dtype) for t in outputs))


class Known:
    """A replay found for a call's own tensors, and the layouts of the outputs it writes."""

    def __init__(self, replay: Replay, layouts: tuple):
        self.replay, self.layouts = replay, layouts

    def outputs(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in self.layouts]


def _capturing(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def quick_key(tensors: tuple, scalars: tuple) -> tuple:
    """The key of :attr:`Replays.known`: each tensor's strides, dtype, 16-byte alignment and the first of the
    tensors it is (their shapes are the plan's problem's), and the scalars. Calls with one key must build values
    of one :func:`layout_key` (true where the outputs a launch allocates are laid out from q's strides, and an
    index tensor is converted by dtype and stride alone), at a fraction of its cost: no views, fewer tensors.

    >>> x = torch.zeros(2, 4)
    >>> quick_key((x, x, None), (0.5,)) == ((x.stride(), x.dtype, True, 0), (x.stride(), x.dtype, True, 0), None, 0.5)
    True
    """
    key, first = [], {}
    for i, t in enumerate(tensors):
        if t is None:
            key.append(None)
        else:
            ptr = t.data_ptr()
            key.append((t.stride(), t.dtype, ptr % 16 == 0, first.setdefault(ptr, i)))
    return (*key, *scalars)


def layout_key(values: tuple) -> tuple:
    """Each tensor's shape, strides, dtype, 16-byte alignment and the first value it is (FA4's cu_seqlens_q and
    cu_seqlens_k are often one tensor: a replay recorded so reads both from one role); any other value as it is.
    The first value at the same address stands for "the same tensor": with every value's shape, strides and dtype
    in the key too, that is :func:`_identity`. Runs once per replayed call, hence the plain loop."""
    key, first = [], {}
    for i, t in enumerate(values):
        if isinstance(t, torch.Tensor):
            ptr = t.data_ptr()
            key.append((t.shape, t.stride(), t.dtype, ptr % 16 == 0, first.setdefault(ptr, i)))
        else:
            key.append(t)
    return tuple(key)
