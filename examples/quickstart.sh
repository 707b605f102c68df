#!/usr/bin/env bash
# Quickstart: tokenize the shipped sample data (text and chat) with the built-in byte tokenizer.
# Training on it arrives with pretrain_step37.py (issue: training entry point).
#   bash examples/quickstart.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/quickstart}
mkdir -p "$OUT/data"
python tools/preprocess_data.py --input examples/data/sample_text.jsonl \
    --output-prefix "$OUT/data/sample_text" --tokenizer-type byte --append-eod
python tools/preprocess_data.py --input examples/data/sample_chat.jsonl \
    --output-prefix "$OUT/data/sample_chat" --tokenizer-type byte --chat messages --append-eod
python tools/inspect_packs.py --data-path "$OUT/data/sample_text_text_document" --seq-length 2048
echo "quickstart: datasets in $OUT/data (sample_text_text_document, sample_chat_text_document," \
     "sample_chat_loss_mask_document)"
