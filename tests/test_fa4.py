"""The fa4 backend on the CPU: candidate enumeration and pruning on simulated sm_90 / sm_100 devices, the
CLC heuristic, the guard on FA4's private signature, and how calls are assembled (with a fake FA4).

flash-attn-4 cannot be imported here (its CuTe DSL wheels need the GPU machine's Python), so the
enumeration tests replace ``fa4.loading.load`` with a fake; the signature guard reads the installed or
unpacked FA4 (inspect when importable, else its source) and skips only when there is none.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import os
import sys
import threading
import types
from pathlib import Path

import pytest
import torch
from blocked_imports import run_without

from inductor_attn.backends import Config, enumerate_candidates, fa4, only_backends, run_backend, run_backend_backward
from inductor_attn.backends import replay as record_replay
from inductor_attn.backends.base import AttnCall
from inductor_attn.backends.block_bitmap import bitmap_lookup, slot_table
from inductor_attn.block_mask import BlockSparseMask
from inductor_attn.device import device_info, parse_device_override
from inductor_attn.layout import tma_aligned
from inductor_attn.problem import Problem

SM90, SM100 = parse_device_override("sm_90"), parse_device_override("sm_100")
UNPACKED = Path("/tmp/cutedsl-site/flash_attn/cute")


def prob(op="attention", **kw) -> Problem:
    base = dict(op=op, dtype="bfloat16", device_type="cuda", batch=2, heads_q=16, heads_kv=16, len_q=4096,
                len_k=4096, head_dim=128, head_dim_v=128)
    base.update(kw)
    return Problem(**base)


def decode(**kw) -> Problem:
    return prob(batch=1, heads_q=32, heads_kv=8, len_q=1, len_k=8192, causal=True, **kw)


def sparse_prob(**kw) -> Problem:
    base = dict(block_q=128, block_kv=128, density=0.3, partial_fraction=0.2)
    base.update(kw)
    return prob("block_sparse", **base)


def fake_fa4(**overrides) -> fa4.loading.FA4:
    base = dict(interface=None, utils=None, block_sparsity=None, version="test",
                fwd_params=fa4.loading.FWD_KWARGS | fa4.loading.KNOB_KWARGS, bwd_params=fa4.loading.BWD_KWARGS,
                has_clc_switch=True, has_sparse_block_size=True, dsl_errors=())
    base.update(overrides)
    return fa4.loading.FA4(**base)


@pytest.fixture
def installed(monkeypatch):
    """FA4 "installed": a fake load result; returns a setter for variants."""
    monkeypatch.setattr(fa4.loading, "load", lambda: fake_fa4())

    def use(**overrides):
        monkeypatch.setattr(fa4.loading, "load", lambda: fake_fa4(**overrides))

    return use


def candidates(p: Problem, dev) -> dict[str, str | None]:
    with only_backends(fa4.BACKEND):
        return {c.name: c.pruned for c in enumerate_candidates(p, dev)}


# ------------------------------------------------------------------------------------- enumeration
def test_simulated_sm100_lists_clc_on_off_and_num_splits(installed, monkeypatch):
    monkeypatch.setenv("INDUCTOR_ATTN_DEVICE", "sm_100")
    dev = device_info("cuda")  # the simulation, not a GPU query
    cands = candidates(decode(), dev)
    assert set(cands) == {f"fa4:clc={c},num_splits={s}" for c in (False, True) for s in (1, 9, 18)}
    assert all(reason is None for reason in cands.values())


def test_sm100_big_problem_gets_no_split_candidates(installed):
    cands = candidates(prob(causal=True, batch=8), SM100)
    assert set(cands) == {"fa4:clc=False,num_splits=1", "fa4:clc=True,num_splits=1"}


def test_sm90_shows_clc_and_split_configs_pruned_with_exact_reasons(installed, monkeypatch):
    monkeypatch.setenv("INDUCTOR_ATTN_DEVICE", "sm_90")
    cands = candidates(decode(), device_info("cuda"))  # an H100's 132 SMs: splits 8 and 16 would help
    assert cands["fa4:clc=True,num_splits=1"] == "CLC needs sm_100"
    assert cands["fa4:clc=True,num_splits=8"] == "CLC needs sm_100"
    assert cands["fa4:clc=False,num_splits=8"] == "split-KV not supported on sm_90 by flash-attn-4"
    assert cands["fa4:clc=False,num_splits=16"] == "split-KV not supported on sm_90 by flash-attn-4"
    assert "fa4:clc=False,num_splits=1" not in cands  # that one is FA4's default, listed as "default"
    assert cands["fa4:default"] is None and cands["fa4:pack_gqa=False"] is None


def test_sm90_lists_default_and_measured_alternatives(installed):
    cands = candidates(prob(causal=True), SM90)
    runnable = {n for n, r in cands.items() if r is None}
    assert runnable == {"fa4:default", "fa4:mma_pv_is_rs=False", "fa4:intra_wg_overlap=False",
                        "fa4:tile_mn=128x176", "fa4:mma_pv_is_rs=False,tile_mn=192x128",
                        "fa4:intra_wg_overlap=False,tile_mn=192x128"}
    # the measured launch failure is pruned with its measurement, not silently dropped
    assert "failed to launch" in cands["fa4:mma_pv_is_rs=False,tile_mn=128x176"]
    assert candidates(prob(head_dim=64, head_dim_v=64), SM90)["fa4:mma_pv_is_rs=False,tile_mn=128x176"] is None


def test_sm90_large_head_dim_and_decode_get_only_defaults(installed):
    assert {n for n, r in candidates(prob(head_dim=256, head_dim_v=256), SM90).items() if r is None} == {
        "fa4:default"}
    assert {n for n, r in candidates(decode(), SM90).items() if r is None} == {"fa4:default", "fa4:pack_gqa=False"}


@pytest.mark.parametrize("p, reason", [
    (prob(), "dense non-causal"),
    (prob("varlen", total_q=8192, total_k=8192, causal=True), "varlen MHA"),
    (sparse_prob(), "block-sparse"),
])
def test_sm100_prunes_clc_where_fa4_turns_it_off(installed, p, reason):
    pruned = {n: r for n, r in candidates(p, SM100).items() if "clc=True" in n}
    assert pruned and all(r is not None and reason in r for r in pruned.values())


@pytest.mark.parametrize("p, clc", [
    (prob(causal=True), True),
    (prob(), False),  # dense non-causal
    (prob(window_left=256, window_right=0), True),  # local counts as masked, CLC stays on
    (prob("varlen", total_q=8192, total_k=8192), False),  # varlen MHA
    (prob("varlen", heads_kv=4, total_q=8192, total_k=8192), True),  # varlen GQA
    (sparse_prob(block_q=256), False),
])
def test_heuristic_reproduces_fa4_clc_rule(installed, p, clc):
    assert fa4.BACKEND.heuristic(p, SM100) == Config.of(clc=clc, num_splits=1)
    assert fa4.BACKEND.heuristic(p, SM90) is None  # no FA4 rule on sm_90: the default (SDPA) stands
    # the rule always names a runnable enumerated candidate
    assert candidates(p, SM100)[f"fa4:{fa4.BACKEND.heuristic(p, SM100)}"] is None


def test_sm90_varlen_is_pruned_for_reading_past_a_sequences_end(installed):
    p = prob("varlen", total_q=8192, total_k=8192, causal=True)
    assert "read the keys after a sequence's end" in candidates(p, SM90)["fa4:-"]
    assert any(reason is None for reason in candidates(p, SM100).values())  # unmeasured there


def test_gqa_adds_pack_gqa_false_on_sm90(installed):
    assert candidates(prob(heads_kv=4), SM90)["fa4:pack_gqa=False"] is None
    assert "fa4:pack_gqa=False" not in candidates(prob(), SM90)


def test_block_sparse_sm90_prunes_tiles_that_do_not_match_the_kv_block(installed):
    cands = candidates(sparse_prob(), SM90)
    assert cands["fa4:default"] is None
    assert cands["fa4:tile_mn=128x176"] == "on sm_90 flash-attn-4 needs the kv block size (128) to equal tile_n (176)"
    assert "multiple of tile_m (192)" in cands["fa4:mma_pv_is_rs=False,tile_mn=192x128"]
    wide = candidates(sparse_prob(block_kv=256), SM90)
    assert wide["fa4:default"] == "on sm_90 flash-attn-4 needs the kv block size (256) to equal tile_n (128)"
    # FA4 shrinks its default tile to a smaller kv block (64 at D128) and to tile_m 64 for 64-row q blocks
    assert candidates(sparse_prob(block_q=64, block_kv=64), SM90)["fa4:default"] is None


def test_block_sparse_sm100_needs_q_blocks_of_two_tiles(installed):
    cands = candidates(sparse_prob(), SM100)
    assert cands["fa4:clc=False,num_splits=1"] == (
        "on sm_100 flash-attn-4 needs the q block size (128) to be a multiple of 256")
    assert candidates(sparse_prob(block_q=256), SM100)["fa4:clc=False,num_splits=1"] is None


@pytest.mark.parametrize("p, dev, reason", [
    (prob(device_type="cpu"), SM90, "needs a CUDA device"),
    (prob(dtype="float32"), SM90, "flash-attn-4 takes float16 and bfloat16 only, got float32"),
    (prob(), parse_device_override("NVIDIA A100:8.0:108"), "covers sm_90 and sm_100/sm_110, got sm_80"),
    (prob(head_dim=256, head_dim_v=256), SM90, None),
    (prob(head_dim=160, head_dim_v=160), SM100, "flash-attn-4 on sm_100 takes head dims up to 128"),
    (prob(head_dim=100, head_dim_v=100), SM90, "multiples of 8"),
])
def test_supports_reasons(installed, p, dev, reason):
    got = fa4.BACKEND.supports(p, dev)
    assert got == reason if reason is None else reason in got


def test_supports_backward_excludes_block_sparse(installed):
    assert fa4.BACKEND.supports(prob(causal=True), SM90, "backward") is None
    assert "block-sparse backward" in fa4.BACKEND.supports(sparse_prob(), SM90, "backward")


def test_moved_private_kwarg_prunes_only_the_configs_that_use_it(installed):
    installed(fwd_params=fa4.loading.FWD_KWARGS | {"mma_pv_is_rs", "intra_wg_overlap", "pack_gqa", "num_splits"})
    cands = candidates(prob(causal=True), SM90)
    assert cands["fa4:default"] is None and cands["fa4:mma_pv_is_rs=False"] is None
    assert cands["fa4:tile_mn=128x176"] == "flash-attn-4 test: _flash_attn_fwd no longer takes tile_mn"


def test_missing_core_kwarg_or_clc_switch_is_a_reason(installed):
    installed(fwd_params=(fa4.loading.FWD_KWARGS - {"lse"}) | fa4.loading.KNOB_KWARGS)
    assert fa4.BACKEND.supports(prob(), SM90) == "flash-attn-4 test: _flash_attn_fwd no longer takes lse"
    installed(has_clc_switch=False)
    assert "to switch CLC per call" in candidates(prob(causal=True), SM100)["fa4:clc=True,num_splits=1"]


def _hide_flash_attn(monkeypatch):
    """Make every import of flash_attn raise ModuleNotFoundError, even where it was imported already."""
    for name in [n for n in sys.modules if n.startswith("flash_attn.")] + ["flash_attn"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_not_installed_is_pruned_cleanly(monkeypatch):
    _hide_flash_attn(monkeypatch)
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/tmp/xdg-test")
    fa4.loading.load.cache_clear()
    try:
        assert candidates(prob(), SM90) == {"fa4:-": "flash-attn-4 not installed"}
        # the disk cache is switched on before the (attempted) import, under the user's cache dir
        assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
        assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == "/tmp/xdg-test/inductor_attn/flash_attn_cute"
    finally:
        fa4.loading.load.cache_clear()


def test_a_store_lookup_lists_fa4_by_name_without_importing_it(monkeypatch):
    """FA4's enumeration imports flash_attn.cute (the CuTe DSL): a lookup leaves it out; the full way runs it."""
    from inductor_attn.backends.registry import LOOKUP_ONLY

    loads = []
    monkeypatch.setattr(fa4.loading, "load", lambda: loads.append(1) or fake_fa4())
    with only_backends(fa4.BACKEND):
        for dev in (SM90, SM100):
            assert [(c.name, c.pruned) for c in enumerate_candidates(prob(), dev, lookup_only=True)] == \
                [("fa4:-", LOOKUP_ONLY)]
        assert loads == []
        assert len(enumerate_candidates(prob(), SM90)) > 1 and loads


