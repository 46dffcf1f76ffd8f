"""The backend contract: what a kernel family implements to become a tuning candidate.

A backend turns a problem into candidates, and a chosen candidate into a :class:`Plan`. It sets:

- ``name``: the prefix of its candidates' names; ``knobs``: the config keys it reads and their types;
  ``sources``: files whose bytes are hashed into decision keys (default: its module; editing a kernel
  invalidates its old timings, like Inductor's ``ExternKernelChoice.hash_key``).
- ``takes`` (:class:`Takes`): the ops it runs and what else its plans take (key masks, fp8, a backward, a
  gradient of the lse); the registry prunes the rest without asking it.
- ``library`` (:class:`Library`): the library its kernels come from, where that is not torch: the
  distributions whose versions enter decision keys, its errors that mean "cannot run here", and whether
  importing it is costly or its compiled kernels land in a disk cache other processes read.

And implements:

- ``supports(p, dev, direction) -> None | reason``: whether it can run this problem here at all.
- ``configs(p, dev, direction) -> [Candidate]``: its knob settings, pruned ones with their reason.
- ``heuristic(p, dev) -> Config | None``: today's hand rule, if the backend has one.
- ``plan(p, dev, cfg, direction) -> Plan``: everything Python decides for (problem, config, device),
  done once. ``Plan.launch`` only allocates outputs and launches kernels.

Compiling ahead (optional, tuning/precompile.py): a plan whose kernels can be compiled without running
them offers ``Plan.compile``; a backend whose library sets ``compiles_to_disk`` has its candidates compiled
in worker processes. Either way the tuner compiles a stage's candidates before gating them.

Nothing in enumeration raises for an unsupported problem: reasons are returned. Tests and benchmarks run a
backend in one step with :func:`run_backend` and :func:`run_backend_backward`.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..block_mask import BlockSparseMask
from ..device import DeviceInfo
from ..problem import Problem, next_power_of_two

ConfigValue = int | bool | str
DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True, order=True)
class Config:
    """A backend's knob settings. ``str()`` is the identity that the decision store keeps.

    >>> c = Config.of(block_m=64, schedule="persistent")
    >>> str(c), Config.parse(str(c)) == c, str(Config())
    ('block_m=64,schedule=persistent', True, 'default')
    """

    params: tuple[tuple[str, ConfigValue], ...] = ()

    @classmethod
    def of(cls, **params: ConfigValue) -> Config:
        return cls(tuple(sorted(params.items())))

    def __getitem__(self, name: str) -> ConfigValue:
        return dict(self.params)[name]

    def get(self, name: str, default=None):
        return dict(self.params).get(name, default)

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.params) or "default"

    @classmethod
    def parse(cls, text: str) -> Config:
        if text == "default":
            return cls()
        params = {}
        for item in text.split(","):
            k, sep, v = item.partition("=")
            if not sep or not k:
                raise ValueError(f"config {text!r}: expected comma-separated key=value items, got {item!r}")
            params[k] = True if v == "True" else False if v == "False" else int(v) if v.lstrip("-").isdigit() else v
        return cls.of(**params)


@dataclass(frozen=True)
class Candidate:
    """One (backend, config) pair; ``pruned`` says why it cannot run here (None = runnable)."""

    backend: str
    config: Config | None
    pruned: str | None = None

    @property
    def name(self) -> str:
        """``backend:config``: the stable string that decisions and generated code refer to."""
        return f"{self.backend}:{self.config if self.config is not None else '-'}"

    @staticmethod
    def split(name: str) -> tuple[str, Config]:
        backend, _, cfg = name.partition(":")
        return backend, Config.parse(cfg)


_INDEX_FIELDS = ("kv_seqlens", "cu_seqlens_q", "cu_seqlens_k", "block_table")
WINDOW_CAP = 2**30  # longer than any sequence a kernel is given (int32 positions)


@dataclass
class AttnCall:
    """The tensors and arguments of one call of an op: what ``Plan.launch`` receives.

    Layouts: ``attention`` and ``block_sparse`` use (B, H, L, D) with any strides; ``varlen`` uses the
    packed (total_tokens, H, D) with ``cu_seqlens_*``. ``paged``: q packed (total_q, Hq, D) by ``cu_seqlens_q``
    (None: one query per sequence), k and v the page pools (num_blocks, page_size, Hkv, D) with any strides,
    ``block_table`` int32 (num_seqs, pages per sequence), ``kv_seqlens`` int32 (num_seqs,), ``max_seqlen_k``
    the longest kv length; ``softcap`` > 0 (paged calls): each scaled score s becomes softcap * tanh(s / softcap)
    before the mask and softmax, as in FlashAttention and Gemma 2.
    """

    op: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    kv_seqlens: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    sparse: BlockSparseMask | None = None
    key_mask: torch.Tensor | None = None
    # fp8 calls (ops/fp8.py): the q, k, v descales as (B, Hkv) float32 views, and the dtype of the output
    descale: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    out_dtype: torch.dtype | None = None
    block_table: torch.Tensor | None = None
    softcap: float = 0.0
    _problem: Problem | None = field(default=None, repr=False)

    def __post_init__(self):
        # a window past any sequence is no limit at all; capped, so that kernels adding it to a position in int32
        # (Triton's type for a Python int below 2**31) cannot wrap around: the checks accept up to 2**31 - 1
        if self.window_left > WINDOW_CAP:
            self.window_left = WINDOW_CAP
        if self.window_right > WINDOW_CAP:
            self.window_right = WINDOW_CAP
        # Our kernels read lengths, cu_seqlens and a table's rows at index + 1, not index * stride (FA3 and FA4 take
        # them so too): an index tensor strided otherwise (a column of a wider tensor, a column-major table) is
        # copied here, once for every backend, eager or traced into compiled code
        for name in _INDEX_FIELDS:
            x = getattr(self, name)
            if x is not None and x.dim() and x.shape[-1] > 1 and x.stride(-1) != 1:
                setattr(self, name, x.contiguous())

    @property
    def problem(self) -> Problem:
        if self._problem is None:
            self._problem = problem_of(self)
        return self._problem


def problem_of(call: AttnCall) -> Problem:
    q, k, v = call.q, call.k, call.v
    common = dict(op=call.op, dtype=str(q.dtype).removeprefix("torch."), device_type=q.device.type,
                  head_dim=q.shape[-1], head_dim_v=v.shape[-1], causal=bool(call.causal),
                  window_left=call.window_left, window_right=call.window_right, softcap=call.softcap > 0)
    if call.op == "paged":
        # len_k is bucketed here already: the kernels read each sequence's length from kv_seqlens, and a serving
        # loop whose longest sequence grows every step then builds no plan per step (plans are per problem)
        num_seqs = call.block_table.shape[0]
        return Problem(batch=num_seqs, heads_q=q.shape[1], heads_kv=k.shape[2],
                       len_q=call.max_seqlen_q, len_k=next_power_of_two(call.max_seqlen_k), total_q=q.shape[0],
                       has_kv_seqlens=True, page_size=k.shape[1],
                       equal_chunks=bool(q.shape[0] == num_seqs * call.max_seqlen_q), **common)
    if call.op == "varlen":
        return Problem(batch=call.cu_seqlens_q.shape[0] - 1, heads_q=q.shape[1], heads_kv=k.shape[1],
                       len_q=call.max_seqlen_q, len_k=call.max_seqlen_k, total_q=q.shape[0],
                       total_k=k.shape[0], **common)
    sparse = call.sparse
    extra = {} if sparse is None else dict(block_q=sparse.block_q, block_kv=sparse.block_kv,
                                           density=sparse.density, partial_fraction=sparse.partial_fraction)
    return Problem(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1], len_q=q.shape[2],
                   len_k=k.shape[2], has_kv_seqlens=call.kv_seqlens is not None,
                   has_key_mask=call.key_mask is not None, **common, **extra)


@dataclass(frozen=True)
class Plan:
    """What a backend decided for one (problem, config, device, direction).

    ``launch`` runs the call: ``launch(call) -> (out, lse)`` forward, ``launch(call, out, lse, grad_out,
    grad_lse) -> (dq, dk, dv)`` backward, outputs in the ops' layout contract (layout.py). It allocates
    outputs and launches kernels; no checks, no decisions. ``traced`` is the same computation written
    with torch ops and ``torch.library.wrap_triton`` launches only, so ``make_fx`` can put it into a
    compiled graph and Inductor's generated code launches the kernels itself; None where that is
    impossible (CuTe DSL kernels, host-side TMA descriptors), and compiled code calls ``launch`` through
    one thin op instead (lowering/). ``warm``: ``traced`` reads what one eager launch records (a
    persistent grid's programs per SM), so the compile launches once before tracing. ``traced_out_only``: a
    forward's traced form returning ``(out,)`` alone, for compiled code that never reads the lse (inference),
    where the kernel can skip computing it; None: ``traced`` serves. ``checks_indices``: the API's compiled
    index checks (their texts in messages.py: KV_SEQLENS_VALUES; a paged call's PAGED_KV_SEQLENS_VALUES and
    PAGED_BLOCK_IDS) that the kernel makes itself when ``traced`` (and ``traced_out_only``) get
    ``check_indices=True``: it stops at a device-side assert with the same text, and lowering leaves the graph's
    own assert out: one kernel launch less per compiled call. ``compile`` takes ``launch``'s arguments and
    compiles the kernels ``launch`` would run for them without running any (Triton's ``kernel.warmup``); the
    tuner calls it ahead of the gate while worker processes compile other candidates (tuning/precompile.py).
    None: the first launch compiles.
    """

    launch: Callable[..., tuple[torch.Tensor, ...]]
    traced: Callable[..., tuple[torch.Tensor, ...]] | None = None
    traced_out_only: Callable[..., tuple[torch.Tensor]] | None = None
    warm: bool = False
    compile: Callable[..., object] | None = None
    checks_indices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Takes:
    """What a backend's plans take beyond dense attention forward; the registry prunes the rest without asking
    the backend. ``ops``: the ops (Problem.op) it runs; the default leaves out ``paged``, the newest: a backend
    reads a paged cache (a block table, packed queries) only where it says so. ``key_mask``: its plans apply
    ``AttnCall.key_mask``. ``fp8``: they take float8_e4m3fn q/k/v with ``AttnCall.descale``. ``backward``: it has
    backward plans. ``grad_lse``: its backward takes a gradient of the lse (a loss that uses the lse, not only the
    output). ``softcap``: its plans apply ``AttnCall.softcap``."""

    ops: tuple[str, ...] = ("attention", "varlen", "block_sparse")
    key_mask: bool = False
    fp8: bool = False
    backward: bool = False
    grad_lse: bool = True
    softcap: bool = False


def _nothing() -> tuple:
    return ()


@dataclass(frozen=True)
class Library:
    """The library a backend's kernels come from, where that is not torch itself.

    ``distributions``: whose versions enter decision keys. ``errors() -> tuple of exception types`` that mean
    "this candidate cannot run here" (the library's compile, launch and resource failures; called when a
    candidate fails, so it may import the library). ``costly_import``: enumerating the backend imports a large
    library (FA4's CuTe DSL stack): a store lookup leaves it out (registry.enumerate_candidates ``lookup_only``),
    so a process whose decisions name other backends never imports it; ``load()`` then imports it, and a compile
    worker calls it before it says ready, so that its first job is a compile, not an import.
    ``compiles_to_disk``: a first launch in another process on the same device leaves the compiled kernels in a
    disk cache that this process's first launch loads (FA4's CuTe DSL cache): tuning/precompile.py then
    compiles the candidates of plans without ``Plan.compile`` in worker processes. ``prebuilt``: its kernels come
    compiled in the wheel (FA3), so a first launch waits for its import only, never for a JIT compile: background
    mode runs a shipped winner of such a backend at once, costly import or not.
    """

    distributions: tuple[str, ...] = ()
    errors: Callable[[], tuple[type[BaseException], ...]] = _nothing
    costly_import: bool = False
    load: Callable[[], object] = _nothing
    compiles_to_disk: bool = False
    prebuilt: bool = False


class Backend:
    """Base class with the contract's defaults; see the module docstring."""

    name: str = "?"
    knobs: dict[str, type | tuple] = {}
    sources: tuple[Path, ...] = ()
    takes: Takes = Takes()
    library: Library = Library()  # torch's own kernels: nothing to import, torch's errors

    def supports(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> str | None:
        raise NotImplementedError

    def configs(self, p: Problem, dev: DeviceInfo, direction: str = "forward") -> list[Candidate]:
        return [Candidate(self.name, Config())]

    def heuristic(self, p: Problem, dev: DeviceInfo) -> Config | None:
        return None

    def plan(self, p: Problem, dev: DeviceInfo, cfg: Config, direction: str) -> Plan:
        raise NotImplementedError


def source_hash(backend: Backend) -> str:
    """Hash of ``backend.sources`` (default: its class's module): editing a kernel invalidates its decisions."""
    files = backend.sources or (Path(inspect.getfile(type(backend))),)
    digest = hashlib.sha256()
    for path in files:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


# conveniences for tests and benchmarks: plan and launch in one step (the runtime caches plans)
def run_backend(backend: Backend, call: AttnCall, cfg: Config | None):
    """``backend``'s forward of ``call`` with ``cfg`` (None: the default config): ``(out, lse)``."""
    return backend.plan(call.problem, _device(call), cfg or Config(), "forward").launch(call)


def run_backend_backward(backend: Backend, call: AttnCall, cfg: Config | None, out, lse, grad_out, grad_lse):
    """``backend``'s backward of ``call`` with ``cfg`` (None: the default config): ``(dq, dk, dv)``."""
    if not backend.takes.backward:
        raise NotImplementedError(f"backend {backend.name} has no backward")
    return backend.plan(call.problem, _device(call), cfg or Config(), "backward").launch(
        call, out, lse, grad_out, grad_lse)


def _device(call: AttnCall) -> DeviceInfo:
    from ..device import device_info

    return device_info(call.q.device)


def check_knobs(backend: Backend, cfg: Config) -> None:
    """Raise ValueError unless every key of ``cfg`` is one of ``backend.knobs`` with an accepted value (a
    type, a tuple of types, or a tuple of allowed values): a typo must not silently mean the default.

    >>> class B(Backend):
    ...     name, knobs = "b", {"block_m": int, "schedule": ("tile", "lpt")}
    >>> check_knobs(B(), Config.of(block_m=64, schedule="lpt"))
    >>> check_knobs(B(), Config.of(blok_m=64))
    Traceback (most recent call last):
    ValueError: backend 'b' has no knob 'blok_m' (config blok_m=64); its knobs: block_m, schedule
    """
    for key, value in cfg.params:
        if key not in backend.knobs:
            known = ", ".join(sorted(backend.knobs)) or "none"
            raise ValueError(f"backend {backend.name!r} has no knob {key!r} (config {cfg}); its knobs: {known}")
        allowed = backend.knobs[key]
        types = allowed if isinstance(allowed, tuple) and all(isinstance(a, type) for a in allowed) else (
            (allowed,) if isinstance(allowed, type) else None)
        if types is not None:
            ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
            accepted = " or ".join(t.__name__ for t in types)
        else:
            ok, accepted = value in allowed, ", ".join(map(repr, allowed))
        if not ok:
            raise ValueError(f"backend {backend.name!r}: knob {key}={value!r} in config {cfg}; accepted: {accepted}")
