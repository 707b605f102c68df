"""A LoRA run's checkpoint out to Hugging Face (tools/convert_checkpoint.py export): as a PEFT
adapter folder that ``peft.PeftModel.from_pretrained`` loads onto transformers' model, and with
``--merge-lora`` as merged weights transformers loads alone; both give our model's logits after 3
training steps (tiny Qwen3-MoE; attention and routed-expert adapters, the experts' written per
expert, which PEFT converts onto transformers' fused experts itself).

Tolerance HF_REL (tests/unit/test_model_hf.py, 4e-5 relative to the largest logit): the two
implementations sum in different orders; PEFT adds the adapter path to the base output as we do,
the merged weights fold it in (one more fp32 rounding per weight, far below that)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.test_training import train
from tests.unit.numerics import assert_close_rel
from tests.unit.test_model_hf import HF_REL, thd
from tests.unit.test_qwen3_moe import save_hf_model
from tools.convert_checkpoint import main as convert

pytest.importorskip("peft")


def test_peft_export_and_merged_export_give_our_logits(dataset, tmp_path):
    from peft import PeftModel
    from transformers import Qwen3MoeForCausalLM

    hf_dir = tmp_path / "hf"
    save_hf_model(str(hf_dir), seed=5, mlp_only_layers=[])
    train(["--data-path", dataset, "--hf-config", str(hf_dir), "--load-hf", str(hf_dir), "--optimizer", "adamw",
           "--lr", "2e-2", "--train-iters", "3", "--lr-warmup-iters", "0", "--lora-rank", "4", "--lora-alpha", "8",
           "--lora-targets", "attention,experts", "--save", str(tmp_path / "ck")], tmp_path / "log")

    # ours: the base with the trained adapters, as the export tool builds it
    from core.checkpoint.sharded import load_checkpoint, read_meta, resolve
    from training.checkpoints import checkpoint_model, lora_model

    path = resolve(str(tmp_path / "ck"))
    meta = read_meta(path)
    spec, cfg = checkpoint_model(path, meta)
    ours = lora_model(spec, cfg, meta["lora"], None, path)
    load_checkpoint(path, [ours])
    tokens, pos, psp = thd([17], vocab=cfg.vocab_size)
    with torch.no_grad():
        want = ours(tokens, pos, psp)

    assert convert(["export", str(tmp_path / "ck"), str(tmp_path / "peft")]) == 0
    config = json.load(open(tmp_path / "peft" / "adapter_config.json"))
    assert config["r"] == 4 and config["lora_alpha"] == 8 and "model.layers.1.mlp.experts.7.down_proj" in config["target_modules"]
    base = Qwen3MoeForCausalLM.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        plain = base(input_ids=tokens[None]).logits[0]
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        got = peft_model(input_ids=tokens[None]).logits[0]
    assert_close_rel(got, want, rel=HF_REL)
    assert (plain - want).abs().max() > 100 * HF_REL * want.abs().max()  # the adapters matter
    with torch.no_grad():  # and the experts' among them: PEFT applied those too
        for m in ours.modules():
            if hasattr(m, "lora_B") and isinstance(m.lora_B, torch.nn.ParameterDict):
                for b in m.lora_B.values():
                    b.zero_()
        without_experts = ours(tokens, pos, psp)
    assert (without_experts - want).abs().max() > 100 * HF_REL * want.abs().max()

    # the PEFT folder imported back: the same adapters, bit for bit, and a LoRA run continues from it
    assert convert(["import", str(hf_dir), str(tmp_path / "imported"), "--peft", str(tmp_path / "peft")]) == 0
    back_path = resolve(str(tmp_path / "imported"))
    back_meta = read_meta(back_path)
    assert back_meta["lora"]["targets"] == ["attention", "experts"] and back_meta["lora"]["rank"] == 4
    assert back_meta["lora"]["base"]["weights_fingerprint"] == meta["lora"]["base"]["weights_fingerprint"]
    back = lora_model(spec, cfg, back_meta["lora"], None, back_path)
    load_checkpoint(back_path, [back])
    again = lora_model(spec, cfg, meta["lora"], None, path)
    load_checkpoint(path, [again])
    for (n, p), (_, q) in zip(again.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), n
    resumed = train(["--data-path", dataset, "--hf-config", str(hf_dir), "--load-hf", str(hf_dir), "--optimizer",
                     "adamw", "--lr", "2e-2", "--train-iters", "1", "--lr-warmup-iters", "0", "--lora-rank", "4",
                     "--lora-alpha", "8", "--lora-targets", "attention,experts", "--load", str(tmp_path / "imported"),
                     "--train-iters", "2"], tmp_path / "log2")
    assert [r["iteration"] for r in resumed] == [1, 2]

    assert convert(["export", str(tmp_path / "ck"), str(tmp_path / "merged"), "--merge-lora"]) == 0
    merged, info = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "merged"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert_close_rel(merged.eval()(input_ids=tokens[None]).logits[0], want, rel=HF_REL)

    # merged over the PEFT folder: its adapter files go (core/checkpoint/out_dir.py), else transformers loads the
    # stale adapter on top of the merged weights (logits 1.5e-2 off)
    assert convert(["export", str(tmp_path / "ck"), str(tmp_path / "peft"), "--merge-lora"]) == 0
    assert not (tmp_path / "peft" / "adapter_config.json").exists()
    over = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "peft")).eval()
    with torch.no_grad():
        assert_close_rel(over(input_ids=tokens[None]).logits[0], want, rel=HF_REL)


def test_step37_merged_export_gives_our_hidden_states(dataset, tmp_path):
    """The tiny Step-3.7 preset (seeded base) after 3 LoRA steps on attention, shared experts and
    routed experts: ``--merge-lora`` writes transformers' Step3p7TextModel layout (head and MTP
    beside it), which transformers loads alone with our final hidden states (HF_REL); the PEFT
    form is refused for its stacked experts (exit 1, naming --merge-lora)."""
    from transformers import Step3p7TextModel

    from core.checkpoint.sharded import load_checkpoint, read_meta, resolve
    from training.checkpoints import checkpoint_model, lora_model

    train(["--data-path", dataset, "--optimizer", "adamw", "--lr", "2e-2", "--train-iters", "3",
           "--lr-warmup-iters", "0", "--lora-rank", "4", "--lora-alpha", "8",
           "--lora-targets", "attention,shared_expert,experts", "--save", str(tmp_path / "ck")], tmp_path / "log")
    path = resolve(str(tmp_path / "ck"))
    meta = read_meta(path)
    spec, cfg = checkpoint_model(path, meta)
    ours = lora_model(spec, cfg, meta["lora"], None, path)
    load_checkpoint(path, [ours])
    base = spec.build(cfg, seed=meta["lora"]["base"]["seed"])
    tokens, pos, psp = thd([17], vocab=cfg.vocab_size)
    with torch.no_grad():
        want, plain = ours.final_hidden(tokens, pos, psp), base.final_hidden(tokens, pos, psp)
    assert (plain - want).abs().max() > 100 * HF_REL * want.abs().max()  # the adapters matter

    assert convert(["export", str(tmp_path / "ck"), str(tmp_path / "merged"), "--merge-lora"]) == 0
    merged, info = Step3p7TextModel.from_pretrained(str(tmp_path / "merged"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        assert_close_rel(merged.eval()(input_ids=tokens[None]).last_hidden_state[0], want, rel=HF_REL)
    assert convert(["export", str(tmp_path / "ck"), str(tmp_path / "peft")]) == 1


def test_step37_peft_export_loads_onto_transformers_text_model(dataset, tmp_path):
    """Step-3.7 adapters on attention, the dense MLP and the shared experts (the issue's command
    line; its routed experts are published
    stacked: no PEFT form): exported against the base's own checkpoint (``--base``: its tensor
    names choose among the family's published names, here transformers' Step3p7TextModel's),
    ``PeftModel.from_pretrained`` on that model gives our final hidden states (HF_REL)."""
    from peft import PeftModel
    from transformers import Step3p7TextModel

    from core.checkpoint.sharded import load_checkpoint, read_meta, resolve
    from models.step37 import Step37Config, Step37Model
    from training.checkpoints import checkpoint_model, lora_model

    base_dir = tmp_path / "base"
    Step37Model(Step37Config.preset("tiny"), seed=5).save_hf(str(base_dir))
    train(["--data-path", dataset, "--load-hf", str(base_dir), "--optimizer", "adamw", "--lr", "2e-2",
           "--train-iters", "3", "--lr-warmup-iters", "0", "--lora-rank", "4", "--lora-alpha", "8",
           "--lora-targets", "attention,mlp,shared_expert", "--save", str(tmp_path / "ck")], tmp_path / "log")
    path = resolve(str(tmp_path / "ck"))
    meta = read_meta(path)
    spec, cfg = checkpoint_model(path, meta)
    ours = lora_model(spec, cfg, meta["lora"], None, path)
    load_checkpoint(path, [ours])
    tokens, pos, psp = thd([17], vocab=cfg.vocab_size)
    with torch.no_grad():
        want = ours.final_hidden(tokens, pos, psp)

    assert convert(["export", str(tmp_path / "ck"), str(tmp_path / "peft")]) == 0
    targets = json.load(open(tmp_path / "peft" / "adapter_config.json"))["target_modules"]
    assert "layers.0.mlp.down_proj" in targets and "layers.1.mlp.shared_experts.up_proj" in targets, targets
    hf = Step3p7TextModel.from_pretrained(str(base_dir)).eval()
    with torch.no_grad():
        plain = hf(input_ids=tokens[None]).last_hidden_state[0]
    model = PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        got = model(input_ids=tokens[None]).last_hidden_state[0]
    assert_close_rel(got, want, rel=HF_REL)
    assert (plain - want).abs().max() > 100 * HF_REL * want.abs().max()  # the adapters matter


def test_step37_vlm_peft_and_merged_exports_give_our_logits(dataset, tmp_path):
    """The issue's check on logits for Step-3.7: a tiny VLM base (vision tower included, so
    transformers' Step3p7ForConditionalGeneration, head and all, loads it), 3 LoRA steps on
    attention, the dense MLP and the shared experts; PeftModel.from_pretrained on transformers'
    model and the --merge-lora export loaded by transformers alone both give our logits (HF_REL)."""
    from peft import PeftModel
    from transformers import Step3p7ForConditionalGeneration

    from core.checkpoint.sharded import load_checkpoint, read_meta, resolve
    from models.step37 import Step37Config, Step37Model
    from training.checkpoints import checkpoint_model, lora_model

    base_dir = tmp_path / "base"
    Step37Model(Step37Config.preset("step37-tiny-vlm"), seed=5).save_hf(str(base_dir))
    train(["--data-path", dataset, "--hf-config", str(base_dir), "--load-hf", str(base_dir), "--optimizer", "adamw",
           "--lr", "2e-2", "--train-iters", "3", "--lr-warmup-iters", "0", "--lora-rank", "4", "--lora-alpha", "8",
           "--lora-targets", "attention,mlp,shared_expert", "--save", str(tmp_path / "ck")], tmp_path / "log")
    path = resolve(str(tmp_path / "ck"))
    meta = read_meta(path)
    spec, cfg = checkpoint_model(path, meta)
    ours = lora_model(spec, cfg, meta["lora"], None, path)
    load_checkpoint(path, [ours])
    tokens, pos, psp = thd([17], vocab=cfg.vocab_size)
    with torch.no_grad():
        want = ours.eval()(tokens, pos, psp)

    assert convert(["export", str(tmp_path / "ck"), str(tmp_path / "peft")]) == 0
    hf = Step3p7ForConditionalGeneration.from_pretrained(str(base_dir)).eval()
    with torch.no_grad():
        plain = hf(input_ids=tokens[None]).logits[0]
    model = PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        assert_close_rel(model(input_ids=tokens[None]).logits[0], want, rel=HF_REL)
    assert (plain - want).abs().max() > 100 * HF_REL * want.abs().max()  # the adapters matter

    assert convert(["export", str(tmp_path / "ck"), str(tmp_path / "merged"), "--merge-lora"]) == 0
    merged = Step3p7ForConditionalGeneration.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert_close_rel(merged(input_ids=tokens[None]).logits[0], want, rel=HF_REL)
