#!/usr/bin/env bash
# Quickstart on real text: the shipped corpus of Python's own documentation
# (examples/data/pydoc_corpus.jsonl: pydoc topics and standard-library docstrings, PSF licence,
# rebuilt by examples/data/make_pydoc_corpus.py), a byte-level BPE tokenizer trained on it in
# seconds, and the tiny model trained on it on CPU for a few minutes (4 processes, PP2 x EP2,
# Muon momentum 0) with 5% of the documents held out. It ends with the loss curve (TensorBoard,
# and loss_curve.png beside the logs), the validation loss against the unigram entropy of the
# corpus, and a few lines the model writes.
#   bash examples/quickstart.sh [OUT_DIR] [ITERS]
# (PYTHON: the interpreter to run, default python; `make quickstart` passes the one it installed into)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-runs/quickstart}
ITERS=${2:-300}
EVAL_INTERVAL=$(( ITERS < 50 ? ITERS : 50 ))
CORPUS=examples/data/pydoc_corpus.jsonl
DATA="$OUT/data/pydoc_text_document"
mkdir -p "$OUT/data"
"$PY" examples/data/train_tokenizer.py "$CORPUS" "$OUT/tokenizer" --vocab-size 1024
"$PY" tools/preprocess_data.py --input "$CORPUS" --output-prefix "$OUT/data/pydoc" \
    --tokenizer-type huggingface --tokenizer-model "$OUT/tokenizer" --append-eod
# chat data with assistant-only loss masks (the built-in template; not trained on here)
"$PY" tools/preprocess_data.py --input examples/data/sample_chat.jsonl \
    --output-prefix "$OUT/data/sample_chat" --tokenizer-type byte --chat messages --append-eod
"$PY" tools/inspect_packs.py --data-path "$DATA" --seq-length 256
bash examples/train_tiny_cpu.sh "$DATA" "$OUT" "$ITERS" \
    --tokenizer-type huggingface --tokenizer-model "$OUT/tokenizer" --vocab-size 1024 \
    --split 95,5,0 --eval-interval "$EVAL_INTERVAL" --eval-iters 4 --log-interval 10
"$PY" tools/plot_loss.py "$OUT/tensorboard" --data-path "$DATA" --split 95,5,0
"$PY" tools/generate.py --load "$OUT/checkpoints" --prompt "The" --prompt "Return the" \
    --max-new-tokens 32
echo "quickstart: datasets in $OUT/data; TensorBoard logs in $OUT/tensorboard" \
     "(tensorboard --logdir $OUT/tensorboard), loss curve $OUT/tensorboard/loss_curve.png;" \
     "checkpoints in $OUT/checkpoints (python tools/generate.py --load $OUT/checkpoints --prompt ...)"
