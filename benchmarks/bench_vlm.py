#!/usr/bin/env python3
"""Image + text training on the CPU: our packed THD step against transformers' padded batch, and
pack fill against padding every document to 2,048 tokens (issue 33, "Benchmark").

Documents: ``examples/data/make_shapes_vlm.py`` (``--rows`` pictures of shapes, colours and
digits, 48 to 660 px a side, aspect ratios 1:1 to 3:1, each with a question and its answer),
preprocessed by ``tools/preprocess_data.py --chat`` with the tiny processor of
``tests/fixtures/step3p7_processor`` (112 px global view: 4 image features; 56 px crops: 1
each), so every document is text around one image's placeholder run. The model: the
``step37-tiny-vlm`` preset (2-layer vision tower, the tiny MoE decoder) without MTP
(transformers' Step3p7 has none), vocabulary 400 and ``<im_patch>`` = 3 (the fixture
tokenizer's), random weights (N(0, 0.02)), exported with ``save_hf`` and loaded by
transformers' ``Step3p7ForConditionalGeneration`` (``sdpa`` attention), so both sides hold the
same weights.

(a) A training step, forward + backward (no optimizer), fp32, on the documents of the planner's
first ``--packs`` packs (over all the rows: what the loader takes first):

* ours: one THD micro-batch, the documents packed by our best-fit-decreasing planner into packs
  of ``--seq-length`` (the trailing pad of each pack folded into its last document, as the
  loader does), their images as ``ImageInputs`` (global views and crops through the tower in one
  call each, features written at the placeholders), the ``sdpa`` backend, loss over the loss
  mask's targets;
* transformers: the same documents as one padded batch, each right-padded to the longest, with
  an attention mask, the same pixels (``pixel_values``, ``pixel_values_local``,
  ``num_local_patches``); the loss is the same per-token cross-entropy over the same targets.

Before timing, both sides' loss sums must agree within CHECK_REL (the same weights, documents and
images). Timed: median of ``--iters`` steps after ``--warmup``, the two sides alternating step by
step; tokens/s counts the documents' real tokens (image placeholders included). Image decoding
and preprocessing are done once, outside the timing, for both.

(b) Pack fill over all ``--rows`` documents: our planner at ``--seq-length`` against one row of
``--seq-length`` per document (NeMo Automodel's Step-3.7 recipe pads every sample to 2,048).

    python benchmarks/bench_vlm.py [--rows 400] [--packs 2] [--seq-length 2048] [--iters 5]

Measured on the shared 2-core development machine (2026-12-02, load average 1.8-2.9 from other
jobs: absolute numbers move by tens of percent from run to run, the ratio by a few points):

    packs  threads  documents  real tokens  ours tok/s  transformers tok/s  ours / tf
    2      1        52         3,768        11,256      8,934               1.26x
    2      1        52         3,768        10,478      8,090               1.30x
    4      2        103        7,851        13,767      11,187              1.23x

    pack fill at 2048 over the 400 documents (36,403 tokens): ours 18 packs, 98.75% (the lower
    bound is 18); one row per document: 400 rows, 4.44% (22.2x the rows)

Why only ~1.25x: these documents are alike in length (51 to 169 tokens: the tiny processor
gives an image 6 to 109 tokens), so transformers' padded batch computes only ~1.5x the real
tokens, and at this size the step's time is mostly per-token work in both. Step-3.7's real
geometry (171 to ~3,164 tokens an image) spreads lengths far more; that is not measured here.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

PROCESSOR = os.path.join(ROOT, "tests", "fixtures", "step3p7_processor")
CHECK_REL = 1e-4  # fp32 loss sums over a few thousand targets, summed in other orders (measured ~1e-6)
NO_MTP = dict(num_mtp_layers=0, mtp_layer_types=[], mtp_mlp_layer_types=[], mtp_swiglu_limits=[],
              mtp_swiglu_limits_shared=[])


def make_dataset(out: str, rows: int, seed: int) -> str:
    """Draw the rows and preprocess them; returns the text dataset's prefix."""
    sys.path.insert(0, os.path.join(ROOT, "examples", "data"))
    from make_shapes_vlm import make_rows

    make_rows(os.path.join(out, "shapes"), rows, seed)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--chat",
                    "--tokenizer-type", "huggingface", "--tokenizer-model", PROCESSOR,
                    "--input", os.path.join(out, "shapes", "rows.jsonl"),
                    "--output-prefix", os.path.join(out, "shapes")], check=True, capture_output=True)
    return os.path.join(out, "shapes_text_document")


