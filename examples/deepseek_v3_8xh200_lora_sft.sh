#!/usr/bin/env bash
# LoRA SFT of DeepSeek-V3 (671B; docs/deepseek-v3.md) on one node of 8 x H200 (141 GB): adapters
# of rank 32 on the default targets (attention, the dense MLPs, the shared experts and the routed
# experts, grouped and sharded with them under EP8; the MTP depth's layer too), every other weight frozen and stored in bf16
# only (docs/lora.md). The frozen base is 1.34 TB in bf16, more than the node's 1.13 TB of GPU
# memory: the routed experts' frozen weights live in host memory and are copied to the GPU for
# each micro-batch (--cpu-offload experts). The Hub's FP8 weights are dequantized at import.
#
# The layout is the top row of the planner's search over every 8-GPU layout:
#   python tools/plan_memory.py --search --world-size 8 --model-preset deepseek-v3 \
#       --seq-length 8192 --global-batch-size 32 --bf16 --lora-rank 32
# EP8, FSDP over the 8 ranks, full recompute, micro-batches of 4 packs (one per rank and step);
# --global-batch-size 32 packs = 262,144 tokens per iteration. Predicted (not measured; no GPU has
# run this): 79.0 GB on the busiest GPU, 1,544 GB of host memory for the node, 44.5 s per step,
# 736 tokens/s per GPU, MFU 16.3% (a prediction of the planner's model, counting useful FLOPs
# only; assumed: 40% MFU for the maths, NVLink 150 GB/s, pinned PCIe 35 GB/s). Plan it first:
#   python tools/plan_memory.py --world-size 8 <the flags below>
#
# Then: python tools/convert_checkpoint.py export "$OUT/checkpoints" "$OUT/merged" --merge-lora
#
#   bash examples/deepseek_v3_8xh200_lora_sft.sh /data/DeepSeek-V3 /data/sft_text_document /out
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: deepseek_v3_8xh200_lora_sft.sh HF_DIR DATA_PREFIX OUT_DIR}
DATA=${2:?}
OUT=${3:?}
torchrun --nproc-per-node 8 pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --lora-rank 32 --lora-alpha 64 \
    --pipeline-model-parallel-size 1 --expert-model-parallel-size 8 \
    --bf16 --data-parallel-sharding fsdp --cpu-offload experts --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 4 --global-batch-size 32 --long-docs truncate \
    --optimizer adamw --lr 1e-4 --min-lr 1e-5 \
    --lr-warmup-iters 20 --lr-decay-style cosine --weight-decay 0.0 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 1000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
