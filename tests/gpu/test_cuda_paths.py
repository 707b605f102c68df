"""GPU-only checks (skipped without CUDA; run by tools/gpu_check.sh): the varlen flash backend
against SDPA in bf16, forward and backward (both against fp32 SDPA), also with query boundaries unequal to key boundaries (context
parallelism); the chunked loss's bf16 path
against fp32 logits; grouped_mm in bf16 against a per-expert loop, forward and backward, with
experts that get no row (and a batch of none); fp32 layers on CUDA (sdpa, the loop); compiled
layers (varlen inside the graph) against eager; and short 1-GPU training runs with --bf16:
eager, --compile, --cpu-offload optimizer and experts, host masters with the optimizer in the backward;
--optimizer-in-backward's steps on their own stream against the step after the backward (bitwise);
chunked recompute with offloaded inputs against the unchunked block, its blocks on one copy stream;
pinned micro-batches copied on a side stream (--num-workers) against blocking copies.
The comparisons are the GPU check's own
(``benchmarks/gpu_parts``) at smaller shapes. The training flags a test adds come last, so they
override the defaults (argparse keeps the last value)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("window", [None, 512])
def test_varlen_forward_and_backward_are_as_exact_as_sdpa_in_bf16(window):
    """Output, dq, dk and dv of bf16 varlen and bf16 sdpa against fp32 sdpa, GQA 16/2, on a pack
    whose documents are longer and shorter than the window: varlen within twice sdpa's error."""
    from benchmarks.gpu_parts.attention import LENGTHS, compare, layout_of

    r = compare(16, 2, 128, window, layout_of(LENGTHS, torch.device("cuda")), torch.device("cuda"), time_it=False)
    assert r["passed"], r


@pytest.mark.parametrize("window", [None, 512])
def test_cp_varlen_with_query_boundaries_unequal_to_key_boundaries(window):
    """Context parallelism's flash call (CP4 rank 0's chunks against their documents' prefixes or
    halos, bottom-right causal) at GQA 16/2: as exact as bf16 sdpa (GPU check part i, smaller)."""
    from benchmarks.gpu_parts.cp_attention import LENGTHS, compare, shards_of

    r = compare(16, 2, 128, window, shards_of(LENGTHS), torch.device("cuda"))
    assert r["passed"], r


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


@pytest.mark.parametrize("experts,rows", [(8, 1000), (36, 4000)])
def test_grouped_mm_forward_and_backward_with_empty_experts(experts, rows):
    """grouped_mm against the bf16 loop, both against the fp32 loop: output, dx and the three
    weight gradients; experts that get no row have a weight gradient of exactly zero; no sync."""
    from benchmarks.gpu_parts.experts import compare

    r = compare(experts, 256, 128, rows, torch.device("cuda"), time_it=False)
    assert r["empty"] > 0 and r["empty_grads_zero"], r
    assert r["passed"], r


