"""DeepseekV3Model against transformers' DeepseekV3ForCausalLM on the same weights (fp32, CPU):
logits per document of a THD pack (q low-rank and plain q, group-limited routing, YaRN with
mscale_all_dim, interleaved rope and not, dense first layers), the export, parameter counts of
the presets on meta, and the config reader.

Tolerance HF_REL (tests/unit/test_model_hf.py), relative to the largest value compared: the two
implementations sum in different orders (per-document SDPA vs a padded causal mask, grouped GEMM
and an fp32 weighted combine vs a per-expert loop with index_add, the routed scaling on the sum
vs on each weight, renormalisation without transformers' +1e-20)."""
from __future__ import annotations

import copy

import pytest
import torch

from models.deepseek_v3 import DeepseekV3Config, DeepseekV3Model
from models.deepseek_v3.config import PRESETS
from models.registry import spec_for_hf
from tests.unit.hf_reference import randomize
from tests.unit.numerics import assert_close_rel
from tests.unit.test_model_hf import HF_REL, LENGTHS, thd

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 8, "beta_slow": 1}  # documents reach past 16
CONFIGS = {  # the tiny preset: q low-rank, 8 experts in 4 groups (2 kept), interleaved rope, 1 dense layer
    "q_lora_grouped_interleaved": {},
    "plain_q_not_interleaved_no_renorm": dict(q_lora_rank=None, rope_interleave=False, norm_topk_prob=False,
                                              n_shared_experts=2),
    "yarn_mscale_bias_two_dense": dict(rope_parameters=YARN, max_position_embeddings=64, attention_bias=True,
                                       first_k_dense_replace=2,
                                       n_group=2, topk_group=1, num_experts_per_tok=3),
}


def hf_kwargs(**overrides) -> dict:
    kw = copy.deepcopy(PRESETS["deepseek-v3-tiny"])
    kw.pop("model_type")
    if "rope_parameters" in overrides:
        kw.pop("rope_theta")
    kw.update(overrides)
    return kw


def save_hf_model(path: str, seed: int = 0, **overrides):
    from transformers import DeepseekV3Config as HFConfig
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(HFConfig(**hf_kwargs(**overrides))).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    return model


def _ours(path) -> DeepseekV3Model:
    model = DeepseekV3Model(DeepseekV3Config.from_hf(str(path)))
    report = model.load_hf(str(path))
    assert report["missing"] == [] and report["unexpected"] == [] and report["misshaped"] == []
    return model


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers_per_document(tmp_path, name):
    hf = save_hf_model(str(tmp_path), seed=3, **CONFIGS[name])
    model = _ours(tmp_path)
    tokens, pos, psp = thd(LENGTHS)
    with torch.no_grad():
        ours = model(tokens, pos, psp)
        for s, n in zip(psp.cu_seqlens.tolist(), LENGTHS):
            assert_close_rel(ours[s:s + n], hf(input_ids=tokens[s:s + n][None]).logits[0], rel=HF_REL)


def test_yarn_mscale_all_dim_scales_the_softmax_as_transformers():
    """The softmax scale and the cos/sin factor of the YaRN config above, against transformers'
    own functions (so the logits test compares a config where both differ from 1)."""
    from transformers import DeepseekV3Config as HFConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    model = DeepseekV3Model(DeepseekV3Config.from_hf(hf_kwargs(rope_parameters=YARN)), seed=0)
    ref = DeepseekV3Attention(HFConfig(**hf_kwargs(rope_parameters=YARN)), 0)
    ours = model.layers["0"].self_attn
    assert ours.scale == ref.scaling and ours.scale != ours.head_dim ** -0.5
    assert model.rotary["default"].scale == pytest.approx(1.0 * (0.1 * 0.8 * 1.3862943611198906 + 1)
                                                          / (0.1 * 1.3862943611198906 + 1), rel=1e-15)


