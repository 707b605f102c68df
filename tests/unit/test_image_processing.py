"""Step-3.7's image preprocessing (models/step37/image_processing.py) against transformers'
Step3p7ImageProcessor / Step3p7Processor, through the fixtures that
tests/fixtures/step3p7_processor/make_fixtures.py made with torchvision (not needed here).

- pixels: every global view and crop of 21 images (tiny, degenerate aspect, elongated, landscape,
  portrait, over the longest-side limit; RGB, RGBA, LA, L, 1, P, P and RGB with a transparency
  entry, CMYK), under both of torchvision's resize paths: native uint8 (AVX2 / AVX512 / ARM) and
  float32 rounded back (other CPUs; checked only under ``ATEN_CPU_CAPABILITY=default``, the
  dispatch it runs under there: torch's float kernel rounds a few pixels differently under AVX).
  The fixtures store the uint8 images transformers normalises (the generator checked that they
  normalise back to its float32 output bit for bit); the expected floats are computed here in
  float64, ``(u / 255 - mean) / std``, so the 1e-6 tolerance covers float32 rounding of values of
  size ~2 (a few ulps of 2.4e-7), not any real difference. Two cases are also compared with
  transformers' float32 output directly.
- tokens: chat rows rendered with the tiny processor folder's template and expanded, equal to the
  processor's input ids exactly; crop counts equal ``get_number_of_image_patches`` on 517 sizes.
- a property over random sizes: the placeholder count is crops x (per-crop + 2) + row breaks +
  global + 2, the counts taken from the settings and the grid, not from the expansion.
- the settings round trip and the errors (unknown processor type, missing config, ...).
"""
from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings as hsettings, strategies as st
from PIL import Image

from models.registry import image_processor_from_settings, load_image_processor
from models.step37 import image_processing as ip
from models.step37.image_processing import Step37ImageProcessor

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                        "step3p7_processor")
TOL = 1e-6  # float32 rounding of O(1) values (see the module docstring); we are in fact bitwise


