"""Hugging Face checkpoints that must not load silently (issue 24 items 1, 5, 8): weights of a
dtype the reader does not convert (a DeepSeek-style fp8 layout with scale tensors, int and bool
tensors), stale files of an earlier export, broken files; and the converter's own errors."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.checkpoint.hf import CheckpointFileError, check_checkpoint
from models.step37 import Step37Config, Step37Model
from tools.convert_checkpoint import main as convert




@pytest.fixture()
def exported(tmp_path):
    """The tiny model exported in the published layout (one file), and the model."""
    model = Step37Model(Step37Config.preset("tiny"), seed=1)
    path = tmp_path / "hf"
    model.save_hf(str(path))
    return path, model


def _rewrite(path, fn):
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_fp8_weights_with_scales_are_refused_naming_the_tensor(exported, capsys):
    path, model = exported
    name = next(k for k in load_file(os.path.join(path, "model.safetensors")) if k.endswith("gate_up_proj"))

    def quantize(t):
        t[name] = t[name].to(torch.float8_e4m3fn)
        t[name + "_scale_inv"] = torch.ones(t[name].shape[0], dtype=torch.float32)
    _rewrite(path, quantize)
    fresh = Step37Model(Step37Config.preset("tiny"))
    with pytest.raises(ValueError, match=rf"{name} \(for layers\.1\.moe\.experts\.(gate|up)_proj\) is F8_E4M3 with "
                                         r"scale tensors beside it .*a quantized checkpoint; dequantize it to bf16"):
        fresh.load_hf(str(path))
    report = check_checkpoint(fresh, str(path))
    assert [w[2] for w in report["wrong_dtype"]] and report["unexpected"] == [name + "_scale_inv"]
    assert convert(["check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "of an unread dtype" in out and "DOES NOT FIT" in out and "F8_E4M3" in out


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_int_and_bool_weights_are_refused(exported, dtype):
    path, _ = exported
    _rewrite(path, lambda t: t.update({"norm.weight": t["norm.weight"].to(dtype)}))
    with pytest.raises(ValueError, match=r"norm\.weight \(for norm\.weight\) is (I64|BOOL): not a weight"):
        Step37Model(Step37Config.preset("tiny")).load_hf(str(path))


def test_bf16_and_fp16_weights_convert(exported):
    path, model = exported
    _rewrite(path, lambda t: t.update({k: v.to(torch.bfloat16 if i % 2 else torch.float16)
                                       for i, (k, v) in enumerate(t.items())}))
    fresh = Step37Model(Step37Config.preset("tiny"))
    report = fresh.load_hf(str(path))
    # the side file (head, MTP) stays fp32
    assert set(check_checkpoint(fresh, str(path))["dtypes"]) == {"BF16", "F16", "F32"} and report["missing"] == []


def test_a_re_export_leaves_nothing_stale(tmp_path, capsys):
    """A sharded export, then a single-file one into the same directory: the old shards and index
    are gone (and said), so every loader reads the new weights."""
    from core.checkpoint.sharded import save_checkpoint

    a, b = (Step37Model(Step37Config.preset("tiny"), seed=s) for s in (1, 2))
    out = tmp_path / "hf"
    a.save_hf(str(out), max_shard_bytes=200_000)
    assert (out / "model.safetensors.index.json").exists()
    save_checkpoint(str(tmp_path / "ck"), 3, [b], None, {}, {"family": "step37", "model": b.config.to_dict(),
                                                              "tokenizer": {"pad_id": 0}})
    assert convert(["export", str(tmp_path / "ck"), str(out)]) == 0
    assert "removed" in capsys.readouterr().out and not (out / "model.safetensors.index.json").exists()
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "step37_extra.safetensors"]
    again = Step37Model(Step37Config.preset("tiny"))
    again.load_hf(str(out))
    assert all(torch.equal(p, q) for p, q in zip(again.parameters(), b.parameters()))


def test_an_index_beside_a_file_it_does_not_name_is_refused(exported):
    path, model = exported
    model.save_hf(str(path.parent / "sharded"), max_shard_bytes=200_000)
    for f in os.listdir(path.parent / "sharded"):
        if f.startswith("model-") or f.endswith(".index.json"):
            os.rename(path.parent / "sharded" / f, path / f)
    with pytest.raises(CheckpointFileError, match="holds both model.safetensors.index.json .* and model.safetensors, "
                                                  "which the index does not name: one is stale"):
        Step37Model(Step37Config.preset("tiny")).load_hf(str(path))


def test_a_truncated_file_and_a_wrong_index_name_the_file_and_tensor(exported):
    path, model = exported
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointFileError, match=rf"{f}: not a readable safetensors file"):
        Step37Model(Step37Config.preset("tiny")).load_hf(str(path))
    f.write_bytes(data)
    keys = list(load_file(str(f)))
    index = {"metadata": {}, "weight_map": {**{k: "model.safetensors" for k in keys}, "norm.weight": "other.safetensors"}}
    save_file({"x": torch.zeros(1)}, str(path / "other.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFileError, match=r"other\.safetensors: cannot read tensor norm\.weight "
                                                  r"\(model\.safetensors\.index\.json says it does\)"):
        Step37Model(Step37Config.preset("tiny")).load_hf(str(path))


def test_the_converter_names_its_own_arguments(tmp_path, capsys):
    from core.checkpoint.sharded import save_checkpoint

    assert convert(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"CKPT {tmp_path / 'nothing'}: no 'latest' pointer" in err and "--load" not in err
    model = Step37Model(Step37Config.preset("tiny"), seed=1)
    save_checkpoint(str(tmp_path / "run"), 200, [model], None, {}, {"family": "step37", "model": model.config.to_dict()})
    model.save_hf(str(tmp_path / "hf"))
    assert convert(["import", str(tmp_path / "hf"), str(tmp_path / "run")]) == 1
    assert "already holds a run's checkpoints ('latest' is iter_0000200)" in capsys.readouterr().err
    assert (tmp_path / "run" / "latest").read_text().strip() == "iter_0000200"


def test_out_onto_a_plain_file_is_one_clear_line(tmp_path, capsys):
    """export (and import) onto a path where a file stands: refused before any work, naming OUT,
    not a raw [Errno 17] (or [Errno 20] for a path inside a file)."""
    (tmp_path / "taken").write_text("not a folder")
    for argv, message in [
        (["export", str(tmp_path / "run"), str(tmp_path / "taken")],
         f"OUT {tmp_path / 'taken'} is a file, not a folder: export writes a folder there; remove the file "
         "or choose another OUT"),
        (["export", str(tmp_path / "run"), str(tmp_path / "taken" / "hf")],
         f"OUT {tmp_path / 'taken' / 'hf'} is inside {tmp_path / 'taken'}, which is a file, not a folder: "
         "export writes a folder there"),
        (["import", str(tmp_path / "hf"), str(tmp_path / "taken")],
         f"OUT {tmp_path / 'taken'} is a file, not a folder: import writes a folder there"),
    ]:
        assert convert(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"convert_checkpoint: error: {message}") and err.count("\n") == 1, err
        assert "Errno" not in err
    assert (tmp_path / "taken").read_text() == "not a folder"
