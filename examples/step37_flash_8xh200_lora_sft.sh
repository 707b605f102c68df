#!/usr/bin/env bash
# LoRA SFT of Step-3.7-Flash on one node of 8 x H200 (141 GB): adapters of rank 32 on attention,
# the shared experts and the routed experts (grouped, sharded with them under EP8), every other
# weight frozen and stored in bf16 only (docs/lora.md). No offload: the frozen base costs 2 bytes
# per parameter on the GPU, FSDP-sharded; no masters, gradients or optimizer state for it.
#
# The layout is the top row of the planner's search over every 8-GPU layout:
#   python tools/plan_memory.py --search --world-size 8 --model-preset step37-flash \
#       --seq-length 8192 --global-batch-size 32 --bf16 --lora-rank 32
# Predicted (not measured; no GPU has run this): 94.6 GB on the busiest GPU (46.4 GB to spare),
# 11.0 s per step, 2,973 tokens/s per GPU, 19.4% MFU counting useful FLOPs only (forward, the
# backward's input gradients, the adapters' forward and backward; no recompute, no weight
# gradients of the frozen base). 8 x H100: examples/step37_flash_8xh100_lora_sft.sh.
#
# Then: python tools/convert_checkpoint.py export "$OUT/checkpoints" "$OUT/merged" --merge-lora
# (the routed experts' adapters export merged only for Step-3.7: it publishes its experts stacked).
#
#   bash examples/step37_flash_8xh200_lora_sft.sh /data/Step-3.7-Flash /data/sft_text_document /out
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: step37_flash_8xh200_lora_sft.sh HF_DIR DATA_PREFIX OUT_DIR}
DATA=${2:?}
OUT=${3:?}
torchrun --nproc-per-node 8 pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --lora-rank 32 --lora-alpha 64 \
    --pipeline-model-parallel-size 1 --expert-model-parallel-size 8 \
    --bf16 --data-parallel-sharding fsdp --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 4 --global-batch-size 32 --long-docs truncate \
    --optimizer adamw --lr 1e-4 --min-lr 1e-5 \
    --lr-warmup-iters 20 --lr-decay-style cosine --weight-decay 0.0 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 1000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