def test_attend_pads_v_exactly_for_kernels_that_need_equal_dims(monkeypatch):
    """A value head dim below the q/k one: sdpa takes it as it is; with sdpa treated as a kernel
    that needs equal dims, V is zero-padded and the output cropped, and the result is the same
    (padding adds zero columns only)."""
    import core.transformer.attention as attention
    from core.transformer.attention_backends import DocLayout

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 14, 4, 12, generator=g).unbind(0)
    v = torch.randn(14, 4, 8, generator=g)
    layout = DocLayout.from_params(thd([5, 9])[2])
    native = attention.attend(q, k, v, layout, None, 0.3, "sdpa")
    monkeypatch.setattr(attention, "NATIVE_VALUE_DIM", ())
    padded = attention.attend(q, k, v, DocLayout.from_params(thd([5, 9])[2]), None, 0.3, "sdpa")
    assert native.shape == padded.shape == (14, 4, 8)
    # fp32, values ~1: SDPA's CPU kernel blocks by head dim, so p.v sums in another order (a few
    # ulp, measured < 1e-6 relative); 1e-6 leaves that margin, a wrong crop or pad is O(1)
    assert_close_rel(padded, native, rel=1e-6)


def test_export_reloads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import DeepseekV3ForCausalLM

    save_hf_model(str(tmp_path / "src"), seed=5, q_lora_rank=None)
    model = _ours(tmp_path / "src")
    with torch.no_grad():  # train-like change so the export is not the source file again
        model.layers["1"].mlp.experts.up_proj.mul_(1.5)
    assert model.save_hf(str(tmp_path / "out")) == "published"
    hf, info = DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # transformers' default num_nextn_predict_layers 1 with no layer saved: read as no MTP layer
    # (models/common/mtp_layers.py), so the export holds nothing transformers does not know
    assert not info["unexpected_keys"]
    tokens, pos, psp = thd([17])
    with torch.no_grad():
        assert_close_rel(model(tokens, pos, psp), hf(input_ids=tokens[None]).logits[0], rel=HF_REL)
    again = _ours(tmp_path / "out")
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    for (n, b), (_, c) in zip(model.named_buffers(), again.named_buffers()):
        assert torch.equal(b, c), n  # the routers' correction biases travel too


@pytest.mark.parametrize("preset", ["deepseek-v3", "kimi-k2", "moonlight-16b-a3b"])
def test_parameter_counts_on_meta_equal_transformers(preset):
    """transformers builds no MTP layer: its count is ours without DeepSeek-V3's (one MoE decoder
    layer, enorm, hnorm, eh_proj, a head norm and a head of its own; the embedding is shared)."""
    from transformers import DeepseekV3Config as HFConfig
    from transformers import DeepseekV3ForCausalLM

    from models.common.decoder import count_parameters

    skip = ("architectures", "model_type", "torch_dtype", "quantization_config")
    kw = {k: v for k, v in PRESETS[preset].items() if k not in skip}
    with torch.device("meta"):
        hf = DeepseekV3ForCausalLM(HFConfig(**kw))
        ours = DeepseekV3Model(DeepseekV3Config.preset(preset))
    count = count_parameters(ours)
    assert count["total_without_mtp"] == sum(p.numel() for p in hf.parameters())
    assert count["total_without_mtp"] == {"deepseek-v3": 671_026_404_352, "kimi-k2": 1_026_408_209_408,
                                          "moonlight-16b-a3b": 15_960_108_544}[preset]
    assert count["mtp"] == {"deepseek-v3": 12_536_747_008, "kimi-k2": 0, "moonlight-16b-a3b": 0}[preset]


