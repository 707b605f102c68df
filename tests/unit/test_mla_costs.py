"""Multi-head latent attention's own cost shape (core.costs.shapes.MLAShape) against the module it
describes (core/transformer/mla.py on DeepSeek-V3's tiny preset, q low-rank and plain q): its
FLOPs against torch's FLOP counter, its weights against the module's, its kept bytes against
what autograd saves, its CP exchange and LoRA adapters by hand; and DeepSeek-V3's numbers."""
from __future__ import annotations

import copy

import pytest
import torch

import core.transformer.attention as attention
from core.costs.activations import cpu_sdpa_extra_bytes
from core.context_parallel.costs import exchange_bytes, expand_flops, gathered_bytes, key_buffer_bytes
from core.costs.flops import matmul_params_per_token, training_flops
from core.costs.saved_bytes import SavedTensorBytes
from core.parallel_state import ParallelState
from core.costs.shapes import AttentionShape, MLAShape
from core.transformer.attention_backends import DocLayout
from models.deepseek_v3 import DeepseekV3Config, DeepseekV3Model
from models.deepseek_v3.config import PRESETS
from models.registry import shapes_of
from tests.unit.test_model_hf import thd
from tests.unit.test_model_thd import labels_for
from training.parallelize import build_chunks
from training.planner.lora import adapter_flops
from tests.planner_inputs import inputs
from training.planner.memory import _chunk_activations

DOCS = [100, 100, 56]  # two causal pieces and one band piece on the CPU's sdpa backend
VARIANTS = {"q_lora": {}, "plain_q": {"q_lora_rank": None}}


def tiny(**overrides) -> DeepseekV3Config:
    return DeepseekV3Config.from_hf({**copy.deepcopy(PRESETS["deepseek-v3-tiny"]), **overrides})


