#!/usr/bin/env bash
# Reference recipe: text SFT of Step-3.7-Flash on one node of 8 x H200 (141 GB), EP8 (no
# pipeline), packed THD rows of 8,192 tokens, 32 packs per step, Muon with momentum 0.
#
# The layout is the top row of the planner's search over every 8-GPU layout (docs/memory.md
# shows the table and why this row):
#   python tools/plan_memory.py --search --world-size 8 --model-preset step37-flash \
#       --seq-length 8192 --global-batch-size 32 --bf16 --optimizer muon --muon-momentum 0 \
#       --overlap-moe-expert-parallel-comm
#
# Batch: --global-batch-size 32 packs = 262,144 tokens per iteration; DP = 8 (EP8 inside it) and
# micro-batch 4 packs: one micro-batch of 32,768 tokens per rank and step.
#
# Memory: the fp32 weights, gradients and Muon's split Newton-Schulz all on the GPU (FSDP shards
# the dense weights over the 8 ranks, each rank holds its 36 of the 288 experts whole: 99.7 GB);
# no CPU offload of weights. --optimizer-in-backward: each matrix steps as soon as its gradient is
# final (its Newton-Schulz on a CUDA stream of its own; a dense matrix by one of the 8 ranks,
# core/optim/muon_split.py) and its gradient is freed. Full recompute a pack at a time
# (--recompute-chunks 4: each layer's rerun and backward hold one pack's working set) with the
# layers' kept inputs in pinned host memory (--offload-recompute-inputs). The head's and each MTP
# depth's loss a tile at a time. --overlap-moe-expert-parallel-comm runs each micro-batch as two
# chunks of whole documents whose all-to-alls fly while the other chunk computes, forward and
# backward (docs/memory.md, "The Planner: Step Time"). Predicted (not measured; no GPU has run
# this): 122.3 GB on each GPU (19 GB to spare), 13 GB of host memory per rank (105 GB for the
# node), 13.2 s per step, 2,491 tokens/s per GPU, MFU 22.9%, of which 0.63 s all-to-all left
# exposed (assumed: 40% MFU for the maths, NVLink 150 GB/s, pinned PCIe 35 GB/s, host memory
# 52 GB/s per rank). Without the overlap the search's top row is --cpu-offload masters
# --fsdp-gather-once without chunks: 13.8 s, 21.8%, 2.94 s of all-to-all exposed (docs/memory.md).
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
    --bf16 --data-parallel-sharding fsdp --optimizer-in-backward \
    --recompute-granularity full --recompute-chunks 4 --offload-recompute-inputs \
    --overlap-moe-expert-parallel-comm \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 4 --global-batch-size 32 --long-docs truncate \
    --optimizer muon --muon-momentum 0 --lr 2e-4 --adamw-lr 1e-5 --min-lr 2e-5 \
    --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
