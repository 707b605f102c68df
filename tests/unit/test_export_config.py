"""The Hugging Face config that export writes: a pad_token_id (transformers assumes 1 when it is
missing, making token 1 a padding row) from the tokenizer, --source's config or the run's
recorded tokenizer, and a model_type / architectures pair that transformers resolves to one
another (``step3p5`` is transformers' model_type of Step3p7TextConfig, the config class of
Step3p7TextModel: the pair Step3p7TextModel.save_pretrained itself writes)."""
from __future__ import annotations

import json

import pytest

from core.checkpoint.sharded import save_checkpoint
from models.step37 import Step37Config, Step37Model
from tools.convert_checkpoint import main as convert

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def checkpoint(tmp_path, tokenizer: dict | None) -> str:
    cfg = Step37Config.preset("tiny")
    meta = {"model": cfg.to_dict(), **({"tokenizer": tokenizer} if tokenizer else {})}
    save_checkpoint(str(tmp_path / "ck"), 3, [Step37Model(cfg)], None, {}, meta)
    return str(tmp_path / "ck")


def exported_config(args) -> dict:
    assert convert(["export", *args]) == 0
    with open(f"{args[1]}/config.json") as f:
        return json.load(f)


def test_pad_token_id_from_the_run_and_a_config_transformers_resolves(tmp_path):
    import transformers

    ck = checkpoint(tmp_path, {"type": "byte", "model": None, "pad_id": 257, "eod_id": 256})
    config = exported_config([ck, str(tmp_path / "hf")])
    assert config["pad_token_id"] == 257
    loaded = transformers.AutoConfig.from_pretrained(str(tmp_path / "hf"))
    arch = getattr(transformers, config["architectures"][0])
    assert type(loaded) is arch.config_class and loaded.model_type == config["model_type"]
    assert loaded.pad_token_id == 257


def test_pad_token_id_from_the_tokenizer_or_the_source_config(tmp_path, hf_tokenizer_dir):
    from data.tokenizers import build_tokenizer

    ck = checkpoint(tmp_path, None)  # e.g. a checkpoint from before the run recorded its tokenizer
    want = build_tokenizer("huggingface", hf_tokenizer_dir).pad_id
    config = exported_config([ck, str(tmp_path / "tok"), "--tokenizer-type", "huggingface",
                              "--tokenizer-model", hf_tokenizer_dir])
    assert config["pad_token_id"] == want
    src = tmp_path / "tok" / "config.json"
    src.write_text(json.dumps({**config, "pad_token_id": 5}))
    assert exported_config([ck, str(tmp_path / "src"), "--source", str(tmp_path / "tok")])["pad_token_id"] == 5


def test_a_checkpoint_without_a_known_tokenizer_names_the_flags(tmp_path, capsys):
    ck = checkpoint(tmp_path, None)
    assert convert(["export", ck, str(tmp_path / "hf")]) == 1
    assert "--tokenizer-type" in capsys.readouterr().err
