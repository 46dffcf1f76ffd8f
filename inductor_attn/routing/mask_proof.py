"""Prove from a Dynamo FX graph what a boolean attention mask contains, without knowing any tensor value.

The mask's producers are interpreted over two abstract values:

- ``Index``: an integer tensor whose element at position ``(n_0, ..., n_r-1)`` is
  ``sum(coefs[d] * n_d) + base``. ``base`` is a static int, or unknown (a value read at run time, such as
  a cache position) that may vary only along ``free_dims``. ``torch.arange`` starts these.
- ``Mask``: a bool tensor that is True exactly where every bound ``sum(coefs[d] * n_d) + base <= 0``
  holds (a conjunction of comparisons of ``Index`` values; no bounds = all True).

Only a short list of value-exact operations is understood (arange, +/-, comparisons, &, None-indexing,
unsqueeze, expand, dtype/device moves, ones, tril). Anything else gives ``Unknown`` with the reason, and
the caller leaves the attention call alone. A graph input is always ``Unknown``: its values exist only at
run time. Sizes are compared with ``statically_known_true``, so no shape guard is added.

The pre-grad graph is not functional: a proof about a tensor holds only if nothing mutates it between
its creation and its use. ``mutation_free`` checks that for the nodes a proof rests on.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch
import torch.fx

from .._compat import op_types, statically_known_true

_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Unknown:
    reason: str


@dataclass(frozen=True)
class Index:
    shape: tuple
    coefs: tuple[int, ...]
    base: int | None
    free_dims: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Bound:
    """``sum(coefs[d] * n_d) + base <= 0``; ``base`` None = unknown, varying only along ``free_dims``."""
    coefs: tuple[int, ...]
    base: int | None
    free_dims: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class Mask:
    shape: tuple
    bounds: tuple[Bound, ...]


def _is_one(size) -> bool:
    return statically_known_true(size == 1)


def _same(a, b) -> bool:
    return a is b or statically_known_true(a == b)


def broadcast_shape(a: tuple, b: tuple) -> tuple | None:
    """Broadcast result, or None when it cannot be shown without a guard.

    >>> broadcast_shape((1, 4), (3, 1))
    (3, 4)
    """
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else 1
        y = b[-i] if i <= len(b) else 1
        if _is_one(x):
            out.append(y)
        elif _is_one(y) or _same(x, y):
            out.append(x)
        else:
            return None
    return tuple(reversed(out))


def _align(coefs: tuple, free: frozenset, ndim: int, target: tuple) -> tuple[tuple, frozenset]:
    """Right-align to ``len(target)`` dims; a dim of size 1 contributes nothing (its index is always 0)."""
    pad = len(target) - ndim
    new = (0,) * pad + tuple(coefs)
    new = tuple(0 if _is_one(target[d]) else c for d, c in enumerate(new))
    moved = frozenset(d + pad for d in free if not _is_one(target[d + pad]))
    return new, moved


def _index(shape, coefs, base, free=frozenset()) -> Index:
    coefs, free = _align(coefs, frozenset(free), len(shape), tuple(shape))
    return Index(tuple(shape), coefs, base, free)


def _example(arg):
    return arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else arg


# ------------------------------------------------------------------------------------------ interpreter
class MaskAnalysis:
    """Abstract values of graph nodes, memoised for one pass over one graph."""

    def __init__(self):
        self._memo: dict[torch.fx.Node, object] = {}
        # nodes whose values a proof rests on (checked for mutation by the caller)
        self.structural: dict[torch.fx.Node, set[torch.fx.Node]] = {}

    def value(self, node) -> Index | Mask | Unknown:
        if not isinstance(node, torch.fx.Node):
            return _literal(node)
        if node not in self._memo:
            self._memo[node] = self._evaluate(node)
        return self._memo[node]

    def cone(self, node: torch.fx.Node) -> set[torch.fx.Node]:
        """The structural nodes behind ``node``'s proof (itself included)."""
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack.extend(self.structural.get(n, ()))
        return seen

    def _evaluate(self, node: torch.fx.Node):
        if node.op == "placeholder":
            return Unknown("it is a graph input: its values exist only at run time")
        handler = _HANDLERS.get((node.op, node.target))
        if handler is None:
            return Unknown(f"it is built by {_describe(node)}, which the proof does not follow")
        result = handler(self, node)
        if not isinstance(result, Unknown):
            dtype = getattr(_example(node), "dtype", None)
            if dtype != torch.bool if isinstance(result, Mask) else dtype not in _INT_DTYPES:
                return Unknown(f"an intermediate has dtype {dtype}; the proof follows int32/int64 indices and bool "
                               "masks")
            self.structural[node] = {a for a in node.all_input_nodes if isinstance(self._memo.get(a), (Index, Mask))}
        return result

    def operand_index(self, arg) -> Index | Unknown:
        """An integer operand: a proven Index, else an opaque integer (its values unknown, shape known)."""
        if not isinstance(arg, torch.fx.Node):
            return _literal(arg)
        val = self.value(arg)
        if isinstance(val, Index):
            return val
        ev = _example(arg)
        if isinstance(ev, torch.SymInt):
            return Index((), (), None)
        if isinstance(ev, torch.Tensor) and ev.dtype in _INT_DTYPES:
            shape = tuple(ev.shape)
            return _index(shape, (0,) * len(shape), None, {d for d, s in enumerate(shape) if not _is_one(s)})
        return val if isinstance(val, Unknown) else Unknown("an operand is a bool mask where an index is expected")