def test_disk_cache_settings_of_the_user_are_kept(monkeypatch):
    _hide_flash_attn(monkeypatch)
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "0")
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "/somewhere")
    fa4.loading.load.cache_clear()
    try:
        fa4.loading.load()
        assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "0"
        assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] == "/somewhere"
    finally:
        fa4.loading.load.cache_clear()


def test_candidate_names_are_unique_and_parse_back(installed):
    for dev in (SM90, SM100):
        for p in (decode(), prob(heads_kv=4, causal=True), sparse_prob()):
            for cfg in [c.config for c in fa4.BACKEND.configs(p, dev)]:
                assert Config.parse(str(cfg)) == cfg
            candidates(p, dev)  # raises on duplicates


# ---------------------------------------------------------------------- FA4's private API (signature)
def _fa4_sources() -> Path | None:
    try:
        spec = importlib.util.find_spec("flash_attn.cute")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return UNPACKED if (UNPACKED / "interface.py").exists() else None


def _importable() -> bool:
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means "read the source instead"
        return False
    return True


def _source_params(path: Path, func: str) -> set[str]:
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == func)
    return {a.arg for a in node.args.args + node.args.kwonlyargs}


@pytest.fixture(scope="module")
def fa4_src():
    src = _fa4_sources()
    if src is None:
        pytest.skip('flash-attn-4 is not installed: pip install ".[fa4]" on a CUDA machine')
    return src


def test_installed_fa4_still_takes_the_private_kwargs_we_pass(fa4_src):
    if _importable():
        from flash_attn.cute import interface

        fwd = set(inspect.signature(interface._flash_attn_fwd).parameters)
        bwd = set(inspect.signature(interface._flash_attn_bwd).parameters)
    else:
        fwd = _source_params(fa4_src / "interface.py", "_flash_attn_fwd")
        bwd = _source_params(fa4_src / "interface.py", "_flash_attn_bwd")
    assert fa4.missing_kwargs(fwd, fa4.loading.FWD_KWARGS | fa4.loading.KNOB_KWARGS) == []
    assert fa4.missing_kwargs(bwd, fa4.loading.BWD_KWARGS) == []


def test_installed_fa4_reads_the_clc_switch_through_utils_on_every_call(fa4_src):
    utils_tree = ast.parse((fa4_src / "utils.py").read_text())
    assert any(isinstance(n, ast.FunctionDef) and n.name == fa4.loading.CLC_SWITCH for n in utils_tree.body)
    fwd = next(n for n in ast.walk(ast.parse((fa4_src / "interface.py").read_text()))
               if isinstance(n, ast.FunctionDef) and n.name == "_flash_attn_fwd")
    calls = [n for n in ast.walk(fwd) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == fa4.loading.CLC_SWITCH and getattr(n.func.value, "id", None) == "utils"]
    assert calls, "_flash_attn_fwd no longer calls utils._get_use_clc_scheduler_default(): fix _clc_scheduler"


