"""Image + text chat rows: tools/preprocess_data.py -> images beside the .bin/.idx -> the loader's
``THDBatch.images`` (tests/fixtures/step3p7_processor: 112 px global views, 56 px crops, so an
image costs a handful of tokens and a few milliseconds)."""
from __future__ import annotations

import base64
import io
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings, strategies as st
from PIL import Image, ImageDraw

from data.cp_shard import shard_batch
from data.image_store import image_prefixes
from data.indexed_dataset import DatasetError, IndexedDataset
from data.loader import THDLoader, open_source
from data.tokenizers import build_tokenizer
from models.registry import image_processor_from_settings, load_image_processor
from tools.inspect_packs import main as inspect_main
from tools.preprocess_data import main

PROC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                        "step3p7_processor")
SHAPES = {  # name: (width, height, colour, format): aspect ratios that give 0, 2 and 8 crops
    "red_circle.png": (90, 60, (220, 30, 30), "PNG"),
    "blue_box.jpg": (150, 40, (30, 30, 220), "JPEG"),
    "green_tall.png": (50, 200, (30, 200, 30), "PNG"),
}


def draw(w: int, h: int, colour, fmt: str) -> bytes:
    im = Image.new("RGB", (w, h), colour)
    d = ImageDraw.Draw(im)
    d.ellipse([w // 5, h // 5, 4 * w // 5, 4 * h // 5], fill=(250, 250, 0))
    d.rectangle([0, 0, w // 6, h // 6], fill=(0, 0, 0))
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def user(*parts, answer="an answer"):
    return {"messages": [{"role": "user", "content": list(parts)},
                         {"role": "assistant", "content": answer}]}


def img(path):
    return {"type": "image", "path": path}


def text(t):
    return {"type": "text", "text": t}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("huggingface", PROC_DIR)


@pytest.fixture(scope="module")
def proc(tok):
    return load_image_processor(PROC_DIR, tok.token_id)


@pytest.fixture
def images_dir(tmp_path):
    for name, (w, h, c, fmt) in SHAPES.items():
        (tmp_path / name).write_bytes(draw(w, h, c, fmt))
    return tmp_path


def good_rows():
    data_url = "data:image/png;base64," + base64.b64encode(draw(70, 70, (9, 9, 9), "PNG")).decode()
    return [user(img("red_circle.png"), text("What colour is the circle?"), answer="Red."),
            {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": [text("Compare "), img("blue_box.jpg"),
                                                       text(" and "), img("green_tall.png")]},
                          {"role": "assistant", "content": [text("Blue is wide, "), text("green tall.")]}]},
            {"messages": [{"role": "user", "content": "no image here"},
                          {"role": "assistant", "content": "fine"}]},
            user(text("inline:"), {"type": "image", "image": data_url}, answer="Black."),
            user({"type": "image", "base64": base64.b64encode(draw(40, 120, (1, 2, 3), "PNG")).decode()},
                 answer="A tall one.")]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def preprocess(inputs, prefix, *extra):
    args = ["--input", *map(str, inputs), "--output-prefix", str(prefix), "--chat",
            "--tokenizer-type", "huggingface", "--tokenizer-model", PROC_DIR,
            "--max-rejected-fraction", "1", *extra]
    assert main(args) == 0
    return f"{prefix}_text_document"


def sources_of(row, base):
    """(bytes) of each image of a row, in order (the reference reads them itself)."""
    out = []
    for m in row["messages"]:
        for p in m["content"] if isinstance(m["content"], list) else []:
            if p["type"] != "image":
                continue
            if "path" in p:
                out.append((base / p["path"]).read_bytes())
            elif "base64" in p:
                out.append(base64.b64decode(p["base64"]))
            else:
                out.append(base64.b64decode(p["image"].split(",", 1)[1]))
    return out


def test_end_to_end_tokens_masks_pixels_and_positions(images_dir, tok, proc, capsys):
    """Each image part becomes exactly the processor's placeholder run where the template wrote
    <im_patch> (reference: the rendered text with the run's tokens spliced in as text, tokenized);
    no run token is a target; the loader's images are the processor's pixels of the original
    files, in token order, and feature_positions are exactly where tokens == <im_patch>."""
    rows = good_rows()
    prefix = preprocess([write_jsonl(images_dir / "rows.jsonl", rows)], images_dir / "out" / "vlm")
    assert "images 5 (" in capsys.readouterr().out
    text_ds, mask_ds = IndexedDataset(prefix), IndexedDataset(prefix.replace("_text_", "_loss_mask_"))
    assert len(text_ds) == len(rows)
    all_pixels = []
    for d, row in enumerate(rows):
        msgs = [{**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]
                 if isinstance(m["content"], list) and m["role"] != "assistant" else
                 ("".join(p["text"] for p in m["content"]) if isinstance(m["content"], list) else m["content"])}
                for m in row["messages"]]
        rendered = tok.apply_chat_template(msgs)
        pics = [Image.open(io.BytesIO(b)) for b in sources_of(row, images_dir)]
        pieces = rendered.split("<im_patch>")
        assert len(pieces) == len(pics) + 1
        want = tok.encode(pieces[0])
        for p, piece in zip(pics, pieces[1:]):
            want += proc.placeholder_ids(*p.size) + tok.encode(piece)
            all_pixels.append(proc.pixels(p))
        ids, mask = np.asarray(text_ds[d]), np.asarray(mask_ds[d])
        assert ids.tolist() == want, d
        runs = [t in proc.token_ids.values() for t in ids.tolist()]
        assert not mask[np.array(runs, bool)].any()  # image tokens are never targets
        assert tok.decode(ids[mask == 1]).startswith(("Red.", "Blue is wide, green tall.", "fine",
                                                      "Black.", "A tall one."))
    src = open_source(prefix, 256, "split", 0, image_processor=image_processor_from_settings)
    loader = THDLoader([(1.0, src)], seq_length=256, micro_batch_size=src.plan.num_packs, pad_id=0)
    b = loader.micro_batch(0)
    t, lab = b.tokens.numpy(), b.labels.numpy()
    assert b.images.feature_positions.tolist() == np.flatnonzero(t == proc.image_token_id).tolist()
    assert not np.isin(lab, list(proc.token_ids.values())).any()  # no label is an image token
    # the images in token order: match each global view to the reference's, crops with it
    im = b.images
    assert len(im.num_local_patches) == 5 and im.pixel_values.shape[1:] == (3, 112, 112)
    refs = {torch.from_numpy(g).sum().item(): (g, c) for g, c in all_pixels}
    crop_at = np.cumsum((0,) + im.num_local_patches)
    for k in range(5):
        g, c = refs[im.pixel_values[k].sum().item()]
        assert torch.equal(im.pixel_values[k], torch.from_numpy(g))
        assert torch.equal(im.pixel_values_local[crop_at[k]:crop_at[k + 1]], torch.from_numpy(c))
    features = sum(proc.global_tokens + n * proc.crop_tokens for n in im.num_local_patches)
    assert features == len(im.feature_positions)  # what the vision tower will produce
    assert inspect_main(["--data-path", prefix, "--seq-length", "256"]) == 0
    out = capsys.readouterr().out
    share = (np.isin(np.concatenate([text_ds[d] for d in range(len(text_ds))]),
                     list(proc.token_ids.values()))).mean()
    assert "images       5 in" in out and f"({100 * share:.2f}% of the packed tokens)" in out