def _literal(value) -> Index | Unknown:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        return Unknown(f"constant {value!r} is not an int")
    return Index((), (), int(value) if isinstance(value, int) else None)


def _describe(node: torch.fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {target}"


# ------------------------------------------------------------------------------------------ handlers
_HANDLERS: dict[tuple[str, object], object] = {}


def _handles(*keys):
    def register(fn):
        for key in keys:
            _HANDLERS[key] = fn
        return fn

    return register


def _fn(*targets):
    return tuple(("call_function", t) for t in targets)


def _method(*names):
    return tuple(("call_method", n) for n in names)


def _args(node: torch.fx.Node) -> list:
    return list(node.args)


def _shape(node: torch.fx.Node) -> tuple:
    return tuple(_example(node).shape)


@_handles(*_fn(torch.arange))
def _arange(an: MaskAnalysis, node):
    args = _args(node)
    if "start" in node.kwargs or "end" in node.kwargs or "step" in node.kwargs or not 1 <= len(args) <= 3:
        return Unknown("arange with keyword bounds is not followed")
    start = an.operand_index(args[0]) if len(args) >= 2 else Index((), (), 0)
    step = args[2] if len(args) == 3 else 1
    if isinstance(start, Unknown) or start.shape != () or not isinstance(step, int) or isinstance(step, bool):
        return Unknown("arange needs an int start and a constant int step")
    return _index(_shape(node), (step,), start.base)


def _combine(a: Index, b: Index, sign: int, shape: tuple) -> Index:
    ca, fa = _align(a.coefs, a.free_dims, len(a.shape), shape)
    cb, fb = _align(b.coefs, b.free_dims, len(b.shape), shape)
    base = None if a.base is None or b.base is None else a.base + sign * b.base
    return _index(shape, tuple(x + sign * y for x, y in zip(ca, cb)), base, fa | fb)


def _index_operands(an: MaskAnalysis, node, extra_args: str) -> tuple[Index, Index] | Unknown:
    """The indexes of a binary op's two operands, or why the proof cannot follow it (``extra_args``: the
    reason when the op has other arguments than two operands)."""
    args = _args(node)
    if len(args) != 2 or node.kwargs:
        return Unknown(extra_args)
    a, b = an.operand_index(args[0]), an.operand_index(args[1])
    return next((v for v in (a, b) if isinstance(v, Unknown)), (a, b))


def _binary_index(an: MaskAnalysis, node, sign: int):
    operands = _index_operands(an, node, "add/sub with extra arguments (alpha, out) is not followed")
    if isinstance(operands, Unknown):
        return operands
    a, b = operands
    if not isinstance(_example(node), torch.Tensor):
        return Unknown("arithmetic on Python scalars")
    return _combine(a, b, sign, _shape(node))


@_handles(*_fn(operator.add, torch.add), *_method("add", "__add__", "__radd__"))
def _add(an, node):
    return _binary_index(an, node, +1)


@_handles(*_fn(operator.sub, torch.sub), *_method("sub", "__sub__"))
def _sub(an, node):
    return _binary_index(an, node, -1)


@_handles(*_fn(operator.neg, torch.neg), *_method("neg", "__neg__"))
def _neg(an, node):
    a = an.operand_index(node.args[0])
    if isinstance(a, Unknown):
        return a
    return Index(a.shape, tuple(-c for c in a.coefs), None if a.base is None else -a.base, a.free_dims)


def _compare(an, node, swap: bool, strict: bool):
    operands = _index_operands(an, node, "comparison with extra arguments")
    if isinstance(operands, Unknown):
        return operands
    if not isinstance(_example(node), torch.Tensor):  # a comparison of sizes (a SymBool under dynamic shapes)
        return Unknown("a comparison of Python scalars or sizes")
    a, b = operands
    if swap:
        a, b = b, a
    # integers: a < b  <=>  a - b + 1 <= 0
    diff = _combine(a, b, -1, _shape(node))
    base = None if diff.base is None else diff.base + (1 if strict else 0)
    return Mask(diff.shape, (Bound(diff.coefs, base, diff.free_dims),))


# a <= b and a < b; a >= b and a > b are the same with the operands swapped
for _targets, _names, _swap, _strict in ((_fn(operator.le, torch.le), ("le", "__le__"), False, False),
                                         (_fn(operator.lt, torch.lt), ("lt", "__lt__"), False, True),
                                         (_fn(operator.ge, torch.ge), ("ge", "__ge__"), True, False),
                                         (_fn(operator.gt, torch.gt), ("gt", "__gt__"), True, True)):
    _handles(*_targets, *_method(*_names))(functools.partial(_compare, swap=_swap, strict=_strict))


def realign(m: Mask, shape: tuple) -> Mask:
    bounds = []
    for b in m.bounds:
        coefs, free = _align(b.coefs, b.free_dims, len(m.shape), shape)
        bounds.append(Bound(coefs, b.base, free))
    return Mask(shape, tuple(bounds))


@_handles(*_fn(operator.and_, torch.logical_and, torch.bitwise_and),
          *_method("__and__", "__rand__", "logical_and", "bitwise_and"))
def _and(an, node):
    args = _args(node)
    if len(args) != 2 or node.kwargs:
        return Unknown("and with extra arguments")
    parts = [an.value(a) for a in args]
    for p in parts:
        if not isinstance(p, Mask):
            why = p.reason if isinstance(p, Unknown) else "it is an index, not a bool mask"
            return Unknown(f"the mask is combined (&) with a tensor the proof cannot follow: {why}")
    shape = _shape(node)
    a, b = (realign(p, shape) for p in parts)
    return Mask(shape, a.bounds + b.bounds)


@_handles(*_fn(torch.ones))
def _ones(an, node):
    if node.kwargs.get("dtype") is not torch.bool:
        return Unknown("ones without dtype=torch.bool")
    return Mask(_shape(node), ())


@_handles(*_fn(torch.tril), *_method("tril"))
def _tril(an, node):
    args = _args(node)
    src = an.value(args[0])
    diagonal = args[1] if len(args) > 1 else node.kwargs.get("diagonal", 0)
    if not isinstance(src, Mask) or not isinstance(diagonal, int) or len(src.shape) < 2:
        return Unknown("tril of something other than a proven bool mask with a constant diagonal")
    # tril keeps column j of row i iff j <= i + diagonal
    coefs = (0,) * (len(src.shape) - 2) + (-1, 1)
    coefs, _ = _align(coefs, frozenset(), len(coefs), src.shape)
    return Mask(src.shape, src.bounds + (Bound(coefs, -diagonal),))


def _reindex(value, shape: tuple, source_dims: list[int | None]):
    """New value whose dim ``k`` is the source's dim ``source_dims[k]`` (None: a new size-1 dim)."""
    def move(coefs, free):
        new = tuple(coefs[s] if s is not None else 0 for s in source_dims)
        return new, frozenset(k for k, s in enumerate(source_dims) if s is not None and s in free)

    if isinstance(value, Index):
        coefs, free = move(value.coefs, value.free_dims)
        return _index(shape, coefs, value.base, free)
    bounds = []
    for b in value.bounds:
        coefs, free = move(b.coefs, b.free_dims)
        bounds.append(Bound(coefs, b.base, free))
    return realign(Mask(shape, tuple(bounds)), shape)


@_handles(*_fn(operator.getitem))
def _getitem(an, node):
    src_node, idx = node.args
    src = an.value(src_node)
    if not isinstance(src, (Index, Mask)):
        return src if isinstance(src, Unknown) else Unknown("indexing an unproven tensor")
    idx = idx if isinstance(idx, tuple) else (idx,)
    full = slice(None, None, None)
    if any(not (i is None or i is Ellipsis or i == full) for i in idx) or sum(i is Ellipsis for i in idx) > 1:
        return Unknown("only None, ':' and '...' indexing is followed")
    consumed = sum(i == full for i in idx if i is not None and i is not Ellipsis)
    expanded = []
    for i in idx:
        if i is Ellipsis:
            expanded += [full] * (len(src.shape) - consumed)
        else:
            expanded.append(i)
    expanded += [full] * (len(src.shape) - sum(i is not None for i in expanded))
    dims, d = [], 0
    for i in expanded:
        if i is None:
            dims.append(None)
        else:
            dims.append(d)
            d += 1
    return _reindex(src, _shape(node), dims)


@_handles(*_fn(torch.unsqueeze), *_method("unsqueeze"))
def _unsqueeze(an, node):
    src = an.value(node.args[0])
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(src, (Index, Mask)) or not isinstance(dim, int):
        return src if isinstance(src, Unknown) else Unknown("unsqueeze without a constant dim")
    ndim = len(src.shape) + 1
    dim = dim % ndim
    dims = list(range(len(src.shape)))
    dims.insert(dim, None)
    return _reindex(src, _shape(node), dims)


@_handles(*_method("expand"))
def _expand(an, node):
    src = an.value(node.args[0])
    if not isinstance(src, (Index, Mask)):
        return src
    shape = _shape(node)
    # expand only repeats size-1 dims (whose index contributes nothing): values are unchanged
    pad = len(shape) - len(src.shape)
    for d, s in enumerate(src.shape):
        if not (_is_one(s) or _same(s, shape[d + pad])):
            return Unknown("expand changes a non-broadcast dim")
    if isinstance(src, Mask):
        return realign(src, shape)
    coefs, free = _align(src.coefs, src.free_dims, len(src.shape), shape)
    return Index(shape, coefs, src.base, free)


@_handles(*_method("to", "long", "int", "bool", "contiguous", "clone", "detach"),
          *_fn(torch.clone))
def _same_values(an, node):
    src = an.value(node.args[0])
    if not isinstance(src, (Index, Mask)):
        return src
    ev, src_ev = _example(node), _example(node.args[0])
    if tuple(ev.shape) != tuple(src_ev.shape):
        return Unknown("a value-preserving op changed the shape")
    return src  # the dtype check in _evaluate rejects conversions that change what the value means


# ------------------------------------------------------------------------------------------ mutation
_INPLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
})
# results that are new tensors (never views of an operand): mutating them cannot reach their inputs
_FRESH_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.le, operator.lt,
    operator.ge, operator.gt, operator.eq, operator.ne, operator.and_, operator.or_, torch.add, torch.sub,
    torch.mul, torch.le, torch.lt, torch.ge, torch.gt, torch.eq, torch.logical_and, torch.where, torch.sum,
    torch._C._nn.scaled_dot_product_attention, torch._C._nn.linear, torch.matmul,
})
_FRESH_METHODS = frozenset({"add", "sub", "mul", "le", "lt", "ge", "gt", "eq", "ne", "sum", "__and__", "__or__"})
# the in-place dunders by name (``x.__iand__(m)`` written out is recorded as this method call, ``x &= m`` as
# operator.iand)
_INPLACE_DUNDERS = frozenset({f"__{name}__" for name in (
    "setitem", "delitem", "iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
    "ixor", "ilshift", "irshift")})