def test_config_reads_the_hub_form_and_errors_are_clear():
    hub = PRESETS["deepseek-v3"]
    cfg = DeepseekV3Config.from_hf(hub)
    assert cfg.rope_parameters == {"rope_type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                   "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                                   "rope_theta": 10000}
    assert (cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace, cfg.num_nextn_predict_layers) == (8, 4, 3, 1)
    assert spec_for_hf(hub).family == "deepseek_v3" and spec_for_hf(PRESETS["kimi-k2"]).family == "deepseek_v3"
    assert DeepseekV3Config.from_hf(cfg.to_hf()) == cfg  # to_hf is transformers' form, read back the same
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['frobnicate'\]"):
        DeepseekV3Config.from_hf({**hub, "frobnicate": 1})
    with pytest.raises(ValueError, match="scoring_func 'softmax' is not supported"):
        DeepseekV3Config.from_hf({**hub, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="topk_group 9 must be in"):
        DeepseekV3Config.from_hf({**hub, "topk_group": 9})


def test_context_parallel_moves_the_latent_and_equals_the_unsharded_layer(monkeypatch):
    """Under CP, MLAttention all-gathers each token's normed latent and roped shared key
    (``[T/N, kv_lora_rank + rope]``), not the expanded K/V, and ``kv_b_proj`` expands the key
    buffer's rows after the exchange. On a one-rank CP shard (the all-gather is then the
    identity, here a recording stand-in) the output and the gradients of the input and of every
    parameter equal the unsharded layer (fp64, 1e-12 relative: the same terms, the sdpa calls cut
    per segment), with a value head dim below the q/k one; so does the ``varlen`` call, with
    torch's documented contract standing in for flash (equal head dims: V padded, the output
    cropped). CP2 against one process through the trainer's step:
    tests/distributed/test_cp_layouts.py."""
    import numpy as np

    import core.context_parallel.attention as cpa
    from core.context_parallel.exchange import CPComm
    from core.transformer.attention_backends import DocLayout
    from core.transformer.mla import MLAttention
    from core.transformer.rotary import RotaryEmbedding
    from data.cp_shard import shard_batch
    from tests.distributed.cp_cases import pack
    from tests.unit.test_varlen_adapter import reference_varlen_attn, use_kernel

    gathered = []
    monkeypatch.setattr(cpa, "all_gather", lambda x, group: gathered.append(tuple(x.shape)) or x)
    torch.manual_seed(0)
    attn = MLAttention(32, 4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                       v_head_dim=6, softmax_scale=0.3).double()
    whole = pack(1)
    shard = shard_batch(whole, 1, 0).packed_seq_params
    T = whole.tokens.numel()
    assert np.array_equal(shard.cp.index, np.arange(T))  # one rank: its shard is the pack, in order
    x, g = torch.randn(T, 32, dtype=torch.float64), torch.randn(T, 32, dtype=torch.float64)
    rope = RotaryEmbedding(4, {"rope_theta": 10000.0})(whole.position_ids, torch.float64)

    def run(params):
        attn.zero_grad()
        xg = x.clone().requires_grad_()
        out = attn(xg, rope, DocLayout.from_params(params))
        (out * g).sum().backward()
        return {"out": out.detach(), "dx": xg.grad, **{n: p.grad.clone() for n, p in attn.named_parameters()}}

    want = run(whole.packed_seq_params)
    attn.context_parallel = cpa.ContextParallel(CPComm(None, [0], 0))
    got = run(shard)
    assert gathered == [(T, 12 + 4)], gathered  # kv_lora_rank + rope per token, once
    for name in want:
        assert_close_rel(got[name], want[name], rel=1e-12)

    def kernel(query, key, value, *args, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert query.shape[-1] == key.shape[-1] == value.shape[-1] == 12, "flash needs equal head dims"
        return reference_varlen_attn(query, key, value, *args, scale=scale, window_size=window_size, calls=calls)

    calls = []
    use_kernel(monkeypatch, kernel)
    attn.backend = "varlen"
    got = run(shard)
    assert len(calls) == 1 and gathered[-1] == (T, 16)
    for name in want:  # the stand-in sums in fp64 too; a wrong pad or crop is O(1)
        assert_close_rel(got[name], want[name], rel=1e-12)
