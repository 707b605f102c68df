#!/usr/bin/env bash
# Reference recipe: text SFT of Step-3.7-Flash on one node of 8 x H200 (141 GB), PP4 x EP2,
# packed THD rows of 8,192 tokens, Muon with momentum 0 for the matrices.
#
# Local batch is counted in packs: --global-batch-size 64 packs = 64 x 8,192 = 524,288 tokens
# per iteration; with DP = 8 / PP4 = 2 (EP2 inside it) and micro-batch 1 pack, each pipeline
# runs 32 micro-batches per iteration (1F1B bubble (p-1)/(m+p-1) = 8.6%).
#
# Memory: --bf16 (bf16 compute over fp32 master weights and fp32 gradients), FSDP2 over the
# data-parallel ranks with every shard offloaded to host memory, and full activation recompute;
# layers split by cost (14,14,14,3: the last stage runs the head and three MTP depths). The
# planner says this fits the GPUs (about 31 GB on the busiest) but needs up to 260 GB of host
# memory per rank (about 1.6 TB for the node); plan it before you spend a node-hour, with the
# same flags:
#   python tools/plan_memory.py --world-size 8 <the flags below>
# This layout has not run on GPUs yet, and offload copies every layer's shards for each
# micro-batch (slow); see docs/memory.md.
#
#   bash examples/step37_flash_8xh200_thd_sft.sh /data/Step-3.7-Flash /data/sft_text_document /out
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: step37_flash_8xh200_thd_sft.sh HF_DIR DATA_PREFIX OUT_DIR}
DATA=${2:?}
OUT=${3:?}
torchrun --nproc-per-node 8 pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --pipeline-model-parallel-size 4 --expert-model-parallel-size 2 \
    --bf16 --data-parallel-sharding fsdp --cpu-offload all --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 1 --global-batch-size 64 --long-docs truncate \
    --optimizer muon --muon-momentum 0 --lr 2e-4 --adamw-lr 1e-5 --min-lr 2e-5 \
    --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
