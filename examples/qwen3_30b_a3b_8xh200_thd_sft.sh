#!/usr/bin/env bash
# Reference recipe: text SFT of Qwen3-30B-A3B on one node of 8 x H200 (141 GB), packed THD rows of
# 8,192 tokens, AdamW, the model's own load-balancing loss (router_aux_loss_coef 0.001, averaged
# over every MoE layer as transformers computes it, across the pipeline stages).
#
# The layout is the top row of the planner's search over every 8-GPU layout:
#   python tools/plan_memory.py --search --world-size 8 --model-preset qwen3-30b-a3b \
#       --seq-length 8192 --global-batch-size 64 --bf16
# PP4 with 2 virtual stages per rank (interleaved 1F1B, 12 layers a rank), DP2 with FSDP2 sharding
# the rank's 128 experts and dense weights over its 2 replicas, gathered once per step
# (--fsdp-gather-once), full activation recompute, micro-batches of one pack: 32 per rank.
# --global-batch-size 64 packs = 524,288 tokens per iteration. Predicted (not measured; no GPU has
# run this): 105.6 GB on the busiest GPU, 6.9 s per step, 9,519 tokens/s per GPU, MFU 26.9%
# (assumed: 40% MFU for the maths, NVLink 150 GB/s). Plan it with the same flags first:
#   python tools/plan_memory.py --world-size 8 <the flags below>
#
#   bash examples/qwen3_30b_a3b_8xh200_thd_sft.sh /data/Qwen3-30B-A3B /data/sft_text_document /out
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: qwen3_30b_a3b_8xh200_thd_sft.sh HF_DIR DATA_PREFIX OUT_DIR}
DATA=${2:?}
OUT=${3:?}
torchrun --nproc-per-node 8 pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --pipeline-model-parallel-size 4 --virtual-pipeline-model-parallel-size 2 --expert-model-parallel-size 1 \
    --bf16 --data-parallel-sharding fsdp --fsdp-gather-once --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 1 --global-batch-size 64 --long-docs truncate \
    --optimizer adamw --lr 1e-5 --min-lr 1e-6 --lr-warmup-iters 50 --lr-decay-style cosine \
    --weight-decay 0.1 --clip-grad 1.0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
