"""tools/generate.py --image: a tiny vision-language checkpoint (random weights) answers about an
image. Greedy decoding is the argmax of the model's own logits with the image features written
at the placeholders, and the image is seen: another image changes the logits. Errors are one
line."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from core.checkpoint.sharded import save_checkpoint
from core.packed_seq import ImageInputs, PackedSeqParams
from data.tokenizers import build_tokenizer
from models import registry
from tools.generate import generate, load_model, main, next_token_logits
from tools.image_prompt import ImagePrompts

ROOT = __file__.rsplit("/tests/", 1)[0]
PROCESSOR = os.path.join(ROOT, "tests", "fixtures", "step3p7_processor")


def _checkpoint(tmp_path, preset="step37-tiny-vlm"):
    spec, cfg = registry.resolve(preset, vocab_size=400)  # the fixture tokenizer's 400 ids
    torch.manual_seed(0)
    model = spec.build(cfg)
    meta = {"family": spec.family, "model": cfg.to_dict(),
            "tokenizer": {"type": "huggingface", "model": PROCESSOR}}
    save_checkpoint(str(tmp_path / "ck"), 3, [model], None, {}, meta)
    return model.eval(), str(tmp_path / "ck")


def _image(tmp_path, name, size, colour):
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (250, 250, 240))
    ImageDraw.Draw(img).ellipse((10, 10, size[0] - 10, size[1] - 10), fill=colour)
    path = str(tmp_path / name)
    img.save(path)
    return path


class _Args:
    def __init__(self, images):
        self.image, self.tokenizer_type, self.tokenizer_model = images, None, None


def test_greedy_with_images_is_the_argmax_of_the_models_logits_and_sees_the_image(tmp_path, capsys):
    saved, ck = _checkpoint(tmp_path)
    model, meta, _ = load_model(ck)
    tok = build_tokenizer("huggingface", PROCESSOR)
    # one image with crops (wider than the 112 px view), one with its global view only
    red = _image(tmp_path, "red.png", (200, 120), (220, 40, 40))
    small = _image(tmp_path, "small.png", (70, 90), (40, 80, 220))
    chat = ImagePrompts(model, tok, meta, _Args([red, small]))
    assert chat.counts[0] > 0 and chat.counts[1] == 0 and chat.crops.shape[0] == chat.counts[0]
    ids = chat.ids("What is in the picture?")
    proc = chat.proc
    want = proc.placeholder_ids(200, 120) + proc.placeholder_ids(70, 90)
    assert [i for i in ids if i in set(want)] == [i for i in want]  # both runs, in order
    new = generate(model, ids, 5, 0.0, 0, stop=-1, generator=torch.Generator(), max_len=4096, vocab=400,
                   images=chat.images(ids))
    full = ids + new
    n = len(full)
    cu = torch.tensor([0, n], dtype=torch.int32)
    # the images as the loader builds them: the processor's pixels, the prompt's placeholders
    g, c = zip(*(proc.pixels(p) for p in chat.pictures))
    images = ImageInputs(torch.stack([torch.as_tensor(x) for x in g]), torch.cat([torch.as_tensor(x) for x in c]),
                         tuple(x.shape[0] for x in c),
                         torch.from_numpy(np.flatnonzero(np.asarray(ids) == proc.image_token_id)))
    with torch.no_grad():
        logits = saved(torch.tensor(full), torch.arange(n), PackedSeqParams(cu, cu.clone(), n), images=images)
    assert len(new) == 5 and logits[len(ids) - 1:-1, :400].argmax(-1).tolist() == new
    # another image of the same size: other features, other logits
    blue = _image(tmp_path, "blue.png", (200, 120), (40, 170, 60))
    other = ImagePrompts(model, tok, meta, _Args([blue, small]))
    assert other.ids("What is in the picture?") == ids
    with torch.no_grad():
        a, b = next_token_logits(model, ids, chat.images(ids)), next_token_logits(model, ids, other.images(ids))
    assert (a - b).abs().max() > 1e-3
    # the command line: one greedy line per prompt, the images named
    assert main(["--load", ck, "--image", red, "--image", small, "--prompt", "Which shape?",
                 "--max-new-tokens", "3", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert f"images {red}, {small}" in out and "[greedy] 'Which shape?' -> " in out


def test_image_errors_are_one_line(tmp_path, capsys):
    _, ck = _checkpoint(tmp_path)
    img = _image(tmp_path, "ok.png", (60, 60), (0, 0, 0))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    cases = [
        (["--image", str(tmp_path / "nope.png")], 1, f"--image {tmp_path / 'nope.png'}: cannot read it"),
        (["--image", str(tmp_path / "broken.png")], 1, f"--image {tmp_path / 'broken.png'}: image_unreadable"),
        (["--image", img, "--tokenizer-type", "byte"], 1, "--image needs a tokenizer folder that holds the "
                                                          "image processor"),
    ]
    for flags, rc, message in cases:
        assert main(["--load", ck, "--max-new-tokens", "1", "--temperature", "0", *flags]) == rc
        captured = capsys.readouterr()
        last = captured.err.splitlines()[-1]  # (a warning for the byte tokenizer goes before it)
        assert last.startswith(f"generate: error: {message}") and captured.out == "", captured.err


def test_a_prompt_that_types_the_image_token_is_refused(tmp_path, capsys):
    _, ck = _checkpoint(tmp_path)
    img = _image(tmp_path, "ok.png", (60, 60), (0, 0, 0))
    assert main(["--load", ck, "--image", img, "--prompt", "look <im_patch>", "--max-new-tokens", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("generate: error: --prompt with --image: the text holds 2 <im_patch> token(s) "
                            "but 1 image(s) came with it\n") and captured.out == ""


def test_a_text_model_refuses_image(tmp_path, capsys):
    spec, cfg = registry.resolve("tiny")
    torch.manual_seed(0)
    save_checkpoint(str(tmp_path / "txt"), 1, [spec.build(cfg)], None, {},
                    {"family": spec.family, "model": cfg.to_dict(), "tokenizer": {"type": "byte", "model": None}})
    img = _image(tmp_path, "ok.png", (60, 60), (0, 0, 0))
    assert main(["--load", str(tmp_path / "txt"), "--image", img, "--max-new-tokens", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("generate: error: --image: the model has no vision tower (step37, text only); "
                            "drop --image or load a vision-language checkpoint\n") and captured.out == ""


@pytest.mark.parametrize("flag", ["--image"])
def test_help_names_the_image_flag(flag):
    from tools.generate import build_parser

    assert flag in build_parser().format_help()
