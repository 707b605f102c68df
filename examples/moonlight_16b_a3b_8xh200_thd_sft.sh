#!/usr/bin/env bash
# Reference recipe: text SFT of Moonlight-16B-A3B (moonshotai/Moonlight-16B-A3B, the deepseek_v3
# family: multi-head latent attention with a plain q_proj, 64 routed experts top-6 and 2 shared
# ones; docs/deepseek-v3.md) on one node of 8 x H200 (141 GB), packed THD rows of 8,192 tokens,
# 64 packs per step, Muon (the optimizer Moonlight was pretrained with; AdamW for embeddings,
# norms and routers).
#
# The layout is the top row of the planner's search over every 8-GPU layout (rows 1-2 tie; 2 only
# stores the masters as bf16 + remainders):
#   python tools/plan_memory.py --search --world-size 8 --model-preset moonlight-16b-a3b \
#       --seq-length 8192 --global-batch-size 64 --bf16 --optimizer muon
# PP2 (the planner's cost-balanced split of the 27 layers), DP4 with FSDP2 sharding each stage's
# weights, experts included, over its 4 replicas and gathering them once per step, no
# recompute, micro-batches of one pack: 16 per pipeline and step.
# --global-batch-size 64 packs = 524,288 tokens per iteration. Predicted (not measured; no GPU has
# run this): 121.3 GB on the busiest GPU, 4.1 s per step, 16,164 tokens/s per GPU, MFU 30.8%
# (a prediction of the planner's model, assumed: 40% MFU for the maths, NVLink 150 GB/s). Plan it
# with the same flags first:
#   python tools/plan_memory.py --world-size 8 <the flags below>
#
# The tokenizer Moonlight publishes is remote code (tiktoken with tokenization_moonshot.py), which
# tools/preprocess_data.py and --tokenizer-model do not run: pass TOKENIZER_DIR, a directory
# whose tokenizer transformers' AutoTokenizer loads without remote code (a tokenizer.json of the
# same vocabulary), to both.
#
#   bash examples/moonlight_16b_a3b_8xh200_thd_sft.sh /data/Moonlight-16B-A3B /data/sft_text_document /out [TOKENIZER_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: moonlight_16b_a3b_8xh200_thd_sft.sh HF_DIR DATA_PREFIX OUT_DIR [TOKENIZER_DIR]}
DATA=${2:?}
OUT=${3:?}
TOK=${4:-$HF}
torchrun --nproc-per-node 8 pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --pipeline-model-parallel-size 2 --expert-model-parallel-size 1 \
    --bf16 --data-parallel-sharding fsdp --fsdp-gather-once --recompute-granularity none \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$TOK" \
    --seq-length 8192 --micro-batch-size 1 --global-batch-size 64 --long-docs truncate \
    --optimizer muon --lr 2e-5 --min-lr 2e-6 --lr-warmup-iters 50 --lr-decay-style cosine \
    --weight-decay 0.1 --clip-grad 1.0 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
