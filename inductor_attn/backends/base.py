"""The backend protocol: what every kernel family implements to become a tuning candidate.

A backend is a small object with a ``name`` and four methods (FlashInfer's TunableRunner and Inductor's
ChoiceCaller have the same shape):
- ``supports(p, dev) -> None | reason``: can it run this problem on this device at all; the reason is
  shown to users ("CLC needs sm_100").
- ``configs(p, dev) -> [Config]``: its knobs for this problem.
- ``prune(p, dev, cfg) -> None | reason``: a single config that cannot run here, with why.
- ``run(call, cfg) -> (out, lse)``; backends with ``has_backward`` also implement ``backward`` and
  may narrow it with ``supports_backward(p, dev) -> None | reason``.
Nothing here raises for an unsupported problem: reasons are returned, so enumeration never fails.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field

import torch

from ..block_mask import BlockSparseMask
from ..device import DeviceInfo
from ..problem import Problem

ConfigValue = int | bool | str


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
            k, v = item.split("=", 1)
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


@dataclass
class AttnCall:
    """The tensors and arguments of one call of an op: what ``Backend.run`` receives.

    Layouts: ``attention`` and ``block_sparse`` use (B, H, L, D) with any strides; ``varlen`` uses the
    packed (total_tokens, H, D) with ``cu_seqlens_*``.
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
    _problem: Problem | None = field(default=None, repr=False)

    @property
    def problem(self) -> Problem:
        if self._problem is None:
            self._problem = problem_of(self)
        return self._problem


def problem_of(call: AttnCall) -> Problem:
    q, k, v = call.q, call.k, call.v
    common = dict(op=call.op, dtype=str(q.dtype).removeprefix("torch."), device_type=q.device.type,
                  head_dim=q.shape[-1], head_dim_v=v.shape[-1], causal=bool(call.causal),
                  window_left=call.window_left, window_right=call.window_right)
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


class Backend:
    """Base class with the protocol's defaults; see the module docstring."""

    name: str = "?"
    has_backward: bool = False
    # whether run/backward apply AttnCall.key_mask; the registry prunes the others for such problems
    takes_key_mask: bool = False

    def supports(self, p: Problem, dev: DeviceInfo) -> str | None:
        raise NotImplementedError

    def supports_backward(self, p: Problem, dev: DeviceInfo) -> str | None:
        return None if self.has_backward else f"{self.name} has no backward"

    def configs(self, p: Problem, dev: DeviceInfo) -> list[Config]:
        return [Config()]

    def backward_configs(self, p: Problem, dev: DeviceInfo) -> list[Config]:
        """Knobs of the backward kernel (default: the forward's)."""
        return self.configs(p, dev)

    def prune(self, p: Problem, dev: DeviceInfo, cfg: Config) -> str | None:
        return None

    def run(self, call: AttnCall, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward(self, call: AttnCall, cfg: Config, out, lse, grad_out, grad_lse):
        raise NotImplementedError(f"backend {self.name} has no backward")

    def source_hash(self) -> str:
        """Hash of this backend's module source: editing a kernel invalidates its old decisions."""
        return hashlib.sha256(inspect.getsource(inspect.getmodule(type(self))).encode()).hexdigest()[:16]
