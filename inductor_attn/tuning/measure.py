"""Running candidates to measure them: the correctness gate's first call and the interleaved timing loop.

One implementation serves the tuner (tuner.py) and the benchmark (bench/), so what the benchmark reports
is measured the way decisions are made:

- a :class:`Trial` is anything that can run on a call: a candidate's plan (:func:`candidate_trial`, the
  code that ships) or, in the benchmark, a user's baseline;
- :func:`gate` runs a trial once on fresh inputs (:func:`gate_inputs`: NaN past kv_seqlens) after poisoning the
  allocator with NaN, records the first call's wall time (JIT compilation included) and compares the outputs
  with the reference;
- :func:`time_trials` times trials that passed in interleaved rounds, one sample of each per round, on
  rotating copies of the inputs (:func:`input_copies`), with one timer (timing.py), so paired statistics
  apply (stats.py).

A trial that raises one of its "cannot run here" errors is recorded as failed with the reason; anything
else is a bug and raises under ``INDUCTOR_ATTN_STRICT=1`` (the test suite sets it).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .._compat import fake_copies, op_types, storage_holders, trace_functional
from ..backends import REFERENCE, AttnCall, Plan, get_backend, plan_for, run_backend
from ..backends.pages import fill_unused
from ..device import device_info
from ..layout import empty_like_layout, filled_like
from ..problem import DECIDED_AT_COMPILE_TIME
from .correctness import POISON, check_output, check_tensor, rel_err
from .settings import env_flag

log = logging.getLogger(__name__)

# Exceptions that mean "this candidate cannot run this problem here": launch, resource and library
# assertion errors (CUDA errors are RuntimeErrors), plus what each backend's library declares in ``errors()``
# (Triton's CompilationError and OutOfResources, CuTe DSL's errors: they derive from Exception only).
# Anything else is a bug in our code and is re-raised in strict mode.
CANDIDATE_ERRORS = (RuntimeError, AssertionError, ValueError, NotImplementedError, MemoryError)
ROTATE_BYTES = 2 * 60 << 20  # input bytes one timed sample reads at least: twice an H200's 60 MB L2
MAX_COPIES = 8


def is_candidate_error(err: BaseException, backend) -> bool:
    return isinstance(err, CANDIDATE_ERRORS + tuple(backend.library.errors()))


def strict() -> bool:
    """INDUCTOR_ATTN_STRICT=1 (the test suite sets it): programming errors in a candidate raise."""
    return env_flag("INDUCTOR_ATTN_STRICT")


def sync(device: torch.device | None = None) -> None:
    """Wait for the work queued on ``device`` (a CPU has none). None: the current GPU's, where there is one
    (bench's wall-clock timers, which time whatever their function runs on)."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def describe(err: BaseException) -> str:
    """``Type: first non-empty line`` (at most 200 characters): the reason a report shows."""
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    return f"{type(err).__name__}: {first[:200]}"


class CudaContextLost(Exception):
    """A candidate's error left this process's CUDA context unusable (an illegal memory access, a device-side
    assert: every later CUDA call fails with it). Not a RuntimeError, so that no handler of candidate errors
    takes it for one candidate's failure."""


def device_error(device: torch.device) -> str | None:
    """Why the device no longer runs anything (a sticky CUDA error), or None if it does."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).item()
    except torch.OutOfMemoryError:  # the probe's own allocation: the context still runs
        return None
    except RuntimeError as err:
        return describe(err)
    return None


def raise_if_context_lost(name: str, err: BaseException, device: torch.device) -> None:
    """Raise CudaContextLost naming candidate ``name`` when its error ``err`` left the device unusable:
    dropping it and going on would charge the error to whatever CUDA call comes next."""
    if device_error(device) is not None:
        raise CudaContextLost(f"candidate {name} left this process's CUDA context unusable while tuning "
                              f"({describe(err)}); no later CUDA call of this process can run") from err


def fresh_inputs(call: AttnCall, seed: int) -> AttnCall:
    """Same shapes, strides, dtypes and index tensors as ``call``, new random q/k/v (never zeros)."""
    gen = torch.Generator(device=call.q.device).manual_seed(seed)

    def normal_(t: torch.Tensor) -> None:
        if t.dtype.itemsize == 1:  # no normal_ kernel for fp8: drawn in float32 and rounded
            t.copy_(torch.empty(t.shape, device=t.device).normal_(generator=gen))
        else:
            t.normal_(generator=gen)

    def like(x: torch.Tensor) -> torch.Tensor:
        return filled_like(x, normal_)

    if call.op == "paged":
        return _softcap_that_shows(_fresh_pages(call, gen, like))
    fresh = dataclasses.replace(call, q=like(call.q), k=like(call.k), v=like(call.v), _problem=call._problem)
    if call.descale is not None:
        # the caller's descales (about amax / 448) on values of about 1 would make every score about 0: a softmax
        # so flat that a kernel ignoring q @ k.T, a descale or the scale passes. One of 0.5-1.5 per (batch, kv
        # head) and tensor keeps the scores of order 1 and tells a kernel reading one descale for all apart.
        b, hkv = call.descale[0].shape
        descale = tuple(torch.rand(b, hkv, generator=gen, device=call.q.device) + 0.5 for _ in range(3))
        fresh = dataclasses.replace(fresh, descale=descale)
    return fresh


# The softcap a gate and a timing use where the call's is larger: scores of fresh inputs are of order 1, where a cap of
# 50 (Gemma 2's) changes them by about 1e-4 and a kernel that ignored it would pass; at 1 tanh bends them
# plainly. The value is a kernel argument, not part of its code: the candidate that passes at 1 runs any.
GATE_SOFTCAP = 1.0


def _softcap_that_shows(call: AttnCall) -> AttnCall:
    return dataclasses.replace(call, softcap=GATE_SOFTCAP) if call.softcap > GATE_SOFTCAP else call


def _fresh_pages(call: AttnCall, gen: torch.Generator, like) -> AttnCall:
    """A paged call's fresh inputs in pools of their own (:func:`fresh_pool`) and the call's lengths."""
    k, v, table = fresh_pool(call.k, call.v, *call.block_table.shape, gen)
    return dataclasses.replace(call, q=like(call.q), k=k, v=v, block_table=table, _problem=call._problem)


def fresh_pool(k: torch.Tensor, v: torch.Tensor, num_seqs: int, width: int, gen: torch.Generator,
               most: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pools like ``k`` and ``v`` (num_blocks, page_size, Hkv, D; in their stride order, NHD or HND) filled with
    normal values, and a contiguous int32 block table (num_seqs, width) that names their pages in random order (a
    fragmented cache): as many pages as the table can name, each once, plus one that no row names; at most
    ``most`` (a server's pool, when it has fewer), where some pages are then named twice, as shared prefixes are.
    A server's whole pool (most of the GPU's memory) is never copied."""
    names = num_seqs * width
    pages = names + 1 if most is None else min(most, names + 1)
    order = torch.randperm(pages, generator=gen, device=gen.device)
    k, v = (empty_like_layout(x, (pages, *x.shape[1:])).normal_(generator=gen) for x in (k, v))
    return k, v, order[torch.arange(names, device=gen.device) % pages].view(num_seqs, width).int()


def gate_inputs(call: AttnCall, seed: int) -> AttnCall:
    """:func:`fresh_inputs` with NaN in k and v past ``kv_seqlens`` (for a paged call: in every slot of the pool
    that holds no key of a sequence; for a varlen call: in the packed rows past the last sequence, a CUDA graph's
    padding): what keys past a length hold must never reach an output or a gradient (the kv_seqlens contract), so
    a candidate that lets it through fails the gate. Timing inputs and the benchmark's gate keep finite values
    there (stock SDPA, a baseline, does not keep the contract)."""
    fresh = fresh_inputs(call, seed)
    if call.op == "paged":
        fill_unused(fresh.k, fresh.v, fresh.block_table, fresh.kv_seqlens, float("nan"))
    elif call.op == "varlen":
        end = int(call.cu_seqlens_k[-1])
        for x in (fresh.k, fresh.v):
            x[end:].fill_(float("nan"))
    elif call.kv_seqlens is not None:
        for x in (fresh.k, fresh.v):
            _nan_past(x, call.kv_seqlens)
    return fresh


def _nan_past(x: torch.Tensor, lengths: torch.Tensor) -> None:
    """Write NaN into every key of (B, H, Lk, D) ``x`` at or past ``lengths[b]``. A dim that ``x`` broadcasts
    (stride 0, an ``expand``-ed head) is written once; where the batch or key dim broadcasts, one element is
    also a key below some length, and nothing is written."""
    written = x[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in x.stride())]
    if (written.shape[0], written.shape[2]) != (x.shape[0], x.shape[2]):
        return
    past = torch.arange(x.shape[2], device=x.device) >= lengths[:, None]
    written.masked_fill_(past[:, None, :, None], float("nan"))


