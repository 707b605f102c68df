#!/usr/bin/env python3
"""Sample a few lines from a training checkpoint, so that you can see what the model learned.

    python tools/generate.py --load runs/quickstart/checkpoints --prompt "The" --prompt "Return the"
        [--max-new-tokens 48] [--temperature 0 0.8] [--top-k 0] [--seed 0]

Any registered model family (the checkpoint's meta.json names it and holds its config); the
tokenizer is the one the run recorded, unless --tokenizer-type / --tokenizer-model say otherwise
(a checkpoint imported from Hugging Face records none: give them). Each prompt is continued
greedily (temperature 0) and by sampling at each other --temperature. An empty prompt starts from
the end-of-document token (an unconditional sample); a prompt must leave room in the model's
context for one new token, and --max-new-tokens is capped at what the context leaves (said
before it starts). Bad flags exit 2 with a one-line reason. A LoRA run's checkpoint samples
with its adapters beside its frozen base: the base is the --load-hf folder the run recorded, or
--base DIR (its weights' fingerprint must be the recorded one).
With ``--image FILE`` (repeatable) a vision-language model answers about images: each prompt
is rendered as one user turn, the images (in the order given) then the text, through the
tokenizer's chat template with its generation prompt; every image token the template writes is
expanded into the image processor's placeholder run for the image's size, and the model gets
the pixels with the positions of those placeholders (``core.packed_seq.ImageInputs``), as
training does. The processor is the one the tokenizer folder holds (the folder the run recorded,
as ``tools/preprocess_data.py --chat`` read it); generation stops at the template's end of turn.
A model without a vision tower, or a tokenizer folder without a processor, refuses --image.
Single process on CPU (or the current GPU), fp32, no KV cache: every new token runs the whole
sequence again, which is fine at this size (the tiny model: milliseconds per token).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from data.tokenizers import TOKENIZER_TYPES, build_tokenizer  # noqa: E402
from models import registry  # noqa: E402
from tools.image_prompt import ImagePrompts  # noqa: E402


def load_model(load_dir: str, model_module: str | None = None, base: str | None = None):
    """(model with the checkpoint's weights, its meta.json, its path), for any registered family.
    A LoRA run's checkpoint holds only adapters: its base is ``base``, else the ``--load-hf`` it
    trained on, else the seeded weights it started from, checked against the recorded
    fingerprint; the adapters run beside the frozen weights, unmerged, as in training."""
    from core.checkpoint.sharded import load_checkpoint
    from core.checkpoint.directory import resolve
    from core.checkpoint.reader import read_meta
    from training.checkpoints import checkpoint_model, lora_model

    if not os.path.exists(load_dir):
        raise FileNotFoundError(f"--load {load_dir}: no such checkpoint directory (train with "
                                "--save DIR first, or point --load at an iter_* directory)")
    registry.import_model_module(model_module)
    path = resolve(load_dir)
    meta = read_meta(path)
    spec, cfg = checkpoint_model(path, meta)
    if base and not meta.get("lora"):
        raise ValueError(f"--base {base}: {path} is not a LoRA run's checkpoint (it holds every weight)")
    model = lora_model(spec, cfg, meta["lora"], base, path) if meta.get("lora") else spec.build(cfg)
    load_checkpoint(path, [model])
    return model.eval(), meta, path


def next_token_logits(model, ids: list[int], images=None) -> torch.Tensor:
    """The logits after the last of ``ids``: one document, positions 0..n-1; ``images``
    (``ImageInputs``) write their features at their placeholders, which lie in the prompt."""
    from core.packed_seq import PackedSeqParams

    n = len(ids)
    cu = torch.tensor([0, n], dtype=torch.int32)
    tokens = torch.tensor(ids, dtype=torch.long)
    extra = {} if images is None else {"images": images}  # a text family's forward need not take it
    logits = model(tokens, torch.arange(n), PackedSeqParams(cu, cu.clone(), n), **extra)
    return logits[-1].float()


@torch.no_grad()
def generate(model, ids: list[int], max_new: int, temperature: float, top_k: int, stop,
             generator: torch.Generator, max_len: int, vocab: int, images=None) -> list[int]:
    """Greedy (``temperature`` 0) or sampled continuation of ``ids``, up to ``max_new`` tokens or
    a ``stop`` token (an id or a collection of ids; not included); only the tokenizer's
    ``vocab`` ids are chosen (a model's embedding rows past them are padding). ``images``: the
    prompt's ``ImageInputs`` (their positions index ``ids``, so stay valid as tokens are added)."""
    stops = {stop} if isinstance(stop, int) else set(stop)
    out = list(ids)
    for _ in range(max_new):
        if len(out) >= max_len:
            break
        logits = next_token_logits(model, out, images)[:vocab]
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=generator))
        if nxt in stops:
            break
        out.append(nxt)
    return out[len(ids):]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--load", required=True, help="a --save directory (its latest checkpoint) or an iter_* directory")
    ap.add_argument("--prompt", action="append", help="text to continue (repeat for several; default: "
                                                       "'The'); with a byte-level BPE, end it without a "
                                                       "space: words carry their leading space. An "
                                                       "empty prompt starts from the end-of-document "
                                                       "token (an unconditional sample); a prompt must "
                                                       "be shorter than the model's context")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="tokens to add to each prompt at most; "
                    "capped at what the model's context leaves after the prompt (said before it starts)")
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.8],
                    help="0 is greedy; each value (finite, >= 0) gives one line per prompt")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens only (0: all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    ap.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                    help="default: the one the run recorded (required for a checkpoint imported from "
                         "Hugging Face, which records none); another than the recorded one is warned of")
    ap.add_argument("--tokenizer-model", help="its file or directory (needs --tokenizer-type; default: "
                                              "the one the run recorded)")
    ap.add_argument("--image", action="append", metavar="FILE",
                    help="an image for a vision-language model (repeat for several, used in this "
                         "order before each prompt's text in one user turn, through the chat "
                         "template; the tokenizer folder must hold the image processor)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a small model runs fastest on "
                                                          "one; 0: torch's default)")
    ap.add_argument("--model-module", help="import this module first (it registers another model family)")
    ap.add_argument("--base", help="a LoRA run's checkpoint: the Hugging Face folder of its base model "
                                   "(default: the --load-hf it trained on, as recorded; the weights' "
                                   "fingerprint is checked)")
    return ap