def open_dataset(prefix: str):
    """(text, loss mask, image store, document lengths)."""
    from data.image_store import open_images
    from data.indexed_dataset import IndexedDataset
    from models import registry

    text = IndexedDataset(prefix)
    mask = IndexedDataset(prefix.replace("_text_document", "_loss_mask_document"))
    lengths = np.asarray(text.lengths, dtype=np.int64)
    store = open_images(prefix, lengths, registry.image_processor_from_settings)
    return text, mask, store, lengths


def model_config(image_token_id: int):
    from models.step37 import Step37Config

    cfg = Step37Config.preset("step37-tiny-vlm")
    return dataclasses.replace(cfg, vocab_size=400, image_token_id=image_token_id, attention_backend="sdpa",
                               **NO_MTP)


def build_models(cfg, seed: int, tmp: str):
    """Ours with N(0, 0.02) weights, and transformers' model loaded from our export."""
    from transformers import Step3p7ForConditionalGeneration

    from benchmarks.model_slice import init_weights
    from models import registry

    ours = registry.spec_of(cfg).build(cfg)
    init_weights(ours, seed, std=0.02)
    path = os.path.join(tmp, "hf")
    ours.save_hf(path)
    hf = Step3p7ForConditionalGeneration.from_pretrained(path, attn_implementation="sdpa")
    return ours, hf


def ours_batch(text, mask, store, packs: int, seq_length: int):
    """Our micro-batch of the planner's first ``packs`` packs over the whole dataset (what the
    loader takes first): (THDBatch, the documents it holds, in token order)."""
    from data.packing import plan_packs
    from data.thd import build_thd_batch

    plan = plan_packs(np.asarray(text.lengths, dtype=np.int64), seq_length, long_docs="drop")
    if packs > plan.num_packs:
        raise SystemExit(f"bench_vlm: --packs {packs}: the dataset makes {plan.num_packs} packs")
    segs = [np.asarray(plan.pack(p)) for p in range(packs)]
    docs = [int(d) for s in segs for d in s[:, 0]]
    return build_thd_batch(segs, text, seq_length, pad_id=0, loss_mask=mask, images=store), docs


def padded_batch(text, mask, store, docs: list) -> dict:
    """transformers' inputs: the documents right-padded to the longest, their images in order."""
    longest = int(max(text.lengths[d] for d in docs))
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    attn = torch.zeros(len(docs), longest, dtype=torch.long)
    labels = torch.full((len(docs), longest), -100, dtype=torch.long)
    globals_, crops, counts = [], [], []
    for r, d in enumerate(docs):
        toks = torch.as_tensor(np.array(text.get(d)), dtype=torch.long)
        keep = torch.as_tensor(np.asarray(mask.get(d))[1:].astype(bool))
        n = len(toks)
        ids[r, :n], attn[r, :n] = toks, 1
        labels[r, :n - 1] = torch.where(keep, toks[1:], torch.full_like(toks[1:], -100))
        for image, _, _, w, h in store.images_in(d, 0, n):
            g, c = store.pixels(image, w, h)
            globals_.append(torch.as_tensor(g))
            crops.append(torch.as_tensor(c))
            counts.append(int(c.shape[0]))
    kw = dict(input_ids=ids, attention_mask=attn, pixel_values=torch.stack(globals_),
              pixel_values_local=torch.cat(crops) if sum(counts) else None, num_local_patches=counts)
    return dict(kw=kw, labels=labels, padded=len(docs) * longest, longest=longest, images=len(globals_))


def steps(ours, hf, batch, padded: dict) -> dict:
    targets = int((batch.labels != -100).sum())
    p = batch.packed_seq_params

    def ours_step():
        ours.zero_grad(set_to_none=True)
        out = ours(batch.tokens, batch.position_ids, p, labels=batch.labels, images=batch.images)
        (out.loss_sum / targets).backward()
        return out.loss_sum.detach()

    def hf_step():
        hf.zero_grad(set_to_none=True)
        logits = hf(**padded["kw"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), padded["labels"].flatten(), reduction="sum")
        (loss / targets).backward()
        return loss.detach()

    return {"ours": ours_step, "hf": hf_step}


