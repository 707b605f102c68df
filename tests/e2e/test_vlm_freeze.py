"""--freeze-vision / --freeze-projector / --freeze-language on the tiny VLM through the command
line, trained on image + text chat rows (examples/data/make_shapes_vlm.py, preprocessed with the
tests' tiny processor): a frozen part is bit-identical after training while the others move
(AdamW with weight decay moves every trained parameter), it has no optimizer state, and the
checkpoint still holds it (a whole model, unlike a LoRA base); bad combinations are refused."""
from __future__ import annotations

import pytest
import torch

from tests.e2e.conftest import PROCESSOR
from tests.e2e.test_training import COMMON, run_in_process, train

VLM = ["--model-preset", "step37-tiny-vlm", "--vocab-size", "400", "--tokenizer-type", "huggingface",
       "--tokenizer-model", PROCESSOR, "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "2",
       "--optimizer", "adamw", "--lr", "1e-2", "--weight-decay", "0.1", "--lr-warmup-iters", "0"]


def _params(path: str) -> dict:
    from tools.generate import load_model

    model, _, _ = load_model(path)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("part", ["vision", "language"])
def test_a_frozen_part_stays_as_it_was_and_the_rest_trains(shapes_data, tmp_path, part):
    rows = train(["--data-path", shapes_data, *VLM, f"--freeze-{part}", "--train-iters", "2",
                  "--save", str(tmp_path / "ck"), "--save-interval", "1"], tmp_path / "log")
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    one, two = _params(str(tmp_path / "ck" / "iter_0000001")), _params(str(tmp_path / "ck" / "iter_0000002"))
    frozen = {n for n in one if (n.startswith("vision_model.") if part == "vision" else
                                 not n.startswith(("vision_model.", "multi_modal_projector.")))}
    assert frozen and len(frozen) < len(one)
    for n in one:
        same = torch.equal(one[n], two[n])
        assert same == (n in frozen), n  # frozen: bit-identical; trained: moved (weight decay at least)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(tmp_path / "ck" / "iter_0000002")).read_metadata().state_dict_metadata
    assert any(k.startswith("model/") and k[len("model/"):].split("#")[0] in frozen for k in keys)  # saved
    bad = [k for k in keys if k.startswith("optim/") and k.split("/")[2].split("#")[0] in frozen]
    assert not bad and any(k.startswith("optim/") for k in keys), bad[:5]  # no state for a frozen part


def test_freeze_flags_are_refused_where_they_cannot_serve(dataset, shapes_data, tmp_path, capfd):
    rc, why = run_in_process(COMMON + ["--data-path", dataset, "--freeze-vision", "--log-dir", str(tmp_path / "a")])
    why += capfd.readouterr().err
    assert rc != 0 and "--freeze-vision: the model has no vision part" in why
    rc, why = run_in_process(COMMON + ["--data-path", shapes_data, *VLM, "--freeze-vision", "--freeze-projector",
                                       "--freeze-language", "--log-dir", str(tmp_path / "b")])
    why += capfd.readouterr().err
    assert rc != 0 and "nothing would be left to train" in why
    rc, why = run_in_process(COMMON + ["--data-path", shapes_data, *VLM, "--freeze-vision", "--lora-rank", "4",
                                       "--log-dir", str(tmp_path / "c")])
    why += capfd.readouterr().err
    assert rc != 0 and "--freeze-vision with --lora-rank: LoRA freezes every base weight already" in why
    # an image dataset needs a model with a vision tower
    rc, why = run_in_process(COMMON + ["--data-path", shapes_data, "--vocab-size", "400", "--log-dir",
                                       str(tmp_path / "d")])
    why += capfd.readouterr().err
    assert rc != 0 and "holds images, but the model has no vision tower" in why
    import dataclasses
    import json

    from models.step37 import Step37Config

    (tmp_path / "other").mkdir()
    other = dataclasses.replace(Step37Config.preset("step37-tiny-vlm"), image_token_id=7)
    (tmp_path / "other" / "config.json").write_text(json.dumps(other.to_hf()))
    rc, why = run_in_process(COMMON + ["--data-path", shapes_data, "--hf-config", str(tmp_path / "other"),
                                       "--log-dir", str(tmp_path / "e")])
    why += capfd.readouterr().err
    assert rc != 0 and "its image placeholders are token 3, the model's image_token_id is 7" in why