@pytest.mark.parametrize("owners", ["fwd_compile_cache_owners", "bwd_compile_cache_owners"])
def test_installed_fa4_keeps_its_compiled_kernels_where_the_recording_looks(fa4_src, owners):
    """Each owner is a module function of interface.py with a ``compile_cache`` attribute that it indexes to
    call its compiled kernel, positional arguments only."""
    source = (fa4_src / "interface.py").read_text()
    functions = {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    names = [owner.__name__ for owner in getattr(fa4, owners)(fake_fa4(interface=_NamedFunctions()))]
    for name in names:
        assert name in functions and f"{name}.compile_cache = " in source, name
        assert f"{name}.compile_cache[compile_key](" in source, name


class _NamedFunctions:
    """Any attribute is a function of that name."""

    def __getattr__(self, name):
        fn = lambda: None  # noqa: E731
        fn.__name__ = name
        return fn


def test_installed_fa4_block_sparse_tensors_have_block_size(fa4_src):
    tree = ast.parse((fa4_src / "block_sparsity.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BlockSparseTensorsTorch")
    fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
    assert fields[:4] == ["mask_block_cnt", "mask_block_idx", "full_block_cnt", "full_block_idx"]
    assert "block_size" in fields


def _fa4_tile_functions(src: Path) -> dict:
    """FA4's pure sm_90 tile-choice functions, compiled from its source (no cutlass import needed)."""
    tree = ast.parse((src / "interface.py").read_text())
    wanted = {"FwdConfig", "_tile_size_fwd_sm90", "_fit_sm90_fwd_tile_to_block_sparsity"}
    module = ast.Module([n for n in tree.body if getattr(n, "name", None) in wanted], type_ignores=[])
    namespace = {"dataclass": dataclasses.dataclass}
    exec(compile(module, str(src / "interface.py"), "exec"), namespace)  # noqa: S102 - FA4's own source
    return namespace


def test_sm90_default_tile_matches_fa4(fa4_src):
    ns = _fa4_tile_functions(fa4_src)
    for d, dv in ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)):
        for causal, local in ((False, False), (True, False), (False, True)):
            cfg = ns["_tile_size_fwd_sm90"](d, dv, causal, local)
            assert fa4.sm90_default_tile(d, dv, causal, local) == (cfg.m_block_size, cfg.n_block_size)
        for bq, bk in ((128, 128), (64, 64), (192, 128), (256, 64)):
            cfg = ns["_fit_sm90_fwd_tile_to_block_sparsity"](
                ns["_tile_size_fwd_sm90"](d, dv, False, False, sparse_block_size_q=bq), bq, bk)
            assert fa4.sm90_default_tile(d, dv, False, False, bq, bk) == (cfg.m_block_size, cfg.n_block_size)


# ------------------------------------------------------------------- assembling calls (fake FA4)
def test_clc_switch_is_swapped_for_one_call_and_restored():
    mod = types.SimpleNamespace(_get_use_clc_scheduler_default=lambda: False)
    original = mod._get_use_clc_scheduler_default
    with fa4.loading.clc_scheduler(mod, True):
        assert mod._get_use_clc_scheduler_default() is True
    assert mod._get_use_clc_scheduler_default is original
    with pytest.raises(ZeroDivisionError), fa4.loading.clc_scheduler(mod, True):
        1 / 0  # noqa: B018
    assert mod._get_use_clc_scheduler_default is original
    with fa4.loading.clc_scheduler(mod, None):
        assert mod._get_use_clc_scheduler_default is original


class Recorder:
    """Stands in for flash_attn.cute.interface: records calls, writes recognisable outputs."""

    def __init__(self, utils=None, returns=5):
        self.calls, self.utils, self.returns = [], utils, returns

    def _flash_attn_fwd(self, q, k, v, **kw):
        clc = self.utils._get_use_clc_scheduler_default() if self.utils else None
        self.calls.append((q, k, v, kw, clc))
        kw["out"].fill_(1.0)
        kw["lse"].fill_(2.0)
        return (kw["out"], kw["lse"], None, None, None)[: self.returns]

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, **kw):
        self.calls.append((q, k, v, kw, None))
        return torch.full_like(q, 3.0), torch.full_like(k, 4.0), torch.full_like(v, 5.0)


def _use_recorder(monkeypatch, **kw) -> Recorder:
    utils = types.SimpleNamespace(_get_use_clc_scheduler_default=lambda: False)
    rec = Recorder(utils, **kw)
    sparsity = types.SimpleNamespace(BlockSparseTensorsTorch=lambda **f: types.SimpleNamespace(**f))
    monkeypatch.setattr(fa4.loading, "load", lambda: fake_fa4(interface=rec, utils=utils, block_sparsity=sparsity))
    return rec


@pytest.mark.parametrize("returns", [4, 5])
def test_run_passes_transposed_views_and_returns_our_layout(monkeypatch, returns):
    rec = _use_recorder(monkeypatch, returns=returns)
    q = torch.randn(2, 8, 64, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 80, 64, dtype=torch.bfloat16), torch.randn(2, 2, 80, 64, dtype=torch.bfloat16)
    before = sum(fa4.COPIES.values())
    out, lse = run_backend(fa4.BACKEND, AttnCall("attention", q, k, v, 0.125, causal=True, window_left=32),
                               Config.of(clc=True, num_splits=2))
    fq, fk, fv, kw, clc = rec.calls[0]
    assert fq.shape == (2, 64, 8, 64) and fq.data_ptr() == q.data_ptr()  # a view, no copy
    assert fk.data_ptr() == k.data_ptr() and sum(fa4.COPIES.values()) == before
    assert kw["causal"] and (kw["window_size_left"], kw["window_size_right"]) == (32, 0)
    assert kw["num_splits"] == 2 and clc is True and "clc" not in kw
    assert out.shape == (2, 8, 64, 64) and out.is_contiguous() and bool((out == 1).all())
    assert lse.shape == (2, 8, 64) and lse.dtype == torch.float32 and bool((lse == 2).all())


def test_run_copies_and_counts_a_layout_fa4_cannot_take(monkeypatch):
    rec = _use_recorder(monkeypatch)
    q = torch.randn(1, 2, 64, 16).transpose(-1, -2).contiguous().transpose(-1, -2).to(torch.float16)
    k = v = torch.randn(1, 2, 64, 16, dtype=torch.float16)
    before = fa4.COPIES["q"]
    run_backend(fa4.BACKEND, AttnCall("attention", q, k, v, 0.25), Config())
    assert fa4.COPIES["q"] == before + 1 and rec.calls[0][0].stride(-1) == 1


def test_a_contiguous_view_at_a_misaligned_address_is_copied_to_an_aligned_one():
    storage = torch.randn(2 * 4 * 8 * 16 + 4, dtype=torch.float16)
    q = storage[4:].view(2, 8, 4, 16).transpose(1, 2)  # FA4's view of it is contiguous, 8 bytes off 16
    before = fa4.COPIES["q"]
    taken = fa4.launch._fa4_layout(q, "q", True)
    assert fa4.COPIES["q"] == before + 1 and tma_aligned(taken, broadcast_ok=True)
    assert torch.equal(taken, q.transpose(1, 2))


def test_run_varlen_and_kv_seqlens_arguments(monkeypatch):
    rec = _use_recorder(monkeypatch)
    q = torch.randn(30, 4, 32, dtype=torch.float16)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    out, lse = run_backend(fa4.BACKEND, AttnCall("varlen", q, q, q, 0.2, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        max_seqlen_q=20, max_seqlen_k=20), Config.of(pack_gqa=False))
    fq, _, _, kw, _ = rec.calls[0]
    assert fq.data_ptr() == q.data_ptr() and kw["cu_seqlens_q"] is cu and kw["max_seqlen_k"] == 20
    assert kw["pack_gqa"] is False and out.shape == (30, 4, 32) and lse.shape == (4, 30)
    qd = torch.randn(3, 4, 1, 32, dtype=torch.float16)
    kd = torch.randn(3, 4, 50, 32, dtype=torch.float16)
    run_backend(fa4.BACKEND, AttnCall("attention", qd, kd, kd, 0.2, kv_seqlens=torch.tensor([5, 50, 0])), Config())
    seqused = rec.calls[1][3]["seqused_k"]
    assert seqused.dtype == torch.int32 and seqused.tolist() == [5, 50, 0]


def _causal_sparse_mask(lq=256, lk=256, block=64) -> BlockSparseMask:
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(lambda b, h, q, kv: kv <= q, None, None, lq, lk, device="cpu", BLOCK_SIZE=block)
    return BlockSparseMask.from_block_mask(bm)


def test_run_block_sparse_passes_fa4_tensors_and_bitmap_aux(monkeypatch):
    rec = _use_recorder(monkeypatch)
    monkeypatch.setattr(fa4.launch, "_bitmap_mask_mod", lambda *geometry: ("mask_mod", geometry))
    sparse = _causal_sparse_mask()
    q = torch.randn(1, 2, 256, 64, dtype=torch.bfloat16)
    run_backend(fa4.BACKEND, AttnCall("block_sparse", q, q, q, 0.125, sparse=sparse), Config())
    kw = rec.calls[0][3]
    t = kw["block_sparse_tensors"]
    assert t.mask_block_cnt is sparse.kv_num_blocks and t.full_block_idx is sparse.full_kv_indices
    assert t.block_size == (64, 64) and "causal" not in kw
    assert kw["mask_mod"] == ("mask_mod", (64, 64, 0, 0))  # mask shared by batch and heads
    slot_of, bits = kw["aux_tensors"]
    assert torch.equal(slot_of, slot_table(sparse)) and torch.equal(bits, sparse.partial_bits)
    assert slot_of.__leading_dim__ == 3 and bits.__leading_dim__ == 5


