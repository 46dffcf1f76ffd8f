"""Problem: the hashable description of one attention call, and the one rule for "the same shape".

Everything that can change which kernel is fastest (or whether it can run) is a field here; tensors are
not. A Problem is built from concrete tensors (eager, tuning) or from sizes alone (the Inductor lowering,
where only shapes are known), so the constructors take plain ints.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

OPS = ("attention", "varlen", "block_sparse", "paged")
# The ops whose calls with static shapes compiled code decides while compiling (lowering/emit.py): it inlines the
# chosen plan's traced form or launches the plan through inductor_attn::launch. The others decide per call, on
# their index tensors (a block mask, cu_seqlens), and run the chosen plan's launch.
DECIDED_AT_COMPILE_TIME = ("attention", "paged")
# Fields added after decisions were first stored: left out of ``key()`` at their default, so the keys of every
# problem that does not use them (and the shipped tables' rows) stay what they were.
_KEY_OPTIONAL = {"page_size": 0, "equal_chunks": False, "softcap": False}


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (n >= 1); 0 stays 0.

    >>> [next_power_of_two(n) for n in (0, 1, 3, 1024, 1025)]
    [0, 1, 4, 1024, 2048]
    """
    if n < 0:
        raise ValueError(f"next_power_of_two needs n >= 0, got {n}")
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def default_scale(head_dim):
    """The softmax scale when none is given: 1 / sqrt(head_dim) to the last bit as SDPA's aten ops compute theirs
    (``head_dim ** -0.5`` differs from it in the last bit for 48 head dims up to 256, 128 among them), so that
    calls of those ops can leave it to them. ``head_dim`` may be a SymInt."""
    return 1.0 / head_dim ** 0.5


def round_fraction(x: float, steps: int) -> float:
    """Round a fraction in [0, 1] to the nearest multiple of 1/steps.

    >>> round_fraction(0.30, 8), round_fraction(0.99, 16)
    (0.25, 1.0)
    """
    return round(x * steps) / steps


