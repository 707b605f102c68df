#!/usr/bin/env python3
"""Sample a few lines from a training checkpoint, so that you can see what the model learned.

    python tools/generate.py --load runs/quickstart/checkpoints --prompt "The" --prompt "Return the"
        [--max-new-tokens 48] [--temperature 0 0.8] [--top-k 0] [--seed 0]

Any registered model family (the checkpoint's meta.json names it and holds its config); the
tokenizer is the one the run recorded, unless --tokenizer-type / --tokenizer-model say otherwise.
Each prompt is continued greedily (temperature 0) and by sampling at each other --temperature.
Single process on CPU (or the current GPU), fp32, no KV cache: every new token runs the whole
sequence again, which is fine at this size (the tiny model: milliseconds per token).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from models import registry  # noqa: E402


def load_model(load_dir: str, model_module: str | None = None):
    """(model with the checkpoint's weights, its meta.json, its path), for any registered family."""
    from core.checkpointing import load_checkpoint
    from core.checkpoint_dir import resolve
    from core.checkpoint_reader import read_meta
    from training.checkpoints import checkpoint_model

    if not os.path.exists(load_dir):
        raise FileNotFoundError(f"--load {load_dir}: no such checkpoint directory (train with "
                                "--save DIR first, or point --load at an iter_* directory)")
    registry.import_model_module(model_module)
    path = resolve(load_dir)
    meta = read_meta(path)
    spec, cfg = checkpoint_model(path, meta)
    model = spec.build(cfg)
    load_checkpoint(path, [model])
    return model.eval(), meta, path


def next_token_logits(model, ids: list[int]) -> torch.Tensor:
    """The logits after the last of ``ids``: one document, positions 0..n-1."""
    from core.packed_seq import PackedSeqParams

    n = len(ids)
    cu = torch.tensor([0, n], dtype=torch.int32)
    tokens = torch.tensor(ids, dtype=torch.long)
    logits = model(tokens, torch.arange(n), PackedSeqParams(cu, cu.clone(), n))
    return logits[-1].float()


@torch.no_grad()
def generate(model, ids: list[int], max_new: int, temperature: float, top_k: int, stop: int,
             generator: torch.Generator, max_len: int, vocab: int) -> list[int]:
    """Greedy (``temperature`` 0) or sampled continuation of ``ids``, up to ``max_new`` tokens or
    the ``stop`` token (not included); only the tokenizer's ``vocab`` ids are chosen (a model's
    embedding rows past them are padding)."""
    out = list(ids)
    for _ in range(max_new):
        if len(out) >= max_len:
            break
        logits = next_token_logits(model, out)[:vocab]
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        if nxt == stop:
            break
        out.append(nxt)
    return out[len(ids):]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--load", required=True, help="a --save directory (its latest checkpoint) or an iter_* directory")
    ap.add_argument("--prompt", action="append", help="text to continue (repeat for several; default: "
                                                       "'The'); with a byte-level BPE, end it without a "
                                                       "space: words carry their leading space")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="tokens to add to each prompt at most")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.8],
                    help="0 is greedy; each value gives one line per prompt")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens only (0: all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    ap.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, help="default: the one the run recorded")
    ap.add_argument("--tokenizer-model", help="default: the one the run recorded")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a small model runs fastest on "
                                                          "one; 0: torch's default)")
    ap.add_argument("--model-module", help="import this module first (it registers another model family)")
    return ap


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process on purpose
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1 or any(t < 0 for t in args.temperature) or min(args.top_k, args.threads) < 0:
        print("generate: error: --max-new-tokens must be >= 1, --temperature, --top-k and --threads >= 0",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, meta, path = load_model(args.load, args.model_module)
        recorded = meta.get("tokenizer") or {}
        kind = args.tokenizer_type or recorded.get("type") or "byte"
        tok = build_tokenizer(kind, args.tokenizer_model or (recorded.get("model") if not args.tokenizer_type else None))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 1
    if tok.vocab_size > model.config.vocab_size:
        print(f"generate: error: the tokenizer has {tok.vocab_size} entries, the model {model.config.vocab_size}",
              file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(args.seed)
    t0, made = time.perf_counter(), 0
    print(f"generate: {path} (iteration {meta.get('iteration')}, {meta.get('family')}), tokenizer {kind}")
    for prompt in args.prompt or ["The"]:
        ids = tok.encode(prompt)
        for t in args.temperature:
            new = generate(model, ids, args.max_new_tokens, t, args.top_k, tok.eod_id, gen,
                           model.config.max_position_embeddings, tok.vocab_size)
            made += len(new)
            label = "greedy" if t == 0 else f"T={t:g}"
            print(f"[{label:>6}] {prompt!r} -> {tok.decode(new)!r}")
    dt = time.perf_counter() - t0
    print(f"generate: {made} tokens in {dt:.1f} s ({1000 * dt / max(made, 1):.0f} ms per token, no KV cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