def _writes_by_name(name: str) -> bool:
    """torch's naming of in-place ops: a trailing underscore (``add_``), and the in-place dunders."""
    return (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS


def may_mutate(node: torch.fx.Node) -> bool:
    """Conservative: True unless ``node`` is known not to write into any of its operands."""
    if node.op in ("placeholder", "output", "get_attr"):
        return False
    if node.op == "call_module":
        return True
    if node.kwargs.get("inplace") is True or "out" in node.kwargs:
        return True
    if node.op == "call_method":
        return _writes_by_name(node.target)
    target = node.target
    overload, _, higher_order = op_types()
    if target in _INPLACE_OPERATORS or isinstance(target, higher_order):
        return True
    if isinstance(target, overload):
        return target._schema.is_mutable
    return _writes_by_name(getattr(target, "__name__", ""))


def _fresh(node: torch.fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _FRESH_FUNCTIONS
    return node.op == "call_method" and node.target in _FRESH_METHODS


def mutation_free(nodes: set[torch.fx.Node], stop: set[torch.fx.Node]) -> bool:
    """No node reachable from ``nodes`` through users (views included) writes into them; the walk stops
    at ``stop`` nodes and at users whose results are fresh tensors."""
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        for user in n.users:
            if user in seen or user in stop or user in nodes:
                continue
            seen.add(user)
            if may_mutate(user):
                return False
            if not _fresh(user):
                stack.append(user)
    return True


def mutation_between(first: torch.fx.Node, last: torch.fx.Node) -> bool:
    """Whether any node strictly between ``first`` and ``last`` (graph order) may mutate anything."""
    node = first.next
    while node is not last and node.op != "root":
        if may_mutate(node):
            return True
        node = node.next
    return False