@dataclass(frozen=True)
class Problem:
    """One attention call, as the tuner and the decision store see it.

    Lengths are per sequence: for varlen, ``batch`` is the number of sequences and ``len_q``/``len_k``
    are ``max_seqlen_q``/``max_seqlen_k``; ``total_q``/``total_k`` hold the packed token counts.
    For block-sparse problems ``density`` is the fraction of (q block, kv block) pairs that are listed
    and ``partial_fraction`` the fraction of listed pairs that need the mask evaluated; both are -1 when
    unknown (a flex_attention call routed in a compiled graph, whose block mask is run-time data).
    For paged problems (a KV cache in pages, ops/paged.py) ``batch`` is the number of sequences, ``len_q`` the
    longest query run, ``total_q`` the packed query tokens, ``len_k`` the longest kv length (rounded up to a
    power of two already: kernels read each sequence's length from ``kv_seqlens``) and ``page_size`` the keys
    per page; ``total_k`` is 0 (the page pool's size does not change which kernel is fastest); ``equal_chunks``:
    every sequence has ``len_q`` queries (decode, or equal chunks), which a bucket keeps apart, since a kernel may
    run only those (the gather baseline) and bucketing the sizes alone mixes them with uneven chunks.
    ``softcap``: the scores pass through a logit softcap (a paged call's ``softcap`` > 0); its value is the call's,
    not the bucket's (one kernel serves every value).
    """

    op: str
    dtype: str
    device_type: str
    batch: int
    heads_q: int
    heads_kv: int
    len_q: int
    len_k: int
    head_dim: int
    head_dim_v: int
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    has_kv_seqlens: bool = False
    has_key_mask: bool = False
    total_q: int = 0
    total_k: int = 0
    block_q: int = 0
    block_kv: int = 0
    density: float = 1.0
    partial_fraction: float = 0.0
    page_size: int = 0
    equal_chunks: bool = False
    softcap: bool = False

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"Problem.op must be one of {OPS}, got {self.op!r}")

    @property
    def gqa_ratio(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def may_have_empty_rows(self) -> bool:
        """Whether a query row may have no key to attend (the ops' contract: out 0, lse -inf there): windows, key
        masks, lengths, packed or block-sparse rows, causal with Lq > Lk (lower-right)."""
        windowed = self.window_left >= 0 or self.window_right >= 0
        return (windowed or self.has_key_mask or self.has_kv_seqlens or self.op != "attention"
                or (self.causal and self.len_q > self.len_k))

    @property
    def is_decode(self) -> bool:
        """Few query rows per sequence: the split-K regime (Lq 1..16)."""
        return self.op != "block_sparse" and self.len_q <= 16

    def bucket(self) -> Problem:
        """The representative of this problem's bucket: what decisions are stored under.

        Rule (documented in README): batch, lengths and packed totals round *up* to a power of two;
        density rounds to 1/16 and partial_fraction to 1/8 (-1, unknown, stays); everything else (dtype,
        heads, head dims, masks, window sizes, block sizes) must match exactly. So L=1000 and L=1024 share
        a decision, L=1025 does not; decode lengths 1, 2, 4, 8, 16 are separate buckets.
        """
        return _bucket(self)

    def key(self) -> str:
        """Stable string form (field=value, in declaration order) used in decision keys; a field of
        ``_KEY_OPTIONAL`` at its default is left out."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                        if _KEY_OPTIONAL.get(f.name, None) != getattr(self, f.name))

    @classmethod
    def from_key(cls, key: str) -> Problem:
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        kwargs = {}
        for item in key.split(","):
            name, value = item.split("=", 1)
            kind = types[name]
            if kind == "bool":
                kwargs[name] = value == "True"
            elif kind == "int":
                kwargs[name] = int(value)
            elif kind == "float":
                kwargs[name] = float(value)
            else:
                kwargs[name] = value
        return cls(**kwargs)

    def flops(self) -> float:
        """Forward FLOPs: 4 * heads_q * kept (query, key) pairs * head_dim (2 matmuls, 2 FLOPs each).

        Causal and windows count lower-right aligned pairs, like the kernels compute them; block-sparse
        counts listed blocks (an upper bound on kept pairs for partial blocks). kv_seqlens is unknown
        here, so the full len_k counts.
        """
        d = (self.head_dim + self.head_dim_v) / 2
        if self.op == "block_sparse":  # an unknown density (-1) counts every pair
            pairs = self.batch * self.len_q * self.len_k * (self.density if self.density >= 0 else 1.0)
        elif self.op == "varlen":
            pairs = self.batch * kept_pairs(self.total_q // max(self.batch, 1), self.total_k // max(self.batch, 1),
                                            self.causal, self.window_left, self.window_right)
        elif self.op == "paged":  # every sequence counted at the longest kv length
            pairs = self.batch * kept_pairs(self.total_q // max(self.batch, 1), self.len_k, self.causal,
                                            self.window_left, self.window_right)
        else:
            pairs = self.batch * kept_pairs(self.len_q, self.len_k, self.causal, self.window_left,
                                            self.window_right)
        return 4.0 * self.heads_q * pairs * d


@functools.lru_cache(maxsize=4096)  # run-time decisions bucket every call's problem
def _bucket(p: Problem) -> Problem:
    return dataclasses.replace(
        p,
        batch=next_power_of_two(p.batch),
        len_q=next_power_of_two(p.len_q),
        len_k=next_power_of_two(p.len_k),
        total_q=next_power_of_two(p.total_q),
        total_k=next_power_of_two(p.total_k),
        density=round_fraction(p.density, 16),
        partial_fraction=round_fraction(p.partial_fraction, 8),
    )


def kept_pairs(len_q: int, len_k: int, causal: bool, window_left: int = -1, window_right: int = -1) -> int:
    """Number of (query, key) pairs that a lower-right aligned causal/window mask keeps.

    >>> kept_pairs(4, 4, causal=True), kept_pairs(1, 8, causal=True), kept_pairs(4, 8, False, 1, 0)
    (10, 8, 8)
    """
    offset = len_k - len_q
    right = 0 if causal else window_right
    total = 0
    for i in range(len_q):
        hi = len_k - 1 if right < 0 else min(len_k - 1, i + offset + right)
        lo = 0 if window_left < 0 else max(0, i + offset - window_left)
        total += max(0, hi - lo + 1)
    return total
