#!/usr/bin/env bash
# Reference recipe: text SFT of Step-3.7-Flash on one node of 8 x H200 (141 GB), EP8 (no
# pipeline), packed THD rows of 8,192 tokens, Muon with momentum 0 for the matrices.
#
# The layout is the top row of the planner's search over every 8-GPU layout (2,016 of them,
# 37 fit; docs/memory.md shows the table and why this row):
#   python tools/plan_memory.py --search --world-size 8 --model-preset step37-flash \
#       --seq-length 8192 --global-batch-size 64 --bf16 --optimizer muon --muon-momentum 0
#
# Local batch is counted in packs: --global-batch-size 64 packs = 64 x 8,192 = 524,288 tokens
# per iteration; DP = 8 (EP8 inside it) and micro-batch 8 packs: one micro-batch of 65,536
# tokens per rank and step.
#
# Memory: --bf16 (bf16 compute over fp32 master weights and fp32 gradients); FSDP2 shards the
# dense weights over the 8 ranks, each rank holds 36 of the 288 experts whole;
# --cpu-offload experts keeps the experts' fp32 masters, gradients and optimizer state in host
# memory (copied to the GPU for the micro-batch's forward and again for its backward); Muon's
# Newton-Schulz runs on the GPU; full activation recompute (MTP depths included); the loss of
# the head and of each MTP depth is computed a tile at a time (no [T, vocab] logits, which is
# what lets 8 packs fit). Predicted (not measured; no GPU has run this): 112.2 GB on each GPU,
# 190 GB of host memory per rank (1.5 TB for the node), 63.4 s per step, 1,034 tokens/s per
# GPU, 9.5% MFU (assumed: 40% MFU for the maths, 25 GB/s PCIe, 20 GB/s of host memory per rank).
# Plan it with the same flags before you spend a node-hour:
#   python tools/plan_memory.py --world-size 8 <the flags below>
#
#   bash examples/step37_flash_8xh200_thd_sft.sh /data/Step-3.7-Flash /data/sft_text_document /out
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: step37_flash_8xh200_thd_sft.sh HF_DIR DATA_PREFIX OUT_DIR}
DATA=${2:?}
OUT=${3:?}
torchrun --nproc-per-node 8 pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --pipeline-model-parallel-size 1 --expert-model-parallel-size 8 \
    --bf16 --data-parallel-sharding fsdp --cpu-offload experts --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 8 --global-batch-size 64 --long-docs truncate \
    --optimizer muon --muon-momentum 0 --lr 2e-4 --adamw-lr 1e-5 --min-lr 2e-5 \
    --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
