#!/usr/bin/env python3
"""Inspect how a dataset packs: packs, fill, documents per pack, lost tokens, length histogram.

    python tools/inspect_packs.py --data-path out/corpus_text_document --seq-length 8192 \\
        [--long-docs split] [--seed 0] [--context-parallel-size N | --document-pad-multiple P] \\
        [--plot packs.png]

For image + text data (an ``..._image_index_document`` beside the dataset) it also reports the
images per pack and the share of pack tokens that are image placeholder tokens.

With context parallelism every document is padded to a multiple of 2 x N (as training pads it):
the plan is then made on padded lengths, and a line shows the padding and the packs it adds.

The plan is the same one training uses, cached the same way: beside the dataset, in
--data-cache-path when given, or in the user cache when the dataset's directory is read-only.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from data.image_store import image_prefixes, pack_image_counts  # noqa: E402
from data.indexed_dataset import IndexedDataset  # noqa: E402
from data.packing import LONG_DOC_POLICIES, cached_plan  # noqa: E402


def histogram_lines(values: np.ndarray, bins: int = 12, width: int = 40) -> list[str]:
    """A text histogram on log2-spaced bins."""
    if values.size == 0:
        return ["(empty)"]
    edges = np.unique(np.geomspace(max(1, values.min()), values.max() + 1, bins + 1).astype(np.int64))
    counts, edges = np.histogram(values, bins=edges)
    top = counts.max() or 1
    return [f"{lo:>8}-{hi - 1:<8} {c:>10,} {'#' * int(round(width * c / top))}"
            for lo, hi, c in zip(edges[:-1], edges[1:], counts)]


def _image_lines(prefix: str, plan) -> None:
    """Images per pack and the image-token share, for image + text data."""
    names = image_prefixes(prefix)
    if names is None or not os.path.exists(names[1] + ".idx"):
        return
    images, tokens = pack_image_counts(IndexedDataset(names[1]), plan.segments)
    offsets = np.asarray(plan.pack_offsets)
    per_pack = np.add.reduceat(images, offsets[:-1]) if plan.num_packs else images[:0]
    share = tokens.sum() / max(1, plan.num_tokens)
    print(f"images       {int(images.sum()):,} in {int((per_pack > 0).sum()):,} of {plan.num_packs:,} "
          f"packs; per pack mean {per_pack.mean():.2f}, max {per_pack.max()}")
    print(f"image tokens {int(tokens.sum()):,} ({100 * share:.2f}% of the packed tokens)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-path", required=True, help="dataset prefix (PREFIX.idx / PREFIX.bin)")
    ap.add_argument("--seq-length", type=int, required=True, help="pack size S in tokens")
    ap.add_argument("--long-docs", choices=LONG_DOC_POLICIES, default="split",
                    help="documents longer than S: split into chunks, truncate, or drop (default: split)")
    ap.add_argument("--seed", type=int, default=0, help="pack shuffle seed (default: 0)")
    ap.add_argument("--plot", metavar="PNG", help="also draw the length and fill histograms (matplotlib)")
    ap.add_argument("--data-cache-path", help="directory for the cached plan (as in training)")
    ap.add_argument("--context-parallel-size", type=int, default=1,
                    help="pad every document to a multiple of 2 x this, as training does (default: 1, no padding)")
    ap.add_argument("--document-pad-multiple", type=int, default=None,
                    help="pad every document to a multiple of this instead (as the training flag)")
    args = ap.parse_args(argv)
    pad = args.document_pad_multiple or (2 * args.context_parallel_size if args.context_parallel_size > 1 else 1)
    if pad < 1 or args.seq_length % pad:
        print(f"inspect_packs: error: --seq-length {args.seq_length} must be a multiple of the document pad "
              f"multiple {pad}", file=sys.stderr)
        return 2
    try:
        ds = IndexedDataset(args.data_path)
    except ValueError as e:
        print(f"inspect_packs: error: {e}", file=sys.stderr)
        return 1
    lengths = ds.lengths.astype(np.int64)
    padded = (lengths + pad - 1) // pad * pad  # what training plans with (data/loader.open_source)
    plan = cached_plan(padded, args.seq_length, args.data_path, long_docs=args.long_docs, seed=args.seed,
                       cache_path=args.data_cache_path)
    per_pack = np.diff(plan.pack_offsets)
    fills = plan.pack_tokens() / args.seq_length
    bound = -(-plan.num_tokens // args.seq_length)
    print(f"dataset      {args.data_path}: {len(ds):,} documents, {ds.num_tokens:,} tokens")
    print(f"packs        {plan.num_packs:,} of {args.seq_length} tokens (lower bound {bound:,})")
    print(f"fill         {100 * plan.fill:.4f}% overall; per pack min {100 * fills.min():.1f}% "
          f"median {100 * np.median(fills):.1f}%")
    print(f"docs/pack    mean {per_pack.mean():.2f}, min {per_pack.min()}, max {per_pack.max()}")
    print(f"long docs    --long-docs {args.long_docs}: split {plan.split_docs:,}, truncated "
          f"{plan.truncated_docs:,} ({plan.truncated_tokens:,} tokens), dropped {plan.dropped_docs:,} "
          f"({plan.dropped_tokens:,} tokens); empty documents skipped {plan.empty_docs:,}")
    if pad > 1:
        bare = cached_plan(lengths, args.seq_length, args.data_path, long_docs=args.long_docs, seed=args.seed,
                           cache_path=args.data_cache_path)
        added = int((padded - lengths).sum())
        print(f"cp padding   documents padded to a multiple of {pad}: +{added:,} pad tokens "
              f"({100 * added / max(1, ds.num_tokens):.2f}% of the real ones); {plan.num_packs:,} packs "
              f"against {bare.num_packs:,} unpadded (fill counts the padding as used)")
    _image_lines(args.data_path, plan)
    print("document lengths:")
    print("\n".join(histogram_lines(lengths[lengths > 0])))
    if args.plot:
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("inspect_packs: error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 1
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        a.hist(lengths[lengths > 0], bins=np.geomspace(1, max(2, lengths.max() + 1), 50))
        a.set_xscale("log")
        a.set(title="document lengths", xlabel="tokens", ylabel="documents")
        b.hist(100 * fills, bins=50)
        b.set(title=f"pack fill ({plan.num_packs:,} packs, S={args.seq_length})", xlabel="fill %",
              ylabel="packs")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"plot         {args.plot}")
    print(f"inspect_packs: {plan.num_packs:,} packs, fill {100 * plan.fill:.4f}%, "
          f"{plan.dropped_tokens + plan.truncated_tokens:,} tokens lost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
