#!/usr/bin/env bash
# The checks that need a GPU, on one GPU, in under 8 minutes, each part in a process of its own
# under its own timeout (tools/gpu_check.py), so a part that hangs is reported as hung and the
# others still report. In order (docs/performance.md says what each measures):
#   build  the C++ extension, in place, for this Python (first: data/ needs it)
#   env    versions and the GPU
#   a      varlen vs sdpa in bf16, fwd+bwd   b      grouped_mm vs the per-expert loop, fwd+bwd
#   c      one MoE layer: syncs, MFU, peak   d      head + MTP depths at T 8192: peak memory
#   e      Newton-Schulz on an EP8 stack     i      CP attention: varlen q != k boundaries, 128K shard
#   h      one-GPU proxy of a recipe rank vs the planner
#   f1/f2  1-GPU --bf16 training, eager / --compile
#   g      bench_gpu.py                      tests  the other tests in tests/gpu
# Each part's output and JSON go to OUT (default runs/gpu_check), one line per finished part to
# OUT/results.jsonl; one table at the end. Exits 2, saying so, where CUDA is absent (nothing run),
# 1 if any part failed, hung or was not run, else 0.
#   bash tools/gpu_check.sh [--out DIR] [--model-preset PRESET] [--only a,b] [--bench-args "--compile"]
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ -z "${GPU_CHECK_FAKE_PARTS:-}" ] && \
   ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing run" >&2
    exit 2
fi
exec "$PYTHON" tools/gpu_check.py "$@"