def test_grouped_mm_with_no_row_at_all():
    """An EP rank that receives no token runs its experts on an empty batch: empty output, zero
    weight gradients, nothing read back."""
    from core.moe.experts import GroupedExperts

    ex = GroupedExperts(4, 256, 128).cuda().bfloat16()
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.zeros(0, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = torch.zeros(4, dtype=torch.int64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = ex(x, counts)
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert y.shape == (0, 256)
    assert all(p.grad is None or float(p.grad.abs().max()) == 0.0 for p in ex.parameters())


def test_fp32_on_cuda_computes_with_sdpa_and_the_loop():
    """Without --bf16 the layers are fp32: auto takes sdpa (flash refuses fp32) and the experts
    the per-expert loop; a forward and backward of the tiny model runs and matches the CPU's."""
    from models.step37 import Step37Config, Step37Model
    from tests.unit.test_model_hf import thd

    cfg = Step37Config.from_hf(Step37Config.preset("tiny").to_hf())
    cpu = Step37Model(cfg, seed=0)
    gpu = Step37Model(cfg, seed=0).cuda()
    tokens, pos, psp = thd([9, 3, 14])
    losses = []
    for model, device in ((cpu, "cpu"), (gpu, "cuda")):
        out = model(tokens.to(device), pos.to(device), psp.to(device), labels=torch.roll(tokens, -1).to(device))
        out.loss_sum.backward()
        losses.append(float(out.loss_sum))
    # fp32 on both, other kernels (TF32 off by default): ~1e-6 relative; 1e-4 leaves 100x
    assert abs(losses[0] - losses[1]) <= 1e-4 * abs(losses[0])


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
    assert rows[-1]["peak_reserved_gib"] >= rows[-1]["peak_mem_gib"] > 0
    return out


def test_compiled_layers_with_varlen_in_bf16_match_eager_without_recompiling():
    """--compile on CUDA: varlen_attn traced into each layer's graph (cu_seqlens of dynamic
    length, the longest segment a traced size), inductor's code in bf16, against eager, over
    three packs with other document boundaries and no new graph after the first."""
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


def test_one_gpu_bf16_host_masters_training_run(tmp_path):
    """--cpu-offload masters with --optimizer-in-backward on a GPU (the recipes' mode): fp32
    masters in pageable memory, one pinned staging slab (its size and pinning time in the log),
    updates copied through it on the side streams while the backward goes on; the loss falls."""
    out = _train_tiny(tmp_path, ["--data-parallel-sharding", "fsdp", "--cpu-offload", "masters",
                                 "--optimizer-in-backward", "--optimizer", "muon", "--muon-momentum", "0",
                                 "--lr", "0.02", "--micro-batch-size", "4", "--train-iters", "10"])
    assert re.search(r"host masters: .* fp32 masters in pageable memory; staging slab [0-9.]+ [GM]iB pinned in "
                     r"[0-9.]+ s \(one allocation", out.stdout), out.stdout[-3000:]


def in_backward_steps_match(rank, world, steps):
    """Rank body (spawned): Muon (momentum 0, fp32 Newton-Schulz) stepping each matrix in the
    backward, against the plain Muon step after it: bitwise masters and losses. Same batches,
    same layout: --bf16 with FSDP on a one-rank mesh (``apply_fsdp``'s one-rank meshes, so its
    post-reduce hooks call the steps) on ``local_device()``: on CUDA each hook's work runs on
    ``InBackwardSteps``' own stream after the stream that called it, and ``end()`` makes the
    compute stream wait. The same kernels on the same inputs on another stream: bitwise."""
    from tests.distributed.masters_cases import compare_modes

    compare_modes(rank, world, 1, "muon", 0.0, steps, {"in_backward": (0.0, 0.0)}, ("bf16", "in_backward"))


def test_optimizer_in_backward_on_its_own_stream_equals_the_step_after_the_backward(tmp_path):
    """--optimizer-in-backward on CUDA (``core/optim/in_backward.py``: ``_own_stream``, ``end()``)
    over 3 steps, one rank on a CPU-gloo / CUDA-NCCL process group."""
    from tests.distributed.harness import run_ranks

    run_ranks(1, in_backward_steps_match, 3, tmpdir=str(tmp_path), timeout=300, backend="cpu:gloo,cuda:nccl")


def test_chunked_recompute_with_offloaded_inputs_on_cuda_equals_unchunked():
    """--recompute-chunks with --offload-recompute-inputs on CUDA (core/transformer/chunked.py):
    the kept inputs go to pinned host memory on the block's own stream and come back behind its
    event; fp32 (TF32 off by default): the unchunked block's losses and gradients within 1e-5 of
    each gradient's largest entry (the CPU test's bound), and the inputs really were in host memory."""
    import core.transformer.chunked as chunked
    from core.transformer.block import apply_recompute
    from models.step37 import Step37Config, Step37Model
    from tests.unit.test_model_hf import thd
    from tests.unit.test_model_thd import labels_for

    lengths = [9, 3, 12, 1, 11, 12, 20, 4]  # documents ending at T/2 = 36: two chunks
    cfg = Step37Config.from_hf(Step37Config.preset("tiny").to_hf(), attention_backend="sdpa")
    stashed = []
    init = chunked._Stash.__init__
    chunked._Stash.__init__ = lambda self, *a: (init(self, *a), stashed.append(self.t.device.type))[0]
    try:
        runs = []
        for kw in ({}, {"chunks": 2, "offload_inputs": True}):
            model = Step37Model(cfg, seed=0).cuda()
            apply_recompute(model, "full", **kw)
            tokens, pos, psp = thd(lengths, seed=3)
            out = model(tokens.cuda(), pos.cuda(), psp.to("cuda"), labels=labels_for(tokens, lengths).cuda())
            (out.loss_sum + sum(out.mtp_loss_sums)).backward()
            runs.append((float(out.loss_sum), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.grad is not None}))
    finally:
        chunked._Stash.__init__ = init
    (ref_loss, ref), (loss, got) = runs
    assert stashed and set(stashed) == {"cpu"}
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss) and got.keys() == ref.keys()
    assert max(_rel(got[n], ref[n]) for n in ref) <= 1e-5


