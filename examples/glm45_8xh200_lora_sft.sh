#!/usr/bin/env bash
# LoRA SFT of GLM-4.5 (355B; docs/glm4-moe.md) on one node of 8 x H200 (141 GB): adapters of rank
# 32 on the default targets (attention, the dense MLPs, the shared expert and the routed experts;
# the MTP layer's too), every other weight frozen and stored in bf16 only (docs/lora.md); the
# routed experts' frozen weights live in host memory and are copied to the GPU for each
# micro-batch (--cpu-offload experts).
#
# The layout is the top row of the planner's search over every 8-GPU layout:
#   python tools/plan_memory.py --search --world-size 8 --model-preset glm-4.5 \
#       --seq-length 8192 --global-batch-size 32 --bf16 --lora-rank 32
# PP8 with 2 virtual stages per rank (interleaved 1F1B), full recompute, micro-batches of one
# pack: 32 per step. --global-batch-size 32 packs = 262,144 tokens per iteration. Predicted (not
# measured; no GPU has run this): 122.9 GB on the busiest GPU, 827 GB of host memory for the node,
# 30.7 s per step, 1,068 tokens/s per GPU, MFU 21.2% (a prediction of the planner's model,
# counting useful FLOPs only; assumed: 40% MFU for the maths, NVLink 150 GB/s, pinned PCIe
# 35 GB/s). Plan it first:
#   python tools/plan_memory.py --world-size 8 <the flags below>
#
# Then: python tools/convert_checkpoint.py export "$OUT/checkpoints" "$OUT/merged" --merge-lora
#
#   bash examples/glm45_8xh200_lora_sft.sh /data/GLM-4.5 /data/sft_text_document /out
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: glm45_8xh200_lora_sft.sh HF_DIR DATA_PREFIX OUT_DIR}
DATA=${2:?}
OUT=${3:?}
torchrun --nproc-per-node 8 pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --lora-rank 32 --lora-alpha 64 \
    --pipeline-model-parallel-size 8 --virtual-pipeline-model-parallel-size 2 --expert-model-parallel-size 1 \
    --bf16 --data-parallel-sharding fsdp --cpu-offload experts --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 1 --global-batch-size 32 --long-docs truncate \
    --optimizer adamw --lr 1e-4 --min-lr 1e-5 \
    --lr-warmup-iters 20 --lr-decay-style cosine --weight-decay 0.0 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 1000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
