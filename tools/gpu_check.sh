#!/usr/bin/env bash
# The checks that need a GPU, in one go: the GPU-only tests (tests/gpu: varlen flash attention vs
# SDPA in bf16, grouped_mm in bf16, --compile, a 1-GPU --bf16 training run of the tiny model),
# then benchmarks/bench_gpu.py at full width (two Step-3.7-Flash layers, ours vs transformers),
# then one table: each check passed / failed / skipped with its seconds, and the benchmark's rows.
# Exits 2, saying so, where CUDA is absent; 1 if anything failed. Budget: 8 minutes on one H200
# (the tests stop after TESTS_TIMEOUT=300 s, the benchmark after BENCH_TIMEOUT=180 s).
#   bash tools/gpu_check.sh                       # BENCH_ARGS="--iters 20" passes flags on
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing run" >&2
    exit 2
fi
"$PYTHON" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__)"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

start=$(date +%s)
timeout "${TESTS_TIMEOUT:-240}" "$PYTHON" -m pytest -q -p no:cacheprovider --junitxml "$out/tests.xml" tests/gpu
tests_rc=$?
tests_s=$(( $(date +%s) - start ))

start=$(date +%s)
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
timeout "${BENCH_TIMEOUT:-240}" "$PYTHON" benchmarks/bench_gpu.py --json "$out/bench.json" ${BENCH_ARGS:---compile}
bench_rc=$?
bench_s=$(( $(date +%s) - start ))

"$PYTHON" tools/gpu_check_report.py --junit "$out/tests.xml" --tests-rc "$tests_rc" --tests-seconds "$tests_s" \
    --bench "$out/bench.json" --bench-rc "$bench_rc" --bench-seconds "$bench_s"