@pytest.mark.parametrize("mask_b, mask_h", [(2, 3), (None, None), (2, None), (None, 3)],
                         ids=["per_batch_and_head", "shared", "per_batch", "per_head"])
def test_bitmap_lookup_reproduces_the_dense_mask_in_partial_blocks(mask_b, mask_h):
    from torch.nn.attention.flex_attention import create_block_mask

    def doc_mask(b, h, q, kv):  # per-batch documents plus a per-head window: every kind of block
        return ((q // (37 + 20 * b)) == (kv // (37 + 20 * b))) & (q - kv <= 40 + 8 * h) & (kv <= q)

    bm = create_block_mask(doc_mask, mask_b, mask_h, 200, 200, device="cpu", BLOCK_SIZE=64)
    sparse = BlockSparseMask.from_block_mask(bm)
    dense = sparse.dense_mask()
    # broadcast batch/head dims (size 1) are looked up at index 0 whatever b and h are asked
    b, h, qi, ki = torch.meshgrid(torch.arange(2), torch.arange(3), *(torch.arange(n) for n in dense.shape[2:]),
                                  indexing="ij")
    dense = dense.expand(2, 3, *dense.shape[2:])
    got = bitmap_lookup(slot_table(sparse), sparse.partial_bits, 64, 64, b, h, qi, ki)
    m, n = qi // 64, ki // 64
    slots = torch.arange(sparse.kv_indices.shape[-1])
    cnt, idx = sparse.kv_num_blocks.expand(2, 3, -1), sparse.kv_indices.expand(2, 3, -1, -1)
    listed = (idx[b, h, m] == n[..., None]) & (slots < cnt[b, h, m][..., None])
    partial = listed.any(-1)
    assert partial.any() and torch.equal(got[partial], dense[partial])


def test_dsl_errors_become_runtime_errors(monkeypatch):
    class DSLError(Exception):
        pass

    class Failing(Recorder):
        def _flash_attn_fwd(self, q, k, v, **kw):
            raise DSLError("\nerror[CUDA_LAUNCH_INVALID_CONFIG]: CUDA launch failed")

    utils = types.SimpleNamespace(_get_use_clc_scheduler_default=lambda: False)
    monkeypatch.setattr(fa4.loading, "load", lambda: fake_fa4(interface=Failing(), utils=utils, dsl_errors=(DSLError,)))
    q = torch.randn(1, 1, 16, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"flash-attn-4 \[tile_mn=128x176\] DSLError: error\[CUDA_LAUNCH"):
        run_backend(fa4.BACKEND, AttnCall("attention", q, q, q, 0.25), Config.of(tile_mn="128x176"))


def _compiling_interface(kernel_calls: list, only_inside: bool = False):
    """A fake FA4 interface whose ``_flash_attn_fwd`` calls a "compiled kernel" from its compile cache with
    positional arguments, as b36 does: tensors, the scale and a constant. ``only_inside``: the kernel raises when
    called other than from ``_flash_attn_fwd`` (a kernel's raw function refusing what the interface converts)."""
    inside = []

    def kernel(q, k, v, out, lse, scale, window, none):
        if only_inside and not inside:
            raise TypeError("Mismatched type on argument #3")
        kernel_calls.append(scale)
        out.copy_(q * scale + v)
        lse.fill_(1.0)

    def _flash_attn_fwd(q, k, v, **kw):
        cache = _flash_attn_fwd.compile_cache
        if ("key",) not in cache:
            cache[("key",)] = kernel
        inside.append(1)
        try:
            cache[("key",)](q, k, v, kw["out"], kw["lse"], kw["softmax_scale"], 7, None)
        finally:
            inside.pop()
        return kw["out"], kw["lse"]

    _flash_attn_fwd.compile_cache = {}
    return types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd)


def _fwd_plan(monkeypatch, kernel_calls, only_inside: bool = False):
    interface = _compiling_interface(kernel_calls, only_inside)
    utils = types.SimpleNamespace(_get_use_clc_scheduler_default=lambda: False)
    monkeypatch.setattr(fa4.loading, "load", lambda: fake_fa4(interface=interface, utils=utils))
    q = torch.randn(1, 2, 16, 16, dtype=torch.float16)
    return interface, fa4.BACKEND.plan(AttnCall("attention", q, q, q, 0.25).problem, SM90, Config(), "forward")


def _qkv(seed: int, shape=(1, 2, 16, 16)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(torch.float16) for _ in range(3)]


def test_forward_plan_calls_the_compiled_kernel_directly_after_one_call_through_fa4(monkeypatch):
    kernel_calls = []
    interface, plan = _fwd_plan(monkeypatch, kernel_calls)
    plan.launch(AttnCall("attention", *_qkv(0), 0.25))  # through FA4, recorded, replayed once to check it
    real = interface._flash_attn_fwd
    interface._flash_attn_fwd = lambda *a, **kw: pytest.fail("went through _flash_attn_fwd again")
    q, k, v = _qkv(1)
    out, lse = plan.launch(AttnCall("attention", q, k, v, 0.25))  # other tensors, the same layout and scale
    assert kernel_calls == [0.25, 0.25, 0.25]
    assert torch.equal(out, q * 0.25 + v) and bool((lse == 1.0).all())
    assert out.stride() == q.stride()  # the ops' layout contract
    interface._flash_attn_fwd = real
    out, _ = plan.launch(AttnCall("attention", q, k, v, 0.5))  # another scale: recorded for itself
    assert kernel_calls[3:] == [0.5, 0.5] and torch.equal(out, q * 0.5 + v)


def test_a_replay_recorded_on_aliased_tensors_serves_only_calls_aliased_the_same_way(monkeypatch):
    """q, k and v one tensor: the recording cannot tell their roles apart, so it serves calls whose values
    are one tensor the same way (FA4's varlen cu_seqlens_q and cu_seqlens_k often are); a call with three
    tensors is recorded for itself."""
    kernel_calls = []
    interface, plan = _fwd_plan(monkeypatch, kernel_calls)
    q = _qkv(0)[0]
    plan.launch(AttnCall("attention", q, q, q, 0.25))  # through FA4, recorded, checked
    q, k, v = _qkv(1)
    out, _ = plan.launch(AttnCall("attention", q, k, v, 0.25))  # through FA4 again, recorded, checked
    assert kernel_calls == [0.25] * 4 and torch.equal(out, q * 0.25 + v)
    interface._flash_attn_fwd = lambda *a, **kw: pytest.fail("went through _flash_attn_fwd again")
    out, _ = plan.launch(AttnCall("attention", k, k, k, 0.25))
    assert torch.equal(out, k * 0.25 + k) and len(plan.launch.replays.by_layout) == 2


def test_varlen_forward_replays_with_the_calls_cu_seqlens_and_keys_on_max_seqlen(monkeypatch):
    kernel_calls = []

    def kernel(q, k, v, out, lse, scale, cu_q, cu_k, max_q):
        kernel_calls.append(max_q)
        out.copy_(q * scale + v + cu_q[-1] + cu_k[1] + max_q)
        lse.fill_(1.0)

    def _flash_attn_fwd(q, k, v, **kw):
        if ("key",) not in _flash_attn_fwd.compile_cache:
            _flash_attn_fwd.compile_cache[("key",)] = kernel
        _flash_attn_fwd.compile_cache[("key",)](q, k, v, kw["out"], kw["lse"], kw["softmax_scale"],
                                                kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["max_seqlen_q"])
        return kw["out"], kw["lse"]

    _flash_attn_fwd.compile_cache = {}
    interface = types.SimpleNamespace(_flash_attn_fwd=_flash_attn_fwd)
    utils = types.SimpleNamespace(_get_use_clc_scheduler_default=lambda: False)
    monkeypatch.setattr(fa4.loading, "load", lambda: fake_fa4(interface=interface, utils=utils))

    def call(seed, cu_q, cu_k, longest):
        q, k, v = _qkv(seed, (16, 2, 16))
        return AttnCall("varlen", q, k, v, 0.25, True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=longest,
                        max_seqlen_k=longest)

    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    first = call(0, cu, cu, 11)
    plan = fa4.BACKEND.plan(first.problem, SM90, Config(), "forward")
    plan.launch(first)
    assert kernel_calls == [11, 11]  # through FA4, then the recorded call checked
    real = interface._flash_attn_fwd
    other = torch.tensor([0, 9, 16], dtype=torch.int32)
    again = call(1, other, torch.tensor([0, 4, 16], dtype=torch.int32), 11)  # two tensors: not the layout recorded
    out, lse = plan.launch(again)
    assert kernel_calls == [11] * 4  # through FA4 and recorded for itself, then checked
    assert torch.equal(out, again.q * 0.25 + again.v + 16 + 4 + 11) and lse.shape == (2, 16)
    interface._flash_attn_fwd = lambda *a, **kw: pytest.fail("through FA4")
    same = call(2, other, other, 11)  # one tensor for both, as recorded first: replayed
    out, _ = plan.launch(same)
    assert torch.equal(out, same.q * 0.25 + same.v + 16 + 9 + 11) and kernel_calls[-1] == 11
    interface._flash_attn_fwd = real
    longer = call(3, other, other, 13)  # another max_seqlen: recorded for itself, never replayed as 11
    out, _ = plan.launch(longer)
    assert torch.equal(out, longer.q * 0.25 + longer.v + 16 + 9 + 13)


def test_backward_uses_views_and_returns_our_layout(monkeypatch):
    rec = _use_recorder(monkeypatch)
    q = torch.randn(2, 4, 32, 16, dtype=torch.float16)
    k = torch.randn(2, 2, 48, 16, dtype=torch.float16)
    call = AttnCall("attention", q, k, k, 0.25, causal=True)
    out, lse = torch.randn_like(q), torch.randn(2, 4, 32)
    dq, dk, dv = run_backend_backward(fa4.BACKEND, call, Config(), out, lse, None, torch.ones(2, 4, 32))
    fq, fk, _, kw, _ = rec.calls[0]
    assert fq.data_ptr() == q.data_ptr() and kw["causal"] and kw["dlse"].shape == (2, 4, 32)
    assert dq.shape == q.shape and dk.shape == k.shape and bool((dq == 3).all()) and bool((dv == 5).all())
    with pytest.raises(NotImplementedError, match="block-sparse backward"):
        sparse = _causal_sparse_mask(32, 32, 32)
        run_backend_backward(fa4.BACKEND, AttnCall("block_sparse", q, q, q, 0.25, sparse=sparse), Config(), out, lse,
                             None, None)


def test_importing_the_fa4_backend_needs_no_optional_dependency():
    """STYLE pattern 2: backends import optional deps lazily (triton, cutlass, flash_attn blocked here)."""
    run_without(("triton", "cutlass", "flash_attn", "quack"), "import inductor_attn.backends.fa4\n")



def test_a_replayed_forward_call_skips_the_layout_work_from_its_second_replay_on(monkeypatch):
    """A compiled call site launches one layout again and again: once a replay served it, the plan keys its
    next calls on the call's own tensors and allocates the outputs laid out as before (FA4's launch through the
    op cost 80 us against cuDNN's 41 on an H200, issue 52); another layout still takes the full way."""
    _, plan = _fwd_plan(monkeypatch, [])
    plan.launch(AttnCall("attention", *_qkv(0), 0.25))  # through FA4, recorded, checked
    plan.launch(AttnCall("attention", *_qkv(1), 0.25))  # the replay, found by the full layout key
    full_way = record_replay.layout_key, fa4.launch._buffers
    monkeypatch.setattr(record_replay, "layout_key", lambda values: pytest.fail("built the full layout key"))
    monkeypatch.setattr(fa4.launch, "_buffers", lambda call: pytest.fail("computed the outputs' layout"))
    q, k, v = _qkv(2)
    out, lse = plan.launch(AttnCall("attention", q, k, v, 0.25))
    assert torch.equal(out, q * 0.25 + v) and bool((lse == 1.0).all()) and out.stride() == q.stride()
    monkeypatch.setattr(record_replay, "layout_key", full_way[0])
    monkeypatch.setattr(fa4.launch, "_buffers", full_way[1])
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in _qkv(3))  # (B, L, H, D) memory
    out, _ = plan.launch(AttnCall("attention", q, k, v, 0.25))
    assert torch.equal(out, q * 0.25 + v) and out.stride() == q.stride() and len(plan.launch.replays.by_layout) == 2


