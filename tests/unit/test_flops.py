"""The FLOP model behind TFLOP/s and MFU: matmul weights per token counted independently from
the model's own parameters (tiny and, on the meta device, Step-3.7-Flash), attention keys by
hand."""
from __future__ import annotations

import pytest
import torch

from models.step37 import Step37Config, Step37Model
from core.costs.flops import keys_seen
from core.costs.flops import matmul_params_per_token as _params
from core.costs.flops import training_flops as _flops
from models.registry import shapes_of


def matmul_params_per_token(cfg):
    return _params(shapes_of(cfg))


def training_flops(cfg, lengths):
    return _flops(shapes_of(cfg), lengths)


def _count_from_parameters(cfg: Step37Config) -> int:
    """Every weight matrix a token multiplies, from the built model: all 2-D/3-D parameters but
    the embedding, with routed experts counted at top-k of E."""
    with torch.device("meta"):
        model = Step37Model(cfg)
    specs = model.param_specs()
    total = 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or specs[name].role == "embedding":
            continue
        routed = specs[name].expert_offset is not None
        total += p.numel() * cfg.num_experts_per_tok // cfg.num_experts if routed else p.numel()
    return total


@pytest.mark.parametrize("preset", ["tiny", "step37-flash"])
def test_matmul_weights_per_token_match_the_model(preset):
    cfg = Step37Config.preset(preset)
    assert matmul_params_per_token(cfg) == _count_from_parameters(cfg)


def test_keys_seen_by_hand():
    assert keys_seen(4, None) == 1 + 2 + 3 + 4
    assert keys_seen(6, 2) == 1 + 2 + 2 + 2 + 2 + 2
    assert keys_seen(3, 8) == 1 + 2 + 3  # the window exceeds the document


def test_step37_flash_at_8192():
    """One document of 8,192 tokens: 6 x 13.887 B weights per token plus the attention scores of
    12 full layers (64 heads, all causal keys) and 36 sliding ones (96 heads, 512-key window;
    45 layers and 3 MTP depths, one in four full)."""
    cfg = Step37Config.preset("step37-flash")
    n = 8192
    full = 12 * 64 * 128 * (n * (n + 1) // 2)
    sliding = 12 * 96 * 128 * (512 * 513 // 2 + (n - 512) * 512)
    kinds = cfg.layer_types + cfg.mtp_layer_types
    want = 6 * 13_887_078_400 * n + kinds.count("full_attention") * full + kinds.count("sliding_attention") * sliding
    assert matmul_params_per_token(cfg) == 13_887_078_400
    assert training_flops(cfg, [n]) == want
    assert kinds.count("full_attention") == 12 and len(kinds) == 48
    # 8 documents of 1,024 in the same pack: the same weights, fewer keys (documents never see
    # each other), most of the saving on the 12 full layers
    saved = 12 * 12 * 64 * 128 * (keys_seen(n, None) - 8 * keys_seen(1024, None)) + \
        36 * 12 * 96 * 128 * (keys_seen(n, 512) - 8 * keys_seen(1024, 512))
    assert training_flops(cfg, [n]) - training_flops(cfg, [1024] * 8) == saved
