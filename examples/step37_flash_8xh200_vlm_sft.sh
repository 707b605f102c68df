#!/usr/bin/env bash
# Image + text SFT of Step-3.7-Flash (the whole vision-language model: the 47-block vision tower,
# its downsamplers and projector trained with the decoder) on one node of 8 x H200 (141 GB),
# EP8, packed THD rows of 8,192 tokens, 32 packs per step, Muon with momentum 0.
#
# The layout is the top row of the planner's search over every 8-GPU layout, for packs whose
# tokens are a quarter image features (--image-token-share 0.25) from images of about
# 1024 x 1024 (the processor cuts 4 crops of 504 beside the 728 global view:
# --image-crops-per-image 4, 169 + 4 x 81 = 493 features an image, about 4 images a pack):
#   python tools/plan_memory.py --search --world-size 8 --model-preset step37-flash-vlm \
#       --seq-length 8192 --global-batch-size 32 --bf16 --optimizer muon --muon-momentum 0 \
#       --image-token-share 0.25 --image-crops-per-image 4
# Why a quarter: chat SFT mixes with most documents text only and a few with one or two images;
# measure yours with tools/inspect_packs.py (it reports the image-token share) and plan with it.
# One image feature costs 16 patches through the tower: 68.8 GFLOP forward (62.3 for a crop's),
# 2.3 times what a text token costs through the whole decoder (30.3), so each 0.1 of share adds
# about 21% to the step's compute, all of it on the first pipeline stage (docs/vlm.md, "Planner").
#
# Predicted (not measured; no GPU has run this): 118.8 GB on the busiest GPU (22.2 GB to spare;
# the tower's activations are 20.6 GB of it: full recompute keeps each block's input, 2.5 MB an
# image feature), 19.3 s per step, 1,700 tokens/s per GPU, MFU 23.9% counting the tower's
# forward and backward as useful (assumed: 40% MFU for the maths, NVLink 150 GB/s, pinned PCIe
# 35 GB/s, host memory 52 GB/s per rank). The same layout with text only: 13.9 s, 2,360 tokens/s.
# At other shares the top row changes: plan yours before you spend a node-hour.
#
# DATA is the prefix tools/preprocess_data.py writes for image + text chat rows with a processor
# directory (docs/vlm.md); the images travel with it.
#
#   bash examples/step37_flash_8xh200_vlm_sft.sh /data/Step-3.7-Flash /data/vlm_text_document /out
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: step37_flash_8xh200_vlm_sft.sh HF_DIR DATA_PREFIX OUT_DIR}
DATA=${2:?}
OUT=${3:?}
torchrun --nproc-per-node 8 pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --pipeline-model-parallel-size 1 --expert-model-parallel-size 8 \
    --bf16 --data-parallel-sharding fsdp --cpu-offload masters --optimizer-in-backward \
    --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 4 --global-batch-size 32 --long-docs truncate \
    --optimizer muon --muon-momentum 0 --lr 2e-4 --adamw-lr 1e-5 --min-lr 2e-5 \
    --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
