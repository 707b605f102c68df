"""What a run's parsed flags mean for the trainer: the model family and config they select,
the layout validation derives (``RunLayout``), the aux-loss weight and whether the run evaluates.
The trainer and the planner read these; ``train_args`` (the flags, above this package) builds
them, so nothing in ``training/`` imports the flags module."""
from __future__ import annotations

from dataclasses import dataclass

from core.parallel_state import ParallelSizes
from models import registry


@dataclass
class RunLayout:
    """What validation derives: the model family and config, the parallel sizes, micro-batches
    per step."""

    spec: registry.ModelSpec
    config: object  # the family's config class
    sizes: ParallelSizes
    num_microbatches: int  # per pipeline (DP rank) per iteration


def model_spec_and_config(args):
    """``(ModelSpec, config)``: from ``--hf-config`` (or ``--load-hf``'s config.json) by its
    model_type, else from ``--model-preset``."""
    m = args.model
    vocab = {"vocab_size": m.vocab_size} if m.vocab_size is not None else {}
    return registry.resolve(m.model_preset, m.hf_config or m.load_hf, attention_backend=m.attention_backend,
                            **vocab)


def model_config(args):
    return model_spec_and_config(args)[1]


def aux_loss_coeff(args, cfg) -> float:
    """``--moe-aux-loss-coeff``, else the model's own default."""
    c = args.model.moe_aux_loss_coeff
    return cfg.aux_loss_coeff if c is None else c


def validation_weights(args) -> list[float] | None:
    """The --split weights when evaluation reads the validation part of the training data;
    None with --valid-data-path."""
    return None if args.eval.valid_data_path else [float(x) for x in args.data.split.split(",")]


def evaluates(args) -> bool:
    """Whether the run evaluates: --eval-iters > 0 and validation data to read."""
    w = validation_weights(args)
    return args.eval.eval_iters > 0 and (w is None or w[1] > 0)
