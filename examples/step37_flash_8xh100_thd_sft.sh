#!/usr/bin/env bash
# Recipe: text SFT of Step-3.7-Flash on one node of 8 x H100 (80 GB), EP8 (no pipeline), packed
# THD rows of 8,192 tokens, 32 packs per step, Muon with momentum 0: the 8 x H200 recipe's
# memory design (examples/step37_flash_8xh200_thd_sft.sh) made to fit 80 GB.
#
# The layout is the top row of the planner's search over every 8-GPU layout at 80 GB
# (docs/memory.md, "8 x H100"):
#   python tools/plan_memory.py --search --world-size 8 --device-gb 80 --model-preset step37-flash \
#       --seq-length 8192 --global-batch-size 32 --bf16 --optimizer muon --muon-momentum 0 \
#       --overlap-moe-expert-parallel-comm
#
# Memory: --cpu-offload masters (bf16 weights the only copy on the GPU, 49.9 GB; fp32 masters in
# host memory) and --optimizer-in-backward need one micro-batch per rank and step, here 4 packs.
# --recompute-chunks 4 runs each recomputed layer and MTP depth a pack at a time and sums its
# gradients over the packs in fp32 (core/transformer/chunked.py): the backward then holds one
# pack's working set and all-to-all buffers, not four. --offload-recompute-inputs keeps the
# layers' inputs in pinned host memory between forward and backward. Without --fsdp-gather-once
# the dense weights are gathered per layer (a unit and the next), and the embedding and head are
# freed once the heads' backward is done. --overlap-moe-expert-parallel-comm runs each micro-batch
# as two chunks of whole documents whose all-to-alls fly while the other chunk computes, forward
# and backward (docs/memory.md, "The Planner: Step Time"): 0.63 s of all-to-all left exposed
# instead of 2.94 s, but Newton-Schulz then finds few all-to-all waits to fill. Predicted (not
# measured; no GPU has run this): 73.6 GB on each GPU (6.4 GB to spare), 165 GB of host memory per
# rank (1.3 TB for the node), 13.5 s per step, 2,435 tokens/s per GPU, MFU 22.3% (14.3 s and 21.1%
# without the overlap; assumed: 40% MFU for the maths, NVLink 150 GB/s, pinned PCIe 35 GB/s, host
# memory 52 GB/s per rank). Plan it with the same flags first:
#   python tools/plan_memory.py --world-size 8 --device-gb 80 <the flags below>
#
#   bash examples/step37_flash_8xh100_thd_sft.sh /data/Step-3.7-Flash /data/sft_text_document /out
set -euo pipefail
cd "$(dirname "$0")/.."
HF=${1:?usage: step37_flash_8xh100_thd_sft.sh HF_DIR DATA_PREFIX OUT_DIR}
DATA=${2:?}
OUT=${3:?}
torchrun --nproc-per-node 8 pretrain_step37.py \
    --hf-config "$HF" --load-hf "$HF" \
    --pipeline-model-parallel-size 1 --expert-model-parallel-size 8 \
    --bf16 --data-parallel-sharding fsdp --cpu-offload masters --optimizer-in-backward \
    --recompute-granularity full --recompute-chunks 4 --offload-recompute-inputs \
    --overlap-moe-expert-parallel-comm \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$HF" \
    --seq-length 8192 --micro-batch-size 4 --global-batch-size 32 --long-docs truncate \
    --optimizer muon --muon-momentum 0 --lr 2e-4 --adamw-lr 1e-5 --min-lr 2e-5 \
    --lr-warmup-iters 50 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --mtp-loss-scale 0.3 --moe-bias-update-rate 0 \
    --train-iters 2000 --log-interval 1 --log-dir "$OUT/tensorboard" \
    --save "$OUT/checkpoints" --save-interval 200 --keep-last 3 --load "$OUT/checkpoints"
