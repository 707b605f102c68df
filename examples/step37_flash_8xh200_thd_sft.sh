#!/usr/bin/env bash
# Reference recipe: text SFT of Step-3.7-Flash on one node of 8 x H200 (141 GB), EP8 (no
# pipeline), packed THD rows of 8,192 tokens, 32 packs per step, Muon with momentum 0.
#
# The layout is the top row of the planner's search over every 8-GPU layout (docs/memory.md
# shows the table and why this row):
#   python tools/plan_memory.py --search --world-size 8 --model-preset step37-flash \
#       --seq-length 8192 --global-batch-size 32 --bf16 --optimizer muon --muon-momentum 0
#
# Batch: --global-batch-size 32 packs = 262,144 tokens per iteration; DP = 8 (EP8 inside it) and
# micro-batch 4 packs: one micro-batch of 32,768 tokens per rank and step.
#
# Memory (--cpu-offload masters, core/optim/host_masters.py): the bf16 weights are the only copy
# on the GPU (each rank's 36 of the 288 experts whole, the dense weights FSDP-sharded over the 8
# ranks and gathered once per step); the fp32 masters and AdamW's state live in host memory.
# --optimizer-in-backward: each matrix's Newton-Schulz runs on the GPU as soon as its gradient is
# final, on a CUDA stream of its own that fills the backward's all-to-all waits (a dense matrix
# by one of the 8 ranks, core/optim/muon_split.py), its bf16 update goes to
# the host on a copy stream, host threads update the master and copy the new bf16 weight back
# while the backward goes on. Full recompute (MTP depths included), the head's and each MTP
# depth's loss a tile at a time. Predicted (not measured; no GPU has run this): 121.2 GB on each
# GPU (20 GB to spare), 152 GB of host memory per rank (1.2 TB for the node), 13.8 s per step,
# 2,378 tokens/s per GPU, MFU 21.8% (assumed: 40% MFU for the maths, NVLink 150 GB/s, pinned
# PCIe 35 GB/s, host memory 52 GB/s per rank; 19.2% if Newton-Schulz hid nothing: docs/memory.md).
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
    --bf16 --data-parallel-sharding fsdp --cpu-offload masters --fsdp-gather-once --optimizer-in-backward \
    --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 4 --global-batch-size 32 --long-docs truncate \
    --optimizer muon --muon-momentum 0 --lr 2e-4 --adamw-lr 1e-5 --min-lr 2e-5 \
    --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
