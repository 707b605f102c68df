"""Tiny transformers Step3p7 reference models, saved with save_pretrained (nothing downloaded)."""
from __future__ import annotations

import copy

import torch

from models.step37.config import PRESETS


def tiny_hf_kwargs(**overrides) -> dict:
    kw = copy.deepcopy(PRESETS["tiny"])
    kw["num_attention_groups"] = kw.pop("num_key_value_heads")
    kw.update(overrides)
    return kw


def _text_kwargs_for_transformers(kw: dict) -> dict:
    """transformers' Step3p7TextConfig spells two legacy keys differently."""
    kw = copy.deepcopy(kw)
    kw["num_key_value_heads"] = kw.pop("num_attention_groups")
    kw["n_routed_experts"] = kw.pop("moe_num_experts")
    kw["num_experts_per_tok"] = kw.pop("moe_top_k")
    return kw


@torch.no_grad()
def randomize(model, seed: int = 0, std: float = 0.3):
    """Non-trivial weights everywhere, norms and router bias included (zero-init hides bugs)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name or not t.is_floating_point() or "position_ids" in name:
            continue
        scale = 0.2 if "norm" in name else (0.5 if "e_score_correction_bias" in name else std)
        t.copy_(torch.randn(t.shape, generator=g) * scale)


def save_text_model(path: str, seed: int = 0, **overrides):
    from transformers import Step3p7TextConfig, Step3p7TextModel

    cfg = Step3p7TextConfig(**_text_kwargs_for_transformers(tiny_hf_kwargs(**overrides)))
    model = Step3p7TextModel(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return model


def save_full_model(path: str, seed: int = 0, **overrides):
    from transformers import Step3p7Config, Step3p7ForConditionalGeneration

    cfg = Step3p7Config(text_config=_text_kwargs_for_transformers(tiny_hf_kwargs(**overrides)),
                        vision_config=dict(width=32, layers=1, heads=2, image_size=28, patch_size=14))
    model = Step3p7ForConditionalGeneration(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return model
