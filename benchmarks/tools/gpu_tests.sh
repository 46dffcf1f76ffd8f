#!/usr/bin/env bash
# The GPU test suite on a device machine, logs and a JUnit file under $OUT (default: ./gpu-test-results).
# Usage, from the repository root: bash benchmarks/tools/gpu_tests.sh [half1 | half2] [pytest args, e.g. test files, -v]
# The whole suite takes longer than one 600 s device call (about 86% ran in 560 s on an H100): `half1` runs the
# FA4 and mask-sequence tests (the longest), `half2` everything else; run them in two calls.
# With the FA4 bundle: `source .devdeps/unpack.sh && bash benchmarks/tools/gpu_tests.sh`.
# Tests run in 10 worker processes (pytest-xdist; GPU_TEST_WORKERS sets another number): they check correctness,
# not speed, so they may share the GPU. On an H100 each half then fits a 600 s call (half1 374 s, half2 260 s).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu-test-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
      torch.cuda.get_device_name(), "x", torch.cuda.device_count())' | tee "$out/gpu_env.txt"
python -c 'import flash_attn.cute, importlib.metadata as m; print("flash-attn-4", m.version("flash-attn-4"))' \
  >> "$out/gpu_env.txt" 2>&1 || echo "flash-attn-4: not importable (FA4 tests skip)" >> "$out/gpu_env.txt"
# The package installed (no dependencies: the machine has them) so that its torch.compile backend name
# "inductor_attn" resolves through the entry point, as it does for users.
python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
ignore=()
python -c 'import expecttest' 2>/dev/null || ignore=(--ignore tests/test_golden.py)  # CPU-only golden tests
workers=()
python -c 'import xdist' 2>/dev/null && workers=(-n "${GPU_TEST_WORKERS:-10}")
args=("$@")
first_half=(tests/test_fa4_gpu.py tests/test_mask_sequence_gpu.py)
case "${1:-}" in
  "") args=(tests) ;;
  half1) args=("${first_half[@]}" "${@:2}") ;;
  half2) args=(tests "${first_half[@]/#/--ignore=}" "${@:2}") ;;
esac
python -m pytest -q -m "gpu and not multigpu" "${workers[@]}" -p no:cacheprovider --junitxml "$out/gpu_tests.xml" \
  "${ignore[@]}" "${args[@]}" 2>&1 | tee "$out/gpu_tests.log"
exit "${PIPESTATUS[0]}"
