#!/usr/bin/env python3
"""Tokenize text or chat data (JSONL, Parquet, Arrow, datasets.save_to_disk folders) into
Megatron-compatible indexed datasets.

Text:  python tools/preprocess_data.py --input data.jsonl --output-prefix out/corpus \\
           --tokenizer-type huggingface --tokenizer-model ./tokenizer --append-eod --workers 8
       -> out/corpus_text_document.{bin,idx}
Chat:  python tools/preprocess_data.py --input 'sft/*.parquet' --output-prefix out/sft --chat
       -> out/sft_text_document.{bin,idx} and out/sft_loss_mask_document.{bin,idx} (uint8,
          1 on assistant tokens), aligned token for token.
Image + text chat: --chat --tokenizer-type huggingface --tokenizer-model PROCESSOR_DIR, where the
       folder also holds an image processor (preprocessor_config.json): each image part becomes
       the processor's placeholder tokens; adds out/sft_images_document.{bin,idx} (the images'
       encoded bytes) and out/sft_image_index_document.{bin,idx} (per document: where each
       image's tokens are). docs/vlm.md.

Every rejected row goes to PREFIX_rejects.jsonl with its file, line number (JSONL) or row index
(Parquet, Arrow), reason and original text; rows read always equal rows accepted plus rows
rejected. A Parquet or Arrow input without a column the run reads stops it before any work. The tool never reads its own
outputs (a glob's matches named like them are left out, and said) and reads a file given twice
once. Outputs are published only when the run succeeds, all of a run's datasets together (a chat
text never without its loss mask), and not at all when more than --max-rejected-fraction of the
rows is rejected, an input file is damaged (a truncated gzip stream, say), a write fails (a full
disk: the file is named) or a worker process dies. Ctrl-C and SIGTERM stop the run and remove
its temporary files. Exit status: 0 published, 1 refused or failed, 130 interrupted, 143
terminated.
"""
from __future__ import annotations

import argparse
import errno
import functools
import os
import sys
from dataclasses import dataclass

if __package__ in (None, ""):  # run as a script from a checkout: make the packages importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from core.cli import add_to_parser, from_namespace, option  # noqa: E402
from data.preprocess import (REJECT_REASONS, PreprocessError, Terminated,  # noqa: E402
                             output_keys, run)
from data.images import DEFAULT_MAX_IMAGE_PIXELS  # noqa: E402
from data.tokenizers import TOKENIZER_TYPES  # noqa: E402
from data.workers import WorkerDied, WorkerFailed  # noqa: E402


