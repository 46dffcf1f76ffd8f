"""SDPA's kernels as candidates on a GPU: every runnable config matches the reference (bf16/fp16)."""

import pytest
import torch

import inductor_attn
from inductor_attn.tuning.correctness import check_output

pytestmark = pytest.mark.gpu

CASES = [
    dict(b=2, hq=8, hkv=8, lq=256, lk=256, d=64, causal=False),
    dict(b=2, hq=8, hkv=8, lq=300, lk=300, d=128, causal=True),
    dict(b=2, hq=8, hkv=2, lq=128, lk=512, d=128, causal=True),  # GQA, lower-right causal
    dict(b=1, hq=16, hkv=4, lq=1, lk=1000, d=256, causal=False),  # decode
    dict(b=2, hq=8, hkv=8, lq=256, lk=256, d=64, causal=True, window=32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_runnable_sdpa_config_matches_the_reference(case, dtype):
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(case["b"], case["hq"], case["lq"], case["d"], device=dev, dtype=dtype)
    k = torch.randn(case["b"], case["hkv"], case["lk"], case["d"], device=dev, dtype=dtype)
    v = torch.randn(case["b"], case["hkv"], case["lk"], case["d"], device=dev, dtype=dtype)
    kwargs = dict(causal=case["causal"], window=case.get("window"))
    ref = inductor_attn.run_candidate("reference:default", q, k, v, return_lse=True, **kwargs)
    ran = 0
    for cand in inductor_attn.candidates(q, k, v, **kwargs):
        if cand.backend != "sdpa" or cand.pruned:
            continue
        out, lse = inductor_attn.run_candidate(cand, q, k, v, return_lse=True, **kwargs)
        assert check_output(out, lse, *ref, dtype) is None, cand.name
        ran += 1
    assert ran >= 1


@pytest.mark.parametrize("grad_layout", ["BHLD", "BLHD", "expanded"])
@pytest.mark.parametrize("out_layout", ["BHLD", "BLHD"])
@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
def test_every_sdpa_backward_kernel_matches_the_reference_whatever_the_layouts(kernel, out_layout, grad_layout):
    # the gate hands a candidate out and grad_out in one layout; a user's step may hand either in another (eagerly,
    # out.sum().backward() gives an expanded grad_out, all strides 0). The efficient kernel assumes out's row
    # stride (H * D): fed a (B, H, L, D)-contiguous out, it read wrong rows
    from inductor_attn.backends.base import AttnCall
    from inductor_attn.tuning.measure import Direction

    def laid_out(t, layout):
        if layout == "expanded":
            return t.new_full((), 0.5).expand(t.shape)
        return t.contiguous() if layout == "BHLD" else t.transpose(1, 2).contiguous().transpose(1, 2)

    torch.manual_seed(0)
    q = torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    call = AttnCall("attention", q, k, v, 128 ** -0.5, causal=True)
    direction = Direction("backward", call)
    out, lse, grad_out, _ = direction.grads
    direction.grads = direction.reference_grads = (laid_out(out, out_layout), lse, laid_out(grad_out, grad_layout),
                                                   None)
    got = direction.run(direction.plan(call, f"sdpa:kernel={kernel}"), call)
    reason, err = direction.check(got, direction.reference(call), torch.bfloat16)
    assert reason is None, (kernel, out_layout, grad_layout, err)


def test_the_cudnn_backward_stays_right_when_grad_outs_layout_changes_between_calls():
    """Stock eager SDPA on cuDNN (torch 2.11) gives a wrong dq for a grad_out laid out unlike the first call's in
    the same process (RESULTS.md, Findings): ours hands it q's layout every time."""
    from inductor_attn.backends.base import AttnCall
    from inductor_attn.tuning.measure import Direction

    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = AttnCall("attention", q, k, v, 128 ** -0.5, causal=True)
    direction = Direction("backward", call)
    out, lse, grad_out, _ = direction.grads
    plan = direction.plan(call, "sdpa:kernel=cudnn")
    want = direction.reference(call)
    for layout in ("BHLD", "BLHD", "BHLD", "BLHD"):
        g = grad_out.contiguous() if layout == "BHLD" else grad_out.transpose(1, 2).contiguous().transpose(1, 2)
        direction.grads = (out, lse, g, None)
        reason, err = direction.check(direction.run(plan, call), want, torch.bfloat16)
        assert reason is None, (layout, err)


@pytest.mark.parametrize("kernel", ["efficient", "cudnn"])
def test_a_row_whose_every_key_is_masked_gives_zero_out_minus_inf_lse_and_zero_grads(kernel):
    from inductor_attn.backends import AttnCall, Config, run_backend, run_backend_backward
    from inductor_attn.backends.sdpa import BACKEND as SDPA

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    key_mask = torch.ones(2, 64, dtype=torch.bool, device="cuda")
    key_mask[1] = False  # the second sequence has no key: a paged sequence of length 0 comes here so
    ref_out, ref_lse = inductor_attn.run_candidate("reference:default", q, k, v, key_mask=key_mask, return_lse=True)
    call = AttnCall("attention", q, k, v, 64 ** -0.5, key_mask=key_mask)
    out, lse = run_backend(SDPA, call, Config.of(kernel=kernel))
    assert check_output(out, lse, ref_out, ref_lse, torch.bfloat16) is None
    assert (lse[1] == float("-inf")).all() and (out[1] == 0).all()
    grads = run_backend_backward(SDPA, call, Config.of(kernel=kernel), out, lse, torch.randn_like(out), None)
    assert all(g.isfinite().all() for g in grads) and all((g[1] == 0).all() for g in grads[:1])