@pytest.fixture(scope="module")
def tokens() -> dict:
    with open(os.path.join(FIXTURES, "tokens.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tokenizer():
    from data.tokenizers import build_tokenizer

    return build_tokenizer("huggingface", FIXTURES)


def token_id_of(tokenizer):
    def token_id(token: str) -> int:
        ids = tokenizer.encode(token)
        if len(ids) != 1:
            raise KeyError(f"{token!r} is not one token")
        return ids[0]
    return token_id


@pytest.fixture(scope="module")
def procs(tokenizer) -> dict:
    small = load_image_processor(FIXTURES, token_id_of(tokenizer))
    default = Step37ImageProcessor.from_settings({}, small.token_ids)
    return {"small": small, "default": default}


@pytest.fixture(scope="module")
def images() -> dict:
    with np.load(os.path.join(FIXTURES, "images.npz")) as z:
        return {k: z[k].tobytes() for k in z.files}


def load(png: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(png))
    img.load()
    return img


# the float path's cases: one of each resize geometry (shrink, stretch, square pad, crops, snap)
FLOAT_CASES = ("tiny_5x3", "extreme_200x20", "fits_112x60", "landscape_300x200", "odd_131x97", "aspect4_1000x250")


def expected(u8: np.ndarray, proc: Step37ImageProcessor) -> np.ndarray:
    mean = np.array(proc.settings["image_mean"], np.float64).reshape(-1, 1, 1)
    std = np.array(proc.settings["image_std"], np.float64).reshape(-1, 1, 1)
    return (u8.astype(np.float64) / 255 - mean) / std


def cases() -> list:
    with open(os.path.join(FIXTURES, "tokens.json"), encoding="utf-8") as f:
        return json.load(f)["cases"]


@pytest.mark.parametrize("native,npz", [(True, "pixels.npz"), (False, "pixels_float.npz")],
                         ids=["native_uint8", "float32"])
def test_pixels_equal_transformers(monkeypatch, procs, images, native, npz):
    import torch

    if not native and torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        # torch's float32 resize rounds a few pixels differently under AVX dispatch; torchvision
        # takes this path only on CPUs without AVX2, i.e. under the DEFAULT dispatch, which torch
        # reads at import: this case runs itself again in a process that starts with it.
        import subprocess
        import sys

        env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                              f"{__file__}::test_pixels_equal_transformers[float32]"],
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]
        return
    monkeypatch.setattr(ip, "native_uint8_resize", lambda: native)
    with np.load(os.path.join(FIXTURES, npz)) as z:
        ref = {k: z[k] for k in z.files}
    checked = 0
    for name, width, height, mode, geometry in cases():
        if not native and name not in FLOAT_CASES:
            continue  # the float path differs in the resize only, and runs slowly without SIMD
        proc = procs[geometry]
        img = load(images[name])
        assert img.size == (width, height)
        glob, crops = proc.pixels(img)
        assert glob.dtype == crops.dtype == np.float32
        assert glob.shape == (3, proc.image_size, proc.image_size), name
        n = int(ref[f"{name}/num_crops"])
        assert crops.shape == (n, 3, proc.patch_size, proc.patch_size), name
        assert proc.plan(width, height).num_crops == n, name
        np.testing.assert_allclose(glob, expected(ref[f"{name}/global"], proc), rtol=0, atol=TOL,
                                   err_msg=f"{name} ({mode}) global view")
        keep = ref[f"{name}/crop_index"]
        np.testing.assert_allclose(crops[keep], expected(ref[f"{name}/crops"], proc), rtol=0, atol=TOL,
                                   err_msg=f"{name} ({mode}) crops")
        if native and f"{name}/global_float" in ref:  # transformers' float32 itself
            np.testing.assert_allclose(glob, ref[f"{name}/global_float"], rtol=0, atol=TOL)
            np.testing.assert_allclose(crops, ref[f"{name}/crops_float"], rtol=0, atol=TOL)
            checked += 1
    assert checked == (2 if native else 0)


def test_chat_rows_expand_as_the_processor(procs, images, tokenizer, tokens):
    for geometry, rows in tokens["chats"].items():
        proc = procs[geometry]
        for row in rows:
            text = tokenizer.apply_chat_template(row["messages"])
            assert text == row["text"]
            sizes = [Image.open(io.BytesIO(images[n])).size for n in row["images"]]  # header only
            assert proc.expand_ids(tokenizer.encode(text), sizes) == row["input_ids"], row["images"]
            per_image = sum(proc.num_placeholders(*s) for s in sizes)
            assert len(row["input_ids"]) == len(tokenizer.encode(text)) - len(sizes) + per_image


def test_crop_counts_equal_transformers(procs, tokens):
    for geometry, rows in tokens["patch_counts"].items():
        got = [[w, h, procs[geometry].plan(w, h).num_crops] for w, h, _n in rows]
        assert got == rows, geometry


@hsettings(max_examples=300, deadline=None)
@given(width=st.integers(1, 8000), height=st.integers(1, 8000),
       geometry=st.sampled_from(["default", "small"]))
