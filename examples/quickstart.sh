#!/usr/bin/env bash
# Quickstart: tokenize the shipped sample data, then train the tiny model on it for a few
# hundred steps on CPU (4 processes, PP2 x EP2, Muon momentum 0).
#   bash examples/quickstart.sh [OUT_DIR] [ITERS]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/quickstart}
ITERS=${2:-300}
mkdir -p "$OUT/data"
python tools/preprocess_data.py --input examples/data/sample_text.jsonl \
    --output-prefix "$OUT/data/sample_text" --tokenizer-type byte --append-eod
python tools/preprocess_data.py --input examples/data/sample_chat.jsonl \
    --output-prefix "$OUT/data/sample_chat" --tokenizer-type byte --chat messages --append-eod
python tools/inspect_packs.py --data-path "$OUT/data/sample_text_text_document" --seq-length 256
bash examples/train_tiny_cpu.sh "$OUT/data/sample_text_text_document" "$OUT" "$ITERS"
echo "quickstart: datasets in $OUT/data; TensorBoard logs in $OUT/tensorboard" \
     "(tensorboard --logdir $OUT/tensorboard); checkpoints in $OUT/checkpoints"
