"""The ``varlen`` backend on the torch builds it meets (the lent H200 runs torch 2.11, CI 2.13):
``varlen_attn``'s keywords are read off its signature, ``auto`` never hands fp32 to flash, and a
compiled layer sizes flash's grid by the pack's longest document, not by the pack. torch's kernel
is CUDA-only, so a reference of its contract stands in (``test_varlen_adapter.py``)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from core.packed_seq import PackedSeqParams
from core.transformer import attention as attention_mod
from core.transformer import attention_backends as ab
from core.transformer.attention_op import compiled_attention
from tests.unit.numerics import assert_close_rel
from tests.unit.test_varlen_adapter import reference_varlen_attn, use_kernel


def v2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    raise AssertionError("not called")


def v2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
          window_size=(-1, -1), k_cache=None, v_cache=None, cache_seqlens=None, cache_batch_idx=None,
          page_table=None, seqused_k=None):
    raise AssertionError("not called")


def v2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
          window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    raise AssertionError("not called")


def test_keywords_follow_the_signature_of_each_torch():
    # 2.11 has no enable_gqa: GQA goes to flash as it is (the kernel takes fewer KV heads)
    assert ab.VarlenAPI.of(v2_11).kwargs(512, 0.1, True, 128) == {"window_size": (511, 0), "scale": 0.1}
    assert ab.VarlenAPI.of(v2_13).kwargs(None, 0.1, True, 128) == \
        {"window_size": (-1, 0), "scale": 0.1, "enable_gqa": True}
    assert ab.VarlenAPI.of(v2_13).kwargs(None, 0.1, False, 128) == {"window_size": (-1, 0), "scale": 0.1}
    # 2.9: causal full attention at the default scale only
    assert ab.VarlenAPI.of(v2_9).kwargs(None, 128 ** -0.5, True, 128) == {"is_causal": True}
    with pytest.raises(RuntimeError, match="no window_size"):
        ab.VarlenAPI.of(v2_9).kwargs(512, 128 ** -0.5, True, 128)
    with pytest.raises(RuntimeError, match="no scale keyword"):
        ab.VarlenAPI.of(v2_9).kwargs(None, 0.1, True, 128)


def _pack():
    # documents of 5, 9 and 3 tokens, each padded to a multiple of 4: segments 8, 12, 4
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    layout = ab.DocLayout.from_params(PackedSeqParams(cu, torch.tensor([0, 8, 20, 24], dtype=torch.int32), 9))
    torch.manual_seed(0)
    q, k, v = (torch.randn(24, h, 8, dtype=torch.bfloat16) for h in (4, 2, 2))
    return q, k, v, layout


@pytest.mark.parametrize("window", [None, 4])
def test_gqa_on_torch_2_11_whose_varlen_has_no_enable_gqa(monkeypatch, window):
    calls = []

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), k_cache=None, v_cache=None, cache_seqlens=None, cache_batch_idx=None,
               page_table=None, seqused_k=None):  # torch 2.11's keywords: an enable_gqa= raises TypeError
        return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                     window_size=window_size, calls=calls)

    use_kernel(monkeypatch, kernel)
    q, k, v, layout = _pack()
    got = ab.varlen_attention(q, k, v, layout, window, 0.3)
    real = torch.cat([torch.arange(0, 5), torch.arange(8, 17), torch.arange(20, 23)])
    # bf16 results of two exact-in-fp32 computations: a few bf16 roundings of the largest value
    assert_close_rel(got[real].float(), ab.sdpa_attention(q, k, v, layout, window, 0.3)[real].float(), rel=2e-2)
    assert calls[0]["max_q"] == 12 and calls[0]["window"] == ((window - 1, 0) if window else (-1, 0))


def test_auto_never_gives_flash_fp32():
    """Without --bf16 the layers compute in fp32: on CUDA ``auto`` takes sdpa (flash refuses
    fp32), and an explicit ``varlen`` says which flag to add instead of failing in the kernel."""
    cuda = torch.device("cuda", 0)
    assert ab.resolve_backend("auto", cuda, torch.float32) == "sdpa"
    assert ab.resolve_backend("auto", cuda, torch.bfloat16) == "varlen"
    assert ab.resolve_backend("auto", cuda, torch.float16) == "varlen"
    q, k, v, layout = _pack()
    with pytest.raises(ValueError, match="add --bf16"):
        ab.varlen_attention(q.float(), k.float(), v.float(), layout, None, 0.3)


def test_the_layer_asks_for_the_backend_of_its_own_dtype(monkeypatch):
    """Attention.forward passes its inputs' dtype: on a (pretended) CUDA device an fp32 layer
    resolves to sdpa."""
    asked = []

    def spy(name, device, dtype=None):
        asked.append(dtype)
        assert ab.resolve_backend(name, torch.device("cuda", 0), dtype) == "sdpa"
        return ab.resolve_backend(name, device, dtype)

    monkeypatch.setattr(attention_mod, "resolve_backend", spy)
    layer = attention_mod.Attention(16, 4, 2, 8, window=None, softmax_scale=0.3, eps=1e-5)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    _, _, _, layout = _pack()
    cos, sin = torch.ones(24, 8), torch.zeros(24, 8)
    layer(torch.randn(24, 16), (cos, sin), layout)
    assert asked == [torch.float32]


def test_compiled_varlen_grid_is_the_longest_document_without_recompiling(monkeypatch):
    """Inside a compiled graph the longest segment is a traced size (an empty host tensor's):
    each pack's own longest segment reaches the kernel, and other packs reuse the one graph."""
    seen = []

    @torch.library.custom_op("test_varlen::flash", mutates_args=())
    def flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
              left: int, scale: float) -> torch.Tensor:
        seen.append(longest)
        return reference_varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(left, 0),
                                     enable_gqa=True, calls=[])

    @flash.register_fake
    def _(q, k, v, cu, longest, left, scale):
        return torch.empty_like(q)

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
               enable_gqa=False):
        return flash(query, key, value, cu_seq_q, max_q, window_size[0], scale)

    use_kernel(monkeypatch, kernel)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v, layout: compiled_attention(q, k, v, layout, 4, 0.3, "varlen"),
                       backend=backend, fullgraph=True)
    for lengths in ([5, 9, 3, 7], [20, 4], [2, 3, 4, 5, 6, 4]):  # 24 tokens each, other boundaries
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        layout = ab.DocLayout.from_params(PackedSeqParams(cu, cu.clone(), max(lengths)))
        q, k, v = (torch.randn(24, h, 8, dtype=torch.bfloat16) for h in (4, 2, 2))
        got = fn(q, k, v, layout)
        assert_close_rel(got.float(), ab.sdpa_attention(q, k, v, layout, 4, 0.3).float(), rel=2e-2)
    assert seen == [9, 20, 6]  # not 24 (the pack)
    assert len(graphs) == 1
