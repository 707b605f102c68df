"""DeepSeek-V3's multi-token-prediction layer (``num_nextn_predict_layers``, published as layer
``num_hidden_layers``) built with core's MTP block: a checkpoint that holds it in the published
layout loads with nothing missing or unexpected, the main logits stay transformers' (which builds
no MTP layer), the export writes every tensor back byte for byte, and a training step trains the
depth through its loss. The release's depth is an MoE layer, as the tiny config's (layer 3 >=
first_k_dense_replace 1)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from core.loss import IGNORE_INDEX
from models.deepseek_v3 import DeepseekV3Config, DeepseekV3Model
from models.deepseek_v3.config import PRESETS
from tests.unit.numerics import assert_close_rel
from tests.unit.test_deepseek_v3 import save_hf_model
from tests.unit.test_model_hf import HF_REL, LENGTHS, thd
from tools.convert_checkpoint import main as convert

L, H, V = 3, 64, 320  # the tiny preset's layers, hidden size, vocabulary


def mtp_tensors(main: dict, seed: int = 0) -> dict:
    """A synthetic ``model.layers.3.*`` set in DeepSeek-V3's published layout: a decoder layer of
    the main layers' MoE shapes (fresh values), ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.{norm,head}`` and the release's copy of the input embedding."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.1
    out = {k.replace("model.layers.1.", f"model.layers.{L}."): rand(*t.shape) + (t == 1).float()
           for k, t in main.items() if k.startswith("model.layers.1.")}  # norms (ones in the source) near 1
    out.update({f"model.layers.{L}.{n}.weight": 1 + rand(H) for n in ("enorm", "hnorm", "shared_head.norm")})
    out[f"model.layers.{L}.eh_proj.weight"] = rand(H, 2 * H)
    out[f"model.layers.{L}.shared_head.head.weight"] = rand(V, H)
    out[f"model.layers.{L}.embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """transformers' model (no MTP layer) saved with ``num_nextn_predict_layers`` 1, the
    synthetic layer 3 written into its file as the release has it."""
    path = tmp_path_factory.mktemp("release")
    hf = save_hf_model(str(path), seed=3, num_nextn_predict_layers=1)
    f = str(path / "model.safetensors")
    main = load_file(f)
    assert not any(k.startswith(f"model.layers.{L}.") for k in main)  # transformers writes none
    save_file({**main, **mtp_tensors(main)}, f, metadata={"format": "pt"})
    return path, hf


def _load(path) -> DeepseekV3Model:
    model = DeepseekV3Model(DeepseekV3Config.from_hf(str(path)))
    report = model.load_hf(str(path))
    assert report["missing"] == [] and report["unexpected"] == [] and report["misshaped"] == []
    assert report["kept_aside"] == 1  # the depth's copy of the embedding: it reads the main one
    return model


def test_mtp_layer_loads_keeps_the_main_logits_and_exports_byte_for_byte(release, tmp_path):
    path, hf = release
    model = _load(path)
    assert model.config.num_mtp_layers == 1 and model.mtp is not None
    tokens, pos, psp = thd(LENGTHS)
    with torch.no_grad():
        ours = model(tokens, pos, psp)
        for s, n in zip(psp.cu_seqlens.tolist(), LENGTHS):
            assert_close_rel(ours[s:s + n], hf(input_ids=tokens[s:s + n][None]).logits[0], rel=HF_REL)
    src = load_file(str(path / "model.safetensors"))
    head = src[f"model.layers.{L}.shared_head.head.weight"]
    assert torch.equal(model.mtp["0"].head.weight, head) and not torch.equal(head, src["lm_head.weight"])
    assert model.save_hf(str(tmp_path / "out")) == "published"
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(out) == sorted(src)
    for k, t in src.items():  # byte for byte, the MTP layer's and the main model's
        assert out[k].dtype == t.dtype and torch.equal(out[k].view(torch.uint8), t.view(torch.uint8)), k
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 1


def test_the_embedding_copy_is_set_aside_and_a_checkpoint_without_the_layer_builds_none(release, tmp_path, capsys):
    """The checkpoint's copy of the embedding is set aside (export writes the main one there).
    A folder without any tensor of the layer (what transformers' save_pretrained writes, keeping
    the count) is read as holding no MTP layer, as GLM-4.5's is (models/common/mtp_layers.py): a
    seeded depth would send its untrained loss into the trunk's gradients. One holding part of it
    is refused naming what is missing; without the count the layer is tensors the model has no
    place for."""
    path, _ = release
    tensors = load_file(str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file({**tensors, f"model.layers.{L}.embed_tokens.weight": torch.zeros(V, H)},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = _load(tmp_path)
    model.save_hf(str(tmp_path / "out"))
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(out[f"model.layers.{L}.embed_tokens.weight"], tensors["model.embed_tokens.weight"])

    main = {k: t for k, t in tensors.items() if not k.startswith(f"model.layers.{L}.")}
    save_file(main, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = DeepseekV3Config.from_hf(str(tmp_path))
    assert raw["num_nextn_predict_layers"] == 1 and cfg.num_mtp_layers == 0
    model = DeepseekV3Model(cfg, seed=7)
    assert not any(n.startswith("mtp.") for n, _ in model.named_parameters())
    report = model.load_hf(str(tmp_path))
    assert report["missing"] == [] and report["unexpected"] == []
    assert convert(["check", str(tmp_path)]) == 0
    assert "0 MTP depths" in capsys.readouterr().out

    save_file({**main, f"model.layers.{L}.eh_proj.weight": torch.zeros(H, 2 * H)},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['mtp.0.enorm.weight', 'mtp.0.hnorm.weight', 'mtp.0.block"):
        DeepseekV3Model(DeepseekV3Config.from_hf(str(tmp_path))).load_hf(str(tmp_path))

    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_nextn_predict_layers": 0}))
    report = DeepseekV3Model(DeepseekV3Config.from_hf(str(tmp_path))).load_hf(str(tmp_path), strict=False)
    assert report["kept_aside"] == 0 and report["unexpected"] == sorted(
        k for k in tensors if k.startswith(f"model.layers.{L}."))


def test_a_training_step_trains_the_depth_through_its_loss():
    """core.train_step on one process with the MTP loss weighted 0.3: the depth's loss is finite,
    and the gradients of the depth and of the embedding are those of main + 0.3 x MTP loss
    computed by calling the model directly."""
    import copy

    from core.parallel_state import ParallelSizes, ParallelState
    from core.train_step import StepSettings, train_step
    from data.thd import THDBatch

    cfg = DeepseekV3Config.from_hf({**PRESETS["deepseek-v3-tiny"], "num_nextn_predict_layers": 1})
    model = DeepseekV3Model(cfg, seed=1)
    ref = copy.deepcopy(model)
    tokens, pos, psp = thd([7, 12, 5], seed=2)
    nxt = torch.cat([tokens[1:], tokens[:1]])
    labels = torch.where(torch.isin(torch.arange(1, 25), psp.cu_seqlens[1:]), IGNORE_INDEX, nxt)
    batch = THDBatch(tokens, labels, pos, psp)
    out = ref(tokens, pos, psp, labels=labels)
    n = batch.num_target_tokens
    ((out.loss_sum + 0.3 * out.mtp_loss_sums[0]) / n).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    m = train_step([model], ParallelState(ParallelSizes(1), 0, {}), opt, [batch],
                   StepSettings(hidden_size=cfg.hidden_size, mtp_depths=1, mtp_loss_scale=0.3))
    assert len(m.mtp_losses) == 1 and torch.isfinite(torch.tensor(m.mtp_losses[0]))
    assert abs(m.mtp_losses[0] - float(out.mtp_loss_sums[0].detach()) / n) <= 1e-6 * m.mtp_losses[0]
    grads = dict(ref.named_parameters())
    for name in ("mtp.0.eh_proj.weight", "mtp.0.enorm.weight", "mtp.0.block.self_attn.kv_b_proj.weight",
                 "mtp.0.block.mlp.experts.up_proj", "mtp.0.head.weight", "embed_tokens.weight"):
        p = dict(model.named_parameters())[name]
        assert p.grad is not None and p.grad.abs().max() > 0, name
        assert_close_rel(p.grad, grads[name].grad, rel=1e-6)  # the same operations