def test_placeholder_count_property(procs, width, height, geometry):
    proc = procs[geometry]
    s = proc.settings
    stride = s["vision_patch_size"] * s["downsampler_stride"]
    per_crop, per_global = (s["patch_size"] // stride) ** 2, (s["image_size"] // stride) ** 2
    plan = proc.plan(width, height)
    cols, rows = plan.grid
    n = cols * rows
    if plan.window:
        assert n >= 1 and plan.crop_size[0] in (plan.global_size[0], cols * plan.window)
        assert plan.crop_size[1] in (plan.global_size[1], rows * plan.window)
    ids = proc.placeholder_ids(width, height)
    breaks = rows - 1 if n else 0
    assert len(ids) == n * (per_crop + 2) + breaks + per_global + 2 == proc.num_placeholders(width, height)
    t = proc.token_ids
    assert ids.count(t["<patch_start>"]) == ids.count(t["<patch_end>"]) == n
    assert ids.count(t["<patch_newline>"]) == breaks
    assert ids.count(t["<im_patch>"]) == n * per_crop + per_global
    assert ids[-per_global - 2:] == [t["<im_start>"]] + [t["<im_patch>"]] * per_global + [t["<im_end>"]]


def test_settings_round_trip(procs):
    for proc in procs.values():
        stored = json.loads(json.dumps({"settings": proc.settings, "token_ids": proc.token_ids}))
        again = image_processor_from_settings(stored["settings"], stored["token_ids"])
        assert again.settings == proc.settings and again.token_ids == proc.token_ids
        assert again.placeholder_ids(1000, 300) == proc.placeholder_ids(1000, 300)
    assert procs["default"].global_tokens == 169 and procs["default"].crop_tokens == 81


def write(folder, name, obj):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
        json.dump(obj, f)


def test_config_files_and_errors(tmp_path, procs):
    ids = procs["small"].token_ids
    token_id = ids.__getitem__
    # transformers >= 5 nests the image processor in processor_config.json; it wins, as there
    write(tmp_path / "nested", "processor_config.json",
          {"image_processor": {"image_processor_type": "Step3p7ImageProcessorFast", "patch_size": 112}})
    write(tmp_path / "nested", "preprocessor_config.json", {"image_processor_type": "Step3p7ImageProcessor"})
    assert load_image_processor(str(tmp_path / "nested"), token_id).patch_size == 112
    write(tmp_path / "nulls", "preprocessor_config.json",
          {"image_processor_type": "Step3p7ImageProcessor", "size": None, "image_mean": None, "resample": 2})
    assert load_image_processor(str(tmp_path / "nulls"), token_id).settings == procs["default"].settings

    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        load_image_processor(str(tmp_path / "empty"), token_id)
    write(tmp_path / "other", "preprocessor_config.json", {"image_processor_type": "CLIPImageProcessor"})
    with pytest.raises(ValueError, match=r"other/preprocessor_config.json.*'CLIPImageProcessor'"):
        load_image_processor(str(tmp_path / "other"), token_id)
    with pytest.raises(ValueError, match="'CLIPImageProcessor' is not Step-3.7's"):
        Step37ImageProcessor.from_pretrained(str(tmp_path / "other"), token_id)
    write(tmp_path / "bad", "preprocessor_config.json", {"image_processor_type": "Step3p7ImageProcessor",
                                                         "resample": 3})
    with pytest.raises(ValueError, match="bad/preprocessor_config.json: resample 3"):
        load_image_processor(str(tmp_path / "bad"), token_id)
    write(tmp_path / "edge", "preprocessor_config.json", {"size": {"shortest_edge": 224}})
    with pytest.raises(ValueError, match="edge/preprocessor_config.json: size"):
        Step37ImageProcessor.from_pretrained(str(tmp_path / "edge"), token_id)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken/preprocessor_config.json: cannot read it as JSON"):
        load_image_processor(str(tmp_path / "broken"), token_id)
    with pytest.raises(ValueError, match="has no '<patch_newline>'"):
        load_image_processor(FIXTURES, {k: v for k, v in ids.items() if k != "<patch_newline>"}.__getitem__)
    with pytest.raises(ValueError, match="the image tokens share ids"):
        load_image_processor(FIXTURES, lambda token: 0)  # a tokenizer answering unk for all
    with pytest.raises(ValueError, match="not a registered model family"):
        image_processor_from_settings({"image_processor_type": "Nope"}, ids)
    with pytest.raises(ValueError, match="unknown image processor settings"):
        Step37ImageProcessor.from_settings({"patch": 3}, ids)
    with pytest.raises(ValueError, match="2 <im_patch> token"):
        procs["small"].expand_ids([ids["<im_patch>"]] * 2, [(10, 10)])
    with pytest.raises(ValueError, match="both sides must be positive"):
        procs["small"].plan(0, 10)