def test_a_call_laid_out_differently_is_recorded_for_itself(monkeypatch):
    """FA4 compiles a kernel per broadcast pattern: a k with zero strides (an expanded tensor) must not
    reuse the replay recorded for a dense one."""
    kernel_calls = []
    interface, plan = _fwd_plan(monkeypatch, kernel_calls)
    plan.launch(AttnCall("attention", *_qkv(0), 0.25))
    q, _, v = _qkv(1)
    k = torch.ones(1, 1, 1, 16, dtype=torch.float16).expand(1, 2, 16, 16)
    kernel_calls.clear()
    out, _ = plan.launch(AttnCall("attention", q, k, v, 0.25))
    assert kernel_calls == [0.25, 0.25]  # through FA4 and recorded, then checked: not the dense replay
    assert len(plan.launch.replays.by_layout) == 2 and torch.equal(out, q * 0.25 + v)


def _compiling_backward(kernel_calls: list, host_filled_dpsum: bool = False,
                        fresh=lambda *shape: torch.full(shape, 7.0)):
    """A fake FA4 interface whose ``_flash_attn_bwd`` runs three "compiled kernels" from three compile caches,
    as b36 does: a preprocess that fills dpsum and zeroes the dq accumulator, a main kernel that adds into the
    accumulators (dk's handed over zeroed by ``torch.zeros``) and writes dv, and a postprocess conversion per
    accumulator. ``host_filled_dpsum``: dpsum is filled on the host instead, which a replay cannot repeat.
    ``fresh``: what FA4's ``torch.empty`` buffers hold (by default not zeros, as memory used before)."""
    def preprocess(o, do, dpsum, dq_accum, scale):
        kernel_calls.append("pre")
        if not host_filled_dpsum:
            dpsum.copy_((o.float() * do.float()).sum(-1))
        dq_accum.zero_()

    def main(q, k, v, dpsum, dq_accum, dk_accum, dv, scale, window):
        kernel_calls.append("main")
        dq_accum.add_(q.float() * scale + dpsum[..., None])
        dk_accum.add_(k.float())
        dv.copy_(v * 2)

    def convert(accum, grad, scale):
        kernel_calls.append("post")
        grad.copy_(accum)

    def owner(kernel):
        def run(*args):
            if "key" not in run.compile_cache:
                run.compile_cache["key"] = kernel
            run.compile_cache["key"](*args)
        run.compile_cache = {}
        return run

    pre, bwd, post = owner(preprocess), owner(main), owner(convert)

    def _flash_attn_bwd(q, k, v, o, do, lse, dq, dk, dv, softmax_scale, **kw):
        dpsum = torch.full(q.shape[:-1], 3.0) if host_filled_dpsum else fresh(*q.shape[:-1])
        dq_accum, dk_accum = fresh(*q.shape), torch.zeros(k.shape)
        pre(o, do, dpsum, dq_accum, softmax_scale)
        bwd(q, k, v, dpsum, dq_accum, dk_accum, dv, softmax_scale, -1)
        post(dq_accum, dq, softmax_scale)
        post(dk_accum, dk, softmax_scale)
        return dq, dk, dv

    return types.SimpleNamespace(_flash_attn_bwd=_flash_attn_bwd, _bwd_preprocess=pre, _flash_attn_bwd_main=bwd,
                                 _bwd_postprocess_convert=post)


def _bwd_call(seed: int):
    q, k, v = _qkv(seed, (1, 2, 16, 16))
    return AttnCall("attention", q, k, v, 0.25)


def _want_grads(call: AttnCall, out, grad_out):
    dpsum = (out.transpose(1, 2).float() * grad_out.transpose(1, 2).float()).sum(-1).transpose(1, 2)
    return (call.q.float() * 0.25 + dpsum[..., None]).half(), call.k, call.v * 2


