"""LoRA on DeepSeek-V3's multi-head latent attention (core/transformer/mla.py): ``--lora-targets
attention`` adapts the projections each attention kind declares (``lora_projections``, the
protocol of core/transformer/attention.py), and the PEFT export names transformers' modules, so
``PeftModel.from_pretrained`` on ``DeepseekV3ForCausalLM`` and the merged export both give our
logits.

Tolerance HF_REL (tests/unit/test_model_hf.py, 4e-5 relative to the largest logit): ours and
transformers sum in different orders (as in tests/unit/test_deepseek_v3.py); PEFT adds the adapter
path to the base output as we do, the merged weights fold it in (one more fp32 rounding per
weight, far below that). The adapters are set to values that move the logits by more than 100 x
that tolerance, so a dropped adapter cannot pass."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from core.finetune.lora import LoraSettings, apply_lora, target_modules
from models.deepseek_v3 import DeepseekV3Config, DeepseekV3Model
from tests.unit.numerics import assert_close_rel
from tests.unit.test_deepseek_v3 import hf_kwargs, save_hf_model
from tests.unit.test_model_hf import HF_REL, thd

MLA_LOW_RANK_Q = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def _adapted(model) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return [f"{names[id(p)]}.{a}" for p, a, _ in target_modules(model, ("attention",))]


@pytest.mark.parametrize("q_lora_rank,projections", [
    (16, MLA_LOW_RANK_Q), (None, ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])])
def test_attention_target_adapts_every_mla_projection(q_lora_rank, projections):
    """Every projection of every layer (q low-rank or plain), never the latent norms."""
    with torch.device("meta"):
        model = DeepseekV3Model(DeepseekV3Config.from_hf(hf_kwargs(q_lora_rank=q_lora_rank)))
    want = [f"layers.{i}.self_attn.{p}" for i in range(model.config.num_layers) for p in projections]
    assert _adapted(model) == want
    assert apply_lora(model, LoraSettings(lora_rank=2, lora_targets="attention")) == len(want)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "layernorm" in n)


def test_a_new_attention_kind_is_adapted_by_what_it_declares():
    """A kind core/finetune/lora.py has never heard of: its declared projections (those it has, in its
    order) are adapted, an undeclared linear is not."""
    class Kind(nn.Module):
        lora_projections = ("wq", "absent", "wo")

        def __init__(self):
            super().__init__()
            self.wo, self.wq, self.extra = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    model = nn.Sequential(Kind())
    assert _adapted(model) == ["0.wq", "0.wo"]


def test_compile_checks_the_backend_of_mla_too():
    from core.compile import apply_compile

    model = DeepseekV3Model(DeepseekV3Config.from_hf(hf_kwargs(), attention_backend="flex"))
    with pytest.raises(ValueError, match="--compile does not support --attention-backend flex"):
        apply_compile(model, "aot_eager")


def _lora_from_hf(path: str, targets: str, seed: int) -> DeepseekV3Model:
    """Our model of the HF checkpoint ``path`` with adapters (rank 4, alpha 8) on ``targets``,
    A and B random (B non-zero, so the adapters change the logits)."""
    model = DeepseekV3Model(DeepseekV3Config.from_hf(path))
    apply_lora(model, LoraSettings(lora_rank=4, lora_alpha=8, lora_targets=targets))
    model.load_hf(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


@pytest.mark.parametrize("q_lora_rank,targets", [(16, "attention,experts"), (None, "attention,mlp,shared_expert")])
def test_peft_and_merged_exports_give_our_logits_in_transformers(tmp_path, q_lora_rank, targets):
    """The PEFT folder loads onto transformers' DeepseekV3ForCausalLM with our logits (adapter
    names are transformers' module paths; routed experts written per expert, which PEFT converts
    onto the fused experts itself) and imports back bit for bit; the merged export alone gives our
    logits too. Adapters on the dense MLP or the shared experts have no PEFT form (PEFT takes
    their gate/up/down for the experts' and dropped them: the base's logits), so the PEFT export
    refuses them by name, pointing to --merge-lora, which serves them."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import DeepseekV3ForCausalLM

    from core.finetune.lora_export import merge_lora, write_peft
    from tools.convert_checkpoint import import_peft

    hf_dir, peft_dir, merged_dir = (str(tmp_path / d) for d in ("hf", "peft", "merged"))
    hf = save_hf_model(hf_dir, seed=4, q_lora_rank=q_lora_rank)
    ours = _lora_from_hf(hf_dir, targets, seed=1)
    tokens, pos, psp = thd([17])
    with torch.no_grad():
        want = ours(tokens, pos, psp)
        plain = hf(input_ids=tokens[None]).logits[0]
    assert (plain - want).abs().max() > 100 * HF_REL * want.abs().max()  # the adapters matter

    if "mlp" in targets:
        with pytest.raises(ValueError, match=r"^model.layers.0.mlp.down_proj: a dense projection named like the "
                                             r"routed experts' .* export the merged weights with --merge-lora, or "
                                             r"train with --lora-targets without mlp, shared_expert$"):
            write_peft(ours, peft_dir, rank=4, alpha=8.0, dropout=0.0, base=hf_dir)
    else:
        config = write_peft(ours, peft_dir, rank=4, alpha=8.0, dropout=0.0, base=hf_dir)
        modules = set(config["target_modules"])
        assert {f"model.layers.1.self_attn.{p}" for p in MLA_LOW_RANK_Q} | {"model.layers.1.mlp.experts.7.down_proj"} \
            <= modules and config["task_type"] == "CAUSAL_LM"
        with torch.no_grad():
            got = PeftModel.from_pretrained(hf, peft_dir).eval()(input_ids=tokens[None]).logits[0]
        assert_close_rel(got, want, rel=HF_REL)
        back = DeepseekV3Model(DeepseekV3Config.from_hf(hf_dir))
        back.load_hf(hf_dir)
        lora, _ = import_peft(back, peft_dir, hf_dir)
        assert lora.targets == ("attention", "experts")
        for (n, p), (m, q) in zip(ours.named_parameters(), back.named_parameters()):
            assert n == m and torch.equal(p, q), n

    merge_lora(ours)
    ours.save_hf(merged_dir)
    merged, info = DeepseekV3ForCausalLM.from_pretrained(merged_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # transformers' default num_nextn_predict_layers 1 with no layer saved: no MTP depth is built
    # (models/common/mtp_layers.py), so nothing is unexpected
    assert not info["unexpected_keys"]
    with torch.no_grad():
        assert_close_rel(merged.eval()(input_ids=tokens[None]).logits[0], want, rel=HF_REL)


@pytest.mark.parametrize("targets,refused", [("shared_expert", "model.layers.1.mlp.shared_experts.down_proj"),
                                             ("attention,mlp,shared_expert,experts", "model.layers.0.mlp.down_proj")])
def test_peft_export_refuses_dense_projections_named_like_the_experts(targets, refused):
    """With or without expert adapters: PEFT takes any target named gate/up/down_proj for the
    experts of a family that publishes them per expert (measured: dropped, the base's logits)."""
    from core.finetune.lora_export import peft_tensors

    model = DeepseekV3Model(DeepseekV3Config.preset("deepseek-v3-tiny"))
    apply_lora(model, LoraSettings(lora_rank=2, lora_targets=targets))
    with pytest.raises(ValueError, match=f"^{refused}: a dense projection named like the routed experts'"):
        peft_tensors(model)