def measure(fns: dict, warmup: int, iters: int) -> dict:
    seconds = {k: [] for k in fns}
    for i in range(warmup + iters):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                seconds[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in seconds.items()}


def fill(lengths: np.ndarray, seq_length: int) -> dict:
    from data.packing import plan_packs

    plan = plan_packs(lengths, seq_length, long_docs="drop")
    tokens = int(lengths.sum())
    return dict(docs=len(lengths), tokens=tokens, packs=plan.num_packs, fill=plan.fill,
                bound=-(-tokens // seq_length), padded_fill=tokens / (len(lengths) * seq_length))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=400, help="make_shapes_vlm rows (the fill is over all)")
    ap.add_argument("--packs", type=int, default=2, help="packs in the timed step (the planner's first "
                                                         "ones over the whole dataset)")
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if min(args.packs, args.rows) < 1:
        ap.error("--packs and --rows must be >= 1")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = make_dataset(tmp, args.rows, args.seed)
        text, mask, store, lengths = open_dataset(prefix)
        cfg = model_config(store.image_token_id)
        ours, hf = build_models(cfg, args.seed, tmp)
        batch, docs = ours_batch(text, mask, store, args.packs, args.seq_length)
        padded = padded_batch(text, mask, store, docs)
        fns = steps(ours, hf, batch, padded)
        a, b = float(fns["ours"]()), float(fns["hf"]())
        err = abs(a - b) / abs(b)
        if err > CHECK_REL:
            raise SystemExit(f"bench_vlm: the loss sums differ: ours {a:.6f}, transformers {b:.6f} "
                             f"(relative {err:.1e} > {CHECK_REL:.0e})")
        load0 = os.getloadavg()[0]
        t = measure(fns, args.warmup, args.iters)
        load1 = os.getloadavg()[0]
        real = int(lengths[docs].sum())
        image_tokens = sum(int(store.runs(d)[:, 1].sum()) for d in docs)
        fl = fill(lengths, args.seq_length)
    print(f"(a) training step (forward + backward, fp32, {args.threads} thread(s)), median of {args.iters} "
          f"alternating steps after {args.warmup} warm-up, load average {load0:.2f}-{load1:.2f}")
    print(f"    {len(docs)} documents, {real} real tokens ({image_tokens} in image runs), {padded['images']} images; "
          f"loss sums agree: ours {a:.4f}, transformers {b:.4f} (relative {err:.1e})")
    print(f"{'':<28}{'tokens computed':>16}{'s / step':>10}{'real tok/s':>12}")
    print(f"{'ours: THD packs':<28}{args.packs * args.seq_length:>16,}{t['ours']:>10.3f}{real / t['ours']:>12,.0f}"
          f"   ({args.packs} pack(s) of {args.seq_length})")
    print(f"{'transformers: padded batch':<28}{padded['padded']:>16,}{t['hf']:>10.3f}{real / t['hf']:>12,.0f}"
          f"   ({len(docs)} rows of {padded['longest']})")
    print(f"{'ours / transformers':<28}{'':>16}{'':>10}{t['hf'] / t['ours']:>11.2f}x")
    print(f"(b) pack fill over {fl['docs']} documents, {fl['tokens']:,} tokens, at {args.seq_length}:")
    print(f"{'':<36}{'rows':>8}{'fill':>9}")
    print(f"{'ours: best-fit-decreasing packs':<36}{fl['packs']:>8}{fl['fill']:>9.2%}   (lower bound {fl['bound']} packs)")
    print(f"{'padding every document':<36}{fl['docs']:>8}{fl['padded_fill']:>9.2%}")
    print(f"{'rows saved':<36}{fl['docs'] / fl['packs']:>7.1f}x")
    print(f"reproduce: python benchmarks/bench_vlm.py --rows {args.rows} --packs {args.packs} --seq-length "
          f"{args.seq_length} --iters {args.iters} --warmup {args.warmup} --threads {args.threads} --seed {args.seed}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
