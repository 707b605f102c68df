#!/usr/bin/env bash
# Long-context recipe: text SFT of Step-3.7-Flash at 131,072 tokens per pack on one node of
# 8 x H200 (141 GB): context parallel 4 (each pack split over 4 ranks: every document padded to
# a multiple of 8 and cut into 8 chunks, rank r holding chunks r and 7 - r), EP8 inside the node,
# data parallel 2, 2 packs per step (262,144 tokens, as the 8K recipe's 32 packs), Muon with
# momentum 0.
#
# The layout is the top row of the planner's search (docs/parallelism.md shows it):
#   python tools/plan_memory.py --search --world-size 8 --model-preset step37-flash \
#       --seq-length 131072 --global-batch-size 2 --bf16 --optimizer muon --muon-momentum 0
#
# Each rank holds 32,768 tokens of a pack, so its activations are the 8K recipe's 4 packs; full
# attention layers all-gather K and V over the CP group (reduce-scatter in the backward),
# sliding-window layers receive only their window - 1 keys of halo. Memory and optimizer as the
# 8K recipe (--cpu-offload masters, --optimizer-in-backward: examples/step37_flash_8xh200_thd_sft.sh).
# Predicted (not measured; no GPU has run this): 113.8 GB on each GPU, 152 GB of host memory per
# rank, 21.9 s per step, 1,499 tokens/s per GPU, MFU 24.7% (assumed: 40% MFU for the maths,
# NVLink 150 GB/s, pinned PCIe 35 GB/s, host memory 52 GB/s per rank; the K/V exchanges 0.10 s).
# Plan it with the same flags before you spend a node-hour:
#   python tools/plan_memory.py --world-size 8 <the flags below>
#
#   bash examples/step37_flash_8xh200_128k_cp_sft.sh /data/Step-3.7-Flash /data/sft_text_document /out
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: step37_flash_8xh200_128k_cp_sft.sh HF_DIR DATA_PREFIX OUT_DIR}
DATA=${2:?}
OUT=${3:?}
torchrun --nproc-per-node 8 pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --pipeline-model-parallel-size 1 --expert-model-parallel-size 8 --context-parallel-size 4 \
    --bf16 --data-parallel-sharding fsdp --cpu-offload masters --fsdp-gather-once --optimizer-in-backward \
    --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 131072 --micro-batch-size 1 --global-batch-size 2 --long-docs truncate \
    --optimizer muon --muon-momentum 0 --lr 2e-4 --adamw-lr 1e-5 --min-lr 2e-5 \
    --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