def flag_error(args) -> str | None:
    """What is wrong with the flags, in one line, or None."""
    bad_t = [t for t in args.temperature if not (math.isfinite(t) and t >= 0)]
    if args.max_new_tokens < 1:
        return f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
    if bad_t:
        return f"--temperature must be a finite number >= 0 (0 is greedy), got {bad_t[0]:g}"
    if min(args.top_k, args.threads) < 0:
        return "--top-k and --threads must be >= 0"
    if args.tokenizer_model and not args.tokenizer_type:
        return ("--tokenizer-model needs --tokenizer-type (huggingface or sentencepiece): the "
                "model alone does not say how to read it")
    if args.tokenizer_type == "byte" and args.tokenizer_model:
        return "--tokenizer-type byte takes no --tokenizer-model"
    if args.tokenizer_type not in (None, "byte") and not args.tokenizer_model:
        return f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model"
    return None


def choose_tokenizer(args, meta: dict, path: str):
    """(tokenizer, what to call it, a warning or None). The flags' tokenizer when given (a
    warning when it is not the one the run recorded: its ids may mean other text, but the
    recorded path may have moved, so it is not refused); else the recorded one; a checkpoint
    that records none (imported from Hugging Face) is a ``SystemExit(2)`` asking for the flags."""
    recorded = meta.get("tokenizer") or {}
    if args.tokenizer_type:
        given = (args.tokenizer_type, args.tokenizer_model)
        tok = build_tokenizer(*given)
        was = (recorded.get("type"), recorded.get("model"))
        same = was[0] == given[0] and (given[0] == "byte" or (
            was[1] is not None and os.path.realpath(was[1]) == os.path.realpath(given[1])))
        warning = None if same or not was[0] else (
            f"generate: warning: the run trained with --tokenizer-type {was[0]}"
            f"{f' --tokenizer-model {was[1]}' if was[1] else ''}, not the tokenizer given; unless "
            "it is a copy of that one, its ids mean other text and the lines will be garbage")
        return tok, " ".join(x for x in given if x), warning
    if not recorded.get("type"):
        source = meta.get("source")
        hint = f" (e.g. --tokenizer-type huggingface --tokenizer-model {source})" if source else ""
        raise SystemExit(f"generate: error: {path} records no tokenizer (a checkpoint imported "
                         f"from Hugging Face): pass --tokenizer-type and --tokenizer-model{hint}")
    return build_tokenizer(recorded["type"], recorded.get("model")), recorded["type"], None


