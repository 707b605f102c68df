#!/usr/bin/env bash
# Tiny Step-3.7 model on CPU: 4 processes, PP2 x EP2, packed THD, Muon with momentum 0 (no
# optimizer state for the matrices). Trains on a dataset written by tools/preprocess_data.py
# with the byte tokenizer; flags after ITERS are passed on to pretrain_step37.py and win over
# the ones here (examples/quickstart.sh gives its tokenizer, --vocab-size and a validation split).
#   bash examples/train_tiny_cpu.sh DATA_PREFIX OUT_DIR [ITERS [PRETRAIN_FLAGS...]]
# (PYTHON: the interpreter to run, default python)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:?usage: train_tiny_cpu.sh DATA_PREFIX OUT_DIR [ITERS [PRETRAIN_FLAGS...]]}
OUT=${2:?usage: train_tiny_cpu.sh DATA_PREFIX OUT_DIR [ITERS [PRETRAIN_FLAGS...]]}
ITERS=${3:-300}
shift $(( $# < 3 ? $# : 3 ))
export OMP_NUM_THREADS=1
"${PYTHON:-python}" -m torch.distributed.run --nproc-per-node 4 --master-port "${MASTER_PORT:-29512}" \
    pretrain_step37.py \
    --model-preset tiny \
    --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 \
    --data-path "$DATA" --tokenizer-type byte \
    --seq-length 256 --micro-batch-size 1 --global-batch-size 8 \
    --optimizer muon --muon-momentum 0 --lr 0.02 --adamw-lr 0.003 \
    --lr-warmup-fraction 0.067 --lr-decay-style cosine --min-lr 0.002 --weight-decay 0.01 \
    --train-iters "$ITERS" --log-interval 20 \
    --log-dir "$OUT/tensorboard" --save "$OUT/checkpoints" --save-interval 100 --keep-last 2 \
    "$@"
