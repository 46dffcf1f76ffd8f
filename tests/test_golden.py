# ruff: noqa: E501  (the cache explain golden is the command's output verbatim: its table is 122+ columns)
"""Golden tests of what users and reviewers read, with expecttest (as PyTorch tests the code Inductor
generates): the wrapper code of a compiled call decided at compile time, the post-grad graph of a Triton
plan, ``cache explain``, and the candidate list with its pruned reasons on a simulated H100 and B200.
All on the CPU.

After an intended change, regenerate the expected strings and review the diff like code:
``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden.py``.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from unittest import mock

import expecttest
import torch
from fakes import FakeBackend, FakeTimer
from test_fa4 import fake_fa4
from torch._inductor.utils import run_and_get_code

import inductor_attn
from inductor_attn.backends import REFERENCE, enumerate_candidates, fa4, only_backends
from inductor_attn.cli import main
from inductor_attn.device import parse_device_override
from inductor_attn.problem import Problem
from inductor_attn.tuning import measure, tuner

WIDTH = 120


def wrap(text: str, width: int = WIDTH) -> str:
    """Lines longer than ``width`` broken after a comma or a space, continuation lines indented four more
    spaces (a golden is read, not run: generated code has lines of a thousand characters).

    >>> print(wrap("f(a, b, c)", width=6))
    f(a,
        b,
        c)
    """
    out = []
    for line in text.splitlines():
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        current = ""
        for piece in re.split(r"(?<=[, ])(?=\S)", line):
            if current.strip() and len(current) + len(piece) > width:
                out.append(current.rstrip())
                current = indent + piece.lstrip()
            else:
                current += piece
        out.append(current.rstrip())
    return "\n".join(out)


def launches(code: str) -> str:
    """What the generated wrapper's ``call()`` launches, in order: each op of torch.ops in full, each
    generated or extern kernel by name (its arguments are Inductor's business), and the return. Size
    checks, allocations, dels and comments are left out, and buffers are renumbered in order of
    appearance."""
    body = re.search(r"def call\((?:self, )?args\):\n(.*?\n\s*return [^\n]*)", code, re.S).group(1)
    kept = []
    for line in (s.strip() for s in body.splitlines()):
        call = re.match(r"^(?:\w+ = )?([\w.]+)\(", line)
        if line.startswith("return "):
            kept.append(line)
        elif call and call.group(1).startswith("torch.ops."):
            kept.append(line)
        elif call and not re.match(r"(assert_size_stride|empty_strided\w*|reinterpret_tensor|args\.clear)$",
                                   call.group(1)):
            kept.append(f"{call.group(1)}(...)")
    numbers = {}
    renumbered = re.sub(r"\bbuf(\d+)\b", lambda m: f"buf{numbers.setdefault(m.group(1), len(numbers))}",
                        "\n".join(kept))
    return wrap(renumbered)


def _fake_clock():
    """A perf_counter (and thread CPU clock, which host times read) that advances 10 ms per reading: first-call
    and host times become exact."""
    ticks = itertools.count()

    def reading():
        return next(ticks) * 1e-2

    return types.SimpleNamespace(perf_counter=reading, thread_time=reading)


class GoldenTest(expecttest.TestCase):
    def setUp(self):
        self.scope = contextlib.ExitStack()
        self.addCleanup(self.scope.close)
        self.addCleanup(torch._dynamo.reset)
        torch._dynamo.reset()

    def _fakes(self, traceable: bool, times=((1.0, 0.0), (0.5, 0.0))):
        a = FakeBackend("a", {"default": times[0]}, traceable=traceable)
        b = FakeBackend("b", {"x=1": times[1]}, traceable=traceable)
        self.scope.enter_context(mock.patch.object(tuner, "default_timer", lambda device_type: FakeTimer([a, b])))
        self.scope.enter_context(only_backends(a, b, REFERENCE))
        self.scope.enter_context(inductor_attn.tuning_mode("autotune"))
        return a, b

    def _compiled_code(self) -> str:
        q, k, v = (torch.randn(1, h, 24, 16) for h in (4, 2, 2))
        fn = torch.compile(lambda q, k, v: inductor_attn.attention(q, k, v, causal=True), fullgraph=True)
        _, (code,) = run_and_get_code(fn, q, k, v)
        return code

    # ------------------------------------------------------------------------------ generated code
    def test_a_plan_that_cannot_be_traced_is_launched_through_the_thin_op_with_its_choice_baked(self):
        self._fakes(traceable=False)
        self.assertExpectedInline(launches(self._compiled_code()), """\
buf0 = torch.ops.inductor_attn.launch.default([arg0_1, arg1_1, arg2_1, None, None], 'forward|b:x=1|0.25|op=attention,
    dtype=float32,device_type=cpu,batch=1,heads_q=4,heads_kv=2,len_q=24,len_k=24,head_dim=16,head_dim_v=16,causal=True,
    window_left=-1,window_right=-1,has_kv_seqlens=False,has_key_mask=False,total_q=0,total_k=0,block_q=0,block_kv=0,
    density=1.0,partial_fraction=0.0')
return (buf1, )""")

    def test_a_traceable_plan_is_compiled_into_the_wrapper_and_no_op_of_ours_runs(self):
        self._fakes(traceable=True)
        self.assertExpectedInline(launches(self._compiled_code()), """\
extern_kernels.bmm(...)
cpp_fused_0(...)
extern_kernels.bmm(...)
cpp_fused_1(...)
return (reinterpret_tensor(buf0, (1, 4, 24, 16), (1536, 384, 16, 1), 0), )""")

    def test_the_pass_puts_a_triton_plans_kernel_launch_into_the_graph(self):
        # Triton plans are traced only without TRITON_INTERPRET (the interpreter runs kernels as Python),
        # so in a process of its own; Triton's target is a simulated sm_90, which torch's analysis of what
        # the kernel writes compiles it for, as on an H100 (no GPU, no driver needed)
        script = textwrap.dedent("""
            import torch, triton
            from torch.fx.experimental.proxy_tensor import make_fx
            from triton.backends.compiler import GPUTarget
            from inductor_attn.lowering.emit import emit_plans

            class Sm90:
                def get_current_target(self):
                    return GPUTarget("cuda", 90, 32)

            triton.runtime.driver.set_active(Sm90())
            choice = "triton:block_m=64,block_n=64,num_stages=3,num_warps=4,schedule=tile,tma=False"

            def attend(q, k, v):
                return torch.ops.inductor_attn.attention(q, k, v, 0.125, True, -1, -1, None, None, choice)[0]

            q, k, v = (torch.randn(1, h, 128, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
            gm = make_fx(attend, tracing_mode="fake")(q, k, v)
            emit_plans(gm.graph)
            gm.recompile()
            print(gm.code)
        """)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        root = Path(__file__).resolve().parents[1]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        code = re.sub(r"(kernel_idx|constant_args_idx) = \d+", r"\1 = N", proc.stdout.strip())
        self.assertExpectedInline(wrap(code), """\
def forward(self, q_1, k_1, v_1):
    empty = torch.ops.aten.empty.memory_format([1, 4, 128, 64], dtype = torch.bfloat16, device = device(type='cpu'),
        pin_memory = False)
    empty_1 = torch.ops.aten.empty.memory_format([1, 4, 128], dtype = torch.float32, device = device(type='cpu'),
        pin_memory = False)
    triton_kernel_wrapper_functional_proxy = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = N,
        constant_args_idx = N, grid = [(8, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'Q': q_1, 'K': k_1, 'V':
        v_1, 'O': empty, 'LSE': empty_1, 'KV_LENS': q_1, 'CU_Q': q_1, 'CU_K': q_1, 'FULL_CNT': q_1, 'FULL_IDX': q_1,
        'PART_CNT': q_1, 'PART_IDX': q_1, 'BITS': q_1, 'TILES': q_1, 'sq_b': 32768, 'sq_h': 8192, 'sq_m': 64, 'sq_d':
        1, 'sk_b': 16384, 'sk_h': 8192, 'sk_n': 64, 'sk_d': 1, 'sv_b': 16384, 'sv_h': 8192, 'sv_n': 64, 'sv_d': 1,
        'so_b': 32768, 'so_h': 8192, 'so_m': 64, 'so_d': 1, 'sl_b': 512, 'sl_h': 128, 'sl_m': 1, 'sfc_b': 0, 'sfc_h':
        0, 'sfc_m': 0, 'sfi_b': 0, 'sfi_h': 0, 'sfi_m': 0, 'sfi_s': 0, 'spc_b': 0, 'spc_h': 0, 'spc_m': 0, 'spi_b': 0,
        'spi_h': 0, 'spi_m': 0, 'spi_s': 0, 'sbt_b': 0, 'sbt_h': 0, 'sbt_m': 0, 'sbt_s': 0, 'sbt_r': 0, 'sbt_w': 0,
        'st_b': 0, 'st_h': 0, 'st_m': 0, 'len_q': 128, 'len_k': 128, 'qk_scale': 0.18033688011112042, 'window_left':
        -1, 'window_right': 0, 'heads_prog': 2, 'num_m': 4, 'num_bh': 2, 'num_tiles': 8, 'lpt_heads': 1024, 'GROUP': 2,
        'PACK': 2, 'BLOCK_M': 64, 'BLOCK_N': 64, 'BLOCK_D': 64, 'BLOCK_DV': 64, 'D': 64, 'DV': 64, 'MODE': 0,
        'SCHEDULE': 0, 'HAS_LEFT': False, 'HAS_RIGHT': True, 'HAS_KV_LENS': False, 'HAS_FULL': False, 'BLOCK_Q': 64,
        'BLOCK_KV': 64, 'EVEN_N': True, 'TILE_LIST': False, 'TMA': False, 'DOT_PREC': 'tf32'}, tensors_to_clone = ['O',
        'LSE']);  q_1 = k_1 = v_1 = empty = empty_1 = None
    getitem_2 = triton_kernel_wrapper_functional_proxy['O']
    getitem_3 = triton_kernel_wrapper_functional_proxy['LSE'];  triton_kernel_wrapper_functional_proxy = getitem_3 =
        None
    return getitem_2""")

    # ----------------------------------------------------------------------------- cache explain
    def test_cache_explain_shows_every_candidate_with_its_time_ci_error_and_reason(self):
        # b:x=1 is twice as fast as a, but its launch costs 2 ms of host and a's none: compiled code runs b in
        # device-bound graphs and a in host-bound ones; b:x=2 is wrong and b:x=3 fails to launch
        a = FakeBackend("a", {"default": (1.0, 0.0)}, traceable=True)
        b = FakeBackend("b", {"x=1": (0.5, 0.0), "x=2": (0.4, 0.0), "x=3": (0.1, 0.0)}, wrong={"x=2"}, fail={"x=3"},
                        host_s=0.002)
        self.scope.enter_context(mock.patch.object(tuner, "default_timer", lambda device_type: FakeTimer([a, b])))
        self.scope.enter_context(mock.patch.object(measure, "time", _fake_clock()))
        self.scope.enter_context(mock.patch.object(tuner, "time", _fake_clock()))
        self.scope.enter_context(only_backends(a, b))
        self.scope.enter_context(inductor_attn.tuning_mode("autotune"))
        q, k, v = (torch.randn(1, h, 24, 16) for h in (4, 2, 2))
        inductor_attn.attention(q, k, v, causal=True)
        (row,) = inductor_attn.cache.list_decisions()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(main(["cache", "explain", row["key"][:12]]), 0)
        text = out.getvalue().replace(row["key"][:16], "<key>")
        text = re.sub(r"(?m)^(  device:\s+).*$", r"\1<this CPU>", text)
        text = re.sub(r"(?m)^(  versions:\s+).*$", r"\1<installed versions>", text)
        text = re.sub(r"tuned here \(.*\)", "tuned here (<date>)", text)
        self.assertExpectedInline("\n".join(line.rstrip() for line in text.splitlines()), """\
decision <key>  attention/forward
  came from:        tuned here (<date>)
  problem (bucket): attention float32 B1 H4/2 L32x32 D16 causal
  measured on:      attention float32 B1 H4/2 L24x24 D16 causal  (fake timer)
  device:           <this CPU>
  versions:         <installed versions>
  winner:           b:x=1  (default a:default)
  why:              2.000x faster than the default a:default (95% CI 2.000-2.000; tie margin 2.0%)
  compiled code:    under CUDA graphs: b:x=1 (device time only)
                    plain launches, H - D < 0.087 ms: b:x=1
                    plain launches, H - D >= 0.087 ms: a:default
  search:           staged (margin 1.25x)
  noise:            not measured: the two fastest are 2.000x apart (> 1.10x): not timed again
  seconds:          compile 0.02, gate 0.02, timing 0.02, host 0.01, total 0.15

  candidate                                    status    median ms  speedup          95% CI  rel.err 1st call s  host ms  reason
  a:default                                    passed       1.0000    1.000     1.000-1.000  0.0e+00       0.01   0.0000
* b:x=1                                        passed       0.5000    2.000     2.000-2.000  0.0e+00       0.01   2.0300  host: its launch path's median + the launch op's cost in a graph; its own probe 2.0000 ms
  b:x=2                                        wrong                                         1.9e+00       0.01           output rel. error 1.94e+00 > 1e-04
  b:x=3                                        failed                                                                     RuntimeError: CUDA error: launch failed (simulated)""")

    # -------------------------------------------------------------------------------- candidates
    def _candidates(self, arch: str) -> str:
        # lower-right causal (Lq < Lk): SDPA's kernel choice for an unmasked problem asks the real GPU
        p = Problem("attention", "bfloat16", "cuda", batch=2, heads_q=16, heads_kv=4, len_q=1024, len_k=4096,
                    head_dim=128, head_dim_v=128, causal=True)
        cands = enumerate_candidates(p, parse_device_override(arch))
        return wrap("\n".join(f"{c.name}  [pruned: {c.pruned}]" if c.pruned else c.name for c in cands))

    def test_candidates_and_pruned_reasons_on_a_simulated_h100(self):
        self.scope.enter_context(mock.patch.object(fa4.loading, "load", lambda: fake_fa4()))  # FA4 "installed"
        self.assertExpectedInline(self._candidates("sm_90"), """\
sdpa:kernel=efficient
sdpa:kernel=cudnn
sdpa:kernel=flash  [pruned: SDPA flash takes no mask: lower-right causal (Lq != Lk), windows and key_mask need one]
flex:-  [pruned: unmasked and plain causal attention are covered by sdpa, fa4 and triton at less tuning cost]
fa3:-  [pruned: tokenspeed-fa3 not installed (pip install 'inductor-attn[fa3]')]
fa4:default
fa4:mma_pv_is_rs=False
fa4:intra_wg_overlap=False
fa4:tile_mn=128x176
fa4:mma_pv_is_rs=False,tile_mn=192x128
fa4:intra_wg_overlap=False,tile_mn=192x128
fa4:mma_pv_is_rs=False,tile_mn=128x176  [pruned: tile_mn=128x176 with mma_pv_is_rs=False failed to launch at head_dim
    128 (CUDA_LAUNCH_INVALID_CONFIG, H200, 2026-11-22)]
fa4:pack_gqa=False
fa4:clc=True,num_splits=1  [pruned: CLC needs sm_100]
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=True,schedule=tile,tma=True
triton:block_m=128,block_n=128,num_stages=2,num_warps=8,pack_gqa=True,schedule=tile,tma=True
triton:block_m=64,block_n=64,num_stages=3,num_warps=4,pack_gqa=True,schedule=tile,tma=True
triton:block_m=128,block_n=32,num_stages=4,num_warps=8,pack_gqa=True,schedule=tile,tma=True
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=True,schedule=persistent,tma=True
triton:block_m=64,block_n=64,num_stages=3,num_warps=4,pack_gqa=True,schedule=persistent,tma=True
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=True,schedule=lpt,tma=True
triton:block_m=64,block_n=64,num_stages=3,num_warps=4,pack_gqa=True,schedule=lpt,tma=True
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=True,schedule=tile,tma=False
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=True,schedule=persistent,tma=False
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=False,schedule=tile,tma=True
triton_decode:-  [pruned: split-K decode is for Lq <= 16, got 1024]
reference:default""")

    def test_candidates_and_pruned_reasons_on_a_simulated_b200(self):
        self.scope.enter_context(mock.patch.object(fa4.loading, "load", lambda: fake_fa4()))  # FA4 "installed"
        self.assertExpectedInline(self._candidates("sm_100"), """\
sdpa:kernel=efficient
sdpa:kernel=cudnn
sdpa:kernel=flash  [pruned: SDPA flash takes no mask: lower-right causal (Lq != Lk), windows and key_mask need one]
flex:-  [pruned: unmasked and plain causal attention are covered by sdpa, fa4 and triton at less tuning cost]
fa3:-  [pruned: tokenspeed-fa3 is built for sm_90a only, got sm_100]
fa4:clc=False,num_splits=1
fa4:clc=True,num_splits=1
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=True,schedule=tile,tma=True
triton:block_m=128,block_n=128,num_stages=2,num_warps=8,pack_gqa=True,schedule=tile,tma=True
triton:block_m=64,block_n=64,num_stages=3,num_warps=4,pack_gqa=True,schedule=tile,tma=True
triton:block_m=128,block_n=32,num_stages=4,num_warps=8,pack_gqa=True,schedule=tile,tma=True
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=True,schedule=persistent,tma=True
triton:block_m=64,block_n=64,num_stages=3,num_warps=4,pack_gqa=True,schedule=persistent,tma=True
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=True,schedule=lpt,tma=True
triton:block_m=64,block_n=64,num_stages=3,num_warps=4,pack_gqa=True,schedule=lpt,tma=True
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=True,schedule=tile,tma=False
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=True,schedule=persistent,tma=False
triton:block_m=128,block_n=64,num_stages=3,num_warps=8,pack_gqa=False,schedule=tile,tma=True
triton_decode:-  [pruned: split-K decode is for Lq <= 16, got 1024]
reference:default""")

    def test_without_flash_attn_4_its_entry_says_it_is_not_installed(self):
        self.scope.enter_context(mock.patch.object(fa4.loading, "load", lambda: "flash-attn-4 not installed"))
        self.scope.enter_context(only_backends(fa4.BACKEND))
        self.assertExpectedInline(self._candidates("sm_90") + "\n" + self._candidates("sm_100"), """\
fa4:-  [pruned: flash-attn-4 not installed]
fa4:-  [pruned: flash-attn-4 not installed]""")
