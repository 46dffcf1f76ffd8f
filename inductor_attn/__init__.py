"""inductor_attn: torch.compile picks the fastest correct attention kernel for each shape.

Public API only; see README.md. Importing the package registers the custom ops; every other public name
is loaded on first use, so the command line (``python -m inductor_attn --help``, ``cache list``) does not
import Dynamo, which ``api`` needs: about 1 s of the 2.5 s that importing everything took on a CPU.
"""

import importlib

from . import ops  # noqa: F401  (registers torch.ops.inductor_attn.*: compiled graphs need them)
from ._version import __version__
from .ops import BlockSparseMask

# public name -> module that defines it (a module itself when the name is the module's)
_LAZY = {
    "attention": "api", "varlen_attention": "api", "fp8_attention": "fp8", "paged_attention": "api",
    "candidates": "api", "run_candidate": "api",
    "Candidate": "backends", "Config": "backends", "register_backend": "backends",
    "disable": "routing.enable", "enable": "routing.enable", "enabled": "routing.enable",
    "is_enabled": "routing.enable",
    "routing_report": "routing.rewrite", "reset_routing_report": "routing.rewrite",
    "stats": "runtime", "reset_stats": "runtime",
    "MODES": "tuning.modes", "set_mode": "tuning.modes", "tuning_mode": "tuning.modes",
    "sync_decisions": "tuning.decisions",
    "cache": None, "fp8": None, "hf_paged": None,
}


def _install_inductor_pass() -> None:
    from .lowering import install  # lazy: importing Inductor costs seconds

    install()


ops.attention.ON_FIRST_TRACE.append(_install_inductor_pass)

__all__ = [
    "attention", "varlen_attention", "fp8_attention", "paged_attention", "BlockSparseMask", "candidates",
    "run_candidate", "Candidate", "Config",
    "register_backend", "set_mode", "tuning_mode", "MODES", "stats", "reset_stats", "cache", "fp8", "hf_paged",
    "__version__",
    "enable", "disable", "enabled", "is_enabled", "routing_report", "reset_routing_report", "sync_decisions",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value  # later lookups are plain attribute reads (Dynamo traces those)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
