"""Output folders (core/checkpoint/out_dir.py): every exporter replaces all files an export of ours writes, of
either kind (a merged export over a PEFT folder left adapter_config.json beside the merged
weights, and transformers loaded both: logits 1.5e-2 off), refuses a folder holding other files
unless --overwrite (which keeps them), and refuses, in one line, a folder it cannot write."""
from __future__ import annotations

import json
import os

import pytest
import torch

from core.checkpoint import out_dir
from core.finetune.lora_export import write_peft
from core.checkpoint.out_dir import check_out_dir, clear_owned, export_files
from tests.unit.test_export_config import checkpoint
from tools.convert_checkpoint import main as convert

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TOKENIZER = {"type": "byte", "model": None, "pad_id": 257, "eod_id": 256}


def _touch(folder, *names):
    os.makedirs(folder, exist_ok=True)
    for n in names:
        with open(os.path.join(folder, n), "w") as f:
            f.write("x")


def test_the_files_of_ours_are_replaced_and_no_other_file_is_touched(tmp_path):
    owned = export_files(("step37_extra.safetensors",))
    ours = ["adapter_config.json", "adapter_model.safetensors", "config.json", "model-00001-of-00002.safetensors",
            "model.safetensors", "model.safetensors.index.json", "step37_extra.safetensors"]
    _touch(tmp_path / "out", *ours)
    assert check_out_dir(str(tmp_path / "out"), owned, flag="OUT", tool="export") == ours
    _touch(tmp_path / "out", "tokenizer.json", "model-1-of-2.safetensors")
    with pytest.raises(ValueError, match=r"^OUT \S+ holds files export did not write \(model-1-of-2.safetensors, "
                                         r"tokenizer.json\): choose an empty or new folder, or pass --overwrite"):
        check_out_dir(str(tmp_path / "out"), owned, flag="OUT", tool="export")
    assert check_out_dir(str(tmp_path / "out"), owned, flag="OUT", tool="export", overwrite=True) == ours
    assert clear_owned(str(tmp_path / "out"), owned) == ours
    assert sorted(os.listdir(tmp_path / "out")) == ["model-1-of-2.safetensors", "tokenizer.json"]
    assert check_out_dir(str(tmp_path / "new" / "deeper"), owned, flag="OUT", tool="export") == []
    assert not (tmp_path / "new").exists()  # it creates nothing


def test_a_file_in_the_way_or_an_unwritable_folder_is_one_line(tmp_path, monkeypatch):
    _touch(tmp_path, "f")
    with pytest.raises(ValueError, match=r"^--out \S+/f/sub is inside \S+/f, which is a file, not a folder"):
        check_out_dir(str(tmp_path / "f" / "sub"), (), flag="--out", tool="gpu_check")
    os.makedirs(tmp_path / "ro")
    # a folder where no file can be created (as root, chmod would not stop the probe): the probe fails
    monkeypatch.setattr(out_dir, "_can_write", lambda folder: PermissionError(13, "Permission denied"))
    with pytest.raises(ValueError, match=r"^--out \S+/ro/x: cannot write there \(its nearest existing parent "
                                         r"\S+/ro\) \(Permission denied\); choose a writable folder$"):
        check_out_dir(str(tmp_path / "ro" / "x"), (), flag="--out", tool="gpu_check")


def _lora_qwen3(tmp_path, **config):
    from core.init import materialize_seeded
    from core.finetune.lora import LoraSettings, apply_lora
    from models import registry
    from tests.distributed.parallel_cases import tiny_config

    cfg = tiny_config("qwen3_moe", **config)
    with torch.device("meta"):
        model = registry.spec_of(cfg).build(cfg)
    apply_lora(model, LoraSettings(lora_rank=2, lora_targets="attention"))
    materialize_seeded(model, "cpu", seed=0, std=cfg.init_std)
    return model