def test_broken_images_are_rejected_with_file_and_reason(images_dir, capsys):
    """Unreadable (garbage, truncated, missing), zero-size, oversized and remote images reject
    their rows naming the image and the reason; accepted + rejected == rows read."""
    (images_dir / "garbage.png").write_bytes(b"not an image at all")
    (images_dir / "trunc.jpg").write_bytes(draw(120, 90, (5, 5, 5), "JPEG")[:400])
    (images_dir / "empty.png").write_bytes(b"")
    (images_dir / "big.png").write_bytes(draw(400, 300, (7, 7, 7), "PNG"))
    bad = [(img("garbage.png"), "image_unreadable", "garbage.png"),
           (img("trunc.jpg"), "image_unreadable", "trunc.jpg"),
           (img("missing.png"), "image_unreadable", "missing.png"),
           (img("empty.png"), "image_empty", "empty.png"),
           (img("big.png"), "image_too_large", "120,000 pixels"),
           ({"type": "image", "url": "https://example.com/cat.png"}, "image_url", "never downloads"),
           ({"type": "image", "base64": "@@@"}, "image_unreadable", "not valid base64")]
    rows = good_rows()[:2] + [user(p) for p, _, _ in bad] + [
        {"messages": [{"role": "user", "content": "<im_patch> typed"}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [img("red_circle.png")]}]}]
    prefix = images_dir / "o"
    preprocess([write_jsonl(images_dir / "rows.jsonl", rows)], prefix, "--max-image-pixels", "100000")
    summary = capsys.readouterr().out
    assert "rows read 11, accepted 2, rejected 9" in summary
    rej = [json.loads(line) for line in open(f"{prefix}_rejects.jsonl")]
    got = [(r["line"], r["reason"]) for r in rej]
    assert got == [(3 + i, reason) for i, (_, reason, _) in enumerate(bad)] + [
        (10, "image_placement"), (11, "image_in_assistant")]
    for r, (_, _, what) in zip(rej, bad):
        assert what in r["detail"], r
    assert len(IndexedDataset(f"{prefix}_images_document")) == 3  # the accepted rows' images


