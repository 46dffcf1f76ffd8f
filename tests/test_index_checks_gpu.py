"""Each row of issue 19's table (tests/test_index_checks.py ROWS) stops a call on a CUDA device: eagerly with the
ValueError, compiled (fullgraph) with a device-side assert whose message names the argument, on every backend
that runs the call there.

A device-side assert leaves the CUDA context unusable, so each compiled case runs in its own process: this file
run as ``python tests/test_index_checks_gpu.py ROW BACKEND``. Run on the device machine:
``python -m pytest -q -m gpu tests/test_index_checks_gpu.py``; the cost of the checks there:
``python tests/test_index_checks.py --device cuda``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from test_index_checks import CALLS, ROWS, make_inputs

from inductor_attn.backends import AttnCall, backends, enumerate_candidates, get_backend, only_backends
from inductor_attn.device import device_info
from inductor_attn.tuning.modes import tuning_mode

pytestmark = pytest.mark.gpu
GPU_INPUTS = dict(device="cuda", dtype=torch.bfloat16, head_dim=64)


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_eager_call_on_cuda_refuses_the_bad_index_value_with_a_value_error(row):
    with pytest.raises(ValueError, match=row.eager):
        CALLS[row.op](*make_inputs(row.op, row.index_args, **GPU_INPUTS))


@pytest.mark.parametrize("backend", [b.name for b in backends()])
@pytest.mark.parametrize("row", ROWS, ids=ROWS.keys())
def test_compiled_call_on_cuda_stops_at_a_device_side_assert_naming_the_argument(row, backend, tmp_path):
    op = ROWS[row].op
    q, k, v, *index = make_inputs(op, {}, **GPU_INPUTS)
    call = (AttnCall("attention", q, k, v, 0.125, kv_seqlens=index[0]) if op == "dense" else
            AttnCall("varlen", q, k, v, 0.125, cu_seqlens_q=index[0], cu_seqlens_k=index[1], max_seqlen_q=index[2],
                     max_seqlen_k=index[3]))
    pruned = [c.pruned for c in enumerate_candidates(call.problem, device_info(q.device)) if c.backend == backend]
    if all(pruned):
        pytest.skip(f"{backend} does not run this {op} call: {pruned[0] if pruned else 'no candidate'}")
    # the child runs this file as a script, so its path starts at tests/: the package comes from the repo root
    # where it is not installed (the GPU machine's checkout)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = os.environ | {"INDUCTOR_ATTN_CACHE_DIR": str(tmp_path),
                        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, __file__, row, backend], capture_output=True, text=True, env=env,
                          timeout=600)
    output = done.stdout + done.stderr
    assert "valid call ran" in done.stdout, output
    assert "bad call returned" not in done.stdout, output
    assert done.returncode != 0, output
    assert "device-side assert" in output, output
    assert re.search(ROWS[row].compiled, output), output


def _run_case(row_name: str, backend: str) -> None:
    """Child process: compiled, on ``backend`` alone, the valid call runs; the row's call must not return."""
    row = ROWS[row_name]
    with only_backends(get_backend(backend)), tuning_mode("off"):
        fn = torch.compile(CALLS[row.op], fullgraph=True)
        fn(*make_inputs(row.op, {}, **GPU_INPUTS))
        torch.cuda.synchronize()
        print("valid call ran", flush=True)
        fn(*make_inputs(row.op, row.index_args, **GPU_INPUTS))
        torch.cuda.synchronize()
    print("bad call returned")


if __name__ == "__main__":
    _run_case(*sys.argv[1:3])
