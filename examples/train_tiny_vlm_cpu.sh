#!/usr/bin/env bash
# The tiny Step-3.7 vision-language model trained on CPU in a few minutes on images it has to
# look at: examples/data/make_shapes_vlm.py draws 400 pictures (shapes, colours, digits; sizes
# and aspect ratios vary) with a question and its answer each, tools/preprocess_data.py expands
# every image into its placeholder tokens with the tiny processor of tests/fixtures/
# step3p7_processor, and pretrain_step37.py --model-preset step37-tiny-vlm trains the whole model
# (vision tower, projector, decoder) on packed THD sequences, one process, 10% of the documents
# held out. It ends with the training and validation losses against the blind baseline (the loss
# a model that cannot see the images reaches at best: examples/data/shapes_vlm_baseline.py says
# how it is counted) and tools/generate.py --image answering about a held-out picture.
#   bash examples/train_tiny_vlm_cpu.sh OUT_DIR [ITERS]
# (PYTHON: the interpreter to run, default python)
#
# The processor fixture's views match the preset's tower: its global view is 112 px (the
# preset's vision image_size, 8 x 8 patches of 14 -> 4 features) and its crops 56 px (4 x 4
# patches -> 1 feature). Its tokenizer has 400 ids (<im_patch> is 3), so the run sets
# --vocab-size 400; the preset's image_token_id (319) is used only by a Hugging Face export
# (training and generation place features by the processor's <im_patch>).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:?usage: train_tiny_vlm_cpu.sh OUT_DIR [ITERS]}
ITERS=${2:-200}
PROCESSOR=tests/fixtures/step3p7_processor
DATA="$OUT/data/shapes_text_document"
EVAL_INTERVAL=$(( ITERS < 50 ? ITERS : 50 ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT/data"
"$PY" examples/data/make_shapes_vlm.py "$OUT/shapes" --rows 400
"$PY" tools/preprocess_data.py --chat --tokenizer-type huggingface --tokenizer-model "$PROCESSOR" \
    --input "$OUT/shapes/rows.jsonl" --output-prefix "$OUT/data/shapes"
"$PY" tools/inspect_packs.py --data-path "$DATA" --seq-length 256 | tail -4
"$PY" pretrain_step37.py --model-preset step37-tiny-vlm --vocab-size 400 \
    --data-path "$DATA" --tokenizer-type huggingface --tokenizer-model "$PROCESSOR" \
    --seq-length 256 --micro-batch-size 1 --global-batch-size 8 \
    --optimizer muon --muon-momentum 0 --lr 0.02 --adamw-lr 0.003 \
    --lr-warmup-fraction 0.067 --lr-decay-style cosine --min-lr 0.002 --weight-decay 0.01 \
    --train-iters "$ITERS" --log-interval 10 --split 90,10,0 \
    --eval-interval "$EVAL_INTERVAL" --eval-iters 4 \
    --log-dir "$OUT/tensorboard" --save "$OUT/checkpoints" --save-interval "$ITERS" \
    2>&1 | tee "$OUT/train.log"
"$PY" examples/data/shapes_vlm_baseline.py "$DATA" "$PROCESSOR" --split 90,10,0 --log "$OUT/train.log"
# a held-out picture (the last row is in the validation part) and its question
ROW=$(tail -n 1 "$OUT/shapes/rows.jsonl")
IMAGE="$OUT/shapes/$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["messages"][0]["content"][0]["path"])' "$ROW")"
QUESTION=$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["messages"][0]["content"][1]["text"])' "$ROW")
ANSWER=$("$PY" -c 'import json,sys; print(json.loads(sys.argv[1])["messages"][1]["content"])' "$ROW")
"$PY" tools/generate.py --load "$OUT/checkpoints" --image "$IMAGE" --prompt "$QUESTION" \
    --temperature 0 --max-new-tokens 16
echo "train_tiny_vlm_cpu: the answer in the data: '$ANSWER'; checkpoints in $OUT/checkpoints" \
     "(python tools/generate.py --load $OUT/checkpoints --image FILE --prompt QUESTION)"