def _bwd_plan(monkeypatch, interface):
    monkeypatch.setattr(fa4.loading, "load", lambda: fake_fa4(interface=interface))
    monkeypatch.setattr(fa4.loading, "bwd_compile_cache_owners", lambda fa: [
        fa.interface._bwd_preprocess, fa.interface._flash_attn_bwd_main, fa.interface._bwd_postprocess_convert])
    return fa4.BACKEND.plan(_bwd_call(0).problem, SM90, Config(), "backward")


def test_backward_plan_replays_the_recorded_kernels_with_fresh_scratch_buffers(monkeypatch):
    kernel_calls = []
    interface = _compiling_backward(kernel_calls)
    plan = _bwd_plan(monkeypatch, interface)
    for seed in range(3):
        call = _bwd_call(seed)
        out, grad_out = torch.randn_like(call.q), torch.randn_like(call.q)
        grads = plan.launch(call, out, torch.zeros(1, 2, 16), grad_out, None)
        for got, want in zip(grads, _want_grads(call, out, grad_out)):
            assert torch.allclose(got.float(), want.float(), atol=1e-2)  # dk's accumulator is zeroed each call
        if seed == 0:  # through FA4, recorded, then the replay checked with two poisons and dk_accum unzeroed
            assert kernel_calls == ["pre", "main", "post", "post"] * 4
            interface._flash_attn_bwd = lambda *a, **kw: pytest.fail("went through _flash_attn_bwd again")
    assert kernel_calls == ["pre", "main", "post", "post"] * 6
    assert all(plan.launch.replays.by_layout.values())


def test_a_replayed_backward_call_skips_the_layout_work_from_its_second_replay_on(monkeypatch):
    plan = _bwd_plan(monkeypatch, _compiling_backward([]))
    for seed in range(3):
        if seed == 2:
            monkeypatch.setattr(record_replay, "layout_key", lambda values: pytest.fail("built the full layout key"))
            monkeypatch.setattr(fa4.launch, "new_grads", lambda *a: pytest.fail("computed the grads' layout"))
        call = _bwd_call(seed)
        out, grad_out = torch.randn_like(call.q), torch.randn_like(call.q)
        grads = plan.launch(call, out, torch.zeros(1, 2, 16), grad_out, None)
        for got, want in zip(grads, _want_grads(call, out, grad_out)):
            assert torch.allclose(got.float(), want.float(), atol=1e-2) and got.stride() == want.stride()


def test_a_backward_call_fa4_cannot_take_as_it_is_replays_with_the_copy_fa4_would_make(monkeypatch):
    """Replays are looked up with the views alone first (no layout checks): a grad_out whose last dim is not
    contiguous finds none there, and its values made what FA4 takes (a copy of grad_out) are recorded for
    their own layout at the first call and replayed at the second."""
    kernel_calls = []
    interface = _compiling_backward(kernel_calls)
    plan = _bwd_plan(monkeypatch, interface)
    call = _bwd_call(0)
    plan.launch(call, torch.randn_like(call.q), torch.zeros(1, 2, 16), torch.randn_like(call.q), None)
    call, before = _bwd_call(1), fa4.COPIES["grad_out"]
    out = torch.randn_like(call.q)
    grad_out = torch.randn_like(call.q).transpose(-1, -2).contiguous().transpose(-1, -2)
    for n in (1, 2):
        kernel_calls.clear()
        grads = plan.launch(call, out, torch.zeros(1, 2, 16), grad_out, None)
        for got, want in zip(grads, _want_grads(call, out, grad_out)):
            assert torch.allclose(got.float(), want.float(), atol=1e-2)
        assert fa4.COPIES["grad_out"] == before + n
        assert kernel_calls == ["pre", "main", "post", "post"] * (4 if n == 1 else 1)  # recorded and checked
        interface._flash_attn_bwd = lambda *a, **kw: pytest.fail("went through _flash_attn_bwd again")
    assert len(plan.launch.replays.by_layout) == 2


def test_a_backward_scratch_buffer_filled_on_the_host_keeps_the_plan_on_fa4s_interface(monkeypatch, caplog):
    """dpsum filled by FA4's Python, not by a recorded kernel: the replay's check (scratch poisoned with NaN)
    sees that it did not reproduce the call, and the plan keeps calling ``_flash_attn_bwd``."""
    kernel_calls = []
    plan = _bwd_plan(monkeypatch, _compiling_backward(kernel_calls, host_filled_dpsum=True))
    for seed in range(2):
        call = _bwd_call(seed)
        out, grad_out = torch.randn_like(call.q), torch.randn_like(call.q)
        dq, _, _ = plan.launch(call, out, torch.zeros(1, 2, 16), grad_out, None)
        assert torch.allclose(dq.float(), call.q.float() * 0.25 + 3.0, atol=1e-2)
    assert list(plan.launch.replays.by_layout.values()) == [None]
    assert "did not reproduce the call" in caplog.text and kernel_calls.count("main") == 3


def test_a_replay_stops_zeroing_a_buffer_that_a_recorded_kernel_clears(monkeypatch):
    """dq's accumulator comes from ``torch.empty`` and the preprocess clears it; handed over as all zeros (fresh
    memory often is), the recording would zero it each call. The check tries it poisoned and stops zeroing it;
    dk's accumulator, which the main kernel adds into, stays zeroed."""
    plan = _bwd_plan(monkeypatch, _compiling_backward([], fresh=torch.zeros))
    for seed in range(3):
        call = _bwd_call(seed)
        out, grad_out = torch.randn_like(call.q), torch.randn_like(call.q)
        grads = plan.launch(call, out, torch.zeros(1, 2, 16), grad_out, None)
        for got, want in zip(grads, _want_grads(call, out, grad_out)):
            assert torch.allclose(got.float(), want.float(), atol=1e-2)
    (replay,) = plan.launch.replays.by_layout.values()
    assert [zeroed for *_, zeroed in replay.scratch] == [False, False, True]  # dpsum, dq_accum, dk_accum


@pytest.mark.parametrize("cleared", [False, True])
def test_a_buffer_read_through_a_max_keeps_its_zeroing_unless_a_kernel_clears_it(cleared):
    """NaN passes through ``fmax`` unseen; the finite poison shows that the buffer's zeros are read."""
    x = torch.randn(64, dtype=torch.float16)

    def clear(buf):
        buf.zero_()

    def running_max(x, buf, out):
        out.copy_(torch.fmax(buf, x.float()))

    buf, out = torch.zeros(64), torch.empty_like(x)
    calls = ([(clear, (buf,))] if cleared else []) + [(running_max, (x, buf, out))]
    for fn, args in calls:
        fn(*args)
    replay = _recorded(calls, (x, out))
    fresh = torch.empty_like(x)
    checked = record_replay.checked_replay(replay, (x, fresh), (out,), (fresh,), "test")
    assert checked is not None and checked.scratch[0][3] == (not cleared)


def _write_where_small(x, buf, out):
    """A kernel that leaves its output as it is where its scratch buffer holds a large value."""
    out.copy_(torch.where(buf > 100, out, x))


def _checked_write_where_small(buf_value: float):
    """``_write_where_small`` recorded with its buffer filled with ``buf_value`` (0: recorded as zeroed), then
    put through the replay check on fresh outputs: (the recorded replay, the check's result)."""
    x = torch.randn(64, dtype=torch.float16)
    buf, out = torch.full((64,), buf_value), torch.empty_like(x)
    _write_where_small(x, buf, out)
    replay = _recorded([(_write_where_small, (x, buf, out))], (x, out))
    fresh = torch.empty_like(x)
    return replay, record_replay.checked_replay(replay, (x, fresh), (out,), (fresh,), "test")


def test_each_poisoned_run_of_the_check_starts_from_nan_filled_outputs():
    """The buffer not zeroed by the replay: the finite poison's run must find the output NaN, not the NaN
    poison's correct result, so the replay is refused."""
    replay, checked = _checked_write_where_small(5.0)
    assert replay is not None and not replay.scratch[0][3]
    assert checked is None


def test_each_trial_without_zeroing_starts_from_nan_filled_outputs():
    """The buffer zeroed by the replay: the finite poison must find the output NaN, not the previous poison's
    correct result, or the zeroing it needs is dropped."""
    _, checked = _checked_write_where_small(0.0)
    assert checked is not None and checked.scratch[0][3]