def test_parquet_images_column_equals_jsonl_paths(images_dir):
    """A Parquet file whose `images` column holds datasets' Image structs ({bytes, path}, in the
    order of the image parts; bytes and paths alternating) and whose contents are lists of part
    structs gives the same datasets, byte for byte, as JSONL with image paths."""
    rows = good_rows()[:3]
    a = preprocess([write_jsonl(images_dir / "rows.jsonl", rows)], images_dir / "a" / "o")
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    msg = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    messages, images = [], []
    for row in rows:
        parts = [(m["role"], m["content"] if isinstance(m["content"], list) else [text(m["content"])])
                 for m in row["messages"]]
        messages.append([{"role": r, "content": [{"type": p["type"], "text": p.get("text")} for p in c]}
                         for r, c in parts])
        paths = [p["path"] for _, c in parts for p in c if p["type"] == "image"]
        images.append([{"bytes": (images_dir / f).read_bytes(), "path": None} if i % 2 == 0 else
                       {"bytes": None, "path": f} for i, f in enumerate(paths)])
    pq.write_table(pa.table({"messages": pa.array(messages, pa.list_(msg)),
                             "images": pa.array(images, pa.list_(image))}), images_dir / "rows.parquet")
    b = preprocess([images_dir / "rows.parquet"], images_dir / "b" / "o")
    for key in ("text", "loss_mask", "images", "image_index"):
        for ext in (".bin", ".idx"):
            want, got = (open(p.replace("_text_", f"_{key}_") + ext, "rb").read() for p in (a, b))
            assert got == want, (key, ext)


def _long_doc_prefix(images_dir):
    rows = [user(text("word " * 40), img("green_tall.png"), text(" tail"), answer="Green.")]
    return preprocess([write_jsonl(images_dir / "long.jsonl", rows)], images_dir / "l" / "o")


def test_a_pack_that_cuts_an_image_run_is_refused_when_the_plan_is_built(images_dir):
    """Split across packs or truncated inside an image's run: refused by open_source (at start-up,
    not when the pack comes up mid-run), in the words of the --long-docs policy that cut it."""
    prefix = _long_doc_prefix(images_dir)
    start, length = IndexedDataset(image_prefixes(prefix)[1]).get(0)[:2].tolist()
    seq = int(start) + int(length) // 2  # the pack ends inside the run
    for policy, verb in (("split", "splits"), ("truncate", "cuts")):
        with pytest.raises(DatasetError, match=rf"document 0 \(208 tokens, longer than --seq-length\) would "
                                               rf"lose part of its image 0: --long-docs {policy} {verb} it at "
                                               rf"token {seq}, inside .*Use --long-docs drop to leave such "
                                               "documents out, or a --seq-length of at least 208"):
            open_source(prefix, seq, policy, 0, image_processor=image_processor_from_settings)
    store = open_source(prefix, 512, "split", 0, image_processor=image_processor_from_settings).images
    with pytest.raises(DatasetError, match=f"at token {seq}, inside"):  # the loader's own check stays
        store.images_in(0, 0, seq)
    open_source(prefix, start, "truncate", 0, image_processor=image_processor_from_settings)  # before it


def test_processor_and_files_must_match_the_dataset(images_dir, proc):
    prefix = _long_doc_prefix(images_dir)
    with pytest.raises(ValueError, match="holds images: reading it needs the image processor"):
        open_source(prefix, 512, "split", 0)
    other = image_processor_from_settings({**proc.settings, "patch_size": 28}, proc.token_ids)
    with pytest.raises(ValueError, match="made with image processor settings"):
        open_source(prefix, 512, "split", 0, image_processor=other)
    src = open_source(prefix, 512, "split", 0, image_processor=proc)
    src.images = None  # a source built without its images (validation parts, say)
    with pytest.raises(ValueError, match="holds images but was opened without them"):
        THDLoader([(1.0, src)], seq_length=512, micro_batch_size=1, pad_id=0)
    os.remove(image_prefixes(prefix)[0] + ".idx")
    with pytest.raises(ValueError, match="images dataset .* is missing"):
        open_source(prefix, 512, "split", 0, image_processor=proc)


