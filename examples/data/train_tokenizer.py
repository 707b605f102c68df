#!/usr/bin/env python3
"""Trains a byte-level BPE tokenizer on a JSONL corpus in seconds, with the `tokenizers` library.

    python examples/data/train_tokenizer.py examples/data/pydoc_corpus.jsonl runs/tok [--vocab-size 1024]

Writes a Hugging Face tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``) that
``--tokenizer-type huggingface --tokenizer-model DIR`` reads without transformers. Byte-level:
every UTF-8 string encodes (the 256 byte symbols are the base alphabet), so nothing is ever
unknown. Special tokens, as the built-in byte tokenizer's: ``<|endoftext|>`` (end of document),
``<|pad|>``, ``<|im_start|>`` and ``<|im_end|>`` (the built-in chat template's markers). Training
is deterministic: the same corpus and flags give the same file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


def texts(path: str, key: str):
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)[key]


def train(corpus: str, out_dir: str, vocab_size: int, key: str = "text") -> int:
    """Train and save; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(corpus, key), trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIALS[0],
                   "pad_token": SPECIALS[1], "model_max_length": 1 << 20}, f, indent=2)
    return tok.get_vocab_size(with_added_tokens=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", help="JSONL with one text per row")
    ap.add_argument("out_dir", help="where to write tokenizer.json and tokenizer_config.json")
    ap.add_argument("--vocab-size", type=int, default=1024, help="entries, bytes and specials included")
    ap.add_argument("--json-key", default="text", help="the key holding the text")
    args = ap.parse_args()
    if not os.path.isfile(args.corpus):
        print(f"train_tokenizer: error: {args.corpus}: no such file", file=sys.stderr)
        return 1
    if args.vocab_size < 256 + len(SPECIALS):
        print(f"train_tokenizer: error: --vocab-size must be at least {256 + len(SPECIALS)} (the "
              "bytes and the special tokens)", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    n = train(args.corpus, args.out_dir, args.vocab_size, args.json_key)
    print(f"train_tokenizer: byte-level BPE, {n:,} entries, trained on {args.corpus} in "
          f"{time.perf_counter() - t0:.1f} s -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