def test_another_threads_fa4_call_during_a_recording_is_not_recorded(monkeypatch):
    """The compile caches are swapped for the whole process while one call records: a kernel that another
    thread runs meanwhile (a layout that goes through FA4's interface, a user's own FA4 call) is that thread's,
    not a step of the replay."""
    kernel_calls = []
    interface = _compiling_backward(kernel_calls)
    recorded_bwd = interface._flash_attn_bwd

    def bwd_beside_another_thread(q, k, v, o, do, lse, dq, dk, dv, softmax_scale, **kw):
        other = threading.Thread(target=interface._bwd_postprocess_convert,
                                 args=(torch.ones(3, dtype=torch.float32), torch.empty(3), softmax_scale))
        other.start()
        other.join()
        return recorded_bwd(q, k, v, o, do, lse, dq, dk, dv, softmax_scale, **kw)

    interface._flash_attn_bwd = bwd_beside_another_thread
    plan = _bwd_plan(monkeypatch, interface)
    call = _bwd_call(0)
    out, grad_out = torch.randn_like(call.q), torch.randn_like(call.q)
    plan.launch(call, out, torch.zeros(1, 2, 16), grad_out, None)
    (replay,) = plan.launch.replays.by_layout.values()
    assert replay is not None and len(replay.steps) == 4  # pre, main, post, post: not the other thread's post


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_a_call_that_began_before_another_thread_recorded_its_layout_still_runs(monkeypatch, direction):
    """Plans are shared per problem: thread A starts a call with nothing recorded yet (so it builds no quick key),
    thread B records the layout meanwhile, and A must not then use the key it never built."""
    kernel_calls = []
    if direction == "forward":
        _, plan = _fwd_plan(monkeypatch, kernel_calls)
        allocator, name = fa4.launch._buffers, "_buffers"

        def other_call():
            plan.launch(AttnCall("attention", *_qkv(1), 0.25))
    else:
        plan = _bwd_plan(monkeypatch, _compiling_backward(kernel_calls))
        allocator, name = fa4.launch.new_grads, "new_grads"

        def other_call():
            call = _bwd_call(1)
            plan.launch(call, torch.randn_like(call.q), torch.zeros(1, 2, 16), torch.randn_like(call.q), None)
    interleaved = []

    def allocate(*args):  # thread A is past its quick key and before its lookup: thread B records now
        if not interleaved:
            interleaved.append(threading.Thread(target=other_call))
            interleaved[0].start()
            interleaved[0].join()
        return allocator(*args)

    monkeypatch.setattr(fa4.launch, name, allocate)
    errors = []

    def call_a():
        try:
            if direction == "forward":
                plan.launch(AttnCall("attention", *_qkv(0), 0.25))
            else:
                call = _bwd_call(0)
                plan.launch(call, torch.randn_like(call.q), torch.zeros(1, 2, 16), torch.randn_like(call.q), None)
        except Exception as err:  # noqa: BLE001 - the failure is what the test looks for
            errors.append(err)

    a = threading.Thread(target=call_a)
    a.start()
    a.join()
    assert interleaved and not errors, errors
    assert len(plan.launch.replays.by_layout) == 1


def test_a_recording_whose_owner_lacks_the_compile_cache_raises_and_releases_its_lock():
    with pytest.raises(AttributeError):
        with record_replay.Recording([types.SimpleNamespace(compile_cache={}), types.SimpleNamespace()]):
            pass
    assert not record_replay.Recording._LOCK.locked()


def test_a_replay_that_raises_in_its_check_is_refused_and_the_layout_keeps_fa4s_interface(monkeypatch):
    """A recorded kernel called directly may refuse what FA4's own call converts first: the check refuses the
    replay (the layout keeps going through FA4, every call right), instead of failing the call it checks."""
    _, plan = _fwd_plan(monkeypatch, [], only_inside=True)
    for seed in range(3):
        q, k, v = _qkv(seed)
        out, _ = plan.launch(AttnCall("attention", q, k, v, 0.25))
        assert torch.equal(out, q * 0.25 + v)
    assert list(plan.launch.replays.by_layout.values()) == [None]


def test_backward_values_that_fa4_would_copy_are_copied_before_it_sees_them(monkeypatch):
    """b36's maybe_contiguous clones an input with an unaligned pointer; a recording would take that copy for
    a scratch buffer (and an all-zero one for a buffer to zero), so the launch hands FA4 aligned copies."""
    seen = []
    interface = _compiling_backward([])
    recorded_bwd = interface._flash_attn_bwd

    def bwd(q, k, v, o, do, lse, dq, dk, dv, softmax_scale, dlse=None, **kw):
        seen.extend([lse, dlse])
        return recorded_bwd(q, k, v, o, do, lse, dq, dk, dv, softmax_scale, **kw)

    interface._flash_attn_bwd = bwd
    plan = _bwd_plan(monkeypatch, interface)
    call = _bwd_call(0)
    out, grad_out = torch.randn_like(call.q), torch.randn_like(call.q)
    lse, grad_lse = (torch.zeros(1 + 2 * 16)[1:].view(1, 2, 16) for _ in range(2))  # 4-byte offsets
    plan.launch(call, out, lse, grad_out, grad_lse)
    assert all(t.data_ptr() % 16 == 0 and t.is_contiguous() for t in seen)


def _recorded(calls: list, values: tuple) -> record_replay.Replay | None:
    """A replay rebuilt from ``calls`` (kernel, args) as a recording would have noted them over ``values``."""
    recording = record_replay.Recording([])
    recording.thread = threading.get_ident()
    for fn, args in calls:
        recording.note(fn, args)
    return recording.replay(values, scratch=True)


def _kernel(*args):
    return None


@pytest.mark.parametrize("made_by_fa4, why", [
    (lambda q, lse: q.clone(), "a copy in q's dtype is an input's copy, not a buffer of FA4's own"),
    (lambda q, lse: lse.view(-1)[1:9], "it overlaps a value without being it"),
    (lambda q, lse: torch.ones(4, dtype=torch.int32), "an integer tensor handed over non-zero: an index or counter"),
])
def test_a_recording_holding_a_tensor_no_replay_can_remake_is_refused(made_by_fa4, why):
    q, lse = torch.randn(2, 16, dtype=torch.float16), torch.randn(2, 16)
    assert _recorded([(_kernel, (q, lse, made_by_fa4(q, lse)))], (q, lse)) is None, why
    assert _recorded([(_kernel, (q, lse, torch.zeros(4)))], (q, lse)) is not None  # a buffer of FA4's own


def test_a_recording_refuses_one_buffer_passed_with_two_layouts():
    q = torch.randn(2, 16, dtype=torch.float16)
    buf = torch.zeros(4, 8)
    assert _recorded([(_kernel, (q, buf)), (_kernel, (q, buf.view(8, 4)))], (q,)) is None


def test_a_replay_allocates_fa4s_buffers_again_zeroed_where_they_were_handed_over_zeroed():
    q = torch.randn(2, 16, dtype=torch.float16)
    semaphores, accum = torch.zeros(4, dtype=torch.int32), torch.full((2, 16), 3.0)
    replay = _recorded([(_kernel, (q, semaphores, accum)), (_kernel, (accum, 0.5))], (q,))
    kinds = [kind for kind, _ in replay.steps[0][1]] if replay is not None else None
    assert kinds == [record_replay.ROLE, record_replay.SCRATCH, record_replay.SCRATCH]
    assert replay.scratch == [((4,), (1,), torch.int32, True), ((2, 16), (16, 1), torch.float32, False)]
    # one buffer, one role, across kernels
    assert replay.steps[1][1] == [(record_replay.SCRATCH, 1), (record_replay.CONST, 0.5)]


