"""GPU-only checks (skipped without CUDA; run by tools/gpu_check.sh): the varlen flash backend
against per-document SDPA in bf16, the chunked loss's bf16 path against fp32 logits,
grouped_mm in bf16 against a per-expert loop, compiled
layers (varlen inside the graph) against eager, and short 1-GPU training runs with --bf16:
eager, --compile, --cpu-offload optimizer and experts. The training flags a test adds come
last, so they override the defaults (argparse keeps the last value)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("window", [None, 512])
def test_varlen_equals_sdpa_in_bf16(window):
    from core.packed_seq import PackedSeqParams
    from core.transformer.attention_backends import DocLayout, sdpa_attention, varlen_attention

    torch.manual_seed(0)
    lengths = [700, 1500, 64, 3000, 2928]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    layout = DocLayout.from_params(PackedSeqParams(cu, cu.clone(), max(lengths)))
    q = torch.randn(8192, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(8192, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    # bf16 inputs, fp32 softmax in both kernels, different blocking: ~1e-2 of the largest value
    assert _rel(varlen_attention(q, k, v, layout, window, 128 ** -0.5),
                sdpa_attention(q, k, v, layout, window, 128 ** -0.5)) < 2e-2


def test_chunked_loss_in_bf16_equals_fp32_logits_without_a_vocabulary_sized_tensor():
    """The GPU path of core/loss.py: bf16 GEMMs writing fp32 (out_dtype), the gradient tile cast
    to bf16 for the backward's GEMMs; Step-3.7-Flash's vocabulary and hidden size at T 8192."""
    import torch.nn.functional as F

    from core.loss import _out_dtype_gemm, linear_cross_entropy

    assert _out_dtype_gemm(torch.device("cuda"), torch.bfloat16), "no fp32-output bf16 GEMM on this torch"
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, V = 8192, 4096, 128896
    h = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (T,), device="cuda", generator=g)
    labels[::5] = -100
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, n = linear_cross_entropy(h, w, labels)
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - base - (h.numel() + w.numel()) * 2  # less dh and dW
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = F.cross_entropy(hf @ wf.t(), labels, ignore_index=-100, reduction="sum")
    ref.backward()
    # the loss: exact bf16 products summed in fp32 by both (TF32 off by default): fp32 rounding
    assert abs(float(loss) - float(ref)) <= 1e-4 * abs(float(ref))
    # gradients: the backward multiplies a bf16 copy of (softmax - onehot) (unit roundoff 2^-8)
    # and returns bf16; relative to the largest entry, a few roundoffs
    assert _rel(h.grad, hf.grad) < 2e-2 and _rel(w.grad, wf.grad) < 2e-2
    assert peak < T * V * 4 / 10  # below a tenth of the fp32 logits (benchmarks/bench_loss.py)


def test_grouped_mm_in_bf16():
    from core.moe.experts import GroupedExperts

    torch.manual_seed(0)
    ex = GroupedExperts(8, 256, 128).cuda().bfloat16()
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x, counts = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16), torch.tensor([125] * 8, device="cuda")
    grouped = ex(x, counts)
    ex.use_grouped_mm = False
    # bf16 GEMMs with fp32 accumulation, blocked differently: ~1e-2 of the largest value
    assert _rel(grouped, ex(x, counts)) < 2e-2


def test_one_gpu_bf16_training_run(tmp_path):
    _train_tiny(tmp_path, [])


def _train_tiny(tmp_path, flags):
    import numpy as np

    from data.indexed_dataset import IndexedDatasetWriter

    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "rep_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for _ in range(20):
            for _ in range(12):
                w.add(rng.integers(0, 256, rng.integers(20, 90)))
    out = subprocess.run([sys.executable, "pretrain_step37.py", "--model-preset", "tiny", "--bf16",
                          "--data-path", prefix, "--seq-length", "128", "--global-batch-size", "4",
                          "--train-iters", "20", "--optimizer", "adamw", "--lr", "5e-3", "--log-interval", "1",
                          "--log-dir", str(tmp_path / "tb"), *flags], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(l) for l in open(tmp_path / "tb" / "metrics.jsonl")]
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["tflops_per_gpu"] > 0


def test_compiled_layers_with_varlen_in_bf16_match_eager_without_recompiling():
    """--compile on CUDA: varlen_attn traced into each layer's graph (cu_seqlens of dynamic
    length, the pack length as the maximum), inductor's code in bf16, against eager, over three
    packs with other document boundaries and no new graph after the first."""
    import torch._dynamo

    from core.packed_seq import PackedSeqParams
    from models.step37 import Step37Config, Step37Model
    from core.compile import apply_compile

    torch._dynamo.reset()
    cfg = Step37Config.from_hf(Step37Config.preset("tiny").to_hf(), attention_backend="varlen")
    eager = Step37Model(cfg, seed=0).cuda().bfloat16()
    compiled = Step37Model(cfg, seed=0).cuda().bfloat16()
    apply_compile(compiled, "inductor")
    graphs = None
    for i, lengths in enumerate([[100, 28], [64, 64], [5, 50, 60, 13]]):
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        psp = PackedSeqParams(cu, cu.clone(), max(lengths)).to("cuda")
        tokens = torch.randint(0, cfg.vocab_size, (128,), device="cuda", generator=None)
        pos = torch.cat([torch.arange(n) for n in lengths]).cuda()
        labels = torch.roll(tokens, -1)
        outs = []
        for model in (eager, compiled):
            model.zero_grad()
            out = model(tokens, pos, psp, labels=labels)
            out.loss_sum.backward()
            outs.append((out.loss_sum.detach(), model.layers["1"].self_attn.q_proj.weight.grad))
        # bf16 throughout, inductor fuses norms and SwiGLU (other roundings): ~1e-2 relative
        assert _rel(outs[1][0], outs[0][0]) < 1e-2 and _rel(outs[1][1], outs[0][1]) < 5e-2
        if graphs is None:
            graphs = dict(torch._dynamo.utils.counters["stats"])
        assert dict(torch._dynamo.utils.counters["stats"]) == graphs, "a new pack recompiled"


def test_one_gpu_bf16_compiled_training_run(tmp_path):
    """pretrain_step37.py --bf16 --compile on one GPU trains (FSDP2 mixed precision hooks
    outside the compiled pieces)."""
    _train_tiny(tmp_path, ["--compile", "--train-iters", "10"])


@pytest.mark.parametrize("offload", ["optimizer", "experts"])
def test_one_gpu_bf16_offloaded_training_run(tmp_path, offload):
    """FSDP2 CPU offload on a GPU: the meta build places offloaded shards in host memory, the
    step moves them (optimizer: once per step; experts: per pass), the optimizer steps on the
    host (Muon's Newton-Schulz on the GPU) and the loss falls."""
    _train_tiny(tmp_path, ["--data-parallel-sharding", "fsdp", "--cpu-offload", offload,
                           "--optimizer", "muon", "--muon-momentum", "0", "--lr", "0.02", "--train-iters", "10"])