def test_each_export_kind_removes_the_other_kinds_files(tmp_path):
    """The cause of the stale adapter: each writer (save_weights, write_peft) clears every file of
    ours first, whatever kind wrote it."""
    from core.finetune.lora_export import merge_lora

    model = _lora_qwen3(tmp_path)
    out = str(tmp_path / "out")
    write_peft(model, out, rank=2, alpha=2.0, dropout=0.0, base=None)
    _touch(out, "model-00001-of-00003.safetensors", "notes.txt")  # a full export's shard from before
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors",
                                       "model-00001-of-00003.safetensors", "notes.txt"]
    merge_lora(model)
    model.save_hf(out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "notes.txt"]
    write_peft(_lora_qwen3(tmp_path), out, rank=2, alpha=2.0, dropout=0.0, base=None)
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors", "notes.txt"]


def test_export_refuses_other_files_without_overwrite_and_a_base_on_a_full_checkpoint(tmp_path, capsys):
    ck = checkpoint(tmp_path, TOKENIZER)
    out = tmp_path / "hf"
    _touch(out, "adapter_config.json", "adapter_model.safetensors", "README.md")  # an earlier PEFT export
    assert convert(["export", ck, str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"convert_checkpoint: error: OUT {out} holds files export did not write (README.md): ")
    assert err.count("\n") == 1 and "--overwrite" in err
    assert convert(["export", ck, str(out), "--overwrite"]) == 0
    said = capsys.readouterr().out
    assert ("removed 2 file(s) of an earlier export first: adapter_config.json, adapter_model.safetensors; kept 1 "
            "other file(s) (--overwrite): README.md)") in said
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors", "step37_extra.safetensors"]
    assert json.load(open(out / "config.json"))["pad_token_id"] == 257
    assert convert(["export", ck, str(tmp_path / "again"), "--source", str(out)]) == 0
    assert convert(["export", ck, str(out), "--overwrite", "--source", str(out)]) == 1
    assert "is --source" in capsys.readouterr().err
    assert convert(["export", ck, str(tmp_path / "b"), "--base", str(out)]) == 1
    assert capsys.readouterr().err == (f"convert_checkpoint: error: --base {out}: {ck}/iter_0000003 is not a LoRA "
                                       "run's checkpoint (it holds every weight): drop --base (--source keeps a "
                                       "published layout)\n")


def test_a_missing_recorded_base_names_itself_and_a_peft_import_onto_another_base_warns(tmp_path, capsys):
    from training.checkpoints import lora_model

    lora = {"rank": 2, "alpha": 2.0, "dropout": 0.0, "targets": ["attention"],
            "base": {"load_hf": str(tmp_path / "gone"), "seed": None, "weights_fingerprint": "0"}}
    with pytest.raises(ValueError) as e:
        lora_model(None, None, lora, None, "CK")
    assert str(e.value) == (f"CK: its recorded LoRA base {tmp_path / 'gone'} (the --load-hf it trained on, in "
                            "meta.json) no longer exists: pass --base DIR with that base's Hugging Face checkpoint")
    with pytest.raises(ValueError, match=r"^--base \S+/nowhere: no such directory"):
        lora_model(None, None, lora, str(tmp_path / "nowhere"), "CK")

    model = _lora_qwen3(tmp_path, mlp_only_layers=[])  # a dense mlp would be named like the experts
    base = tmp_path / "base"
    from models import registry

    registry.spec_of(model.config).build(model.config, seed=0).save_hf(str(base))
    write_peft(model, str(tmp_path / "peft"), rank=2, alpha=2.0, dropout=0.0, base=str(base))
    assert convert(["import", str(base), str(tmp_path / "same"), "--peft", str(tmp_path / "peft")]) == 0
    assert "warning" not in capsys.readouterr().err
    config = json.load(open(tmp_path / "peft" / "adapter_config.json"))
    json.dump({**config, "base_model_name_or_path": "/elsewhere"}, open(tmp_path / "peft" / "adapter_config.json", "w"))
    assert convert(["import", str(base), str(tmp_path / "other"), "--peft", str(tmp_path / "peft")]) == 0
    assert capsys.readouterr().err == (f"convert_checkpoint import: warning: --peft {tmp_path / 'peft'} was trained "
                                       f"on /elsewhere (its base_model_name_or_path), imported onto {base}: check "
                                       "that they hold the same weights\n")
