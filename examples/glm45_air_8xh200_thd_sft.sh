#!/usr/bin/env bash
# Reference recipe: text SFT of GLM-4.5-Air (zai-org/GLM-4.5-Air, 106B, the glm4_moe family: GQA
# with q/k/v biases and partial RoPE, 128 routed experts top-8 and a shared one, its MTP layer;
# docs/glm4-moe.md) on one node of 8 x H200 (141 GB), packed THD rows of 8,192 tokens, 64 packs
# per step, Muon with momentum 0 (stateless; GLM-4.5 was pretrained with Muon; AdamW for
# embeddings, norms, biases and routers).
#
# The layout is the top row of the planner's search over every 8-GPU layout (rows 1-2 tie; 2 keeps
# fp32 masters instead of bf16 + remainders):
#   python tools/plan_memory.py --search --world-size 8 --model-preset glm-4.5-air \
#       --seq-length 8192 --global-batch-size 64 --bf16 --optimizer muon --muon-momentum 0
# EP2, DP8 with FSDP2 sharding the dense weights over the 8 ranks and each expert half over 4, the
# masters stored as bf16 + 16-bit remainders (exact fp32, 4 bytes) and stepped in the backward
# (--optimizer-in-backward), full recompute a pack at a time (--recompute-chunks 8), micro-batches
# of 8 packs: one per rank and step.
# --global-batch-size 64 packs = 524,288 tokens per iteration. Predicted (not measured; no GPU has
# run this): 109.5 GB on the busiest GPU, 30.4 s per step, 2,156 tokens/s per GPU, MFU 24.1% (a
# prediction of the planner's model, assumed: 40% MFU for the maths, NVLink 150 GB/s). Plan it
# with the same flags first:
#   python tools/plan_memory.py --world-size 8 <the flags below>
#
#   bash examples/glm45_air_8xh200_thd_sft.sh /data/GLM-4.5-Air /data/sft_text_document /out
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: glm45_air_8xh200_thd_sft.sh HF_DIR DATA_PREFIX OUT_DIR}
DATA=${2:?}
OUT=${3:?}
torchrun --nproc-per-node 8 pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --pipeline-model-parallel-size 1 --expert-model-parallel-size 2 \
    --bf16 --data-parallel-sharding fsdp --store-param-remainders --optimizer-in-backward \
    --recompute-granularity full --recompute-chunks 8 \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 8 --global-batch-size 64 --long-docs truncate \
    --optimizer muon --muon-momentum 0 --lr 2e-5 --min-lr 2e-6 \
    --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
