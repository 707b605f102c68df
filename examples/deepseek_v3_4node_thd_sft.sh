#!/usr/bin/env bash
# Reference recipe: text SFT of DeepSeek-V3 (671B; DeepSeek-R1 and V3.1 share its shapes;
# docs/deepseek-v3.md) on four nodes of 8 x H200 (141 GB): 32 ranks, packed THD rows of 8,192
# tokens, 64 packs per step, Muon with momentum 0 (stateless: no optimizer state beside the
# masters; AdamW for embeddings, norms and routers). The Hub's FP8 weights are dequantized to
# fp32 at import (--load-hf), shard by shard.
#
# The layout is the top row of the planner's search over every 32-GPU layout:
#   python tools/plan_memory.py --search --world-size 32 --model-preset deepseek-v3 \
#       --seq-length 8192 --global-batch-size 64 --bf16 --optimizer muon --muon-momentum 0
# (AdamW fits no layout of 32 H200s: its fp32 masters and two moments need 2.8 TB of host memory
# per node even offloaded.) EP32 (8 of the 256 routed experts per rank, the all-to-all across the
# nodes), DP32 with FSDP2 sharding the dense weights over all 32 ranks, gathered once per step;
# --cpu-offload masters: the bf16 weights are the only copy on the GPU, the fp32 masters live in
# host memory and the optimizer steps each matrix in the backward (--optimizer-in-backward); full
# recompute; micro-batches of 2 packs, one per rank and step.
# --global-batch-size 64 packs = 524,288 tokens per iteration. Predicted (not measured; no GPU has
# run this): 126.1 GB on each GPU, 1,031 GB of host memory per node, 31.0 s per step, 529 tokens/s
# per GPU, MFU 15.6% (a prediction of the planner's model, assumed: 40% MFU for the maths, NVLink
# 150 GB/s inside a node, 50 GB/s per GPU between nodes, pinned PCIe 35 GB/s, host memory 52 GB/s
# per rank). Plan it with the same flags first:
#   python tools/plan_memory.py --world-size 32 <the flags below>
# DeepSeek-V3's multi-token-prediction layer trains beside the model (--mtp-loss-scale 0.3, the
# scale of DeepSeek-V3's first 10T tokens; docs/deepseek-v3.md), costed in the plan.
#
# Run the same command on the four nodes; torchrun's c10d rendezvous on MASTER_ADDR:MASTER_PORT
# (a host every node reaches, e.g. the first node) assigns the node ranks:
#   MASTER_ADDR=node0 bash examples/deepseek_v3_4node_thd_sft.sh /data/DeepSeek-V3 /data/sft_text_document /out
# HF_DIR, DATA_PREFIX and OUT_DIR must be the same paths on every node (a shared file system:
# checkpoints are written by every rank into OUT_DIR/checkpoints).
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: deepseek_v3_4node_thd_sft.sh HF_DIR DATA_PREFIX OUT_DIR (env: MASTER_ADDR)}
DATA=${2:?}
OUT=${3:?}
: "${MASTER_ADDR:?set MASTER_ADDR to a host every node reaches (the rendezvous)}"
torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-deepseek-v3-sft}" pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --pipeline-model-parallel-size 1 --expert-model-parallel-size 32 \
    --bf16 --data-parallel-sharding fsdp --cpu-offload masters --fsdp-gather-once --optimizer-in-backward \
    --recompute-granularity full \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 2 --global-batch-size 64 --long-docs truncate \
    --optimizer muon --muon-momentum 0 --lr 1e-5 --min-lr 1e-6 \
    --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
