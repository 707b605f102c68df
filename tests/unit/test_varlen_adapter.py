"""The ``varlen`` backend's adapter on CPU: torch's ``varlen_attn`` is CUDA-only, so a pure-torch
reference of its documented contract stands in; the test checks the arguments the adapter
passes (int32 ``cu_seqlens`` on the tensors' device, host-int maximum lengths, the window as
``(W - 1, 0)``, the scale, GQA) and that its output equals the ``sdpa`` backend's on real tokens."""
from __future__ import annotations

import pytest
import torch

from core.packed_seq import PackedSeqParams
from core.transformer import attention_backends as ab
from tests.unit.numerics import assert_close_rel


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                          window_size=(-1, -1), enable_gqa=False, calls=None):
    """``varlen_attn`` as documented: per segment, query i of the segment's ``cu_seq_q`` rows sees
    keys j of its ``cu_seq_k`` rows with i' - left <= j <= i' + right (-1: unbounded), where
    i' = i + n_k - n_q (bottom-right alignment: the last query sits at the last key; i' = i when
    the boundaries are equal), GQA sharing each kv head by H_q / H_kv heads."""
    calls.append(dict(cu=cu_seq_q, cu_k=cu_seq_k, max_q=max_q, max_k=max_k, scale=scale,
                      window=window_size, gqa=enable_gqa))
    left, right = window_size
    out = torch.zeros_like(query)
    group = query.shape[1] // key.shape[1]
    cu_k = cu_seq_q if cu_seq_k is None else cu_seq_k
    for a, b, ka, kb in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        q, k, v = query[a:b], key[ka:kb].repeat_interleave(group, 1), value[ka:kb].repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
        d = torch.arange((kb - ka) - (b - a), kb - ka)[:, None] - torch.arange(kb - ka)[None, :]
        ok = ((d <= left) | (left < 0)) & ((-d <= right) | (right < 0))
        p = s.masked_fill(~ok, float("-inf")).softmax(-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", p, v.double()).to(query.dtype)
    return out


def use_kernel(monkeypatch, fn) -> None:
    """Put ``fn`` where torch's ``varlen_attn`` is taken from, with the keywords its signature has."""
    monkeypatch.setattr(ab, "_varlen_kernel", lambda: fn)
    monkeypatch.setattr(ab, "VARLEN", ab.VarlenAPI.of(fn))


@pytest.mark.parametrize("window", [None, 4])
def test_varlen_adapter_passes_the_contract_and_equals_sdpa(monkeypatch, window):
    calls = []

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
               enable_gqa=False):  # torch >= 2.12's keywords
        return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                     window_size=window_size, enable_gqa=enable_gqa, calls=calls)

    use_kernel(monkeypatch, kernel)
    torch.manual_seed(0)
    # three documents of 5, 9, 3 real tokens, each padded to a multiple of 4 (pack of 24)
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    cu_pad = torch.tensor([0, 8, 20, 24], dtype=torch.int32)
    layout = ab.DocLayout.from_params(PackedSeqParams(cu, cu_pad, 9))
    q, k, v = (torch.randn(24, h, 8, dtype=torch.bfloat16) for h in (4, 2, 2))  # flash takes 16-bit
    got = ab.varlen_attention(q, k, v, layout, window, 0.3)
    again = ab.varlen_attention(q, k, v, layout, window, 0.3)  # the boundaries are built once
    want = ab.sdpa_attention(q, k, v, layout, window, 0.3)
    c = calls[0]
    assert c["cu"].dtype == torch.int32 and c["cu"].device == q.device and c["cu"].tolist() == [0, 8, 20, 24]
    assert c["cu_k"] is c["cu"] and calls[1]["cu"] is c["cu"]
    assert type(c["max_q"]) is int and c["max_q"] == c["max_k"] == 12  # padded segments, host ints
    assert c["window"] == ((window - 1, 0) if window else (-1, 0)) and c["scale"] == 0.3 and c["gqa"]
    real = torch.cat([torch.arange(0, 5), torch.arange(8, 17), torch.arange(20, 23)])
    # bf16 outputs of an fp64 reference and of sdpa's bf16 kernel over <= 12 keys: a few bf16
    # roundings (2^-8 each) of the largest value
    assert_close_rel(got[real].float(), want[real].float(), rel=2e-2)
    assert torch.equal(got, again)


def test_auto_is_varlen_on_cuda_and_sdpa_elsewhere():
    assert ab.resolve_backend("auto", torch.device("cpu")) == "sdpa"
    assert ab.resolve_backend("auto", torch.device("cuda", 0)) == "varlen"
    assert ab.resolve_backend("flex", torch.device("cuda", 0)) == "flex"


def test_flex_block_masks_are_built_once_per_micro_batch_and_window(monkeypatch):
    """The tiny model has 4 layers and 2 MTP depths over two layer types: two masks per forward."""
    import torch.nn.attention.flex_attention as fa

    from models.step37 import Step37Config, Step37Model
    from tests.unit.test_model_hf import thd

    built = []
    real = fa.create_block_mask
    monkeypatch.setattr(fa, "create_block_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    cfg = Step37Config.from_hf(Step37Config.preset("tiny").to_hf(), attention_backend="flex")
    tokens, pos, psp = thd([9, 3, 14])
    with torch.no_grad():
        Step37Model(cfg)(tokens, pos, psp)
    assert len(built) == len(set(cfg.layer_types + cfg.mtp_layer_types)) == 2