def prompt_ids(tok, prompt: str, context: int, max_new: int) -> tuple[list[int], int]:
    """(the prompt's ids, the new tokens it gets): an empty prompt is the end-of-document token;
    a ``SystemExit(2)`` for a prompt that leaves the context no room; a note on stderr when
    ``max_new`` is capped at what the context leaves."""
    ids = tok.encode(prompt)
    if not ids:
        if tok.eod_id < 0:
            raise SystemExit(f"generate: error: --prompt {prompt!r} is empty and the tokenizer has "
                             "no end-of-document token to start from: give a prompt")
        ids = [tok.eod_id]
    if len(ids) >= context:
        raise SystemExit(f"generate: error: --prompt {prompt[:40]!r}{'...' if len(prompt) > 40 else ''} "
                         f"is {len(ids)} tokens, and the model's context is {context} "
                         f"(max_position_embeddings): give at most {context - 1} tokens")
    room = context - len(ids)
    if max_new > room:
        print(f"generate: --max-new-tokens {max_new} is capped at {room} for --prompt {prompt[:40]!r} "
              f"(the model's context is {context} tokens, the prompt {len(ids)})", file=sys.stderr)
    return ids, min(max_new, room)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise


def _main(argv: list[str] | None) -> int:
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process on purpose
    args = build_parser().parse_args(argv)
    if (err := flag_error(args)) is not None:
        print(f"generate: error: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model, meta, path = load_model(args.load, args.model_module, args.base)
        tok, kind, warning = choose_tokenizer(args, meta, path)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 1
    if warning:
        print(warning, file=sys.stderr)
    if tok.vocab_size > model.config.vocab_size:
        print(f"generate: error: the tokenizer has {tok.vocab_size} entries, the model {model.config.vocab_size}",
              file=sys.stderr)
        return 1
    context = model.config.max_position_embeddings
    images, stops = None, {tok.eod_id}
    if args.image:
        try:
            chat = ImagePrompts(model, tok, meta, args)
        except ValueError as e:
            print(f"generate: error: {e}", file=sys.stderr)
            return 2 if str(e).startswith("--image: the model") else 1
        images, stops = chat.images, stops | chat.stops
        try:
            prompts = [(p, *chat.prompt_ids(p, context, args.max_new_tokens)) for p in args.prompt or ["The"]]
        except ValueError as e:  # the text itself holds the image token
            print(f"generate: error: --prompt with --image: {e}", file=sys.stderr)
            return 2
    else:
        prompts = [(p, *prompt_ids(tok, p, context, args.max_new_tokens)) for p in args.prompt or ["The"]]
    gen = torch.Generator().manual_seed(args.seed)
    t0, made = time.perf_counter(), 0
    print(f"generate: {path} (iteration {meta.get('iteration')}, {meta.get('family')}), tokenizer {kind}"
          + (f", images {', '.join(args.image)}" if args.image else ""))
    for prompt, ids, max_new in prompts:
        for t in args.temperature:
            new = generate(model, ids, max_new, t, args.top_k, stops, gen, context, tok.vocab_size,
                           images=None if images is None else images(ids))
            made += len(new)
            label = "greedy" if t == 0 else f"T={t:g}"
            print(f"[{label:>6}] {prompt!r} -> {tok.decode(new)!r}")
    dt = time.perf_counter() - t0
    print(f"generate: {made} tokens in {dt:.1f} s ({1000 * dt / max(made, 1):.0f} ms per token, no KV cache)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