@dataclass
class PreprocessConfig:
    """Input, tokenizer and output."""

    input: list = option(help="inputs, read in the order given (globs sorted): JSONL files (.gz "
                              "too), .parquet files, Arrow IPC files (.arrow, .feather) and "
                              "datasets.save_to_disk folders", nargs="+")
    output_prefix: str = option(help="writes PREFIX_<key>_document.{bin,idx} and PREFIX_rejects.jsonl")
    json_keys: list = option(["text"], "text keys (Parquet / Arrow: columns) to tokenize, one "
                                       "dataset each (a row missing any of them is rejected)",
                             nargs="+")
    chat: str = option(None, "chat mode: the key (column) holding the messages list (bare --chat "
                             "means 'messages'); adds PREFIX_loss_mask_document", nargs="?",
                       const="messages", metavar="KEY")
    reasoning_loss: bool = option(True, "chat: an assistant message's reasoning_content (or "
                                        "thinking), where the chat template renders it, is a "
                                        "training target (default); --no-reasoning-loss makes it "
                                        "context, loss mask 0")
    mask_history: bool = option(False, "chat: only the last turn is a target (the assistant "
                                       "messages after the last user message); earlier assistant "
                                       "messages are context, loss mask 0 (default: every "
                                       "assistant message is a target)")
    tokenizer_type: str = option("byte", "tokenizer kind", choices=TOKENIZER_TYPES)
    tokenizer_model: str = option(None, "Hugging Face tokenizer directory or tokenizer.json; "
                                        "SentencePiece .model file")
    append_eod: bool = option(False, "append the end-of-document token to every document")
    workers: int = option(1, "encoding processes; 1 encodes in this process")
    chunk_mb: float = option(4.0, "MB of input per unit of work handed to a worker")
    log_interval: int = option(10000, "refresh the progress bar's row counters every N rows")
    max_rejected_fraction: float = option(0.01, "exit 1 without publishing a dataset when more "
                                                "than this fraction of rows is rejected")
    max_image_pixels: int = option(DEFAULT_MAX_IMAGE_PIXELS, "image + text chat: an image of more "
                                   "pixels (width x height) rejects its row (image_too_large; "
                                   "a decompression bomb); PIL's own threshold is the default, "
                                   "and a larger value raises PIL's for the decode")

    def __post_init__(self):
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if not 0.0 <= self.max_rejected_fraction <= 1.0:
            raise ValueError(f"--max-rejected-fraction must be in [0, 1], got {self.max_rejected_fraction}")
        if self.chunk_mb <= 0:
            raise ValueError(f"--chunk-mb must be > 0, got {self.chunk_mb}")
        if self.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1, got {self.log_interval}")
        if self.tokenizer_type != "byte" and not self.tokenizer_model:
            raise ValueError(f"--tokenizer-type {self.tokenizer_type} needs --tokenizer-model")
        if self.max_image_pixels < 1:
            raise ValueError(f"--max-image-pixels must be >= 1, got {self.max_image_pixels}")


IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def image_processor_factory(cfg: PreprocessConfig):
    """A picklable ``token_id -> processor`` for a chat run whose tokenizer folder holds an image
    processor (the workers build their own), else None (a text-only run)."""
    folder = cfg.tokenizer_model
    if not cfg.chat or cfg.tokenizer_type != "huggingface" or not folder or not os.path.isdir(folder) \
            or not any(os.path.isfile(os.path.join(folder, f)) for f in IMAGE_PROCESSOR_FILES):
        return None
    from models.registry import load_image_processor

    return functools.partial(load_image_processor, folder)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=f"Rejection reasons: {', '.join(REJECT_REASONS)} (docs/data-preparation.md).")
    add_to_parser(parser, PreprocessConfig, "preprocessing")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = from_namespace(PreprocessConfig, args)
    except ValueError as e:
        parser.error(str(e))
    try:
        stats = run(cfg, progress=True, image_processor=image_processor_factory(cfg))
    except (PreprocessError, FileNotFoundError, ValueError, WorkerFailed) as e:
        print(f"preprocess_data: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # writing the outputs: a full disk, a quota, permissions
        full = " (the disk is full: free space or choose another --output-prefix)" \
            if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        print(f"preprocess_data: error: cannot write {e.filename or 'the outputs'}: "
              f"{e.strerror or e}{full}. No dataset was published and the temporary files were "
              "removed.", file=sys.stderr)
        return 1
    except WorkerDied as e:
        print(f"preprocess_data: error: {e}. Nothing was published and the temporary files were "
              "removed. A worker killed by SIGKILL was most likely stopped by the out-of-memory "
              "killer: use fewer --workers or a smaller --chunk-mb.", file=sys.stderr)
        return 1
    except (Terminated, KeyboardInterrupt) as e:
        why = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        print(f"preprocess_data: stopped by {why}; nothing was published and the temporary files "
              "were removed", file=sys.stderr)
        return 143 if isinstance(e, Terminated) else 130
    outputs = ", ".join(f"{cfg.output_prefix}_{k}_document" for k in output_keys(cfg))
    if cfg.chat:
        outputs += f", {cfg.output_prefix}_loss_mask_document"
    if stats.images is not None:
        outputs += f", {cfg.output_prefix}_images_document, {cfg.output_prefix}_image_index_document"
    print(f"preprocess_data: {stats.summary()}; wrote {outputs}")
    for what in stats.removed:
        print(f"preprocess_data: removed {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
