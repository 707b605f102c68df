#!/usr/bin/env bash
# Step-3.7-Flash text SFT on two nodes of 8 GPUs (16 ranks), for users who outgrow one node: the
# same model, data, batch (32 packs of 8,192 tokens) and optimizer as
# examples/step37_flash_8xh200_thd_sft.sh, at the layout the planner's search ranks first for 16
# GPUs of each kind (docs/memory.md, "Two nodes"):
#   python tools/plan_memory.py --search --world-size 16 [--device-gb 80] --model-preset step37-flash \
#       --seq-length 8192 --global-batch-size 32 --bf16 --optimizer muon --muon-momentum 0
#
# H200 (141 GB, the default): EP8 inside each node, DP16, --cpu-offload masters with the optimizer
#   in the backward, 2 packs per rank. Predicted (not measured): 115.4 GB per GPU, 609 GB of host
#   memory per node, 9.2 s per step, 1,777 tokens/s per GPU, MFU 16.3%.
# H100 (80 GB, GPU=H100): the same without --fsdp-gather-once. Predicted: 52.6 GB per GPU, 609 GB
#   of host memory per node, 10.0 s per step, 1,633 tokens/s per GPU, MFU 15.0%.
# (assumed: 40% of peak for the maths, NVLink 150 GB/s inside a node, 50 GB/s per GPU between
# nodes, pinned PCIe 35 GB/s, host memory 52 GB/s per rank.) Two nodes halve each rank's share of
# the batch, so the per-GPU rate is lower than one node's; the step is faster.
#
# Run the same command on both nodes; torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT
# (a host both nodes reach, e.g. the first node) assigns the node ranks:
#   MASTER_ADDR=node0 bash examples/step37_flash_2node_thd_sft.sh /data/Step-3.7-Flash /data/sft_text_document /out
#   GPU=H100 MASTER_ADDR=node0 bash examples/step37_flash_2node_thd_sft.sh ...
# HF_DIR, DATA_PREFIX and OUT_DIR must be the same paths on both nodes (a shared file system:
# checkpoints are written by every rank into OUT_DIR/checkpoints).
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: step37_flash_2node_thd_sft.sh HF_DIR DATA_PREFIX OUT_DIR (env: MASTER_ADDR, GPU=H200|H100)}
DATA=${2:?}
OUT=${3:?}
: "${MASTER_ADDR:?set MASTER_ADDR to a host both nodes reach (the rendezvous)}"
case "${GPU:-H200}" in
    H200) ONCE=--fsdp-gather-once ;;
    H100) ONCE= ;;
    *) echo "step37_flash_2node_thd_sft.sh: GPU must be H200 or H100, got ${GPU}" >&2; exit 2 ;;
esac
# shellcheck disable=SC2086  # ONCE is one flag or none
torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-step37-sft}" pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --pipeline-model-parallel-size 1 --expert-model-parallel-size 8 \
    --bf16 --data-parallel-sharding fsdp --cpu-offload masters $ONCE --optimizer-in-backward \
    --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 2 --global-batch-size 32 --long-docs truncate \
    --optimizer muon --muon-momentum 0 --lr 2e-4 --adamw-lr 1e-5 --min-lr 2e-5 \
    --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
