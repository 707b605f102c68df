#!/usr/bin/env bash
# The checks that need a GPU, in one go: the GPU-only tests (varlen flash attention vs SDPA in
# bf16, grouped_mm in bf16, a 1-GPU --bf16 training run of the tiny model), then a summary line.
# Exits 2, saying so, where CUDA is absent.
#   bash tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing run" >&2
    exit 2
fi
"$PYTHON" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__)"
start=$(date +%s)
"$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu
rc=$?
echo "gpu_check: GPU tests $([ $rc -eq 0 ] && echo passed || echo FAILED) in $(( $(date +%s) - start )) s"
exit $rc