def test_a_text_only_run_joins_text_parts_and_rejects_images(tmp_path, images_dir):
    """Without an image processor (the built-in template here) a list of text parts is text, as
    before; an image part rejects its row (images_unsupported)."""
    rows = [{"messages": [{"role": "user", "content": [text("a "), text("b")]},
                          {"role": "assistant", "content": "c"}]},
            user(img("red_circle.png"))]
    assert main(["--input", str(write_jsonl(tmp_path / "r.jsonl", rows)), "--output-prefix",
                 str(tmp_path / "o"), "--chat", "--max-rejected-fraction", "1"]) == 0
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert build_tokenizer("byte").decode(ds[0]).startswith("<|im_start|>user\na b<|im_end|>")
    rej = [json.loads(line) for line in open(tmp_path / "o_rejects.jsonl")]
    assert [(r["line"], r["reason"]) for r in rej] == [(2, "images_unsupported")]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """An image dataset and a text-only chat dataset (the same tokenizer, no images)."""
    d = tmp_path_factory.mktemp("mixed")
    for name, (w, h, c, fmt) in SHAPES.items():
        (d / name).write_bytes(draw(w, h, c, fmt))
    rows = good_rows() * 3
    with_images = preprocess([write_jsonl(d / "rows.jsonl", rows)], d / "img" / "o")
    plain = [{"messages": [{"role": "user", "content": f"question {i}"},
                           {"role": "assistant", "content": "answer " * (i % 7 + 1)}]} for i in range(12)]
    # the same tokenizer without the processor folder: a text-only chat run
    assert main(["--input", str(write_jsonl(d / "t.jsonl", plain)), "--output-prefix", str(d / "txt" / "o"),
                 "--chat", "--tokenizer-type", "huggingface", "--tokenizer-model",
                 os.path.join(PROC_DIR, "tokenizer.json")]) == 0
    text_only = str(d / "txt" / "o_text_document")
    assert not os.path.exists(image_prefixes(text_only)[0] + ".idx")
    return with_images, text_only


@settings(max_examples=8, deadline=None)
@given(seq=st.sampled_from([96, 128, 200]), mbs=st.integers(1, 3), seed=st.integers(0, 9),
       pad=st.sampled_from([1, 4]), m=st.integers(0, 3))
def test_positions_are_the_image_tokens_in_any_blend(mixed, proc, seq, mbs, seed, pad, m):
    """Whatever the packing, blend and micro-batch: feature_positions == where tokens are
    <im_patch>, one global view per image run, crops as the runs' sizes say; a text-only
    dataset's micro-batches have no images; a CP shard keeps the whole pack's images and the
    placeholders it holds."""
    with_images, text_only = mixed
    srcs = [(0.5, open_source(with_images, seq, "split", seed, pad_multiple=pad,
                              image_processor=image_processor_from_settings)),
            (0.5, open_source(text_only, seq, "split", seed, pad_multiple=pad))]
    b = THDLoader(srcs, seq_length=seq, micro_batch_size=mbs, pad_id=0, seed=seed,
                  pad_multiple=pad).micro_batch(m)
    tokens = b.tokens.numpy()
    where = np.flatnonzero(tokens == proc.image_token_id)
    if b.images is None:
        assert len(where) == 0
    else:
        assert b.images.feature_positions.tolist() == where.tolist()
        assert (tokens == proc.token_ids["<im_start>"]).sum() == len(b.images.num_local_patches)
        assert (tokens == proc.token_ids["<patch_start>"]).sum() == sum(b.images.num_local_patches)
        assert not np.isin(b.labels.numpy(), list(proc.token_ids.values())).any()
    text_b = THDLoader([srcs[1]], seq_length=seq, micro_batch_size=mbs, pad_id=0).micro_batch(0)
    assert text_b.images is None
    if pad % 4 == 0 and b.images is not None:  # each CP shard: all the pack's images, its own placeholders
        for r in range(2):
            shard = shard_batch(b, 2, r)
            here = np.flatnonzero(shard.tokens.numpy() == proc.image_token_id)
            if shard.images is None:
                assert len(here) == 0
                continue
            im = shard.images
            assert im.pixel_values is b.images.pixel_values and im.num_features == len(where)
            assert im.feature_positions.tolist() == here.tolist()
            # the tower's feature k goes where the whole pack's feature k went
            assert b.images.feature_positions[im.feature_index].tolist() == \
                shard.packed_seq_params.cp.index[here].tolist()
