#!/usr/bin/env bash
# The checks that need a GPU, on one GPU, inside one budget (default 9 minutes of wall clock,
# counted from here), each part in a process of its own under its own timeout
# (tools/gpu_check.py). In order of what they decide (docs/performance.md says which part answers
# which prediction):
#   build  the C++ extension, in place, for this Python (first: data/ needs it)
#   env    versions and the GPU
#   t1     the CUDA tests of the newest features (tests/gpu)   t1c  the compiled-varlen one
#   a      varlen vs sdpa in bf16, fwd+bwd   b      grouped_mm vs the per-expert loop, fwd+bwd
#   t2     the older CUDA tests (tests/gpu)
#   c      one MoE layer: syncs, MFU, peak
#   j      EP2 all-to-all, plain vs --overlap-moe-expert-parallel-comm: two ranks on the one GPU over
#          gloo (the mechanism, not NVLink's numbers), step and exposed all-to-all vs the planner
#   d      head + MTP depths at T 8192: peak memory
#   e      Newton-Schulz on an EP8 stack     h, h100  one-GPU proxies of the 8 x H200 / H100 recipes' ranks
#   i      CP attention: varlen q != k boundaries, 128K shard
#   f1/f2  1-GPU --bf16 training, eager / --compile          g  bench_gpu.py
# A part starts only when the budget holds its timeout; else it is "not run: budget". OUT (default
# runs/gpu_check) receives three files: results.json, summary.txt (the table the console ends
# with) and logs.tar.gz. Exits 2, saying so, where CUDA is absent (nothing run), 1 if any part
# failed, hung or was not run, else 0.
#   bash tools/gpu_check.sh [--out DIR] [--budget 540] [--model-preset PRESET] [--only a,b] [--bench-args "--compile"]
set -uo pipefail
GPU_CHECK_T0=$(date +%s.%N)
export GPU_CHECK_T0
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ -z "${GPU_CHECK_FAKE_PARTS:-}" ] && \
   ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing run" >&2
    exit 2
fi
exec "$PYTHON" tools/gpu_check.py "$@"