def _attention(cfg):
    model = DeepseekV3Model(cfg, seed=0)
    tokens, pos, psp = thd(DOCS)
    rope = next(iter(model.rotary.values()))(pos, torch.float32)
    return model.layers["1"].self_attn, rope, DocLayout.from_params(psp)


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_flops_equal_torchs_flop_counter(variant):
    """torch's counter on the attention's forward: its GEMMs are the shape's weights x 2 per
    token, exactly; its batched matmuls are the shape's score FLOPs over n^2 keys per document
    (the CPU's sdpa computes q.k at dim 24 and p.v at dim 16 for every key and masks the causal
    half); the model's own count reads the causal n (n + 1) / 2."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = tiny(**VARIANTS[variant])
    attn, rope, layout = _attention(cfg)
    a = shapes_of(cfg).blocks[1].attention
    with FlopCounterMode(display=False) as counter:
        attn(torch.randn(sum(DOCS), cfg.hidden_size), rope, layout)
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    assert counts == {"aten.mm": 2 * sum(DOCS) * a.params(cfg.hidden_size),
                      "aten.bmm": a.score_flops(sum(n * n for n in DOCS))}
    assert counter.get_total_flops() == a.flops(cfg.hidden_size, sum(DOCS), sum(n * n for n in DOCS))


@pytest.mark.parametrize("variant", VARIANTS)
def test_shape_weights_equal_the_module(variant):
    cfg = tiny(**VARIANTS[variant])
    attn, _, _ = _attention(cfg)
    weights = sum(p.numel() for p in attn.parameters() if p.dim() == 2)
    assert shapes_of(cfg).blocks[1].attention.params(cfg.hidden_size) == weights


def _count_from_parameters(cfg) -> int:
    """Every weight matrix a token multiplies, from the model built on meta: all 2-D/3-D
    parameters but the embedding, routed experts at top-k of E."""
    with torch.device("meta"):
        model = DeepseekV3Model(cfg)
    specs, total = model.param_specs(), 0
    for name, p in model.named_parameters():
        if p.dim() < 2 or specs[name].role == "embedding":
            continue
        routed = specs[name].expert_offset is not None
        total += p.numel() * cfg.num_experts_per_tok // cfg.num_experts if routed else p.numel()
    return total


@pytest.mark.parametrize("preset", ["deepseek-v3-tiny", "tiny-mtp", "moonlight-16b-a3b", "deepseek-v3"])
def test_matmul_weights_per_token_match_the_model(preset):
    """Every decoder layer and each MTP depth (its ``eh_proj``, decoder layer and own head;
    DeepSeek-V3 has one)."""
    cfg = tiny(num_nextn_predict_layers=1) if preset == "tiny-mtp" else DeepseekV3Config.preset(preset)
    assert len(shapes_of(cfg).extra) == cfg.num_nextn_predict_layers
    assert matmul_params_per_token(shapes_of(cfg)) == _count_from_parameters(cfg)


def test_deepseek_v3_attention_by_hand():
    """q_a 7168 x 1536, q_b 1536 x 128 x 192, kv_a 7168 x (512 + 64), kv_b 512 x 128 x (128 +
    128), o 128 x 128 x 7168: 187.1 M weights per token per layer, where a GQA shape of 128 K/V
    heads of 192 counts 704.6 M (3.77x); scores at q/k 192 and values at 128, 4 x 128 x 160 per
    causal key and training 3x that; one token's CP exchange is its latent and rope key."""
    a = shapes_of(DeepseekV3Config.preset("deepseek-v3")).blocks[3].attention
    assert a == MLAShape(128, 512, 128, 64, 128, 1536)
    assert a.params(7168) == 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert a.params(7168) == 187_105_280
    assert AttentionShape(128, 128, 192).params(7168) == 704_643_072
    n = 4096
    assert a.score_flops(n * (n + 1) // 2) == 2 * 128 * (192 + 128) * n * (n + 1) // 2
    cfg = DeepseekV3Config.preset("deepseek-v3")
    attn_train = (61 + 1) * 3 * a.score_flops(n * (n + 1) // 2)  # 61 layers and the MTP depth
    assert training_flops(shapes_of(cfg), [n]) == 6.0 * matmul_params_per_token(shapes_of(cfg)) * n + attn_train
    T, b = 8192, 2
    assert a.exchange_row_bytes(b) == (512 + 64) * 2  # 85x less than the expanded K/V's 2 x 128 x 192 x 2
    assert exchange_bytes(a, T, 2, b) == T // 2 * 576 * 2 and exchange_bytes(a, T, 1, b) == 0
    assert gathered_bytes(a, T, 2, b) == T * 576 * 2
    assert key_buffer_bytes(a, T, 2, b) == (T + T // 4) * (576 + 2 * 128 * 192) * 2


def test_cp_expands_the_key_rows_on_every_rank_by_hand():
    """Under CP, MLA runs kv_b_proj on its key buffer's rows ((1 + 1/2N) T on a full layer)
    instead of its T / N tokens: on the tiny preset (kv_b 24 x 4 x (16 + 16)) at CP2 over a pack
    of 64 tokens, 80 - 32 = 48 more rows per layer and micro-batch, 2 x 3,072 FLOPs each; the
    step's compute grows by 3 (forward, backward) x 3 layers x 2 micro-batches of that over half
    of one rank's (the rest splits evenly). GQA moves K/V as they are: nothing to expand."""
    from training.planner.timing import TimeAssumptions, plan_time

    cfg = tiny()
    a = shapes_of(cfg).blocks[0].attention
    assert expand_flops(a, 64, 2) == 2 * 3072 * (64 + 16 - 32) and expand_flops(a, 64, 1) == 0
    assert expand_flops(AttentionShape(4, 2, 16), 64, 2) == 0
    base = dict(pp=1, dp=1, seq_length=64, micro_batch_size=1, num_microbatches=2, optimizer="adamw")
    t = TimeAssumptions(assumed_mfu=0.5, hbm_gb_s=1.0)
    compute = lambda cp: plan_time(cfg, inputs(**base, cp=cp), t, peak=1.0).ranks[0].seconds["compute"]
    assert compute(2) == pytest.approx(compute(1) / 2 + 3 * 3 * 2 * expand_flops(a, 64, 2) / 0.5e12, rel=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kept_bytes_match_what_autograd_saves(variant, monkeypatch):
    """The planner assumes a fused kernel that needs equal q/k and v dims (flash varlen): V
    padded to 24, the output cropped. The CPU's sdpa takes V at 16 natively but then runs its
    math path (score matrices saved); with the padding forced it runs its fused kernel, as a GPU
    does. The attention within 10% of what autograd saves inside it (its input is the norm's
    output), the whole chunk within 25% (the GQA test's bound), CPU sdpa's extra included."""
    monkeypatch.setattr(attention, "NATIVE_VALUE_DIM", ())
    cfg = tiny(**VARIANTS[variant])
    chunk = build_chunks(cfg, ParallelState.single())[0]
    shapes, T, H = shapes_of(cfg), sum(DOCS), cfg.hidden_size
    a = shapes.blocks[1].attention
    inside = SavedTensorBytes(chunk)
    attn = chunk.layers["1"].self_attn
    attn.register_forward_pre_hook(lambda m, args: inside.__enter__() and None)
    attn.register_forward_hook(lambda m, args, out: inside.__exit__(None, None, None))
    tokens, pos, psp = thd(DOCS)
    with SavedTensorBytes(chunk) as saved:
        chunk(tokens, pos, psp, labels=labels_for(tokens, DOCS))
    extra = cpu_sdpa_extra_bytes(a, DOCS, 4)
    own = a.kept_bytes(H, T, 4) - (2 * T * H * 4 + T * 4)  # the input norm's fp32 input, output and 1/rms
    assert 0.9 <= (own + extra) / inside.bytes <= 1.1, (own + extra, inside.bytes)
    estimate = _chunk_activations(cfg, chunk, T, 4, inputs()) + extra * cfg.num_layers
    assert 0.75 <= estimate / saved.bytes <= 1.25, (estimate, saved.bytes)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_modes_keep_what_the_planner_books(mode, monkeypatch):
    """Under recompute every attention kind keeps the same (core.costs.activations.block_bytes:
    selective, the norms and the residual stream; full, each layer's input): on the MLA chunk
    within 5% of what autograd saves (the head's and loss's share included)."""
    from core.transformer.block import apply_recompute

    monkeypatch.setattr(attention, "NATIVE_VALUE_DIM", ())
    cfg = tiny()
    chunk = build_chunks(cfg, ParallelState.single())[0]
    apply_recompute(chunk, mode)
    tokens, pos, psp = thd(DOCS)
    with SavedTensorBytes(chunk) as saved:
        chunk(tokens, pos, psp, labels=labels_for(tokens, DOCS))
    estimate = _chunk_activations(cfg, chunk, sum(DOCS), 4, inputs(recompute_granularity=mode))
    assert 0.95 <= estimate / saved.bytes <= 1.05, (estimate, saved.bytes)


def test_frozen_layers_keep_what_the_planner_books(monkeypatch):
    """LoRA on the MLA chunk (core/finetune/lora.py adapts its projections), measured on its last layer
    (MoE with a shared expert; earlier adapters make its input require a gradient) as the GQA
    test does (tests/unit/test_lora_plan.py): the planner's block within 25% of what autograd
    saved and its saving against the full block within 25% of the measured saving."""
    from core.costs.activations import block_bytes
    from core.finetune.lora import LoraSettings, apply_lora

    monkeypatch.setattr(attention, "NATIVE_VALUE_DIM", ())
    cfg, i = tiny(), 2
    shapes, T = shapes_of(cfg), sum(DOCS)
    extra = cpu_sdpa_extra_bytes(shapes.blocks[i].attention, DOCS, 4)

    def measured(targets):
        torch.manual_seed(0)  # the adapters' initialisation: the same run whatever ran before
        chunk = build_chunks(cfg, ParallelState.single())[0]
        if targets:
            apply_lora(chunk, LoraSettings(lora_rank=4, lora_alpha=8, lora_targets=targets))
        saved = SavedTensorBytes(chunk)
        layer = chunk.layers[str(i)]
        layer.register_forward_pre_hook(lambda m, a: saved.__enter__() and None)
        layer.register_forward_hook(lambda m, a, o: saved.__exit__(None, None, None))
        tokens, pos, psp = thd(DOCS)
        chunk(tokens, pos, psp, labels=labels_for(tokens, DOCS))
        return saved.bytes

    full, full_est = measured(None), block_bytes(shapes, i, T, 4) + extra
    # the attention adapted alone and everything adapted (the FFN's share is GQA's formula, which
    # tests/unit/test_lora_plan.py checks target by target); the saved bytes of the adapted
    # routed experts move by a few KB from run to run, too much for a saving of ~0.2 MB alone
    for targets in ("attention", "attention,mlp,shared_expert,experts"):
        got, est = measured(targets), block_bytes(shapes, i, T, 4, "none", (4, targets)) + extra
        assert 0.75 <= est / got <= 1.25, (targets, est, got)
        assert 0.75 <= (full_est - est) / (full - got) <= 1.25, (targets, full_est - est, full - got)


def test_lora_adapters_and_frozen_savings_by_hand():
    """LoRA's ``attention`` target adapts q_a, q_b, kv_a, kv_b and o (or q, kv_a, kv_b, o):
    2 r (in + out) FLOPs per token each; frozen, the block drops the normalised outputs of its
    input and latent norms and, unadapted, its projections' inputs (o's is the cropped copy)."""
    a, plain = MLAShape(4, 24, 16, 8, 16, 32), MLAShape(4, 24, 16, 8, 16)
    ends = (64 + 32) + (32 + 96) + (64 + 32) + (24 + 128) + (64 + 64)
    assert a.adapter_ends(64) == ends and plain.adapter_ends(64) == ends - (64 + 32) - (32 + 96) + (64 + 96)
    block = shapes_of(tiny()).blocks[1]
    assert adapter_flops(64, block, 4, {"attention"}) == 2 * 4 * ends
    T, b = 10, 2
    # fp32 normalised outputs of the input, q and kv norms; inputs of q_a / kv_a, q_b, kv_b (the
    # latent beside the rope key) and o (V cropped from 24 to 16)
    assert a.frozen_savings(64, T, b, 0) == T * (64 + 32 + 24) * 4 + T * (64 + 32 + 24 + 8) * 2 + T * 4 * 16 * 2
    assert a.frozen_savings(64, T, b, 4) == T * (64 + 32 + 24) * 4 - 5 * T * 4 * 2
    assert plain.frozen_savings(64, T, b, 4) == T * (64 + 24) * 4 - 4 * T * 4 * 2