def test_a_replays_scratch_buffers_share_one_allocation_without_overlapping():
    """One allocation per replay, the zeroed buffers first (one fill), each at a multiple of 512 bytes; a
    buffer not zeroed is poisoned in a check; each kernel gets its arguments in the recorded order."""
    scratch = [((3, 5), (5, 1), torch.float32, False), ((4,), (1,), torch.int32, True),
               ((2, 3, 4), (12, 1, 3), torch.float32, True), ((0, 7), (7, 1), torch.float32, False)]
    seen = []
    steps = [(lambda *args: seen.append(args), [(record_replay.SCRATCH, 2), (record_replay.ROLE, 0),
                                                (record_replay.CONST, 0.5), (record_replay.SCRATCH, 0)]),
             (lambda *args: seen.append(args), [(record_replay.SCRATCH, 1)]),
             (lambda *args: seen.append(args), [(record_replay.CONST, "x")])]
    q = torch.randn(2)
    record_replay.Replay(steps, scratch)((q,), poison=float("nan"))
    (b2, role, half, b0), (b1,), (const,) = seen
    assert role is q and half == 0.5 and const == "x"
    assert [(tuple(b.shape), b.stride(), b.dtype) for b in (b0, b1, b2)] == [s[:3] for s in scratch[:3]]
    assert b0.isnan().all() and not b1.any() and not b2.any()
    base = b0.untyped_storage().data_ptr()
    assert all(b.untyped_storage().data_ptr() == base for b in (b1, b2))
    starts = sorted((b.data_ptr() - base, b) for b in (b0, b1, b2))
    assert [offset % 512 for offset, _ in starts] == [0, 0, 0]
    for (offset, b), (next_offset, _) in zip(starts, starts[1:]):
        assert offset + b.numel() * b.element_size() <= next_offset
    assert starts[-1][1] is b0  # the zeroed buffers first, side by side


def test_a_replay_outside_a_check_reuses_one_kept_allocation_and_clears_its_zeroed_buffers(monkeypatch):
    """Steady-state replays make no tensor but the zero fill: the buffers are views of an allocation kept per
    device and stream, grown for a larger arena (whose views are then made again); a check's replay (poison
    given) gets a fresh allocation of its own."""
    monkeypatch.setattr(record_replay, "_KEPT", {})  # this process's other replays may have grown it
    seen = []

    def dirty(zeroed, other):  # a kernel that leaves garbage in both buffers
        seen.append((zeroed.clone(), zeroed.untyped_storage().data_ptr()))
        zeroed.fill_(7.0)
        other.fill_(9.0)

    small = record_replay.Replay([(dirty, [(record_replay.SCRATCH, 0), (record_replay.SCRATCH, 1)])],
                                 [((4,), (1,), torch.float32, True), ((8,), (1,), torch.float32, False)])
    big = record_replay.Replay([(dirty, [(record_replay.SCRATCH, 0), (record_replay.SCRATCH, 1)])],
                               [((64,), (1,), torch.float32, True), ((1024,), (1,), torch.float32, False)])
    q = torch.randn(2)
    small((q,))
    small((q,))
    (first, ptr1), (second, ptr2) = seen
    assert ptr1 == ptr2 and not first.any() and not second.any()  # kept, and cleared though the kernel dirtied it
    big((q,))
    small((q,))
    assert seen[2][1] == seen[3][1] != ptr1 and not seen[3][0].any()  # grown once, the small one's views remade
    small((q,), poison=float("nan"))
    assert seen[4][1] != seen[3][1] and not seen[4][0].any()


@pytest.mark.parametrize("current, stream, keeps, why", [
    (0, 0, True, "the current device's default stream"),
    (0, 1234, False, "another stream: a capture, or cudagraph trees' warm-up allocating into the graph's pool"),
    (1, 0, False, "another device than the current one"),
])
def test_a_cuda_replay_keeps_its_scratch_only_on_the_current_devices_default_stream(monkeypatch, current, stream,
                                                                                  keeps, why):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(record_replay, "current_raw_stream", lambda index: stream)
    assert record_replay._may_keep(torch.device("cuda", 0)) is keeps, why


def test_kept_scratch_first_made_in_inference_mode_serves_calls_outside_it_and_large_arenas_are_not_kept(
        monkeypatch):
    """Views made inside ``torch.inference_mode`` would be inference tensors, which a call outside it could not
    touch; an arena above KEEP_AT_MOST allocates per call, so a process keeps no gigabytes for good."""
    monkeypatch.setattr(record_replay, "_KEPT", {})
    seen = []

    def touch(buf):
        buf.add_(1.0)  # an in-place torch op on the buffer, as a kernel written in torch would do
        seen.append(buf.untyped_storage().data_ptr())

    replay = record_replay.Replay([(touch, [(record_replay.SCRATCH, 0)])], [((16,), (1,), torch.float32, True)])
    q = torch.randn(2)
    with torch.inference_mode():
        replay((q,))
    replay((q,))
    assert seen[0] == seen[1]
    assert record_replay.kept_bytes(q.device) == 512 and record_replay.kept_bytes(torch.device("meta")) == 0
    assert record_replay.served_bytes(q.device, reset=True) == 512 and record_replay.served_bytes(q.device) == 0
    monkeypatch.setattr(record_replay, "KEEP_AT_MOST", 32)  # below this arena's 512 bytes
    replay((q,))
    assert seen[2] != seen[1]


class _FfiFunction:
    """Stands in for tvm_ffi.Function (a Cython class of tvm_ffi.core): calling it is the kernel call."""

    def __init__(self, log):
        self.log = log

    def __call__(self, *args):
        self.log.append(("ffi", args))

    def __chandle__(self):
        return 1


_FfiFunction.__module__, _FfiFunction.__name__ = "tvm_ffi.core", "Function"


def _wrapper(names: str, target, unpack: bool = False):
    """tvm-ffi's generated kwargs wrapper for ``names`` (a default, keyword-only ones), as make_kwargs_wrapper
    writes it: defaults are filled, a dataclass argument unpacked through ``__i_unpack``."""
    body = "__i_unpack(a), b" if unpack else "a, b"
    space = {"__i_target_func": target, "__i_unpack": lambda x: x}
    exec(f"def wrapper({names}):\n    return __i_target_func({body})", space)
    return space["wrapper"]


class _WithKwargs:
    """Stands in for TVMFFIJitCompiledFunctionWithKwargs: its call goes through the wrapper to the function."""

    def __init__(self, log, args_spec, names: str, unpack: bool):
        self.log, self.execution_args, self.raw = log, args_spec, _FfiFunction(log)
        self._kwargs_wrapper = _wrapper(names, self.raw, unpack)

    def __call__(self, *args):
        self.log.append(("python", args))
        return self._kwargs_wrapper(*args)

    def __tvm_ffi_object__(self):
        return self.raw


@pytest.mark.parametrize("kind, num_args, direct", [
    ("positional", 2, True),
    ("kwargs", 2, True),
    ("kwargs_with_a_default_left_out", 1, False),
    ("kwargs_with_a_default_given", 2, True),
    ("kwargs_keyword_only", 2, False),
    ("kwargs_unpacking_a_dataclass", 2, False),
    ("pointer_address_args", 2, False),
    ("plain_callable", 2, False),
])
def test_replayed_kernels_are_called_through_their_tvm_ffi_function_where_that_is_all_their_call_does(
        kind, num_args, direct):
    """CuTe DSL's compiled objects (tvm_ffi_provider.py, 4.8) reach their tvm-ffi function through Python frames
    per call; a replay calls that function itself, unless the object's own call would do more with the
    recorded arguments (fill defaults, unpack a dataclass, convert pointer addresses)."""
    log = []
    args_spec = types.SimpleNamespace(has_pointer_address_arg_specs=kind == "pointer_address_args")
    if kind in ("positional", "pointer_address_args"):
        class Compiled(_FfiFunction):
            execution_args = args_spec

            def __call__(self, *args):
                log.append(("python", args))
                super().__call__(*args)

        fn = Compiled(log)
    elif kind == "plain_callable":
        fn = lambda *args: log.extend([("python", args), ("ffi", args)])  # noqa: E731
    else:
        names = {"kwargs_with_a_default_left_out": "a, b=3", "kwargs_with_a_default_given": "a, b=3",
                 "kwargs_keyword_only": "a, b, *, c=None"}.get(kind, "a, b")
        fn = _WithKwargs(log, args_spec, names, unpack="dataclass" in kind)
    values = tuple(torch.full((1,), float(i)) for i in range(num_args))
    record_replay.Replay([(fn, [(record_replay.ROLE, i) for i in range(num_args)])], [])(values)
    assert [where for where, _ in log] == (["ffi"] if direct else ["python", "ffi"])
    assert all(a is b for a, b in zip(log[-1][1], values))
