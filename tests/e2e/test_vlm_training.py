"""Image + text SFT through the command lines, against transformers: rows with images ->
``tools/preprocess_data.py --chat --tokenizer-type huggingface --tokenizer-model PROCESSOR_DIR``
-> ``pretrain_step37.py --load-hf HF_VLM_DIR --data-path ...``: the first logged loss equals
``Step3p7ForConditionalGeneration``'s per-target-token loss over the same documents, each run
alone with its pixels (our preprocessing equals transformers' on the fixtures,
tests/unit/test_image_processing.py). The run reads a copy of the dataset that lost its
modification times (plain ``cp``): it is still one unit, and its images pass their checksums.

Tolerance 1e-5 relative: fp32 both sides, the same weights; the two sum attention, experts and
the loss in different orders (the model tests hold logits to 4e-5 of the largest logit; a mean
over many tokens is tighter). The images matter at this scale: blank pixels move transformers'
loss by 1.2e-3 relative (measured once), over a hundred times the tolerance."""
from __future__ import annotations

import os
import shutil

import numpy as np
import torch

from tests.e2e.conftest import PROCESSOR
from tests.e2e.test_training import train


def _hf_vlm(path) -> None:
    from models.step37 import Step37Config, Step37Model

    cfg = Step37Config.preset("step37-tiny-vlm")  # the tiny processor's vocabulary and <im_patch>
    assert (cfg.vocab_size, cfg.image_token_id) == (400, 3)
    Step37Model(cfg, seed=3).save_hf(str(path))


def _transformers_loss(hf_dir: str, prefix: str) -> float:
    """Sum of token cross-entropies over every target of every document / their count, each
    document run alone through transformers with its images' pixels."""
    from transformers import Step3p7ForConditionalGeneration

    from data.image_store import open_images
    from data.indexed_dataset import IndexedDataset
    from data.loader import loss_mask_prefix
    from models.registry import image_processor_from_settings

    model = Step3p7ForConditionalGeneration.from_pretrained(hf_dir).eval()
    text = IndexedDataset(prefix)
    mask = IndexedDataset(loss_mask_prefix(prefix))
    store = open_images(prefix, text.lengths, image_processor_from_settings)
    total, count = 0.0, 0
    for doc in range(len(text)):
        ids = np.asarray(text.get(doc), dtype=np.int64)
        keep = np.asarray(mask.get(doc)).astype(bool)[1:]
        views, crops, n_crops = [], [], []
        for image, _, _, w, h in store.images_in(doc, 0, len(ids)):
            g, c = store.pixels(image, w, h)
            views.append(torch.from_numpy(g))
            crops += [torch.from_numpy(x) for x in c]
            n_crops.append(len(c))
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids)[None], pixel_values=torch.stack(views),
                           pixel_values_local=torch.stack(crops) if crops else None,
                           num_local_patches=n_crops).logits[0].double()
        ce = torch.nn.functional.cross_entropy(logits[:-1], torch.from_numpy(ids[1:]), reduction="none")
        total += float(ce[torch.from_numpy(keep)].sum())
        count += int(keep.sum())
    return total / count


def test_first_logged_loss_equals_transformers_over_the_same_documents(shapes_data, tmp_path):
    from data.indexed_dataset import IndexedDataset
    from data.loader import open_source
    from models.registry import image_processor_from_settings

    hf = tmp_path / "hf"
    _hf_vlm(hf)
    seq = 512
    packs = open_source(shapes_data, seq, "truncate", 0, image_processor=image_processor_from_settings).plan.num_packs
    copy = tmp_path / "copy"  # trained on a copy made as plain `cp` makes one: no modification times
    copy.mkdir()
    src_dir, name = os.path.split(shapes_data)
    for f in os.listdir(src_dir):
        if f.startswith(name.replace("_text_document", "_")):
            shutil.copyfile(os.path.join(src_dir, f), copy / f)
    rows = train(["--data-path", str(copy / name), "--hf-config", str(hf), "--load-hf", str(hf),
                  "--tokenizer-type", "huggingface", "--tokenizer-model", PROCESSOR, "--seq-length", str(seq),
                  "--micro-batch-size", "1", "--global-batch-size", str(packs), "--train-iters", "1",
                  "--optimizer", "adamw", "--lr", "1e-3", "--lr-warmup-iters", "0"], tmp_path / "log")
    want = _transformers_loss(str(hf), shapes_data)
    assert len(IndexedDataset(shapes_data)) == 12
    assert abs(rows[0]["loss"] - want) <= 1e-5 * want, (rows[0]["loss"], want)
