"""The files a run reads, checked before any process group exists (``train_args.validate``
calls these unless it plans a run on another machine): the datasets' whole indexes, token ids
and targets against the model (``data/checks.py``), their images and the tokenizer they were made
with, the validation data, the checkpoint to load and a writable ``--save``."""
from __future__ import annotations

import os

from core.checkpoint.directory import check_writable
from data.checks import check_made_with, check_training_data
from data.dataset_stats import recorded_facts
from data.image_store import open_images
from data.indexed_dataset import IndexedDataset
from data.loader import parse_data_path
from data.tokenizers import build_tokenizer
from models import registry
from training.eval_data import validation_ranges
from training.run_layout import evaluates


def check_run_files(args, cfg) -> None:
    """--save writable now rather than at the first save; the validation data."""
    if args.checkpoint.save:
        check_writable(args.checkpoint.save)
    if not evaluates(args):
        return
    e, d = args.eval, args.data
    if e.valid_data_path:
        for _, prefix in parse_data_path(e.valid_data_path):
            if not os.path.exists(prefix + ".idx"):
                raise ValueError(f"--valid-data-path {prefix}: no {prefix}.idx (write it with "
                                 "tools/preprocess_data.py)")
            check_training_data(prefix, cfg.vocab_size, cache_path=d.data_cache_path)
            check_made_with(prefix, build_tokenizer(d.tokenizer_type, d.tokenizer_model), d.tokenizer_type,
                            d.tokenizer_model, registry.load_image_processor, d.data_cache_path)
    else:
        validation_ranges(parse_data_path(d.data_path), d.split)  # raises when a part is empty


def _check_images(prefix: str, cfg, cache_path: str | None) -> None:
    """A dataset with images opens whole (its images and index present, of this publishing
    unit, of this version: a missing or damaged file is named here, in one line) and needs a
    model with a vision tower whose image token is the one the dataset's placeholders carry (the
    features go to the loader's positions either way, but an export would tell transformers
    another token)."""
    if open_images(prefix, IndexedDataset(prefix).lengths, registry.image_processor_from_settings,
                   cache_path) is None:
        return
    if getattr(cfg, "vision", None) is None:
        raise ValueError(f"--data-path {prefix} holds images, but the model has no vision tower (a "
                         "text-only config or preset): train a vision-language config (--hf-config of a "
                         "checkpoint with a vision_config, or a VLM preset), or preprocess text-only rows")
    recorded = (recorded_facts(prefix, cache_path).get("images") or {}).get("image_token_id")
    ours = getattr(cfg, "image_token_id", None)
    if recorded is not None and ours is not None and int(recorded) != int(ours):
        raise ValueError(f"--data-path {prefix}: its image placeholders are token {recorded}, the model's "
                         f"image_token_id is {ours}: preprocess with the model's tokenizer and processor, "
                         "or use a config whose image_token_id matches")


def check_data_files(args, cfg) -> None:
    """The files a run reads, and the data against the model: the whole index, token ids below
    cfg.vocab_size, some training targets (data/checks.py)."""
    d, ck = args.data, args.checkpoint
    if not d.data_path:
        raise ValueError("--data-path is required")
    tok = build_tokenizer(d.tokenizer_type, d.tokenizer_model)
    for _, prefix in parse_data_path(d.data_path):
        if not os.path.exists(prefix + ".idx"):
            raise ValueError(f"--data-path {prefix}: no {prefix}.idx (write it with tools/preprocess_data.py)")
        check_training_data(prefix, cfg.vocab_size, cache_path=d.data_cache_path)
        _check_images(prefix, cfg, d.data_cache_path)
        check_made_with(prefix, tok, d.tokenizer_type, d.tokenizer_model,
                        registry.load_image_processor, d.data_cache_path)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer vocabulary {tok.vocab_size} exceeds the model's {cfg.vocab_size}")
    if ck.load and not os.path.exists(ck.load):
        raise ValueError(f"--load {ck.load}: no such directory")