def test_chunked_blocks_share_one_offload_stream_per_device():
    """--offload-recompute-inputs on CUDA: every chunked block copies its inputs out on the one
    high-priority stream the rank's ``ChunkedRecompute`` made for the device (not one per block,
    which would cycle through torch's pool of 32 that FSDP2's streams come from)."""
    import core.transformer.chunked as chunked
    from core.transformer.block import apply_recompute
    from models.step37 import Step37Config, Step37Model
    from tests.unit.test_model_hf import thd
    from tests.unit.test_model_thd import labels_for

    lengths = [9, 3, 12, 1, 11, 12, 20, 4]
    cfg = Step37Config.from_hf(Step37Config.preset("tiny").to_hf(), attention_backend="sdpa")
    model = Step37Model(cfg, seed=0).cuda()
    apply_recompute(model, "full", chunks=2, offload_inputs=True)
    streams = []
    init = chunked._Stash.__init__
    chunked._Stash.__init__ = lambda self, t, offload, stream: (init(self, t, offload, stream),
                                                                streams.append(stream))[0]
    try:
        tokens, pos, psp = thd(lengths, seed=3)
        out = model(tokens.cuda(), pos.cuda(), psp.to("cuda"), labels=labels_for(tokens, lengths).cuda())
        (out.loss_sum + sum(out.mtp_loss_sums)).backward()
    finally:
        chunked._Stash.__init__ = init
    shared = {id(m.chunked): m.chunked for m in model.modules() if getattr(m, "chunked", None) is not None}
    assert len(shared) == 1
    (ctx,) = shared.values()
    assert len(streams) >= len(model.blocks()) > 1  # a stash per kept input, one or more per block
    assert all(s is ctx.offload_stream(torch.device("cuda")) for s in streams)
    assert streams[0].priority < 0


def test_pinned_micro_batches_copy_on_a_side_stream_equal_to_blocking_copies():
    """--num-workers: a batch pinned as the DataLoader hands it over (core/batch_copy.py) is page-
    locked; DeviceBatches' non-blocking side-stream copies, each waited for by the compute
    stream when first asked for, equal plain .to("cuda") copies, and the compute stream may
    overwrite them afterwards (record_stream kept the allocator from reusing them early)."""
    from core.batch_copy import DeviceBatches, pin, tensors_of
    from core.packed_seq import ImageInputs, PackedSeqParams
    from data.thd import THDBatch

    T = 1 << 16
    cu = torch.tensor([0, T // 2, T], dtype=torch.int32)
    images = ImageInputs(torch.randn(2, 3, 112, 112).to(torch.bfloat16), None, (0, 0), torch.arange(8))
    batches = [THDBatch(torch.arange(T) + k, torch.arange(T) - k, torch.arange(T) % 7, PackedSeqParams(cu, cu, T // 2),
                        images) for k in range(3)]
    pinned = [pin(b) for b in batches]
    assert all(t.is_pinned() for b in pinned for t in tensors_of(b))
    on = DeviceBatches(pinned, "cuda")
    for k, b in enumerate(batches):
        got, want = tensors_of(on.get(k)), tensors_of(b.to("cuda"))
        assert all(g.is_cuda and torch.equal(g, w) for g, w in zip(got, want))
    on.get(0).tokens.add_(1)  # on the compute stream, after its wait
    torch.cuda.synchronize()
    assert torch.equal(on.get(0).tokens.cpu(), batches[0].tokens + 1)