def input_copies(call: AttnCall) -> int:
    """Input copies to rotate through, so each timed call starts with its data out of L2: enough that
    one sample reads ``ROTATE_BYTES`` of inputs, at most ``MAX_COPIES``; one off the GPU.

    >>> q = torch.empty(1, 1, 1024, 64, device="meta")
    >>> input_copies(AttnCall("attention", q, q, q, 1.0))
    1
    """
    if call.q.device.type != "cuda":
        return 1
    per_call = sum(t.numel() * t.element_size() for t in (call.q, call.k, call.v)) * 2
    return int(min(MAX_COPIES, max(1, -(-ROTATE_BYTES // max(per_call, 1)))))


# ------------------------------------------------------------------------------------------- trials
@dataclass(frozen=True)
class Trial:
    """Something the gate runs and the timer samples. ``bind(call)`` prepares it for one call's tensors
    (a plan is built here, so a config that cannot be planned fails like one that cannot launch) and
    returns the zero-argument run; ``cannot_run(err)``: whether ``err`` means "cannot run here" rather
    than a bug; ``ours``: a bug of ours raises in strict mode (a user's baseline is torch's code)."""

    name: str
    bind: Callable[[AttnCall], Callable[[], object]]
    cannot_run: Callable[[BaseException], bool]
    ours: bool = True


class Direction:
    """What running a candidate means for forward or backward: its plan's launch (``launch(call)``, or
    ``launch(call, out, lse, grad_out, grad_lse)`` with a forward's out and lse, a seeded ``grad_out``
    and, where the loss uses the lse too, a seeded ``grad_lse``), and how outputs are checked.

    A backward's out and lse come from ``forward`` (the choice that runs this problem's forward in this process)
    where one is given and it runs, so the gate checks the pair, another library's forward included, against the
    reference's gradients (computed from the reference's own out and lse); else from the reference. ``forward``
    then says which forward was used (None: the reference's)."""

    def __init__(self, direction: str, call: AttnCall, grad_lse: bool = False, forward: str | None = None):
        self.direction = direction
        self.dev = device_info(call.q.device)
        self.rows = _covered_rows(call)
        self._not_aten: set[str] = set()  # backends whose traced form holds more than aten ops (as_compiled_code_runs)
        self.grads = self.reference_grads = self.forward = None
        if direction == "backward":
            out, lse = run_backend(REFERENCE, call, None)
            gen = torch.Generator(device=call.q.device).manual_seed(7)
            grad_out = torch.empty_like(out).normal_(generator=gen)
            dlse = torch.empty_like(lse).normal_(generator=gen) if grad_lse else None
            self.grads = self.reference_grads = (out, lse, grad_out, dlse)
            paired = self._forward_outputs(call, forward)
            if paired is not None:
                self.grads, self.forward = (*paired, grad_out, dlse), forward

    def _forward_outputs(self, call: AttnCall, forward: str | None):
        """(out, lse) of ``forward`` on ``call``, or None where there is none to pair, it is the reference, or it
        cannot run here (then the reference's serve)."""
        if not forward or forward.partition(":")[0] == REFERENCE.name:
            return None
        try:
            return tuple(plan_for(call.problem, forward, self.dev, "forward").launch(call))
        except Exception as err:
            if not is_candidate_error(err, get_backend(forward.partition(":")[0])):
                raise
            log.warning("the backward's gate takes the reference's out and lse: forward %s raised %s", forward,
                        describe(err))
            return None

    def plan(self, call: AttnCall, choice: str) -> Plan:
        return plan_for(call.problem, choice, self.dev, self.direction)

    def run(self, plan: Plan, call: AttnCall):
        return plan.launch(call) if self.grads is None else plan.launch(call, *self.grads)

    def as_compiled_code_runs(self, plan: Plan, call: AttnCall, choice: str) -> Callable[[], object]:
        """``plan`` launched as compiled code launches it. Calls that compiled code decides per call (block-sparse,
        varlen) and fp8 calls (compiled as calls of ``fp8_attention`` itself) run the plan's launch through the
        op impl at run time: approximated by the plan's launch. Calls decided while compiling
        (``DECIDED_AT_COMPILE_TIME``): a traced form of aten ops alone (SDPA's plans) as those ops called one after
        the other as generated code calls them (:func:`_aten_calls_of`), not the plan's Python (through which an
        SDPA launch cost 35 us a call against 19-25 in compiled code, H200, 2026-11-29); a traced form with Triton
        kernels by the plan's launch (Triton's launcher, where generated code uses Inductor's, cheaper: an
        overestimate); a plan without a traced form through the thin op that compiled code calls
        (:func:`thin_op_launch`: its dispatch and lookup cost host time that the plan's own launch does not
        show)."""
        own = lambda: self.run(plan, call)  # noqa: E731
        if call.op not in DECIDED_AT_COMPILE_TIME or call.descale is not None:
            return own
        if plan.traced is not None:  # on a GPU: a CPU tune's wall-clock timer weighs no host time (step_cost.py)
            # what a traced form holds is its backend's, not a config's: a backend found to launch more than aten
            # ops (Triton kernels) is not traced again for its other configs
            backend = choice.partition(":")[0]
            generated = None
            if call.q.is_cuda and backend not in self._not_aten:
                generated = _aten_calls_of(plan.traced, call, self.grads)
                if generated is None:
                    self._not_aten.add(backend)
            return generated or own
        return _THIN_OP_LAUNCH(self.direction, choice, call, *(self.grads or ())) if _THIN_OP_LAUNCH else own

    def compile(self, plan: Plan, call: AttnCall):
        """Compile ``plan``'s kernels for ``call`` without running them (plans that can, see precompile.py)."""
        return plan.compile(call) if self.grads is None else plan.compile(call, *self.grads)

    def reference(self, call: AttnCall):
        plan = REFERENCE.plan(call.problem, self.dev, None, self.direction)
        return plan.launch(call) if self.grads is None else plan.launch(call, *self.reference_grads)

    def check(self, got, want, dtype) -> tuple[str | None, float]:
        """(why ``got`` does not match ``want`` or None, its relative error). A forward that returns the
        output alone (a user's baseline: no lse) is checked on it alone."""
        if self.rows is not None:  # packed rows past the last sequence: outside every sequence, never read
            got, want = self._covered(got), self._covered(want)
        if self.grads is None and isinstance(got, torch.Tensor):
            return check_tensor("output", got, want[0], dtype, rows=True), rel_err(got, want[0])
        if self.grads is None:
            return check_output(got[0], got[1], want[0], want[1], dtype), rel_err(got[0], want[0])
        reasons = [check_tensor(name, g, w, dtype) for name, g, w in zip(("dq", "dk", "dv"), got, want)]
        return next((r for r in reasons if r), None), max(rel_err(g, w) for g, w in zip(got, want))

    def _covered(self, results):
        """``results`` (out, lse; a baseline's out alone; or dq, dk, dv) less the rows no sequence covers."""
        rows_q, rows_k = self.rows
        if self.grads is not None:
            dq, dk, dv = results
            return (dq[:rows_q], dk[:rows_k], dv[:rows_k]) if rows_k is not None else (dq[:rows_q], dk, dv)
        if isinstance(results, torch.Tensor):
            return results[:rows_q]
        return results[0][:rows_q], results[1][:, :rows_q]


def _covered_rows(call: AttnCall) -> tuple[int, int | None] | None:
    """(query rows, key rows) that a packed call's sequences cover, where fewer than its tensors hold: rows past
    ``cu_seqlens_q[-1]`` (and keys past ``cu_seqlens_k[-1]``) belong to no sequence. transformers' batches padded
    for CUDA graphs pass such rows (``check_indices=False``); kernels leave them unwritten, as FlashAttention
    does, and no caller reads them, so the gate does not compare them. None: every row is covered."""
    if call.cu_seqlens_q is None:
        return None
    rows_q = int(call.cu_seqlens_q[-1])
    rows_k = int(call.cu_seqlens_k[-1]) if call.op == "varlen" else None
    if rows_q == call.q.shape[0] and rows_k in (None, call.k.shape[0]):
        return None
    return rows_q, rows_k


def _aten_calls_of(traced, call: AttnCall, grads) -> Callable[[], object] | None:
    """A zero-argument run of ``traced`` on ``call`` (and a backward's ``grads``: out, lse, grad_out, grad_lse)
    traced into an FX graph as lowering/emit.py traces it, where that graph holds aten ops alone: its generated
    Python calls each op by its overload, as Inductor's generated code calls the extern kernels of the graph.
    None where it holds anything else (a Triton kernel through ``wrap_triton``)."""
    # the tensors of the calls decided while compiling (as_compiled_code_runs): attention's and paged's
    names = [n for n in ("q", "k", "v", "kv_seqlens", "key_mask", "block_table", "cu_seqlens_q")
             if getattr(call, n) is not None]
    extra = list(grads or ())
    present = [i for i, g in enumerate(extra) if g is not None]

    def launch(*tensors):
        c = dataclasses.replace(call, **dict(zip(names, tensors)))
        if grads is None:
            return tuple(traced(c))
        given = list(extra)
        for i, t in zip(present, tensors[len(names):]):
            given[i] = t
        return tuple(traced(c, *given))

    args = [getattr(call, n) for n in names] + [extra[i] for i in present]
    try:
        # Traced on fakes first, as compiled code traces a plan, which runs nothing: a graph that holds a Triton
        # kernel is no probe. Tracing one on real tensors ran its kernels under functionalization, where on an
        # H200 Triton kernels hit illegal addresses that their direct launches never did. A plan that fake tensors
        # cannot trace (Python that reads values, real tensors of its own) is no probe either.
        fake_graph = trace_functional(launch, fake_copies(args))
    except Exception as err:  # its plan's launch stands in (an overestimate)
        log.debug("the host probe of a traced plan times its launch: tracing it on fakes raised %s", describe(err))
        return None
    if not _aten_only(fake_graph):
        return None
    try:  # aten ops alone: traced again on the real tensors, for the graph the probe runs
        graph = trace_functional(launch, args)
    except Exception as err:  # a probe must not fail a tune: its plan's launch stands in (an overestimate)
        if strict():
            raise
        log.warning("the host probe of a traced plan times its launch: tracing it raised %s", describe(err))
        return None
    return lambda: graph.forward(*args)


def _aten_only(graph: torch.fx.GraphModule) -> bool:
    overload = op_types()[0]
    return all(n.op != "call_function" or isinstance(n.target, overload) or n.target is operator.getitem
               for n in graph.graph.nodes)


# How compiled code launches a plan that has no traced form: given by ops/launch.py, which defines that op,
# when it is imported (importing the package does), so that the tuner needs nothing of the ops.
_THIN_OP_LAUNCH: Callable[..., Callable[[], object]] | None = None


def thin_op_launch(make: Callable[..., Callable[[], object]]) -> None:
    """Set ``make(direction, choice, call, *backward tensors) -> launch``: a zero-argument launch of the plan
    of ``choice`` for ``call`` through the op that compiled code calls where it has no traced form."""
    global _THIN_OP_LAUNCH
    _THIN_OP_LAUNCH = make


def candidate_trial(choice: str, direction: Direction) -> Trial:
    """A candidate (``backend:config``) run through its cached plan, the code that ships."""
    backend = get_backend(choice.partition(":")[0])

    def bind(call: AttnCall):
        plan = direction.plan(call, choice)
        return lambda: direction.run(plan, call)

    return Trial(choice, bind, lambda err: is_candidate_error(err, backend))


# --------------------------------------------------------------------------------------------- gate
@dataclass
class GateResult:
    status: str  # "passed" | "wrong" | "failed"
    reason: str | None = None
    error: float | None = None  # relative error against the reference
    first_call_s: float | None = None  # wall time of the first call: JIT compilation + one run


NAN_REACHED = "NaN past kv_seqlens reached its results"  # how the gate words a failure that NaN caused


def gate(trial: Trial, call: AttnCall, expected, check: Callable[[object], tuple[str | None, float]]) -> GateResult:
    """Run ``trial`` once on ``call`` and ``check`` its outputs (``check(got) -> (reason, rel. error)``).

    The allocator is first filled with NaN where the outputs will likely land (the caching allocator hands
    freed blocks of the same size class back first), and after the check the blocks of the outputs are too
    (:func:`_poison_blocks`), so an output the next kernel never writes shows as NaN."""
    device = call.q.device
    try:
        if device.type == "cuda":
            _poison_blocks([(sum(t.numel() * t.element_size() for t in expected), device)])
        start = time.perf_counter()
        got = trial.bind(call)()
        sync(device)
        seconds = time.perf_counter() - start
    except Exception as err:  # noqa: BLE001 - a failing candidate must not crash the user's compile
        raise_if_context_lost(trial.name, err, device)
        if not trial.cannot_run(err):
            if strict() and trial.ours:
                raise
            log.warning("%s raised %s (a bug, please report): %s", trial.name, type(err).__name__, err)
        return GateResult("failed", describe(err))
    reason, error = check(got)
    blocks = _let_go(got, call)
    del got
    _poison_blocks(blocks)
    if reason is not None and call.kv_seqlens is not None and _passes_without_nan_tails(trial, call, check):
        reason = f"{NAN_REACHED}: {reason}"
    return GateResult("wrong" if reason else "passed", reason, error, seconds)


def _let_go(got, call: AttnCall) -> list[tuple[int, torch.device]]:
    """Before a checked candidate's outputs are freed: the memory blocks (bytes, device) of its floating-point
    outputs, for :func:`_poison_blocks` once they are; and NaN bytes (0xFF: NaN in every float dtype) into its CPU
    outputs that nothing else holds, since the host's malloc may hand that memory, whole or in part, to the next
    candidate's outputs, and no number of fresh blocks filled afterwards is sure to cover it. Left as they are: an
    output sharing its memory with another tensor (a view the candidate keeps) or with the call's inputs. (A buffer
    object a candidate returns on every call would be filled too, and written on its next.)"""
    tensors = [t for t in (got if isinstance(got, (tuple, list)) else (got,))
               if isinstance(t, torch.Tensor) and t.is_floating_point()]
    blocks = {t.untyped_storage().data_ptr(): (t.untyped_storage().nbytes(), t.device) for t in tensors}
    inputs = {x.untyped_storage().data_ptr() for x in _tensors_of(call)}
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        sharing = sum(1 for other in tensors if other.untyped_storage().data_ptr() == ptr)
        if t.device.type == "cpu" and ptr not in inputs and storage_holders(t) == sharing:
            torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).fill_(255)
    return list(blocks.values())


def _tensors_of(call: AttnCall) -> list[torch.Tensor]:
    """Every tensor a call holds (its fields, and tensors in tuples or dataclasses one level down)."""
    found = []
    for f in dataclasses.fields(call):
        value = getattr(call, f.name)
        items = value if isinstance(value, (tuple, list)) else (
            [getattr(value, g.name) for g in dataclasses.fields(value)] if dataclasses.is_dataclass(value) else [value])
        found += [x for x in items if isinstance(x, torch.Tensor)]
    return found


HOST_POISON_BLOCKS, HOST_POISON_BYTES = 32, 64 << 20  # at most, and at most this much memory at once


def _poison_blocks(blocks: list[tuple[int, torch.device]]) -> None:
    """Fill blocks of these sizes with NaN through new allocations, once a checked candidate's outputs are freed:
    an allocator hands a freed block back to the next request of its size first, so the next candidate's outputs
    would otherwise start as this one's right answer, and memory a kernel never writes would pass the check. Beside
    the outputs themselves (:func:`_let_go`), which cannot be filled where they share memory with tensors in use."""
    for nbytes, device in blocks:
        # CUDA's caching allocator hands the block just freed to the next request of its size; the host's malloc
        # merges and splits free chunks and may hand out another (on a perturbed heap 126 of 300 unwritten
        # heads read as the right answer with one block, none with 32), so on the host several are filled at once
        copies = 1 if device.type == "cuda" else max(1, min(HOST_POISON_BLOCKS, HOST_POISON_BYTES // max(nbytes, 1)))
        held = [torch.full((max(nbytes // 4, 1),), POISON, dtype=torch.float32, device=device) for _ in range(copies)]
        del held


def _passes_without_nan_tails(trial: Trial, call: AttnCall, check) -> bool:
    """Whether ``call`` holds NaN (:func:`gate_inputs` wrote it past kv_seqlens) and ``trial`` passes with zeros
    there instead: then that NaN is what failed it. Run only for a candidate that failed, so a passing one costs
    nothing more."""
    if not (call.k.isnan().any() or call.v.isnan().any()):
        return False
    finite = dataclasses.replace(call, k=call.k.nan_to_num(), v=call.v.nan_to_num(), _problem=call._problem)
    try:
        got = trial.bind(finite)()
    except Exception as err:  # noqa: BLE001 - it ran on the NaN: an error now says nothing about the NaN
        raise_if_context_lost(trial.name, err, call.q.device)
        return False
    passed = check(got)[0] is None
    blocks = _let_go(got, finite)
    del got
    _poison_blocks(blocks)
    return passed


def gate_once(call: AttnCall, choice: str, direction: str, grad_lse: bool = False) -> GateResult:
    """The gate for one candidate on fresh inputs shaped like ``call``'s: what a tune checks every candidate
    with, for a decision that was not tuned in this process."""
    gate_call = gate_inputs(call, seed=1)
    mode = Direction(direction, gate_call, grad_lse)
    expected = mode.reference(gate_call)
    return gate(candidate_trial(choice, mode), gate_call, expected,
                lambda got: mode.check(got, expected, call.q.dtype))


# ------------------------------------------------------------------------------------------- timing
@dataclass
class Timed:
    samples: list[float] = field(default_factory=list)  # ms per call, one per round
    note: str = ""  # the timer's remark (e.g. timed without a CUDA graph)
    failed: str | None = None  # why it stopped: an error while preparing or sampling it (samples dropped)
    out_of_memory: bool = False  # it stopped because the device ran out of memory


def time_trials(trials: list[Trial], call: AttnCall, timer, rounds: int, tick=None, seed: int = 100) -> list[Timed]:
    """Interleaved rounds with one timer: every trial is bound to each rotating input copy and prepared
    (warm-up, graph capture), then each round takes one sample of each, so all share the same clock and
    thermal drift, in an order shuffled every round: a long kernel's time depends on what ran just before it
    (FA3 at B2 H32 L16k D128 ran 11.3 ms right after SDPA's efficient kernel and 12.4 ms right after FA4's, the
    GPU's power state, H200, 2026-11-29, benchmarks/tools/timing_order_gpu.py), and a fixed order would give
    each trial the same predecessor, and its bias, in every round. ``tick()`` is called once per round. A trial
    that raises one of its "cannot run" errors is marked failed (its memory freed) and the others go on; any
    other error propagates. ``seed``: of the first input copy and of the order; a new seed gives a new timing
    session fresh inputs."""
    copies = [fresh_inputs(call, seed=seed + i) for i in range(input_copies(call))]
    results = [Timed() for _ in trials]
    runners = {}
    for i, trial in enumerate(trials):
        try:
            runners[i] = timer.prepare([trial.bind(c) for c in copies])
            results[i].note = runners[i].note
        except Exception as err:
            raise_if_context_lost(trial.name, err, call.q.device)
            if not trial.cannot_run(err):
                raise
            _fail(results[i], err, call.q.device)
    order = random.Random(seed)
    for _ in range(rounds):
        turns = list(runners.items())
        order.shuffle(turns)
        for i, runner in turns:
            try:
                results[i].samples.append(runner.sample())
            except Exception as err:
                raise_if_context_lost(trials[i].name, err, call.q.device)
                if not trials[i].cannot_run(err):
                    raise
                del runners[i]
                _fail(results[i], err, call.q.device)
        if tick is not None:
            tick()
    runners.clear()  # drops the graphs and their memory pools
    return results


def _fail(timed: Timed, err: Exception, device: torch.device) -> None:
    timed.failed, timed.samples = f"while timing: {describe(err)}", []
    timed.out_of_memory = isinstance(err, torch.OutOfMemoryError)
    if device.type == "cuda":
        torch.cuda.empty_cache()
