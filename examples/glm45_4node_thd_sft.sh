#!/usr/bin/env bash
# Reference recipe: text SFT of GLM-4.5 (zai-org/GLM-4.5, 355B, the glm4_moe family; its MTP
# layer trains beside it; docs/glm4-moe.md) on four nodes of 8 x H200 (141 GB): 32 ranks, packed
# THD rows of 8,192 tokens, 64 packs per step, Muon with momentum 0 (stateless; AdamW for
# embeddings, norms, biases and routers).
#
# The layout is the top row of the planner's search over every 32-GPU layout (rows 1-2 tie; 2 only
# stores the masters as bf16 + remainders):
#   python tools/plan_memory.py --search --world-size 32 --model-preset glm-4.5 \
#       --seq-length 8192 --global-batch-size 64 --bf16 --optimizer muon --muon-momentum 0
# PP8 with 2 virtual stages per rank (interleaved 1F1B; a pipeline spans a node), EP4, DP4 with
# FSDP2 sharding each stage's weights over its 4 replicas (the nodes), full recompute, micro-
# batches of one pack: 16 per pipeline and step.
# --global-batch-size 64 packs = 524,288 tokens per iteration. Predicted (not measured; no GPU has
# run this): 121.2 GB on the busiest GPU, no host memory, 25.9 s per step, 633 tokens/s per GPU,
# MFU 16.7% (a prediction of the planner's model, assumed: 40% MFU for the maths, NVLink 150 GB/s
# inside a node, 50 GB/s per GPU between nodes). Plan it with the same flags first:
#   python tools/plan_memory.py --world-size 32 <the flags below>
#
# Run the same command on the four nodes; torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT
# (a host every node reaches, e.g. the first node) assigns the node ranks:
#   MASTER_ADDR=node0 bash examples/glm45_4node_thd_sft.sh /data/GLM-4.5 /data/sft_text_document /out
# HF_DIR, DATA_PREFIX and OUT_DIR must be the same paths on every node (a shared file system:
# checkpoints are written by every rank into OUT_DIR/checkpoints).
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: glm45_4node_thd_sft.sh HF_DIR DATA_PREFIX OUT_DIR (env: MASTER_ADDR)}
DATA=${2:?}
OUT=${3:?}
: "${MASTER_ADDR:?set MASTER_ADDR to a host every node reaches (the rendezvous)}"
torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-glm45-sft}" pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --pipeline-model-parallel-size 8 --virtual-pipeline-model-parallel-size 2 --expert-model-parallel-size 4 \
    --bf16 --data-parallel-sharding fsdp --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 1 --global-batch-size 64 --long-docs truncate \
    --optimizer muon --muon-momentum 0 --lr 1e-5 --min-lr 1e-6 \
    --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
